#!/usr/bin/env python
"""Backward benchmark: SPEC §6 grid (batch*seq = 16384, 16 heads, d_head 128 and 64, S 1k/4k/16k,
causal and not, bf16/fp16), TFLOP/s of cupyflash.backward against PyTorch SDPA's FLASH_ATTENTION
(FlashAttention-2) and CUDNN_ATTENTION backward, and FlashAttention-3's backward (the
`flash_attn3_jax` wheel, d_head 128 only) where it is installed, all in one process on the same
tensors.

Only the backward is timed: cupyflash.backward(dout, q, k, v, out, lse, cfg=None) on the forward's
out/lse (the row "cupyflash": the library's own pick, i.e. the shipped tuning table); SDPA:
torch.autograd.grad of its output (backend forced, retain_graph); FA3: the jitted VJP of
`flash_mha` (its forward runs once, outside the timing). Backward FLOPs = 2.5 x forward =
2.5 * 4*B*H*S*S*D (half if causal). Median of CUDA-event timings after warm-up (FA3: host clock
over batches of calls, JAX launches on its own stream); with --rounds N every implementation is
timed in N rounds in alternating order and the median of the round medians is kept (clock drift
then cannot favour whichever runs first). Every tensor is >= 32 MB at 16k tokens, and the
backward reads ~6 of them, well past the 50 MB L2. Each point also reports the relative L2
difference of cupyflash's (dq, dk, dv) from SDPA flash's.

    python scripts/bench_backward.py --json bench_backward.json
    python scripts/bench_backward.py --d-heads 128 --seqs 4096 --cfgs 'backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled'

Public helpers (imported by scripts/bench.py): backward_flops, time_events, rel, main.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_impls import sustain_load  # noqa: E402  (shared with the forward bench)
from cupyflash.config import DType  # noqa: E402
from cupyflash.families.forward_sm80.config_sets import default_config as forward_default  # noqa: E402
from cupyflash.backward_validation import resolve_backward_config  # noqa: E402
from cupyflash.families.backward_sm80.config_sets import default_config  # noqa: E402

TOKENS = 16384
HEADS = 16
FA3_BATCH = 5  # calls per host-clock sample of the FA3 backward


def backward_flops(batch: int, heads: int, seq: int, d: int, causal: bool) -> float:
    f = 2.5 * 4.0 * batch * heads * seq * seq * d
    return f / 2 if causal else f


SPIN_CYCLES = 2_000_000  # ~1 ms of GPU spin queued ahead of each timed call (at least)
SPIN_CYCLES_PER_S = 2e9  # GPU clock for sizing longer spins (H100 ~1.98 GHz; only a lower bound matters)


def time_events(torch, fn, warmup: int, reps: int, sustain: float = 0.0) -> float:
    """Median milliseconds of fn() between CUDA events on the current stream. Each sample is queued
    behind a GPU spin (torch.cuda._sleep) of at least ~1 ms and of three times the longest host
    time of a warm-up call, so the start event fires only after the host has issued fn()'s
    kernels: the figure is their GPU time, not the host's cost of issuing them (which an idle GPU
    would otherwise wait out inside the timed span: ~0.1 ms, 6% of a 1k point; a call through the
    full validation path, dq/dk/dv given, can take longer than 1 ms of host time).
    sustain > 0 (seconds): the GPU is first loaded with fn() back to back for that long (sustain_load),
    then the reps run back to back with an event pair around each and no spin between them, so
    they are timed at the power-capped clocks of continuous work rather than in short bursts
    (the host issues a backward call in well under its GPU time at every bench point)."""
    if sustain > 0:
        for _ in range(max(1, warmup)):
            fn()
        sustain_load(fn, sustain, torch.cuda.synchronize)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)
    host = 0.0
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        host = max(host, time.perf_counter() - t0)
    spin = max(SPIN_CYCLES, int(3 * host * SPIN_CYCLES_PER_S))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(torch, a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def time_host(fn, block, warmup: int, reps: int, batch: int = FA3_BATCH, sustain: float = 0.0) -> float:
    """Median milliseconds per call of fn(), timed on the host over batches of `batch` calls each
    ended by block(result) (for JAX, which launches on its own stream); sustain > 0: after
    `sustain` seconds of back-to-back calls (time_events)."""
    for _ in range(warmup):
        block(fn())
    if sustain > 0:
        last = [None]

        def call():
            last[0] = fn()
        sustain_load(call, sustain, lambda: block(last[0]))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            r = fn()
        block(r)
        times.append((time.perf_counter() - t0) * 1e3 / batch)
    return statistics.median(times)


def fa3_backward(torch, q, k, v, do, causal: bool):
    """(run, block) for FlashAttention-3's backward through the flash_attn3_jax wheel on DLPack views
    of the same tensors, or raise (not installed, d_head not 128, no GPU for JAX)."""
    import jax
    import jax.dlpack
    import flash_attn3_jax

    if q.shape[-1] != 128:
        raise ValueError(f"the flash-attn3-jax wheel is built for d_head 128, not {q.shape[-1]}")
    torch.cuda.synchronize()  # JAX reads the tensors on its own stream
    jq, jk, jv, jdo = (jax.dlpack.from_dlpack(x) for x in (q, k, v, do))
    _, vjp = jax.vjp(lambda a, b, c: flash_attn3_jax.flash_mha(a, b, c, is_causal=causal), jq, jk, jv)
    bwd = jax.jit(lambda f, g: f(g))
    return (lambda: bwd(vjp, jdo)), (lambda r: r[0].block_until_ready())


def timed_rounds(timers: dict, rounds: int) -> dict:
    """{name: median ms} from {name: zero-argument timer}: every timer runs once per round, in
    alternating order; the median of its round medians is kept. A timer that raises is dropped
    (its exception text is returned under the key ('error', name))."""
    samples: dict = {name: [] for name in timers}
    errors: dict = {}
    for r in range(max(1, rounds)):
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            if name in errors:
                continue
            try:
                samples[name].append(timers[name]())
            except Exception as exc:  # a backend unavailable for this shape/dtype
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    out = {name: statistics.median(v) for name, v in samples.items() if v and name not in errors}
    out.update({("error", name): e for name, e in errors.items()})
    return out


def auto_config(q, k, v, do, dtype, d: int, seq: int, causal: bool) -> str:
    """The config cfg=None ran: backward_sm90's default where backward() takes the Hopper family
    (hopper_reason None), else backward_sm80's table or default pick."""
    from cupyflash.backward_api import _hopper_default, _select, hopper_reason
    from cupyflash.interop import as_view

    if hopper_reason(*(as_view(t, n) for t, n in ((do, "dout"), (q, "q"), (k, "k"), (v, "v")))) is None:
        return str(_hopper_default(dtype, d, causal, seq))
    return str(_select(dtype, d, seq, seq, q.device.index or 0, causal))


