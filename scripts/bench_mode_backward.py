"""bench.py --mode backward: issue 12's backward table, built from scripts/bench_backward.py's
FLOP count, timers, FA3 backward and grid constants (imported, not copied: that script keeps
working on its own, with its config sweeps and rounds).

    python scripts/bench.py --mode backward [--dtypes bf16,fp16] [--d-heads 128,64] [--seqs 1k,4k,16k]
                            [--causal both|yes|no] [--warmup 3] [--reps 10] [--rounds 1] [--sustain 0]
                            [--json bench_backward.json]

Grid: batch*seq = 16384 (bench_backward.TOKENS), 16 heads, S_q = S_k = S. Only the backward is
timed: cupyflash.backward(dout, q, k, v, out, lse) on the output and lse of cupyflash.forward,
three times: `cupyflash` with cfg=None (the library's choice: backward_sm90 on an H100 where it
applies), `backward_sm80` with that family's tuned-or-default config, `backward_sm90` with the
Hopper family's default config (skipped off compute capability 9.0 and for d_head 96/256); SDPA flash and SDPA cuDNN: torch.autograd.grad of their forward's
output (backend forced, retain_graph); FlashAttention-3 (flash_attn3_jax, d_head 128, when the wheel
is installed): bench_backward.fa3_backward (the jitted VJP of flash_mha), timed with its host clock
(bench_backward.time_host). Backward FLOPs = 2.5 x forward (bench_backward.backward_flops;
half when causal). Every implementation's (dq, dk, dv) is checked once, before it is timed,
against a float64 reference of the first and last (batch, head) (SPEC §5 relative L2 bound on
each of dq, dk, dv). Times: median of --reps CUDA-event timings after --warmup calls; with
--rounds N, every checked column is timed in N rounds in alternating order and the median of its
round medians is reported. With --sustain S (seconds), each timing first runs its column back to
back for S seconds and then times its --reps calls back to back (no GPU spin between them): the
figures are then taken at the clocks the GPU holds under its power cap in continuous work, as in a
training loop, instead of in short bursts after idle gaps (bench_backward.time_events).
Targets (issue 12, printed beside the figures, never a failure): the sm_80 backward family
>= 1.00x SDPA flash at every S >= 1k; the Hopper backward family >= 1.00x cuDNN, then FA3.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any, Callable

import bench_backward as bb
from bench_impls import timed_rounds  # shared with the forward mode's --rounds
from bench_mode_common import (Skip, bar_plot, check_then_time, collect_failures, finish, fmt, format_table, gpu_host,
                               parse_d_heads, parse_impls, ratio, verdict)
from cupyflash.benchmarking import REL_L2_TOLERANCE, parse_dtypes, parse_ints
from cupyflash.config import DType

IMPLS = ("cupyflash", "backward_sm80", "backward_sm90", "sdpa_flash", "sdpa_cudnn", "fa3")
OURS = IMPLS[:3]  # cupyflash's columns: a refusal or error in any of them makes the mode exit 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py --mode backward", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--d-heads", default="128,64")
    p.add_argument("--seqs", default="1k,4k,16k", help="sequence lengths ('k' = 1024)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--sm90-config", default=None,
                   help="short form of the backward_sm90 config the backward_sm90 column runs (default: the family's "
                        "default for the point's dtype and d_head; its dtype and d_head are replaced by the point's)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated columns to measure (default all: {IMPLS})")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10, help="timed calls per measurement (median reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds per point: after every column's check, each column is timed once per round "
                        "in alternating order and the median of its round medians is reported (clock drift then "
                        "cannot favour whichever column runs first; bench_backward.py --rounds does the same)")
    p.add_argument("--sustain", type=float, default=0.0,
                   help="seconds of back-to-back calls before each timing, whose reps then run back to back "
                        "(0: each rep after a GPU spin, the burst timing)")
    p.add_argument("--json", default="bench_backward.json")
    p.add_argument("--plot", default=None, help="PNG (default: the --json path with .png; '' for none)")
    return p


def grid(seqs: tuple[int, ...]) -> list[tuple[int, int]]:
    """(seq, batch) with batch*seq = bench_backward.TOKENS (batch 1 beyond it)."""
    return [(s, max(1, bb.TOKENS // s)) for s in seqs]


def reference_grads(torch: Any, q: Any, k: Any, v: Any, do: Any, b: int, h: int, causal: bool) -> tuple:
    """float64 (dq, dk, dv) of one (batch, head), each (seq, d): P = softmax(scale q k^T + mask),
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q."""
    qs, ks, vs, dos = (x[b, :, h].double() for x in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (qs @ ks.T) * scale
    if causal:  # bottom-right aligned; square here
        n, m = s.shape
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(m - n + 1), -math.inf)
    p = torch.softmax(s, dim=-1)
    del s
    o = p @ vs
    ds = p * (dos @ vs.T - (dos * o).sum(dim=-1, keepdim=True))
    return scale * (ds @ ks), scale * (ds.T @ qs), p.T @ dos


def grads_rel_l2(torch: Any, refs: dict, grads: tuple) -> float:
    """The worst of dq, dk, dv's relative L2 errors over the reference (batch, head)s; inf on NaN/inf."""
    worst = 0.0
    for i, g in enumerate(grads):
        num = den = 0.0
        for (b, h), ref in refs.items():
            got = g[b, :, h].double()
            if not bool(torch.isfinite(got).all()):
                return math.inf
            num += float(((got - ref[i]) ** 2).sum())
            den += float((ref[i] ** 2).sum())
        worst = max(worst, math.sqrt(num / den) if den > 0 else math.inf)
    return worst


