#!/usr/bin/env python
"""Backward of a packed ragged batch: cupyflash.backward_varlen against its peers, one table.

    python scripts/bench_varlen_backward.py [--dtypes bf16,fp16] [--d-heads 128] [--causal both|yes|no]
        [--total-tokens 32768] [--max-len 8192] [--heads 16] [--seed 0] [--iters 20] [--warmup 3]
        [--sustain 0] [--sm90-config SHORT_FORM] [--json bench_varlen_backward.json]

The batch is bench.py --mode varlen's (lengths drawn from 1..--max-len until --total-tokens), the
same lengths for queries and keys. Implementations, each timed on the backward alone (the forward
runs once before): cupyflash.backward_varlen with cfg=None (atomic dQ, and `cupyflash_det`:
deterministic; on Hopper the backward_sm90 family), `cupyflash_sm80` (the mma.sync family's pick),
`backward_sm90` (the config --sm90-config names, its dtype and d_head taken from each point: a
same-process A/B of a backward_sm90 config against cfg=None),
PyTorch SDPA's FLASH_ATTENTION backend on nested (jagged) views of the same packed tensors
(torch.autograd.grad of the saved forward graph: its nested-tensor host work between kernels is
timed, as a caller pays it), and flash_attn3_jax's varlen backward (jitted, d_head 128 only; host
clock over batches of calls). Check, before timing: every implementation's dq, dk, dv against a
float64 reference on the three shortest sequences (relative L2, SPEC §5 bound) and against
cupyflash's deterministic gradients over the whole batch. TFLOP/s = 2.5 x the forward's FLOPs
(visible pairs only when causal).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Any, Callable


from bench_impls import JAX_BATCH, Skip, time_events, time_host
from bench_mode_varlen import cu_seqlens, draw_lengths, varlen_flops
from cupyflash.benchmarking import REL_L2_TOLERANCE, parse_dtypes
from cupyflash.config import DType

IMPLS = ("cupyflash", "cupyflash_det", "cupyflash_sm80", "backward_sm90", "sdpa_flash", "fa3")


def reference_grads(torch: Any, q, k, v, dout, start: int, n: int, scale: float, causal: bool) -> tuple:
    """float64 (dq, dk, dv) of one sequence (tokens start..start+n), every head (no GQA here)."""
    qs, ks, vs, ds = (x[start:start + n].double().transpose(0, 1).requires_grad_() for x in (q, k, v, dout))
    s = qs @ ks.transpose(1, 2) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    o = torch.softmax(s, dim=-1) @ vs
    grads = torch.autograd.grad(o, (qs, ks, vs), ds.detach())
    return tuple(g.transpose(0, 1) for g in grads)


def rel_l2(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return math.inf
    norm = float(b.norm())
    return float((a - b).norm()) / norm if norm > 0 else float((a - b).norm())


def measure(torch: Any, jax: Any, dtype: DType, d: int, heads: int, lengths: list[int], causal: bool,
            impls: tuple[str, ...], warmup: int, iters: int, sustain: float, seed: int,
            sm90_config: Any = None) -> list[dict]:
    import cupyflash

    tdt = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[dtype]
    total, max_len, scale = sum(lengths), max(lengths), 1.0 / math.sqrt(d)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn((total, heads, d), generator=gen, device="cuda").to(tdt) for _ in range(4))
    cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device="cuda")
    out, lse = cupyflash.forward_varlen(q, k, v, cu, cu, max_len, max_len, causal=causal, softmax_scale=scale,
                                        return_lse=True)
    starts = cu_seqlens(lengths)[:-1]
    shortest = sorted(range(len(lengths)), key=lambda b: lengths[b])[:3]
    refs = [(starts[b], lengths[b], reference_grads(torch, q, k, v, dout, starts[b], lengths[b], scale, causal))
            for b in shortest]
    baseline = cupyflash.backward_varlen(dout, q, k, v, out, lse, cu, cu, max_len, max_len, causal=causal,
                                         softmax_scale=scale, deterministic=True)

    def cupyflash_run(det: bool, cfg: Any = None) -> Callable[[int], Any]:
        return lambda _i: cupyflash.backward_varlen(dout, q, k, v, out, lse, cu, cu, max_len, max_len, causal=causal,
                                                    softmax_scale=scale, deterministic=det, cfg=cfg)

    def sm80_pick() -> Any:
        from cupyflash.backward_api import _select

        return _select(dtype, d, max_len, max_len, torch.cuda.current_device(), causal)

    def sm90_pick() -> Any:
        if sm90_config is None:
            raise Skip("no --sm90-config given")
        return sm90_config.replace(dtype=dtype, d_head=d)

    def sdpa_flash() -> tuple[Callable[[int], Any], Callable[[Any], tuple]]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        nested = [torch.nested.nested_tensor_from_jagged(x, offsets=cu.long(), min_seqlen=min(lengths),
                                                         max_seqlen=max_len).transpose(1, 2) for x in leaves]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            try:
                o = torch.nn.functional.scaled_dot_product_attention(*nested, is_causal=causal, scale=scale)
            except RuntimeError as exc:
                raise Skip(f"SDPA flash on a jagged nested tensor: {str(exc).splitlines()[0]}") from None
        packed = o.transpose(1, 2).values()

        def run(_i: int) -> Any:
            return torch.autograd.grad(packed, leaves, dout, retain_graph=True)

        return run, lambda grads: grads

    def fa3() -> tuple[Callable[[int], Any], Callable[[Any], tuple]]:
        if jax is None:
            raise Skip("jax is not importable")
        try:
            from flash_attn3_jax.varlen_bwd import flash_mha_varlen_bwd
            from flash_attn3_jax.varlen_fwd import flash_mha_varlen_fwd
        except Exception as exc:
            raise Skip(f"flash_attn3_jax is not importable ({type(exc).__name__}: {exc})") from None
        if d != 128:
            raise Skip(f"the flash-attn3-jax wheel is built for d_head 128, not {d}")
        torch.cuda.synchronize()
        jq, jk, jv, jdo, jcu = (jax.dlpack.from_dlpack(x) for x in (q, k, v, dout, cu))
        config = dict(max_seqlen_q=max_len, max_seqlen_k=max_len, softmax_scale=scale, is_causal=causal)
        jo, jlse = jax.jit(lambda *a: flash_mha_varlen_fwd(*a, None, **config))(jq, jk, jv, jcu, jcu)
        bwd = jax.jit(functools.partial(flash_mha_varlen_bwd, **config))

        def run(_i: int) -> Any:
            return bwd(jdo, jq, jk, jv, jo, jlse, jcu, jcu)

        def as_torch(grads: Any) -> tuple:
            return tuple(torch.from_dlpack(g.block_until_ready()) for g in grads)

        return run, as_torch

    makers = {"cupyflash": lambda: (cupyflash_run(False), lambda g: g),
              "cupyflash_det": lambda: (cupyflash_run(True), lambda g: g),
              "cupyflash_sm80": lambda: (cupyflash_run(False, sm80_pick()), lambda g: g),
              "backward_sm90": lambda: (cupyflash_run(False, sm90_pick()), lambda g: g),
              "sdpa_flash": sdpa_flash, "fa3": fa3}
    flops = 2.5 * varlen_flops(lengths, lengths, heads, d, causal)
    point = {"dtype": dtype.name.lower(), "d_head": d, "heads": heads, "causal": causal, "batch": len(lengths),
             "total_tokens": total, "max_len": max_len, "flops": flops}
    records = []
    for name in impls:
        rec = {"impl": name, **point}
        try:
            run, grads_of = makers[name]()
            grads = grads_of(run(0))
            torch.cuda.synchronize()
            errs = [rel_l2(g[s:s + n], r) for s, n, ref in refs for g, r in zip(grads, ref)]
            rec["rel_l2_reference"] = max(errs)
            rec["rel_l2_vs_cupyflash_det"] = max(rel_l2(g, b) for g, b in zip(grads, baseline))
            if rec["rel_l2_reference"] > REL_L2_TOLERANCE[dtype]:
                rec["status"] = f"wrong: relative L2 {rec['rel_l2_reference']:.2e} against the float64 reference"
            else:
                if name == "fa3":
                    t = time_host(run, lambda x: [g.block_until_ready() for g in x], 1, warmup, max(5, iters // 4),
                                  JAX_BATCH)
                else:
                    t = time_events(torch, run, 1, warmup, iters, sustain)
                rec.update(status="ok", us=t.median_ms * 1e3, tflops=flops / (t.median_ms * 1e-3) / 1e12)
        except Skip as exc:
            rec["status"] = f"skipped: {exc}"
        records.append(rec)
        torch.cuda.synchronize()
        shown = (f"{rec['tflops']:7.1f} TFLOP/s ({rec['us']:.0f} us)" if rec.get("status") == "ok"
                 else rec["status"])
        print(f"  {name:14s} {dtype.name.lower()} d{d} causal={int(causal)}: {shown}; rel_l2 "
              f"{rec.get('rel_l2_reference', float('nan')):.1e} (reference), "
              f"{rec.get('rel_l2_vs_cupyflash_det', float('nan')):.1e} (vs cupyflash_det)", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--d-heads", default="128")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--total-tokens", type=int, default=32768)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls before each timing")
    p.add_argument("--sm90-config", default=None,
                   help="short form of the backward_sm90 config the backward_sm90 column runs")
    p.add_argument("--json", default="bench_varlen_backward.json")
    args = p.parse_args(argv)
    sm90_config = None
    if args.sm90_config:
        from cupyflash.families.backward_sm90.config import HopperBackwardKernelConfig

        try:
            sm90_config = HopperBackwardKernelConfig.parse(args.sm90_config)
        except ValueError as exc:
            p.error(f"--sm90-config: {exc}")
    impls = tuple(x.strip() for x in args.impls.split(",") if x.strip())
    unknown = set(impls) - set(IMPLS)
    if unknown:
        p.error(f"--impls: unknown {sorted(unknown)}; choose from {','.join(IMPLS)}")
    import torch

    try:
        import jax
    except Exception:
        jax = None
    lengths = draw_lengths(args.total_tokens, args.max_len, args.seed)
    print(f"{torch.cuda.get_device_name()}: {len(lengths)} sequences, {sum(lengths)} tokens, longest {max(lengths)}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    records = []
    for dtype in parse_dtypes(args.dtypes):
        for d in (int(x) for x in args.d_heads.split(",")):
            for causal in causals:
                records += measure(torch, jax, dtype, d, args.heads, lengths, causal, impls, args.warmup,
                                   args.iters, args.sustain, args.seed, sm90_config)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "lengths": lengths, "records": records}, f, indent=1)
    print("\nbackward_varlen: TFLOP/s (2.5x forward FLOPs, visible pairs), ratio = cupyflash / peer")
    print(f"{'point':26s} " + " ".join(f"{n:>14s}" for n in impls) + "   cupyflash/sdpa_flash  cupyflash/fa3")
    for key in sorted({(r["dtype"], r["d_head"], r["causal"]) for r in records}):
        got = {r["impl"]: r.get("tflops") for r in records if (r["dtype"], r["d_head"], r["causal"]) == key}
        ours = got.get("cupyflash")
        cells = " ".join(f"{got[n]:14.1f}" if got.get(n) else f"{'-':>14s}" for n in impls)
        ratios = [f"{ours / got[n]:.3f}x" if ours and got.get(n) else "-" for n in ("sdpa_flash", "fa3")]
        print(f"{key[0]} d{key[1]} causal={int(key[2])}".ljust(26) + " " + cells + f"   {ratios[0]:>20s}  {ratios[1]:>12s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
