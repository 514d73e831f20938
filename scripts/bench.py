#!/usr/bin/env python
"""Benchmark cupyflash against its peers on the SPEC §6 grid, in one process, on the same inputs.

    python scripts/bench.py [--mode forward|decode|varlen|backward] ...
    python scripts/bench.py --mode M --help          # each mode's own options

Modes: forward (the default; described below), decode (issue 10's KV-cache table against SDPA,
FA3 and the bandwidth limit: bench_mode_decode.py), varlen (a ragged packed batch against SDPA on
nested tensors and FA3: bench_mode_varlen.py), backward (issue 12's table: bench_mode_backward.py).

    python scripts/bench.py [--dtypes bf16,fp16] [--d-heads 128] [--seqs 512,1k,...,16k]
                            [--causal] [--configs SHORT_FORM ...] [--all-tune] [--progression]
                            [--iters 50] [--sustain S] [--rounds N] [--json bench_results.json] [--plot PNG]

Grid: batch*seq = 16384, heads*d_head = 2048 (d_head 96: 21 heads), S_q = S_k = S; FLOPs = 4*B*H*S*S*D, or with --causal
2*B*H*S*S*D (half the score matrix is masked, and skipped). Implementations: cupyflash
(cfg='auto', plus --configs / --all-tune; causal=True with --causal), PyTorch SDPA with the
FLASH_ATTENTION and CUDNN_ATTENTION backends on `.transpose(1, 2)` views of the same (B, S, H, D)
tensors (is_causal=True with --causal), JAX's cuDNN attention (jitted, zero-copy DLPack views;
is_causal=True with --causal) when jax is importable, and FlashAttention-3 (`flash_attn3_jax.flash_mha`,
jitted, d_head 128 only) when the flash-attn3-jax wheel is installed. A peer that is missing or
fails is skipped with its reason printed. Times: median of --iters CUDA-event timings after
warm-up (JAX: host clock over batches of back-to-back calls, as its stream is not torch's), input
sets rotated when one set is smaller than 3x L2. With --sustain S every column first runs S
seconds of back-to-back calls, so all are timed at the power-capped clock of continuous work
(without it, CUDA-event columns start after an idle spin at boost clocks while the host-clocked
JAX columns run longer batches, which favours the event columns by a few percent). With
--rounds N every checked column of a grid point is timed N times in alternating order and the
round with the median time is reported (the GPU's clock drifts by a few percent over a point;
one pass favours whichever column ran at the better moment). Every
implementation's output is checked once against a float64 reference (SPEC §5 relative L2 bound:
1e-2 bf16, 2e-3 fp16) before it is timed; a result that fails is refused, not reported.

Also: --progression (the seven-step optimisation history at S=4096, or --seqs), and the per-call
Python overhead of cupyflash.forward vs SDPA flash on a tiny problem (skip with --no-overhead).

Targets (printed, never a failure): non-causal d_head 128 >= 1.00x SDPA flash for S >= 1k and
>= 0.95x at 512, d_head 64 >= 1.00x for S >= 2k; causal d_head 128 bf16 >= 1.00x for S >= 2k.

Exit codes: 0 all measured (missed speed targets are printed, not failures); 1 a cupyflash
config was refused by the correctness check or raised; 2 nothing was measured: bad arguments,
no CUDA GPU, no PyTorch.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must not take 75% of the GPU

try:
    import cupyflash  # noqa: F401  (an installed or editable cupyflash)
except ImportError:  # a plain checkout: use the package next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.benchmarking import grid_shape, parse_dtypes, parse_ints  # noqa: E402
from cupyflash.config import SUPPORTED_D_HEADS, DType, KernelConfig  # noqa: E402
from cupyflash.families import DEFAULT_FAMILY, FAMILIES, get_family, parse_config  # noqa: E402

import bench_report as report  # noqa: E402

GRID_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
MODES = ("forward", "decode", "varlen", "backward")
PROGRESSION_SEQS = (4096,)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    p.add_argument("--mode", choices=MODES, default="forward",
                   help="forward (default: the options below), decode, varlen or backward "
                        "(`--mode M --help` lists each mode's options)")
    p.add_argument("--seqs", default=None, help="sequence lengths (default 512,1k,2k,4k,8k,16k; 'k' = 1024)")
    p.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16,fp16")
    p.add_argument("--d-heads", default="128", help="comma-separated head dimensions, e.g. 64,128")
    p.add_argument("--gqa", type=int, default=1, metavar="G",
                   help="grouped-query attention: k and v get heads/G heads (G=1: multi-head)")
    p.add_argument("--causal", action="store_true",
                   help="causal attention for every implementation (FLOPs counted as 2*B*H*S*S*D)")
    p.add_argument("--seq-k-factor", type=float, default=1.0, metavar="F",
                   help="keys per sequence = round(F * seq) (seq_q != seq_k: prefill over a longer or shorter "
                        "context); causal is bottom-right aligned and counts the visible (query, key) pairs, so "
                        "SDPA and jax_cudnn (top-left is_causal) are skipped for causal with F != 1")
    p.add_argument("--configs", nargs="+", default=[], metavar="SHORT_FORM",
                   help="also time these cupyflash configs (quoted short forms), at the grid points of their dtype/d_head")
    p.add_argument("--family", default=DEFAULT_FAMILY,
                   help=f"kernel family whose tune/progression sets --all-tune and --progression run: "
                        f"{', '.join(f for f in FAMILIES if get_family(f).kind == 'forward')} (default {DEFAULT_FAMILY})")
    p.add_argument("--all-tune", action="store_true",
                   help="also time every autotuning-set config of each dtype/d_head and report the best")
    p.add_argument("--progression", action="store_true",
                   help="time the progression set at S=4096 (or --seqs) and print each step's gain")
    p.add_argument("--no-grid", action="store_true", help="skip the grid (e.g. only --progression)")
    p.add_argument("--no-overhead", action="store_true", help="skip the per-call overhead measurement")
    p.add_argument("--peers", default="sdpa_flash,sdpa_cudnn,jax_cudnn,fa3",
                   help="peers to run (default all: sdpa_flash,sdpa_cudnn,jax_cudnn,fa3; '' for none)")
    p.add_argument("--iters", type=int, default=50, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before timing")
    p.add_argument("--sustain", type=float, default=0.0, metavar="S",
                   help="seconds of back-to-back calls before each column's timed calls, so every column "
                        "(peers included) is timed at the GPU's power-capped steady state; 0 (default): "
                        "timed calls start after an idle spin, at boost clocks")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds per grid point: after every column's check and first timing, each is "
                        "timed rounds - 1 more times in alternating order and its round with the median time "
                        "(the lower middle one for an even N) is reported, so clock drift over a point cannot "
                        "favour whichever column runs first")
    p.add_argument("--overhead-calls", type=int, default=2000, help="back-to-back calls per overhead round")
    p.add_argument("--json", default="bench_results.json", help="results file (default bench_results.json)")
    p.add_argument("--plot", default=None,
                   help="PNG plot when matplotlib is importable (default: the --json path with .png; '' for none)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _fail(msg: str) -> int:
    print(f"bench.py: {msg}", file=sys.stderr)
    return 2


def _no_gpu_reason() -> str | None:
    from cupyflash.device import has_gpu

    if not has_gpu():
        return ("no CUDA GPU found (cupy.cuda.runtime.getDeviceCount() failed or returned 0): the benchmark "
                "times kernels on a GPU, so nothing was run")
    try:
        import torch
    except ImportError as exc:
        return f"PyTorch is required (CUDA-event timing and the SDPA peers) and is not importable: {exc}"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: PyTorch cannot use the GPU, so nothing was run"
    return None


class Run:
    """Collects results and writes the JSON after every measurement (a killed run keeps its numbers)."""

    def __init__(self, args: argparse.Namespace, meta: dict) -> None:
        self.args = args
        self.data: dict[str, Any] = {"meta": meta, "args": vars(args), "grid": [], "progression": [],
                                     "progression_baselines": {}, "overhead": None, "complete": False}
        self.failures: list[str] = []

    def save(self) -> None:
        report.write_json(self.args.json, self.data)


def _or_none(fn: Any) -> Any:
    try:
        return fn()
    except Exception:  # a version we cannot read is recorded as null, not a crash
        return None


def _meta(torch: Any, jax: Any | None) -> dict:
    import cupy

    import cupyflash
    from cupyflash.compiler import nvrtc_version

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count, "l2_bytes": getattr(props, "L2_cache_size", None),
        "memory_bytes": props.total_memory, "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version(), "cupy": cupy.__version__,
                     "cuda_driver": _or_none(cupy.cuda.runtime.driverGetVersion),
                     "nvrtc": ".".join(map(str, nvrtc_version())), "cupyflash": cupyflash.__version__,
                     "jax": getattr(jax, "__version__", None)},
    }


def _import_jax(peers: list[str]) -> tuple[Any | None, str | None]:
    if "jax_cudnn" not in peers and "fa3" not in peers:
        return None, "not requested"
    try:
        import jax
        import jax.dlpack  # noqa: F401

        return jax, None
    except Exception as exc:  # ImportError, or a broken plugin
        return None, f"jax is not importable ({type(exc).__name__}: {exc})"


def seq_k_for(seq: int, factor: float) -> int:
    """Keys per sequence for --seq-k-factor: round(factor * seq), at least 1."""
    return max(1, round(factor * seq))


def _auto_choice(dtype: DType, d_head: int, seq: int, device: int,
                 causal: bool = False, seq_k: int | None = None) -> tuple[KernelConfig, str]:
    """What forward(cfg=None) runs here and why; cross-checked with the library's own resolver."""
    from cupyflash.api import resolve_config
    from cupyflash.families import family_of
    from cupyflash.tuning import device_arch_name, device_name, explain_choice

    keys = seq if seq_k is None else seq_k
    used = resolve_config(None, dtype, d_head, seq, keys, device, causal)
    family = family_of(used).name
    if family != DEFAULT_FAMILY:  # the Hopper family on Hopper: its tuning table, else its default config
        tuned, source = explain_choice(dtype, d_head, seq, keys, device_name(device), causal, family,
                                       device_arch_name(device))
        return used, (f"{family} {source}" if tuned == used else f"{family} default")
    cfg, source = explain_choice(dtype, d_head, seq, keys, device_name(device), causal, DEFAULT_FAMILY,
                                 device_arch_name(device))
    if cfg is None:
        cfg, source = get_family(DEFAULT_FAMILY).default_config(dtype, d_head), "heuristic"
    if used != cfg:
        raise RuntimeError(f"bench.py: auto config mismatch: resolve_config gives {used}, tuning says {cfg}")
    return cfg, source


