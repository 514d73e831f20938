#!/usr/bin/env python
"""Backward benchmark: SPEC §6 grid (batch*seq = 16384, 16 heads, d_head 128 and 64, S 1k/4k/16k,
causal and not, bf16/fp16), TFLOP/s of cupyflash.backward against PyTorch SDPA's FLASH_ATTENTION
(FlashAttention-2) and CUDNN_ATTENTION backward, all in one process on the same tensors.

Only the backward is timed: cupyflash.backward(dout, q, k, v, out, lse) on the forward's out/lse;
SDPA: torch.autograd.grad of its output (backend forced, retain_graph). Backward FLOPs = 2.5 x
forward = 2.5 * 4*B*H*S*S*D (half if causal). Median of CUDA-event timings after warm-up; every
tensor is >= 32 MB at 16k tokens, and the backward reads ~6 of them, well past the 50 MB L2.
Each point also reports the relative L2 difference of cupyflash's (dq, dk, dv) from SDPA flash's.

    python scripts/bench_backward.py --json bench_backward.json
    python scripts/bench_backward.py --d-heads 128 --seqs 4096 --cfgs 'backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled'
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.config import DType  # noqa: E402
from cupyflash.families.forward_sm80.config_sets import default_config as forward_default  # noqa: E402
from cupyflash.families.backward_sm80.config import BackwardKernelConfig  # noqa: E402
from cupyflash.families.backward_sm80.config_sets import default_config  # noqa: E402

TOKENS = 16384
HEADS = 16


def backward_flops(batch: int, heads: int, seq: int, d: int, causal: bool) -> float:
    f = 2.5 * 4.0 * batch * heads * seq * seq * d
    return f / 2 if causal else f


def time_events(torch, fn, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() between CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(torch, a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-heads", default="128,64")
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    ap.add_argument("--cfgs", default="", help="'|'-separated cupyflash configs to time besides the default "
                    "(matched by d_head; dtype follows the point)")
    ap.add_argument("--deterministic", action="store_true", help="also time deterministic=True (default config)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupyflash

    extra = [BackwardKernelConfig.parse(s) for s in args.cfgs.split("|") if s.strip()]
    dtypes = [DType.parse(x.replace("bf16", "BF16").replace("fp16", "FP16")) for x in args.dtypes.split(",")]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
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
                    ref = None
                    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            with sdpa_kernel(backend):
                                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

                            def sdpa_bwd(o=o):
                                return torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)

                            ms = time_events(torch, sdpa_bwd, args.warmup, args.reps)
                            row["ms"][name] = ms
                            row["tflops"][name] = flops / ms / 1e9
                            if name == "sdpa_flash":
                                ref = [g.transpose(1, 2) for g in sdpa_bwd()]
                            del o
                        except Exception as exc:  # backend unavailable for this shape/dtype
                            row["ms"][name] = None
                            row["tflops"][name] = None
                            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:200]
                    cfgs = [default_config(dtype, d)] + [c.replace(dtype=dtype) for c in extra if c.d_head == d]
                    variants = [(c, False) for c in dict.fromkeys(cfgs)]
                    if args.deterministic:
                        variants.append((cfgs[0], True))
                    for cfg, det in variants:
                        key = str(cfg) + (" [deterministic]" if det else "")

                        def cf_bwd(cfg=cfg, det=det):
                            return cupyflash.backward(do, q, k, v, out, lse, causal=causal, deterministic=det, cfg=cfg)

                        try:
                            ms = time_events(torch, cf_bwd, args.warmup, args.reps)
                        except Exception as exc:
                            row.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:300]
                            continue
                        row["configs"][key] = {"ms": ms, "tflops": flops / ms / 1e9}
                        if ref is not None:
                            grads = cf_bwd()
                            row["configs"][key]["rel_l2_vs_flash"] = [rel(torch, g, r) for g, r in zip(grads, ref)]
                    plain = {k_: v_ for k_, v_ in row["configs"].items() if "deterministic" not in k_}
                    if plain:
                        best = max(plain, key=lambda c: plain[c]["tflops"])
                        row["best_config"] = best
                        row["tflops"]["cupyflash"] = plain[best]["tflops"]
                        row["ms"]["cupyflash"] = plain[best]["ms"]
                        det_key = [k_ for k_ in row["configs"] if "deterministic" in k_]
                        if det_key:
                            row["tflops"]["cupyflash_det"] = row["configs"][det_key[0]]["tflops"]
                    rows.append(row)
                    fl, cu, cf = (row["tflops"].get(x) for x in ("sdpa_flash", "sdpa_cudnn", "cupyflash"))
                    print(f"{dtype.name.lower()} d{d} S={seq} causal={int(causal)}: cupyflash "
                          f"{cf or 0:.0f} ({row.get('best_config', '-')}), flash {fl or 0:.0f}, cudnn {cu or 0:.0f}"
                          + "".join(f"\n    {k_}: {v_['tflops']:.0f} TFLOP/s rel_l2 "
                                    + ",".join(f"{x:.1e}" for x in v_.get('rel_l2_vs_flash', []))
                                    for k_, v_ in row["configs"].items()), flush=True)
                torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "tokens": TOKENS, "heads": HEADS, "reps": args.reps, "seconds": time.perf_counter() - t_start}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| dtype | d | causal | S | cupyflash | SDPA flash | SDPA cuDNN | cf/flash | det |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tflops"]
        ratio = (t["cupyflash"] / t["sdpa_flash"]) if t.get("cupyflash") and t.get("sdpa_flash") else float("nan")
        fmt = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
        print(f"| {r['dtype']} | {r['d_head']} | {'yes' if r['causal'] else 'no'} | {r['seq']} | "
              f"{fmt(t.get('cupyflash'))} | {fmt(t.get('sdpa_flash'))} | {fmt(t.get('sdpa_cudnn'))} | "
              f"{ratio:.2f}x | {fmt(t.get('cupyflash_det'))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
