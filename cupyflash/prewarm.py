"""Prewarm a kernel cache without a GPU: compile named config sets of any kernel family for named
archs in parallel.

NVRTC needs no device, so CI and container builds can fill a cache directory that a later GPU
process (CUPYFLASH_CACHE_DIR=DIR) uses as is. Every (config, variant, arch) is compiled through
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
from .config import KernelConfig
from .families import DEFAULT_FAMILY, FAMILIES, Variant, family_of, get_family, parse_config
from .progress import ProgressBar

__all__ = ["PrewarmResult", "PrewarmReport", "prewarm", "prewarm_for_device", "parse_archs", "format_summary",
           "build_parser",
           "run_from_args", "main"]


@dataclass(frozen=True)
class PrewarmResult:
    """Outcome of one (config, variant, arch) compile."""

    short_form: str
    arch: str
    ok: bool
    cached: bool
    registers: int | None = None       # of the module's first kernel (the family's main role)
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    compile_seconds: float = 0.0  # NVRTC time of the compile that produced the entry (also when cached)
    error: str | None = None
    variant: Variant = ()         # the family's template flags, e.g. (causal,)
    family: str = DEFAULT_FAMILY
    # Every kernel of the module, by role: (registers, spill stores, spill loads) from ptxas.
    roles: tuple[tuple[str, int, int, int], ...] = ()
    # ptxas' warning lines for the module (e.g. C7508 setmaxnreg ignored, C7515 wgmma serialised)
    ptxas_warnings: tuple[str, ...] = ()

    @property
    def causal(self) -> bool:
        """Whether this is the causally masked instantiation (families with a causal flag)."""
        fam = get_family(self.family)
        return "causal" in fam.variant_flags and bool(self.variant[fam.variant_flags.index("causal")])

    @property
    def label(self) -> str:
        return self.short_form + get_family(self.family).variant_label(self.variant)

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


def _result(task: "_Task", module: CompiledModule, cached: bool) -> PrewarmResult:
    family, short_form, arch, variant = task
    fam = get_family(family)
    cfg = fam.parse(short_form)
    roles = []
    for role, expr in fam.name_expressions(cfg, variant).items():
        res = module.resources.get(expr)
        if res is not None:
            roles.append((role, res.registers, res.spill_store_bytes, res.spill_load_bytes))
    first = module.resources.get(next(iter(fam.name_expressions(cfg, variant).values())))
    return PrewarmResult(
        short_form, arch, ok=True, cached=cached,
        registers=first.registers if first else None,
        spill_store_bytes=first.spill_store_bytes if first else None,
        spill_load_bytes=first.spill_load_bytes if first else None,
        compile_seconds=module.compile_seconds, variant=variant, family=family, roles=tuple(roles),
        ptxas_warnings=tuple(line.strip() for line in (module.log or "").splitlines() if "warning" in line.lower()),
    )


def _cached_result(cache: KernelCache, task: "_Task") -> PrewarmResult | None:
    """The result for an entry already in `cache`, or None when it must be compiled."""
    from .registry import config_cache_key

    family, short_form, arch, variant = task
    module = cache.get(config_cache_key(get_family(family).parse(short_form), arch, variant=variant))
    return _result(task, module, cached=True) if module is not None else None


def _failed(task: "_Task", error: str) -> PrewarmResult:
    family, short_form, arch, variant = task
    return PrewarmResult(short_form, arch, ok=False, cached=False, error=error, variant=variant, family=family)


def _compile_with(cache: KernelCache, task: "_Task") -> PrewarmResult:
    """Compile one (config, arch, variant) into `cache`, turning any failure into a failed result."""
    from .registry import compile_config  # imported here so workers only load what they use

    family, short_form, arch, variant = task
    try:
        lookup = compile_config(get_family(family).parse(short_form), arch, cache, variant=variant)
    except KernelCompileError as exc:
        return _failed(task, str(exc))
    except Exception as exc:  # report every failure in the summary rather than kill the whole run
        return _failed(task, f"{type(exc).__name__}: {exc}")
    return _result(task, lookup.module, lookup.cached)


def _compile_in_worker(cache_dir: str, task: "_Task") -> PrewarmResult:
    """Worker-process entry point (plain arguments so they pickle cheaply)."""
    cache = _worker_caches.get(cache_dir)
    if cache is None:
        cache = _worker_caches[cache_dir] = KernelCache(cache_dir)
    return _compile_with(cache, task)


# (family name, short form, arch, variant): plain values, cheap to pickle to worker processes
_Task = tuple[str, str, str, Variant]


def _variants_for(cfg: KernelConfig, causal: Sequence[bool], variants: Sequence[Variant] | None) -> list[Variant]:
    family = family_of(cfg)
    if variants is not None:
        return list(dict.fromkeys(family.check_variant(v) for v in variants))
    wanted = dict.fromkeys(bool(c) for c in causal)
    if "causal" not in family.variant_flags:
        return [family.default_variant()]
    return [family.variant(causal=c) for c in wanted]


# ----------------------------------------------------------------------------- driver
def prewarm(configs: Sequence[KernelConfig], archs: Sequence[str],
            cache_dir: str | os.PathLike | None = None, jobs: int | None = None,
            progress: TextIO | None = sys.stderr, causal: Sequence[bool] = (False,),
            variants: Sequence[Variant] | None = None) -> PrewarmReport:
    """Compile every config (of any families) for every arch into `cache_dir` (default: the
    default cache dir).

    jobs: worker processes (default os.cpu_count()); 1 compiles in this process. Progress goes to
    `progress` (None = silent). causal: which instantiations of each config of a family with a
    causal flag, (False,) for the plain kernels only, (False, True) to add the causally masked
    ones; `variants`, if given, lists the exact variants instead. An arch a config's family does
    not compile for (sm_80 for an sm_90a family) is a ValueError before anything compiles.
    Failures to compile are reported in the result, not raised.
    """
    archs = parse_archs(archs)
    configs = list(dict.fromkeys(configs))
    for cfg in configs:
        if not isinstance(cfg, KernelConfig):
            raise TypeError(f"configs: expected kernel configs, got {type(cfg).__name__}")
        for arch in archs:
            family_of(cfg).check_arch(arch)
    directory = str(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir())
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    tasks: list[_Task] = [(family_of(cfg).name, cfg.short_form(), arch, v) for cfg in configs
                          for v in _variants_for(cfg, causal, variants) for arch in archs]
    bar = ProgressBar(len(tasks), progress, label="prewarm")
    start = time.perf_counter()
    results: dict[_Task, PrewarmResult] = {}

    def record(result: PrewarmResult) -> None:
        results[(result.family, result.short_form, result.arch, result.variant)] = result
        status = "FAILED " if not result.ok else ("cached " if result.cached else "")
        bar.advance(f"{status}{result.arch} {result.label}", failed=not result.ok)

    # Entries already on disk are reported from here, so a warm rerun starts no worker processes.
    cache = KernelCache(directory)
    pending = []
    for task in tasks:
        result = _cached_result(cache, task)
        if result is not None:
            record(result)
        else:
            pending.append(task)
    workers = min(jobs, max(1, len(pending)))
    if workers == 1:
        for task in pending:
            record(_compile_with(cache, task))
    else:
        # spawn, not fork: the parent may hold CUDA state (a GPU process prewarming), which must
        # never be inherited by a forked child.
        context = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = {pool.submit(_compile_in_worker, directory, task): task for task in pending}
            for future in cf.as_completed(futures):
                try:
                    record(future.result())
                except Exception as exc:  # a worker died (e.g. killed); keep going, report it
                    record(_failed(futures[future], f"{type(exc).__name__}: {exc}"))
    bar.finish()
    ordered = tuple(results[t] for t in tasks)
    return PrewarmReport(ordered, archs, len(configs), time.perf_counter() - start, jobs, directory)


def prewarm_for_device(configs: Iterable[KernelConfig], device: int, progress: TextIO | None = None,
                       causal: Sequence[bool] = (False,), jobs: int | None = None) -> list[PrewarmReport]:
    """Compile `configs` (of any families) each for its own family's target on CUDA device
    `device` (e.g. sm_90 for the mma.sync family and sm_90a for the Hopper family on an H100),
    into the default cache; one report per target arch."""
    by_arch: dict[str, list[KernelConfig]] = {}
    for cfg in dict.fromkeys(configs):
        by_arch.setdefault(family_of(cfg).arch_for_device(device), []).append(cfg)
    return [prewarm(cfgs, [arch], progress=progress, causal=causal, jobs=jobs) for arch, cfgs in sorted(by_arch.items())]


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
    parser.add_argument("--arch", default=None,
                        help="comma-separated target archs, e.g. sm_80,sm_90 (sm_90a and compute_XY also accepted); "
                             "default: the family's usual targets")
    parser.add_argument("--family", default=DEFAULT_FAMILY,
                        help=f"kernel family whose --set is compiled: {', '.join(FAMILIES)} (default {DEFAULT_FAMILY})")
    parser.add_argument("--set", dest="config_set", default=None,
                        help="config set of the family: for forward_sm80 tune, prog, prog_all, all or 'B_r,B_c' "
                             "(default: $KERNELS, else tune)")
    parser.add_argument("--config", dest="configs", action="append", default=[], metavar="SHORT_FORM",
                        help="a single config in short form (any family, read off its prefix), e.g. "
                             "'(FP16, 128, 64, 64, 4): async+...'; repeatable; replaces --set when given")
    parser.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $CUPYFLASH_CACHE_DIR, else ~/.cache/cupyflash)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPU count)")
    parser.add_argument("--causal", action="store_true",
                        help="also compile each config's causally masked kernel (families with a causal flag)")
    parser.add_argument("--all-variants", action="store_true",
                        help="compile every variant (every combination of the family's template flags)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Execute a parsed prewarm command; returns the process exit code (1 if any compile failed)."""
    try:
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs: expected a positive integer, got {args.jobs}")
        family = get_family(args.family)
        if args.configs:
            configs = [parse_config(text) for text in args.configs]
        else:
            key = args.config_set if args.config_set is not None else os.environ.get("KERNELS", "tune")
            configs = family.config_set(key)
        families = {family_of(c).name for c in configs}
        archs = parse_archs(args.arch) if args.arch else tuple(
            dict.fromkeys(a for name in sorted(families) for a in get_family(name).default_archs()))
        variants = None
        if args.all_variants:
            if len(families) != 1:
                raise ValueError("--all-variants: the configs must be of one family")
            variants = get_family(families.pop()).all_variants()
        report = prewarm(configs, archs, cache_dir=args.cache_dir, jobs=args.jobs,
                         progress=None if args.quiet else sys.stderr,
                         causal=(False, True) if args.causal else (False,), variants=variants)
    except ValueError as exc:
        print(f"prewarm: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(report))
    for r in report.failed:
        print(f"\nprewarm: FAILED {r.arch} {r.label}\n{r.error}", file=sys.stderr)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))
