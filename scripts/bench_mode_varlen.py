"""bench.py --mode varlen: one ragged batch (issue 10's varlen target), packed as (total_tokens,
heads, d_head), against SDPA on the same batch as a nested (jagged) tensor and FlashAttention-3.

    python scripts/bench.py --mode varlen [--dtypes bf16,fp16] [--d-heads 128,64] [--causal both|yes|no]
                            [--total-tokens 32768] [--max-len 8192] [--heads 16] [--seed 0]
                            [--iters 30] [--warmup 5] [--json bench_varlen.json] [--plot PNG]

The batch: sequence lengths drawn uniformly from 1..--max-len with --seed until --total-tokens
are reached (the last one cut to fit), the same lengths for queries and keys. Implementations:
cupyflash.forward_varlen (cu_seqlens int32), PyTorch SDPA with the FLASH_ATTENTION and
CUDNN_ATTENTION backends on nested tensors (torch.nested.nested_tensor_from_jagged over the same
packed tensors, transposed to (batch, heads, j, d_head) as SDPA wants; a backend that refuses
jagged inputs is skipped with its reason), and flash_attn3_jax.flash_mha_varlen (jitted, d_head
128 only) when the flash-attn3-jax wheel is installed.

FLOPs = sum over sequences of 4 * L_q * L_k * heads * d_head; causal counts only the visible
(query, key) pairs, bottom-right aligned: L_q*L_k - n(n-1)/2 with n = min(L_q, L_k). Each
implementation's output is checked once, before it is timed, per sequence against a float64
reference (spot rows of the first and last head; SPEC §5 relative L2 bound on every sequence).
Times: median of --iters CUDA-event timings (FA3: host clock over batches of jitted calls); a
call's events bracket whatever it makes the GPU wait for, so SDPA's nested-tensor path is timed
with its host-side work between kernels, as a caller pays it.
Targets (issue 10, printed beside the figures, never a failure): cupyflash faster than SDPA
flash on the nested batch; on the H100 at least as fast as FA3's varlen forward.
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from bench_mode_common import (Skip, bar_plot, check_then_time, collect_failures, finish, fmt, format_table, gpu_host,
                               host_cost_us, parse_d_heads, parse_impls, ratio, verdict)
from cupyflash.benchmarking import REL_L2_TOLERANCE, parse_dtypes, spot_rows, visible_pairs
from cupyflash.config import DType

IMPLS = ("cupyflash", "sdpa_flash", "sdpa_cudnn", "fa3")
PEERS = IMPLS[1:]


# ---------------------------------------------------------------------------- the batch and its FLOPs
def draw_lengths(total_tokens: int, max_len: int, seed: int) -> list[int]:
    """Lengths drawn uniformly from 1..max_len (numpy's default_rng(seed)) until they sum to
    total_tokens; the last one is cut so the sum is exact."""
    if total_tokens < 1 or max_len < 1:
        raise ValueError(f"--total-tokens ({total_tokens}) and --max-len ({max_len}) must be >= 1")
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    left = total_tokens
    while left > 0:
        n = min(int(rng.integers(1, max_len + 1)), left)
        lengths.append(n)
        left -= n
    return lengths


def cu_seqlens(lengths: list[int]) -> list[int]:
    """[0, L0, L0+L1, ...]: the batch+1 offsets forward_varlen and flash_mha_varlen take."""
    return [0] + list(np.cumsum(lengths, dtype=np.int64).tolist())


def varlen_flops(lens_q: list[int], lens_k: list[int], heads: int, d_head: int, causal: bool) -> float:
    """Sum over sequences of 4 * (visible pairs) * heads * d_head (two matmuls, 2 FLOPs a multiply-add)."""
    if len(lens_q) != len(lens_k):
        raise ValueError(f"{len(lens_q)} query lengths but {len(lens_k)} key lengths")
    return float(sum(4 * visible_pairs(a, b, causal) * heads * d_head for a, b in zip(lens_q, lens_k)))


# ---------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py --mode varlen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    p.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16,fp16")
    p.add_argument("--d-heads", default="128,64", help="comma-separated head dimensions (default 128,64)")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--total-tokens", type=int, default=32768, help="tokens in the batch (default 32768)")
    p.add_argument("--max-len", type=int, default=8192, help="longest sequence drawn (default 8192)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and of the inputs")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    p.add_argument("--iters", type=int, default=30, help="timed calls per measurement (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="bench_varlen.json")
    p.add_argument("--plot", default=None, help="PNG (default: the --json path with .png; '' for none)")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the per-call host cost of forward_varlen (fast path, cached kernel)")
    return p


@dataclass(frozen=True)
class VarlenArgs:
    dtypes: tuple[DType, ...]
    d_heads: tuple[int, ...]
    causals: tuple[bool, ...]
    lengths: tuple[int, ...]
    impls: tuple[str, ...]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, VarlenArgs]:
    """argparse, then every value checked; ValueError naming the option on a bad one."""
    args = build_parser().parse_args(argv)
    dtypes = parse_dtypes(args.dtypes)
    d_heads = parse_d_heads(args.d_heads)
    impls = parse_impls(args.impls, IMPLS)
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("--iters must be >= 1 and --warmup >= 0")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    lengths = tuple(draw_lengths(args.total_tokens, args.max_len, args.seed))
    return args, VarlenArgs(dtypes, d_heads, causals, lengths, impls)


# ---------------------------------------------------------------------------- one problem
@dataclass
class VarlenProblem:
    dtype: DType
    d_head: int
    heads: int
    causal: bool
    lengths: tuple[int, ...]
    scale: float
    q: Any = field(repr=False)  # (total, heads, d_head) torch, packed
    k: Any = field(repr=False)
    v: Any = field(repr=False)
    cu: Any = field(repr=False)  # (batch+1,) int32 on the GPU
    refs: list = field(default_factory=list, repr=False)  # (start, rows, head, float64 reference rows)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def flops(self) -> float:
        return varlen_flops(list(self.lengths), list(self.lengths), self.heads, self.d_head, self.causal)


def make_problem(torch: Any, dtype: DType, d_head: int, heads: int, lengths: tuple[int, ...], causal: bool,
                 seed: int, device: str = "cuda") -> VarlenProblem:
    """Random normal packed inputs (fp32 draws rounded to the dtype) and the float64 reference of
    each sequence's spot rows for the first and last head, computed once for every implementation.
    (`device` is "cuda" here; the CPU tests build small problems on "cpu".)"""
    tdt = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}[dtype]
    total = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn((total, heads, d_head), generator=gen, device=device, dtype=torch.float32).to(tdt)
               for _ in range(3))
    cu = torch.tensor(cu_seqlens(list(lengths)), dtype=torch.int32, device=device)
    p = VarlenProblem(dtype, d_head, heads, causal, tuple(lengths), 1.0 / math.sqrt(d_head), q, k, v, cu)
    starts = cu_seqlens(list(lengths))
    for start, n in zip(starts, lengths):
        if n == 0:
            continue
        rows = torch.as_tensor(spot_rows(n), device=device)
        for h in sorted({0, heads - 1}):
            qs = q[start + rows, h].double()
            ks, vs = k[start:start + n, h].double(), v[start:start + n, h].double()
            s = (qs @ ks.T) * p.scale
            if causal:  # bottom-right aligned; L_q == L_k here, so also top-left
                keys = torch.arange(n, device=device)[None, :]
                s = s.masked_fill(keys > rows[:, None], -math.inf)
            p.refs.append((start, rows, h, torch.softmax(s, dim=-1) @ vs))
    return p


def rel_l2_per_sequence(torch: Any, p: VarlenProblem, out: Any) -> float:
    """The worst sequence's relative L2 error of packed `out` (total, heads, d_head) against the
    float64 reference; inf when `out` holds any NaN/inf (an unwritten, poisoned element)."""
    if not bool(torch.isfinite(out).all()):
        return math.inf
    per_seq: dict[int, list[float]] = {}
    for start, rows, h, ref in p.refs:
        got = out[start + rows, h].double()
        acc = per_seq.setdefault(start, [0.0, 0.0])
        acc[0] += float(((got - ref) ** 2).sum())
        acc[1] += float((ref ** 2).sum())
    return max((math.sqrt(n / d) if d > 0 else math.inf) for n, d in per_seq.values())


# ---------------------------------------------------------------------------- implementations
Measure = tuple[Callable[[], float], Callable[[], float]]  # (check -> rel L2, time -> median us)


def cupyflash_impl(torch: Any, p: VarlenProblem, warmup: int, iters: int) -> Measure:
    import cupyflash
    from bench_impls import time_events

    forward_varlen = getattr(cupyflash, "forward_varlen", None)
    if forward_varlen is None:
        raise RuntimeError("this cupyflash has no forward_varlen")
    out = torch.empty_like(p.q)

    def run(_i: int) -> Any:
        return forward_varlen(p.q, p.k, p.v, p.cu, p.cu, p.max_len, p.max_len, causal=p.causal,
                              softmax_scale=p.scale, out=out)

    def check() -> float:
        out.fill_(math.nan)  # poisoned: an element the kernel does not write fails the check
        run(0)
        return rel_l2_per_sequence(torch, p, out)

    return check, lambda: time_events(torch, run, 1, warmup, iters).median_ms * 1e3


def sdpa_nested_impl(torch: Any, p: VarlenProblem, backend: str, warmup: int, iters: int) -> Measure:
    """SDPA on nested (jagged) views of the same packed tensors: (batch, j, heads, d) -> (batch,
    heads, j, d). One offsets tensor for q, k and v, so they share one ragged structure; min/max
    lengths given, so SDPA needs no host read of the offsets per call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench_impls import time_events

    if not hasattr(SDPBackend, backend):
        raise Skip(f"torch {torch.__version__} has no SDPBackend.{backend}")
    offsets = p.cu.long()
    nested = [torch.nested.nested_tensor_from_jagged(x, offsets=offsets, min_seqlen=min(p.lengths),
                                                     max_seqlen=p.max_len).transpose(1, 2) for x in (p.q, p.k, p.v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kernel = functools.partial(sdpa_kernel, [getattr(SDPBackend, backend)])

    def run(_i: int) -> Any:
        return sdpa(*nested, is_causal=p.causal, scale=p.scale)

    def check() -> float:
        with kernel():
            try:
                got = run(0)
            except RuntimeError as exc:  # the backend refuses jagged inputs (or this causal/dtype)
                raise Skip(f"SDPBackend.{backend} on a jagged nested tensor: {str(exc).splitlines()[0]}") from None
        return rel_l2_per_sequence(torch, p, got.transpose(1, 2).values())

    def time() -> float:
        with kernel():
            return time_events(torch, run, 1, warmup, iters).median_ms * 1e3

    return check, time


def fa3_impl(torch: Any, jax: Any, p: VarlenProblem, warmup: int, iters: int) -> Measure:
    """flash_attn3_jax.flash_mha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=...,
    max_seqlen_k=..., softmax_scale=..., is_causal=...) jitted (the max lengths are static), on
    zero-copy DLPack views of the same tensors."""
    from bench_impls import JAX_BATCH, time_host

    if jax is None:
        raise Skip("jax is not importable")
    try:
        from flash_attn3_jax import flash_mha_varlen
    except Exception as exc:
        raise Skip(f"flash_attn3_jax is not importable ({type(exc).__name__}: {exc})") from None
    if p.d_head != 128:
        raise Skip(f"the flash-attn3-jax wheel is built for d_head 128, not {p.d_head}")
    torch.cuda.synchronize()  # JAX reads the tensors on its own stream
    args = [jax.dlpack.from_dlpack(x) for x in (p.q, p.k, p.v, p.cu, p.cu)]
    fn = jax.jit(functools.partial(flash_mha_varlen, max_seqlen_q=p.max_len, max_seqlen_k=p.max_len,
                                   softmax_scale=p.scale, is_causal=p.causal))

    def run(_i: int) -> Any:
        return fn(*args)

    def check() -> float:
        got = run(0).astype(jax.numpy.float32)
        got.block_until_ready()
        return rel_l2_per_sequence(torch, p, torch.from_dlpack(got))

    def time() -> float:
        t = time_host(run, lambda x: x.block_until_ready(), 1, warmup, max(5, iters // 4), JAX_BATCH)
        return t.median_ms * 1e3

    return check, time


# ---------------------------------------------------------------------------- the run
def measure_point(torch: Any, jax: Any, p: VarlenProblem, impls: tuple[str, ...], warmup: int, iters: int) -> list[dict]:
    makers: dict[str, Callable[[], Measure]] = {
        "cupyflash": lambda: cupyflash_impl(torch, p, warmup, iters),
        "sdpa_flash": lambda: sdpa_nested_impl(torch, p, "FLASH_ATTENTION", warmup, iters),
        "sdpa_cudnn": lambda: sdpa_nested_impl(torch, p, "CUDNN_ATTENTION", warmup, iters),
        "fa3": lambda: fa3_impl(torch, jax, p, warmup, iters),
    }
    point = {"dtype": p.dtype.name.lower(), "d_head": p.d_head, "causal": p.causal, "heads": p.heads,
             "batch": len(p.lengths), "total_tokens": sum(p.lengths), "flops": p.flops}
    records = []
    for name in impls:
        holder: dict[str, Measure] = {}

        def check(name: str = name) -> float:
            holder["m"] = makers[name]()
            return holder["m"][0]()

        rec = check_then_time(name, check, lambda: holder["m"][1](), REL_L2_TOLERANCE[p.dtype])
        torch.cuda.synchronize()
        rec.update(point, point=f"{point['dtype']} d{p.d_head} causal={int(p.causal)}")
        if rec["status"] == "ok":
            rec["tflops"] = p.flops / (rec["us"] * 1e-6) / 1e12
        records.append(rec)
        status = f"{rec['tflops']:7.1f} TFLOP/s ({rec['us']:.0f} us, rel_l2 {rec['rel_l2']:.1e})" \
            if rec["status"] == "ok" else f"{rec['status'].upper()}: {rec['reason']}"
        print(f"  {rec['point']:<22} {name:<11} {status}", flush=True)
    return records


def report_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One row per (dtype, d_head, causal): TFLOP/s of each implementation, cupyflash's ratio to
    SDPA flash and to FA3, each with the issue's target."""
    header = ["dtype", "d_head", "causal"] + list(IMPLS) + ["cf/flash", "target >=1.00", "cf/FA3", "target >=1.00"]
    rows = []
    for key in dict.fromkeys((r["dtype"], r["d_head"], r["causal"]) for r in records):
        got = {r["impl"]: r for r in records if (r["dtype"], r["d_head"], r["causal"]) == key}
        tf = {n: got[n].get("tflops") if n in got and got[n]["status"] == "ok" else None for n in IMPLS}
        cells = [fmt(tf[n]) if tf[n] is not None else (got[n]["status"].upper() if n in got else "-") for n in IMPLS]
        r_flash, r_fa3 = ratio(tf["cupyflash"], tf["sdpa_flash"]), ratio(tf["cupyflash"], tf["fa3"])
        rows.append([key[0], str(key[1]), "yes" if key[2] else "no"] + cells +
                    [fmt(r_flash, 2) + ("x" if r_flash else ""), verdict(r_flash, 1.0),
                     fmt(r_fa3, 2) + ("x" if r_fa3 else ""), verdict(r_fa3, 1.0)])
    return header, rows


def overhead_us(torch: Any) -> dict:
    """Host cost of one forward_varlen call on its fast path (cached kernel; bursts of calls queued
    behind a GPU spin, so only the host side counts): the library's choice (the Hopper family on
    an H100) with and without `out`, the mma.sync family's default config, and torch SDPA on one
    dense sequence of the same size for scale. Median of interleaved rounds."""
    import cupyflash
    from cupyflash.families.forward_sm80.config_sets import default_config

    lengths = (40, 17, 64)
    cu = torch.tensor(cu_seqlens(list(lengths)), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out = torch.empty_like(q)
    sm80 = default_config(DType.BF16, 128).short_form()
    fv = cupyflash.forward_varlen
    qd = q[None, :64].transpose(1, 2)
    cases = {
        "cupyflash": lambda: fv(q, k, v, cu, cu, 64, 64, out=out),
        "cupyflash_no_out": lambda: fv(q, k, v, cu, cu, 64, 64),
        "cupyflash_sm80": lambda: fv(q, k, v, cu, cu, 64, 64, out=out, cfg=sm80),
        "sdpa_dense": lambda: torch.nn.functional.scaled_dot_product_attention(qd, qd, qd),
    }
    return host_cost_us(torch, cases)


def format_overhead(o: dict) -> str:
    if "error" in o:
        return f"per-call host cost: not measured ({o['error']})"
    return ("per-call host cost of forward_varlen (3 sequences, 121 tokens, 8 heads, d128 bf16, cached kernel, "
            "calls queued behind a GPU spin, steady), us: " +
            ", ".join(f"{k} {v:.1f}" for k, v in o.items() if isinstance(v, (int, float))) +
            ("; first burst after a synchronize: " + ", ".join(f"{k} {v:.1f}" for k, v in o["first_burst"].items())
             if o.get("first_burst") else ""))


def format_report(data: dict) -> str:
    header, rows = report_rows(data["records"])
    lengths = data["lengths"]
    lines = [f"varlen: {len(lengths)} sequences, {sum(lengths)} tokens, lengths {lengths} (seed {data['seed']}), "
             f"{data['heads']} heads; TFLOP/s on real tokens (causal: visible pairs only), median of "
             f"{data['iters']} (CUDA events; fa3: host clock)",
             format_table(header, rows),
             "targets (issue 10): cupyflash faster than SDPA flash on the nested batch; on the H100 at least as "
             "fast as FA3's flash_mha_varlen once the Hopper family serves varlen"]
    notes = list(dict.fromkeys(f"  {r['impl']} {r['point']}: {r['status']}: {r['reason']}"
                               for r in data["records"] if r["status"] != "ok"))
    if "overhead_us" in data:
        lines.append(format_overhead(data["overhead_us"]))
    return "\n".join(lines + (["not reported:"] + notes if notes else []))


def main(argv: list[str] | None = None, host: Any = None) -> int:
    """Exit codes as bench.py: 0 measured, 1 cupyflash refused or raised, 2 nothing measured."""
    try:
        args, va = parse_args(argv)
    except ValueError as exc:
        print(f"bench.py --mode varlen: error: {exc}", file=sys.stderr)
        return 2
    host = gpu_host(host)
    if host is None:
        return 2
    import torch

    from bench_report import write_json

    jax, jax_reason = host._import_jax(["fa3"] if "fa3" in va.impls else [])
    meta = host._meta(torch, jax)
    data: dict[str, Any] = {"mode": "varlen", "meta": meta, "args": vars(args), "lengths": list(va.lengths),
                            "seed": args.seed, "heads": args.heads, "iters": args.iters, "records": [],
                            "complete": False}
    if jax is None and "fa3" in va.impls:
        data["jax"] = jax_reason
    print(f"bench varlen: {meta['gpu']} | {meta['date']} | {len(va.lengths)} sequences {list(va.lengths)}", flush=True)
    for dtype in va.dtypes:
        for d_head in va.d_heads:
            for causal in va.causals:
                p = make_problem(torch, dtype, d_head, args.heads, va.lengths, causal, args.seed)
                data["records"] += measure_point(torch, jax, p, va.impls, args.warmup, args.iters)
                del p
                torch.cuda.empty_cache()
                write_json(args.json, data)
    if not args.no_overhead:
        try:
            data["overhead_us"] = overhead_us(torch)
        except Exception as exc:  # a figure beside the table: its failure is reported, not fatal
            data["overhead_us"] = {"error": f"{type(exc).__name__}: {exc}"}
    failures = collect_failures(data["records"])
    data.update(complete=True, failures=failures)
    write_json(args.json, data)
    print()
    print(f"== {meta['gpu']} | {meta['date']} | " + " | ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))
    print(format_report(data))
    def draw(path: str) -> str | None:
        header, rows = report_rows(data["records"])
        groups = [f"{r[0]} d{r[1]}{' causal' if r[2] == 'yes' else ''}" for r in rows]
        series = {n: [next((x["tflops"] for x in data["records"] if x["impl"] == n and x["status"] == "ok"
                            and f"{x['dtype']} d{x['d_head']}{' causal' if x['causal'] else ''}" == g), None)
                      for g in groups] for n in IMPLS}
        return bar_plot(groups, series, path, "TFLOP/s", f"varlen, {meta['gpu']}, {meta['date']}")

    return finish("varlen", args.json, args.plot, draw, failures)