def meta_of(torch, args, argv, peers, t_start: float) -> dict:
    """The JSON's meta block: device, versions, settings, the command line, seconds so far."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "tokens": TOKENS, "heads": HEADS, "reps": args.reps, "rounds": args.rounds, "peers": peers,
            "command": "python scripts/bench_backward.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seconds": time.perf_counter() - t_start}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-heads", default="128,64")
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    ap.add_argument("--cfgs", default="", help="'|'-separated cupyflash configs to time besides cfg=None "
                    "(matched by d_head; dtype follows the point), or 'tune' for the family's tuning set")
    ap.add_argument("--deterministic", action="store_true", help="also time deterministic=True (cfg=None)")
    ap.add_argument("--peers", default="sdpa_flash,sdpa_cudnn,fa3",
                    help="peers to run: sdpa_flash,sdpa_cudnn,fa3 ('' for none)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per point")
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="seconds of back-to-back calls before each timing (0: burst timing after a GPU spin; "
                    "> 0: the clocks of continuous work at the power cap, as in a training loop)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    peers = [p_.strip() for p_ in args.peers.split(",") if p_.strip()]
    if "fa3" in peers:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must not take 75% of the GPU
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupyflash

    if args.cfgs.strip() == "tune":  # every config of the family's tuning set
        from cupyflash.families.backward_sm80.config_sets import tune_configs

        extra = [c for c in tune_configs() if c.dtype is DType.BF16]
    else:
        extra = [resolve_backward_config(s) for s in args.cfgs.split("|") if s.strip()]  # either family
    dtypes = [DType.parse(x.replace("bf16", "BF16").replace("fp16", "FP16")) for x in args.dtypes.split(",")]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    t_start = time.perf_counter()
    for d in (int(x) for x in args.d_heads.split(",")):
        for dtype in dtypes:
            tdt = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[dtype]
            for seq in (int(x) for x in args.seqs.split(",")):
                batch = max(1, TOKENS // seq)
                gen = torch.Generator(device="cuda").manual_seed(seq + d)
                q, k, v, do = (torch.randn(batch, seq, HEADS, d, device="cuda", dtype=tdt, generator=gen)
                               for _ in range(4))
                for causal in causals:
                    flops = backward_flops(batch, HEADS, seq, d, causal)
                    row = {"dtype": dtype.name.lower(), "d_head": d, "seq": seq, "batch": batch, "heads": HEADS,
                           "causal": causal, "tflops": {}, "ms": {}, "configs": {}}
                    out, lse = cupyflash.forward(forward_default(dtype, d), q, k, v, causal=causal,
                                                 return_lse=True)
                    # SDPA (batch, heads, seq, d) views; autograd leafs
                    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                    dot = do.transpose(1, 2)
                    timers: dict = {}
                    keep = []  # SDPA outputs (their graphs) alive for the timing
                    ref = None
                    for name in (n for n in ("sdpa_flash", "sdpa_cudnn") if n in peers):
                        try:
                            with sdpa_kernel(backends[name]):
                                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        except Exception as exc:  # backend unavailable for this shape/dtype
                            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:200]
                            continue
                        keep.append(o)

                        def sdpa_bwd(o=o):
                            return torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)

                        timers[name] = (lambda f=sdpa_bwd: time_events(torch, f, args.warmup, args.reps, args.sustain))
                        if name == "sdpa_flash":
                            try:
                                ref = [g.transpose(1, 2) for g in sdpa_bwd()]
                            except Exception:
                                ref = None
                    if "fa3" in peers:
                        try:
                            run, block = fa3_backward(torch, q, k, v, do, causal)
                            timers["fa3"] = (lambda r=run, b=block: time_host(r, b, args.warmup, args.reps, sustain=args.sustain))
                        except Exception as exc:  # not installed, or d_head other than 128
                            row.setdefault("errors", {})["fa3"] = f"{type(exc).__name__}: {exc}"[:200]
                    variants = [(None, False)] + [(c.replace(dtype=dtype), False) for c in extra if c.d_head == d]
                    if args.deterministic:
                        variants.append((None, True))
                    cf_calls = {}
                    for cfg, det in dict.fromkeys(variants):
                        key = (str(cfg) if cfg is not None else "auto") + (" [deterministic]" if det else "")

                        def cf_bwd(cfg=cfg, det=det):
                            return cupyflash.backward(do, q, k, v, out, lse, causal=causal, deterministic=det, cfg=cfg)

                        cf_calls[key] = cf_bwd
                        timers[key] = (lambda f=cf_bwd: time_events(torch, f, args.warmup, args.reps, args.sustain))
                    ms_by_name = timed_rounds(timers, args.rounds)
                    torch.cuda.synchronize()
                    for name, ms in ms_by_name.items():
                        if isinstance(name, tuple):
                            row.setdefault("errors", {})[name[1]] = ms
                        elif name in cf_calls:
                            row["configs"][name] = {"ms": ms, "tflops": flops / ms / 1e9}
                            if ref is not None:
                                grads = cf_calls[name]()
                                row["configs"][name]["rel_l2_vs_flash"] = [rel(torch, g, r) for g, r in zip(grads, ref)]
                        else:
                            row["ms"][name] = ms
                            row["tflops"][name] = flops / ms / 1e9
                    for name in [n for n in peers if n not in row["ms"]]:
                        row["ms"][name] = row["tflops"][name] = None
                    if "auto" in row["configs"]:
                        row["tflops"]["cupyflash"] = row["configs"]["auto"]["tflops"]
                        row["ms"]["cupyflash"] = row["configs"]["auto"]["ms"]
                        row["auto_config"] = auto_config(q, k, v, do, dtype, d, seq, causal)
                    plain = {k_: v_ for k_, v_ in row["configs"].items() if "deterministic" not in k_}
                    if plain:
                        best = max(plain, key=lambda c: plain[c]["tflops"])
                        row["best_config"] = best
                        row["tflops"]["cupyflash_best"] = plain[best]["tflops"]
                    det_key = [k_ for k_ in row["configs"] if "deterministic" in k_]
                    if det_key:
                        row["tflops"]["cupyflash_det"] = row["configs"][det_key[0]]["tflops"]
                    rows.append(row)
                    if args.json:  # after every point, so a run cut short keeps what it measured
                        Path(args.json).write_text(json.dumps({"meta": meta_of(torch, args, argv, peers, t_start),
                                                               "rows": rows}, indent=1))
                    fl, cu, f3, cf = (row["tflops"].get(x) for x in ("sdpa_flash", "sdpa_cudnn", "fa3", "cupyflash"))
                    print(f"{dtype.name.lower()} d{d} S={seq} causal={int(causal)}: cupyflash "
                          f"{cf or 0:.0f} ({row.get('auto_config', '-')}), flash {fl or 0:.0f}, cudnn {cu or 0:.0f}, "
                          f"fa3 {f3 or 0:.0f}"
                          + "".join(f"\n    {k_}: {v_['tflops']:.0f} TFLOP/s rel_l2 "
                                    + ",".join(f"{x:.1e}" for x in v_.get('rel_l2_vs_flash', []))
                                    for k_, v_ in row["configs"].items())
                          + "".join(f"\n    error {k_}: {v_}" for k_, v_ in row.get("errors", {}).items()),
                          flush=True)
                    del keep, timers, cf_calls
                torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta_of(torch, args, argv, peers, t_start), "rows": rows},
                                              indent=1))
    print("\n| dtype | d | causal | S | cupyflash | SDPA flash | SDPA cuDNN | FA3 | cf/flash | best cfg | det |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tflops"]
        ratio = (t["cupyflash"] / t["sdpa_flash"]) if t.get("cupyflash") and t.get("sdpa_flash") else float("nan")
        fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
        print(f"| {r['dtype']} | {r['d_head']} | {'yes' if r['causal'] else 'no'} | {r['seq']} | "
              f"{fmt(t.get('cupyflash'))} | {fmt(t.get('sdpa_flash'))} | {fmt(t.get('sdpa_cudnn'))} | "
              f"{fmt(t.get('fa3'))} | {ratio:.2f}x | {fmt(t.get('cupyflash_best'))} | {fmt(t.get('cupyflash_det'))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