def measure_point(torch: Any, dtype: DType, d: int, seq: int, batch: int, causal: bool, warmup: int,
                  reps: int, jax: Any = None, impls: tuple[str, ...] = IMPLS, sm90_config: Any = None,
                  rounds: int = 1, sustain: float = 0.0) -> list[dict]:
    import cupyflash
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[dtype]
    gen = torch.Generator(device="cuda").manual_seed(seq + d)
    q, k, v, do = (torch.randn(batch, seq, bb.HEADS, d, device="cuda", dtype=tdt, generator=gen) for _ in range(4))
    refs = {(b, h): reference_grads(torch, q, k, v, do, b, h, causal)
            for b in sorted({0, batch - 1}) for h in sorted({0, bb.HEADS - 1})}
    flops = bb.backward_flops(batch, bb.HEADS, seq, d, causal)
    tol = REL_L2_TOLERANCE[dtype]
    point = {"dtype": dtype.name.lower(), "d_head": d, "seq": seq, "batch": batch, "heads": bb.HEADS,
             "causal": causal, "flops": flops, "point": f"{dtype.name.lower()} d{d} S={seq} causal={int(causal)}"}
    runs: dict[str, Callable[[], Callable[[], tuple]]] = {}

    def cupyflash_run(cfg: Any = None) -> Callable[[], tuple]:
        out, lse = cupyflash.forward(None, q, k, v, causal=causal, return_lse=True)
        grads = tuple(torch.full_like(x, math.nan) for x in (q, k, v))  # poisoned before the checked run
        return lambda: cupyflash.backward(do, q, k, v, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2],
                                          cfg=cfg)

    def family_run(family: str) -> Callable[[], tuple]:
        from cupyflash.backward_api import _select
        from cupyflash.device import compute_capability
        from cupyflash.families.backward_sm90.config import D_HEADS as SM90_D_HEADS
        from cupyflash.families.backward_sm90.config_sets import default_config as sm90_default

        device = q.get_device()
        if family == "backward_sm80":
            return cupyflash_run(_select(dtype, d, seq, seq, device, causal))
        cc = compute_capability(device)
        if cc != 90:
            raise Skip(f"backward_sm90 runs on compute capability 9.0 (this GPU: {cc // 10}.{cc % 10})")
        if d not in SM90_D_HEADS:
            raise Skip(f"backward_sm90 has d_head {SM90_D_HEADS}")
        if sm90_config is not None:
            return cupyflash_run(sm90_config.replace(dtype=dtype, d_head=d))
        return cupyflash_run(sm90_default(dtype, d, causal, seq))

    def sdpa_run(backend: str) -> Callable[[], tuple]:
        if not hasattr(SDPBackend, backend):
            raise Skip(f"torch {torch.__version__} has no SDPBackend.{backend}")
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        except RuntimeError as exc:  # this backend does not take the shape/dtype here
            raise Skip(f"SDPBackend.{backend}: {str(exc).splitlines()[0]}") from None
        dot = do.transpose(1, 2)
        return lambda: tuple(g.transpose(1, 2) for g in torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True))

    runs["cupyflash"] = cupyflash_run
    runs["backward_sm80"] = lambda: family_run("backward_sm80")
    runs["backward_sm90"] = lambda: family_run("backward_sm90")
    runs["sdpa_flash"] = lambda: sdpa_run("FLASH_ATTENTION")
    runs["sdpa_cudnn"] = lambda: sdpa_run("CUDNN_ATTENTION")
    fa3: dict[str, Callable] = {}

    def fa3_run() -> Callable[[], tuple]:
        if jax is None:
            raise Skip("jax is not importable")
        try:  # bench_backward's FA3 backward: the jitted VJP of flash_mha, and how to block on it
            fa3["run"], fa3["block"] = bb.fa3_backward(torch, q, k, v, do, causal)
        except Exception as exc:  # not installed, d_head not 128, JAX without a GPU
            raise Skip(f"FA3 backward: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        return fa3["run"]

    runs["fa3"] = fa3_run
    records = []
    timers: dict[str, tuple[dict, Callable[[], float]]] = {}  # rounds > 1: the checked columns, kept alive
    for name, make in runs.items():
        if name not in impls:
            continue
        holder: dict[str, Callable] = {}

        def check(make: Callable = make, name: str = name, holder: dict = holder) -> float:
            holder["fn"] = make()
            grads = holder["fn"]()
            if name == "fa3":  # JAX arrays, computed on JAX's stream
                grads = [torch.from_dlpack(g.block_until_ready()) for g in grads]
            return grads_rel_l2(torch, refs, grads)

        def time_us(name: str = name, holder: dict = holder) -> float:  # bound: rounds call it after the loop
            if name == "fa3":  # not on torch's stream: host clock over batches of calls
                return bb.time_host(fa3["run"], fa3["block"], warmup, reps, sustain=sustain) * 1e3
            return bb.time_events(torch, holder["fn"], warmup, reps, sustain) * 1e3

        rec = check_then_time(name, check, time_us, tol)
        if rounds > 1 and rec["status"] == "ok":
            timers[name] = (rec, time_us)
        else:
            holder.clear()
        torch.cuda.synchronize()
        rec.update(point)
        records.append(rec)
    if timers:
        samples = timed_rounds({name: rec["us"] for name, (rec, _) in timers.items()},
                               {name: fn for name, (_, fn) in timers.items()}, rounds)
        for name, (rec, _) in timers.items():
            rec.update(us=statistics.median(samples[name]), us_rounds=samples[name])
        timers.clear()
    for rec in records:
        if rec["status"] == "ok":
            rec["tflops"] = flops / (rec["us"] * 1e-6) / 1e12
        status = f"{rec['tflops']:7.1f} TFLOP/s ({rec['us']:.0f} us, rel_l2 {rec['rel_l2']:.1e})" \
            if rec["status"] == "ok" else f"{rec['status'].upper()}: {rec['reason']}"
        print(f"  {point['point']:<28} {rec['impl']:<11} {status}", flush=True)
    return records


def target_flash(seq: int) -> float | None:
    """Issue 12: the sm_80 backward family >= 1.00x SDPA flash at every S >= 1k."""
    return 1.0 if seq >= 1024 else None


def format_report(records: list[dict]) -> str:
    header = ["dtype", "d_head", "causal", "S"] + list(IMPLS) + ["sm80/flash", "target", "sm90/cuDNN", "sm90/FA3"]
    rows = []
    for key in dict.fromkeys((r["dtype"], r["d_head"], r["causal"], r["seq"]) for r in records):
        got = {r["impl"]: r for r in records if (r["dtype"], r["d_head"], r["causal"], r["seq"]) == key}
        tf = {n: got[n]["tflops"] if n in got and got[n]["status"] == "ok" else None for n in IMPLS}
        cells = [fmt(tf[n], 0) if tf[n] is not None else (got[n]["status"].upper() if n in got else "-") for n in IMPLS]
        r_fl, r_cu = ratio(tf["backward_sm80"], tf["sdpa_flash"]), ratio(tf["backward_sm90"], tf["sdpa_cudnn"])
        r_fa3 = ratio(tf["backward_sm90"], tf["fa3"])
        tgt = target_flash(key[3])
        rows.append([key[0], str(key[1]), "yes" if key[2] else "no", str(key[3])] + cells +
                    [fmt(r_fl, 2) + ("x" if r_fl else ""), f"{verdict(r_fl, tgt)}>={tgt:.2f}" if tgt else "-",
                     fmt(r_cu, 2) + ("x" if r_cu else ""), fmt(r_fa3, 2) + ("x" if r_fa3 else "")])
    notes = list(dict.fromkeys(f"  {r['impl']} {r['point']}: {r['status']}: {r['reason']}"
                               for r in records if r["status"] != "ok"))
    return "\n".join(["backward: TFLOP/s (2.5x forward FLOPs, half if causal), median of CUDA-event timings",
                      format_table(header, rows),
                      "targets (issue 12): sm_80 backward >= 1.00x SDPA flash at S >= 1k (bf16/fp16, d 64/128, causal "
                      "and not); a Hopper backward family >= 1.00x SDPA cuDNN, then FA3"] +
                     (["not reported:"] + notes if notes else []))


def main(argv: list[str] | None = None, host: Any = None) -> int:
    """Exit codes as bench.py: 0 measured, 1 cupyflash refused or raised, 2 nothing measured."""
    args = build_parser().parse_args(argv)
    try:
        dtypes = parse_dtypes(args.dtypes)
        d_heads = parse_d_heads(args.d_heads)
        seqs = parse_ints(args.seqs, "--seqs")
        impls = parse_impls(args.impls, IMPLS)
        sm90_config = None
        if args.sm90_config:
            from cupyflash.families.backward_sm90.config import HopperBackwardKernelConfig

            try:
                sm90_config = HopperBackwardKernelConfig.parse(args.sm90_config)
            except ValueError as exc:
                raise ValueError(f"--sm90-config: {exc}") from None
        if args.reps < 1 or args.warmup < 0 or args.rounds < 1 or args.sustain < 0:
            raise ValueError("--reps and --rounds must be >= 1, --warmup and --sustain >= 0")
    except ValueError as exc:
        print(f"bench.py --mode backward: error: {exc}", file=sys.stderr)
        return 2
    host = gpu_host(host)
    if host is None:
        return 2
    import torch

    from bench_report import write_json

    jax, jax_reason = host._import_jax(["fa3"])
    meta = host._meta(torch, jax)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    data: dict[str, Any] = {"mode": "backward", "meta": meta, "args": vars(args), "records": [], "complete": False}
    print(f"bench backward: {meta['gpu']} | {meta['date']}", flush=True)
    for d in d_heads:
        for dtype in dtypes:
            for seq, batch in grid(seqs):
                for causal in causals:
                    data["records"] += measure_point(torch, dtype, d, seq, batch, causal, args.warmup, args.reps, jax,
                                                   impls, sm90_config, args.rounds, args.sustain)
                    torch.cuda.empty_cache()  # the point's tensors are gone with measure_point's frame
                    write_json(args.json, data)
    failures = [f for name in OURS for f in collect_failures([r for r in data["records"] if r["impl"] == name], name)]
    data.update(complete=True, failures=failures)
    write_json(args.json, data)
    print()
    print(f"== {meta['gpu']} | {meta['date']} | " + " | ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))
    print(format_report(data["records"]))
    def draw(path: str) -> str | None:
        keys = list(dict.fromkeys((r["dtype"], r["d_head"], r["causal"], r["seq"]) for r in data["records"]))
        groups = [f"{k[0]} d{k[1]}{' c' if k[2] else ''} {k[3] // 1024}k" for k in keys]
        series = {n: [next((r["tflops"] for r in data["records"] if r["impl"] == n and r["status"] == "ok"
                            and (r["dtype"], r["d_head"], r["causal"], r["seq"]) == k), None) for k in keys]
                  for n in IMPLS}
        return bar_plot(groups, series, path, "backward TFLOP/s", f"backward, {meta['gpu']}, {meta['date']}")

    return finish("backward", args.json, args.plot, draw, failures)
