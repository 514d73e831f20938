"""Prewarm a kernel cache without a GPU: compile named config sets for named archs in parallel.

NVRTC needs no device, so CI and container builds can fill a cache directory that a later GPU
process (CUPYFLASH_CACHE_DIR=DIR) uses as is. Every (config, arch) is compiled through
`registry.compile_config`, the same function the run-time registry uses, so the cache keys match.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, TextIO

from .cache import KernelCache, default_cache_dir
from .compiler import CompiledModule, KernelCompileError, parse_arch
from .config import FlashForwardKernelConfig
from .config_sets import get_kernel_configs
from .progress import ProgressBar

__all__ = ["PrewarmResult", "PrewarmReport", "prewarm", "parse_archs", "format_summary", "build_parser",
           "run_from_args", "main"]


@dataclass(frozen=True)
class PrewarmResult:
    """Outcome of one (config, arch) compile."""

    short_form: str
    arch: str
    ok: bool
    cached: bool
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    compile_seconds: float = 0.0  # NVRTC time of the compile that produced the entry (also when cached)
    error: str | None = None
    causal: bool = False  # which instantiation of the config: causally masked or not

    @property
    def label(self) -> str:
        return self.short_form + (" [causal]" if self.causal else "")

    @property
    def spill_bytes(self) -> int | None:
        if self.spill_store_bytes is None or self.spill_load_bytes is None:
            return None
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass(frozen=True)
class PrewarmReport:
    """All results of one prewarm run, in config-then-arch order."""

    results: tuple[PrewarmResult, ...]
    archs: tuple[str, ...]
    n_configs: int
    seconds: float
    jobs: int
    cache_dir: str

    @property
    def failed(self) -> tuple[PrewarmResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    @property
    def ok(self) -> bool:
        return not self.failed


def parse_archs(text: str | Iterable[str]) -> tuple[str, ...]:
    """'sm_80,sm_90' (or a list) -> ('sm_80', 'sm_90'), each validated against NVRTC; ValueError otherwise."""
    items = text.split(",") if isinstance(text, str) else list(text)
    archs = tuple(dict.fromkeys(a.strip() for a in items if a.strip()))
    if not archs:
        raise ValueError("arch: expected at least one arch, e.g. 'sm_80,sm_90'")
    for arch in archs:
        parse_arch(arch)
    return archs


# ----------------------------------------------------------------------------- worker side
_worker_caches: dict[str, KernelCache] = {}  # one per directory and worker process, reused across tasks


def _result(short_form: str, arch: str, causal: bool, module: CompiledModule, cached: bool) -> PrewarmResult:
    res = next(iter(module.resources.values()), None)
    return PrewarmResult(
        short_form, arch, ok=True, cached=cached,
        registers=res.registers if res else None,
        spill_store_bytes=res.spill_store_bytes if res else None,
        spill_load_bytes=res.spill_load_bytes if res else None,
        compile_seconds=module.compile_seconds, causal=causal,
    )


def _cached_result(cache: KernelCache, short_form: str, arch: str, causal: bool) -> PrewarmResult | None:
    """The result for an entry already in `cache`, or None when it must be compiled."""
    from .registry import config_cache_key

    module = cache.get(config_cache_key(FlashForwardKernelConfig.parse(short_form), arch, causal))
    return _result(short_form, arch, causal, module, cached=True) if module is not None else None


def _compile_with(cache: KernelCache, short_form: str, arch: str, causal: bool) -> PrewarmResult:
    """Compile one (config, arch, causal) into `cache`, turning any failure into a failed result."""
    from .registry import compile_config  # imported here so workers only load what they use

    try:
        lookup = compile_config(FlashForwardKernelConfig.parse(short_form), arch, cache, causal)
    except KernelCompileError as exc:
        return PrewarmResult(short_form, arch, ok=False, cached=False, error=str(exc), causal=causal)
    except Exception as exc:  # report every failure in the summary rather than kill the whole run
        return PrewarmResult(short_form, arch, ok=False, cached=False, error=f"{type(exc).__name__}: {exc}",
                             causal=causal)
    return _result(short_form, arch, causal, lookup.module, lookup.cached)


def _compile_in_worker(cache_dir: str, short_form: str, arch: str, causal: bool) -> PrewarmResult:
    """Worker-process entry point (plain arguments so they pickle cheaply)."""
    cache = _worker_caches.get(cache_dir)
    if cache is None:
        cache = _worker_caches[cache_dir] = KernelCache(cache_dir)
    return _compile_with(cache, short_form, arch, causal)


# ----------------------------------------------------------------------------- driver
def prewarm(configs: Sequence[FlashForwardKernelConfig], archs: Sequence[str],
            cache_dir: str | os.PathLike | None = None, jobs: int | None = None,
            progress: TextIO | None = sys.stderr, causal: Sequence[bool] = (False,)) -> PrewarmReport:
    """Compile every config for every arch into `cache_dir` (default: the default cache dir).

    jobs: worker processes (default os.cpu_count()); 1 compiles in this process. Progress goes to
    `progress` (None = silent). causal: which instantiations of each config, (False,) for the
    plain kernels only, (False, True) to add the causally masked ones. Failures are reported in
    the result, not raised.
    """
    archs = parse_archs(archs)
    configs = list(dict.fromkeys(configs))
    for cfg in configs:
        if not isinstance(cfg, FlashForwardKernelConfig):
            raise TypeError(f"configs: expected FlashForwardKernelConfig items, got {type(cfg).__name__}")
    directory = str(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir())
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    variants = tuple(dict.fromkeys(bool(c) for c in causal))
    tasks = [(cfg.short_form(), arch, c) for cfg in configs for c in variants for arch in archs]
    bar = ProgressBar(len(tasks), progress, label="prewarm")
    start = time.perf_counter()
    results: dict[tuple[str, str, bool], PrewarmResult] = {}

    def record(result: PrewarmResult) -> None:
        results[(result.short_form, result.arch, result.causal)] = result
        status = "FAILED " if not result.ok else ("cached " if result.cached else "")
        bar.advance(f"{status}{result.arch} {result.label}", failed=not result.ok)

    # Entries already on disk are reported from here, so a warm rerun starts no worker processes.
    cache = KernelCache(directory)
    pending = []
    for task in tasks:
        result = _cached_result(cache, *task)
        if result is not None:
            record(result)
        else:
            pending.append(task)
    workers = min(jobs, max(1, len(pending)))
    if workers == 1:
        for task in pending:
            record(_compile_with(cache, *task))
    else:
        # spawn, not fork: the parent may hold CUDA state (a GPU process prewarming), which must
        # never be inherited by a forked child.
        context = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = {pool.submit(_compile_in_worker, directory, *task): task for task in pending}
            for future in cf.as_completed(futures):
                sf, arch, c = futures[future]
                try:
                    record(future.result())
                except Exception as exc:  # a worker died (e.g. killed); keep going, report it
                    record(PrewarmResult(sf, arch, ok=False, cached=False, error=f"{type(exc).__name__}: {exc}",
                                         causal=c))
    bar.finish()
    ordered = tuple(results[t] for t in tasks)
    return PrewarmReport(ordered, archs, len(configs), time.perf_counter() - start, jobs, directory)


def format_summary(report: PrewarmReport) -> str:
    """Human-readable table: one line per (config, arch) plus totals."""
    width = max([len("config")] + [len(r.label) for r in report.results])
    n_cached = sum(r.cached for r in report.results if r.ok)
    n_compiled = sum(not r.cached for r in report.results if r.ok)
    compile_total = sum(r.compile_seconds for r in report.results if r.ok and not r.cached)
    lines = [
        f"prewarm: {report.n_configs} configs x {len(report.archs)} archs ({','.join(report.archs)}) = "
        f"{len(report.results)} modules in {report.seconds:.1f} s with {report.jobs} jobs -> {report.cache_dir}",
        f"  compiled {n_compiled} ({compile_total:.1f} s of NVRTC time), cached {n_cached}, "
        f"failed {len(report.failed)}",
        f"{'config':<{width}}  {'arch':<8} {'regs':>4} {'spill_st':>8} {'spill_ld':>8} {'compile_s':>9}  status",
    ]
    for r in report.results:
        if r.ok:
            regs = "-" if r.registers is None else str(r.registers)
            st = "-" if r.spill_store_bytes is None else str(r.spill_store_bytes)
            ld = "-" if r.spill_load_bytes is None else str(r.spill_load_bytes)
            status = "cached" if r.cached else "compiled"
        else:
            regs = st = ld = "-"
            status = "FAILED"
        lines.append(f"{r.label:<{width}}  {r.arch:<8} {regs:>4} {st:>8} {ld:>8} {r.compile_seconds:>9.2f}  {status}")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of the prewarm command (shared by scripts/prewarm_cache.py and `cupyflash prewarm`)."""
    parser = parser or argparse.ArgumentParser(
        prog="prewarm_cache.py", description="Compile cupyflash kernels into a cache directory (no GPU needed)."
    )
    parser.add_argument("--arch", required=True,
                        help="comma-separated target archs, e.g. sm_80,sm_90 (sm_90a and compute_XY also accepted)")
    parser.add_argument("--set", dest="config_set", default=None,
                        help="config set: tune, prog, prog_all, all or 'B_r,B_c' (default: $KERNELS, else tune)")
    parser.add_argument("--config", dest="configs", action="append", default=[], metavar="SHORT_FORM",
                        help="a single config in short form, e.g. '(FP16, 128, 64, 64, 4): async+...'; "
                             "repeatable; replaces --set when given")
    parser.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $CUPYFLASH_CACHE_DIR, else ~/.cache/cupyflash)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPU count)")
    parser.add_argument("--causal", action="store_true",
                        help="also compile each config's causally masked kernel (forward(causal=True))")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Execute a parsed prewarm command; returns the process exit code (1 if any compile failed)."""
    try:
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs: expected a positive integer, got {args.jobs}")
        archs = parse_archs(args.arch)
        if args.configs:
            configs = [FlashForwardKernelConfig.parse(text) for text in args.configs]
        else:
            configs = get_kernel_configs(args.config_set)
    except ValueError as exc:
        print(f"prewarm: error: {exc}", file=sys.stderr)
        return 2
    report = prewarm(configs, archs, cache_dir=args.cache_dir, jobs=args.jobs,
                     progress=None if args.quiet else sys.stderr, causal=(False, True) if args.causal else (False,))
    print(format_summary(report))
    for r in report.failed:
        print(f"\nprewarm: FAILED {r.arch} {r.label}\n{r.error}", file=sys.stderr)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))