def _prewarm(configs: list[KernelConfig], device: int, causal: bool = False) -> dict[str, str]:
    """Compile everything the run will launch, in parallel, before any timing (with `causal`, the
    causal instantiations too), each family for its own target on this device."""
    from cupyflash.families import family_of
    from cupyflash.prewarm import prewarm

    by_arch: dict[str, list[KernelConfig]] = {}
    for cfg in set(configs):
        by_arch.setdefault(family_of(cfg).arch_for_device(device), []).append(cfg)
    failed = {}
    for arch, cfgs in sorted(by_arch.items()):
        rep = prewarm(sorted(cfgs), [arch], progress=sys.stderr, causal=(False, True) if causal else (False,))
        print(f"compiled/cached {len(rep.results)} kernels for {arch} in {rep.seconds:.1f} s", flush=True)
        failed.update({r.short_form: (r.error or "compile failed") for r in rep.failed})
    return failed


def _measure(torch: Any, impl: Any, problem: Any, record: dict, args: argparse.Namespace) -> dict:
    """Check, then time one implementation; fills status/reason/numbers in `record`."""
    from bench_impls import Skip
    from cupyflash.benchmarking import REL_L2_TOLERANCE

    try:
        impl.prepare(problem)
        with impl.context():
            rel = impl.check(torch)
            tol = REL_L2_TOLERANCE[problem.dtype]
            record["rel_l2"] = rel
            if not rel <= tol:
                why = "NaN/inf or unwritten elements in the output" if rel == float("inf") else \
                    f"relative L2 error {rel:.3g} > {tol:g}"
                record.update(status="refused", reason=why)
                return record
            timing = impl.time(torch, args.warmup, args.iters, args.sustain)
        record.update(status="ok", tflops=timing.tflops(problem.flops), timing=impl.timing_method, **timing.to_dict())
    except Skip as exc:
        record.update(status="skipped", reason=str(exc))
    except Exception as exc:  # a peer or config that raises is reported with its error, never silently
        record.update(status="error", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    finally:
        torch.cuda.synchronize()
    return record


def _more_rounds(torch: Any, problem: Any, checked: list[tuple[Any, dict]], args: argparse.Namespace) -> None:
    """--rounds: time each checked column rounds - 1 more times (bench_impls.timed_rounds' order)
    and report, per column, the round with the median time (the lower middle one for an even
    count: a round that ran); every round's median is kept in `ms_rounds`, and ms_min / ms_max /
    samples cover all rounds. A round that raises is left out and named in `round_errors`."""
    from bench_impls import timed_rounds
    from cupyflash.benchmarking import Timing

    def timer(impl: Any, rec: dict) -> Callable[[], Timing | None]:
        def again() -> Timing | None:
            try:
                impl.prepare(problem)
                with impl.context():
                    return impl.time(torch, args.warmup, args.iters, args.sustain)
            except Exception as exc:  # the first round's figure stands; say why this one is missing
                rec.setdefault("round_errors", []).append(f"{type(exc).__name__}: {exc}"[:200])
                return None
            finally:
                torch.cuda.synchronize()
        return again

    first = {i: Timing(rec["ms_median"], rec["ms_min"], rec["ms_max"], rec["samples"]) for i, (_, rec) in enumerate(checked)}
    rounds = timed_rounds(first, {i: timer(impl, rec) for i, (impl, rec) in enumerate(checked)}, args.rounds)
    for i, (impl, rec) in enumerate(checked):
        times = [t for t in rounds[i] if t is not None]
        mid = sorted(times, key=lambda t: t.median_ms)[(len(times) - 1) // 2]  # lower median: an actual round
        rec.update(tflops=mid.tflops(problem.flops), ms_median=mid.median_ms, ms_min=min(t.min_ms for t in times),
                   ms_max=max(t.max_ms for t in times), samples=sum(t.samples for t in times),
                   ms_rounds=[t.median_ms for t in times])
        print(f"  {rec['dtype']} d{rec['d_head']} S={rec['seq']:<6} {impl.name:<16} {rec['tflops']:7.1f} TFLOP/s, "
              f"median of {len(times)} rounds ({', '.join(f'{problem.flops / (t.median_ms * 1e9):.1f}' for t in times)})",
              flush=True)


def _grid_point(torch: Any, run: Run, dtype: DType, d_head: int, seq: int, impls: list, l2: int | None,
                list_key: str = "grid", extra: dict | None = None) -> list[dict]:
    from bench_impls import make_problem

    shape = grid_shape(seq, d_head)
    seq_k = seq_k_for(seq, run.args.seq_k_factor)
    problem = make_problem(torch, dtype, shape, run.args.causal, l2, seed=run.args.seed + seq,
                           kv_group=run.args.gqa, seq_k=seq_k)
    out = []
    for impl, info in impls:
        record = {"dtype": dtype.name.lower(), "d_head": d_head, "seq": seq, "seq_k": seq_k, "batch": shape.batch,
                  "heads": shape.heads, "kv_heads": shape.heads // run.args.gqa, "causal": run.args.causal, "impl": impl.name, "n_sets": len(problem.sets),
                  **info, **(extra or {})}
        _measure(torch, impl, problem, record, run.args)
        if record["impl"].startswith("cupyflash") and record["status"] not in ("ok", "skipped"):
            run.failures.append(f"{record['impl']} {record.get('config')} {dtype.name} d{d_head} S={seq}: "
                                f"{record['status']}: {record.get('reason')}")
        status = f"{record['tflops']:7.1f} TFLOP/s" if record["status"] == "ok" else \
            f"{record['status'].upper()}: {record.get('reason')}"
        print(f"  {dtype.name.lower()} d{d_head} S={seq:<6} {impl.name:<16} {status}"
              + (f"  {record['config']}" if record.get("config") else ""), flush=True)
        run.data[list_key].append(record)
        out.append(record)
        run.save()
    if run.args.rounds > 1:
        _more_rounds(torch, problem, [(impl, rec) for (impl, _), rec in zip(impls, out) if rec["status"] == "ok"],
                     run.args)
        run.save()
    del problem
    gc.collect()
    torch.cuda.empty_cache()
    return out


def split_mode(argv: list[str]) -> tuple[str, list[str]]:
    """(mode, the other arguments): --mode is peeled off first, so each mode parses its own options."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--mode", choices=MODES, default="forward")
    known, rest = pre.parse_known_args(argv)
    return known.mode, rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode, rest = split_mode(argv)
    if mode != "forward":  # the other modes live in bench_mode_<mode>.py and use this module's helpers
        return importlib.import_module(f"bench_mode_{mode}").main(rest, host=sys.modules[__name__])
    args = build_parser().parse_args(argv)
    try:
        dtypes = parse_dtypes(args.dtypes)
        d_heads = parse_ints(args.d_heads, "--d-heads")
        seqs = parse_ints(args.seqs, "--seqs") if args.seqs else GRID_SEQS
        prog_seqs = seqs if args.seqs else PROGRESSION_SEQS
        explicit = [parse_config(s) for s in args.configs]
        family = get_family(args.family)
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        for d in d_heads:
            if d not in SUPPORTED_D_HEADS:
                raise ValueError(f"--d-heads: {d} is not supported (expected {SUPPORTED_D_HEADS})")
        for s in set(seqs) | set(prog_seqs):
            for d in d_heads:
                grid_shape(s, d)
        unknown = set(peers) - set(report.PEER_ORDER)
        if unknown:
            raise ValueError(f"--peers: unknown {sorted(unknown)}; expected from {report.PEER_ORDER}")
        if args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.sustain < 0:
            raise ValueError("--iters and --rounds must be >= 1, --warmup and --sustain >= 0")
        if not args.seq_k_factor > 0:
            raise ValueError(f"--seq-k-factor must be > 0, got {args.seq_k_factor}")
    except ValueError as exc:
        return _fail(f"error: {exc}")
    reason = _no_gpu_reason()
    if reason:
        return _fail(reason)

    import torch

    from bench_impls import CupyflashImpl, Fa3Impl, JaxImpl, SdpaImpl, Skip, measure_overhead

    device = torch.cuda.current_device()
    jax, jax_reason = _import_jax(peers)
    meta = _meta(torch, jax)
    run = Run(args, meta)
    l2 = meta["l2_bytes"]
    print(f"bench: {meta['gpu']} (cc {meta['compute_capability']}, {meta['sm_count']} SMs) | "
          + " | ".join(f"{k} {v}" for k, v in meta["versions"].items() if v is not None) + f" | {meta['date']}",
          flush=True)

    # Everything this run launches is compiled up front, in parallel.
    groups = [(dt, d) for dt in dtypes for d in d_heads]
    needed = [_auto_choice(dt, d, s, device, args.causal, seq_k_for(s, args.seq_k_factor))[0] for dt, d in groups
              for s in (() if args.no_grid else seqs)]
    needed += [c for c in explicit if (c.dtype, c.d_head) in groups]
    if args.all_tune:
        needed += [c for dt, d in groups for c in family.tune_candidates(dt, d)]
    if args.progression:
        needed += [c for dt, d in groups for c in family.progression_configs(dt, d)]
    if not args.no_overhead:
        needed.append(_auto_choice(DType.BF16, 128, 128, device)[0])
    failed_compiles = _prewarm(needed, device, args.causal)
    for sf, err in failed_compiles.items():
        print(f"bench.py: COMPILE FAILED {sf}\n{err}", file=sys.stderr)

    def peer_impls() -> list:
        out = []
        for name, make in (("sdpa_flash", lambda: SdpaImpl(torch, "FLASH_ATTENTION", "sdpa_flash")),
                           ("sdpa_cudnn", lambda: SdpaImpl(torch, "CUDNN_ATTENTION", "sdpa_cudnn")),
                           ("jax_cudnn", lambda: JaxImpl(jax) if jax else _raise(Skip(jax_reason))),
                           ("fa3", lambda: Fa3Impl(jax) if jax else _raise(Skip(jax_reason)))):
            if name not in peers:
                continue
            try:
                out.append((make(), {}))
            except Skip as exc:
                print(f"  skipping {name}: {exc}", flush=True)
                run.data.setdefault("skipped_peers", {})[name] = str(exc)
        return out

    peers_now = peer_impls()
    if not args.no_grid:
        gqa = f", GQA with heads/{args.gqa} k/v heads" if args.gqa > 1 else ""
        if args.seq_k_factor != 1:
            gqa += f", seq_k = {args.seq_k_factor:g} x seq"
        print(f"grid: batch*seq=16384, heads*d_head=2048, {'causal' if args.causal else 'non-causal'}{gqa}; "
              f"median of {args.iters} timings after {args.warmup} warm-up calls"
              + (f" and {args.sustain:g} s of sustained load (power-capped clocks)" if args.sustain else ""), flush=True)
        for dtype, d_head in groups:
            for seq in seqs:
                cfg, source = _auto_choice(dtype, d_head, seq, device, args.causal,
                                           seq_k_for(seq, args.seq_k_factor))
                impls = [(CupyflashImpl(None, "cupyflash"), {"config": str(cfg), "config_source": source})]
                for i, c in enumerate(explicit):
                    if (c.dtype, c.d_head) == (dtype, d_head):
                        impls.append((CupyflashImpl(c, f"cupyflash[{i + 1}]"), {"config": str(c)}))
                if args.all_tune:
                    impls += [(CupyflashImpl(c, "cupyflash_tune"), {"config": str(c)})
                              for c in family.tune_candidates(dtype, d_head)]
                records = _grid_point(torch, run, dtype, d_head, seq, impls + peers_now, l2)
                tuned = [r for r in records if r["impl"] == "cupyflash_tune" and r["status"] == "ok"]
                if args.all_tune:
                    best = dict(max(tuned, key=lambda r: r["tflops"]), impl="cupyflash_best") if tuned else \
                        {**records[0], "impl": "cupyflash_best", "status": "error", "reason": "no tune config passed",
                         "config": None}
                    run.data["grid"].append(best)
        run.save()

    if args.progression:
        print("progression set:", flush=True)
        baselines = run.data["progression_baselines"]
        for dtype, d_head in groups:
            for seq in prog_seqs:
                impls = [(CupyflashImpl(c, "cupyflash_prog"), {"config": str(c), "step": i + 1})
                         for i, c in enumerate(family.progression_configs(dtype, d_head))]
                have = report.find_ok(run.data["grid"], impl="sdpa_flash", dtype=dtype.name.lower(), d_head=d_head, seq=seq)
                if have is None and "sdpa_flash" in peers:
                    impls += [p for p in peers_now if p[0].name == "sdpa_flash"]
                records = _grid_point(torch, run, dtype, d_head, seq, impls, l2, list_key="progression")
                have = have or report.find_ok(records, impl="sdpa_flash")
                if have:
                    baselines[f"{dtype.name.lower()},{d_head},{seq}"] = have["tflops"]
        run.data["progression"] = [r for r in run.data["progression"] if r["impl"] == "cupyflash_prog"]
        prev: dict[tuple, float | None] = {}
        for r in run.data["progression"]:  # gain over the previous step of the same shape, for the README
            key = (r["dtype"], r["d_head"], r["seq"])
            ok = r["status"] == "ok"
            r["gain_vs_previous"] = (r["tflops"] / prev[key] - 1) if ok and prev.get(key) else None
            prev[key] = r["tflops"] if ok else None
        run.save()

    if not args.no_overhead:
        print("per-call overhead ...", flush=True)
        try:
            run.data["overhead"] = measure_overhead(torch, n_calls=args.overhead_calls)
        except Exception as exc:
            run.data["overhead"] = {"error": f"{type(exc).__name__}: {exc}"}
            run.failures.append(f"overhead measurement: {type(exc).__name__}: {exc}")
        run.save()

    # The summary comes last: it is what a log tail shows.
    print()
    print(f"== {meta['gpu']} | {meta['date']} | " + " | ".join(f"{k} {v}" for k, v in meta["versions"].items()
                                                              if v is not None))
    if run.data["grid"]:
        print(f"TFLOP/s, median of {args.iters} (CUDA events; jax_cudnn: host clock over batches of calls)")
        print(report.format_grid(run.data["grid"], args.causal))
    if run.data["progression"]:
        print()
        print(report.format_progression(run.data["progression"], run.data["progression_baselines"]))
    overhead = run.data["overhead"]
    if overhead:
        print()
        print(report.format_overhead(overhead) if "error" not in overhead else f"overhead: {overhead['error']}")
    plot_path = args.plot if args.plot is not None else str(Path(args.json).with_suffix(".png"))
    if run.data["grid"] and plot_path:
        why = report.plot(run.data["grid"], plot_path, f"{meta['gpu']}, {meta['date']}, cupyflash "
                          f"{meta['versions']['cupyflash']}, torch {meta['versions']['torch']}")
        print(f"plot: {plot_path}" if why is None else f"plot: not written: {why}")
    run.data["complete"] = True
    run.data["failures"] = run.failures
    run.save()
    print(f"json: {args.json}")
    if run.failures:
        print("\nbench.py: cupyflash FAILURES (refused or raised):\n  " + "\n  ".join(run.failures), file=sys.stderr)
        return 1
    return 0


def _raise(exc: Exception):
    raise exc


if __name__ == "__main__":
    sys.exit(main())
