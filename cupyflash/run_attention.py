"""The main job: one attention run with timing and an accuracy check against an upcast reference.

    python scripts/run_attention.py [--batch 2 --seq 1024 --heads 16 --d-head 128 --dtype bf16 --config auto]
    python -m cupyflash run ...

Prints the shape, the config (short form), the median time over CUDA-event timed runs after
warm-up, TFLOP/s (4*B*H*S_q*S_k*D / t), and the max abs and relative L2 error against a reference
computed with CuPy in fp32 (or fp64) on upcast inputs. Exit code 0 when the SPEC §5 rule holds,
1 when it does not, 2 for bad arguments. Without a GPU it says so, shows what it would have run,
and exits 0.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Sequence

import numpy as np

from .config import DType
from .families.forward_sm80.config import FlashForwardKernelConfig
from .families.forward_sm90.config import HopperForwardKernelConfig

__all__ = ["build_parser", "run_from_args", "main"]

# SPEC §5: relative L2 error bounds per input dtype.
REL_L2_TOLERANCE = {DType.BF16: 1e-2, DType.FP16: 2e-3}
_DTYPE_ALIASES = {"bf16": DType.BF16, "bfloat16": DType.BF16, "fp16": DType.FP16, "float16": DType.FP16,
                  "half": DType.FP16}
# Upper bound on one (heads x S_q x S_k) block of reference scores, so long sequences fit.
_REFERENCE_CHUNK_BYTES = 1 << 30


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024, help="query sequence length")
    parser.add_argument("--seq-k", type=int, default=None, help="key/value sequence length (default: --seq)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-head", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPE_ALIASES))
    parser.add_argument("--config", default="auto",
                        help="kernel config short form, e.g. '(BF16, 128, 64, 64, 4): async+...', or 'auto'")
    parser.add_argument("--softmax-scale", type=float, default=None, help="default 1/sqrt(d_head)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--reference", default="fp32", choices=("fp32", "fp64"),
                        help="precision of the reference computation")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _describe(args, dtype: DType, cfg: FlashForwardKernelConfig | None, seq_k: int) -> list[str]:
    shape = (args.batch, args.seq, args.heads, args.d_head)
    kshape = (args.batch, seq_k, args.heads, args.d_head)
    lines = [f"shape       q {shape}  k/v {kshape}  (batch, seq, heads, d_head)  {dtype.name.lower()}"]
    lines.append(f"config      {cfg.short_form() if cfg is not None else args.config}")
    return lines


def _plan(args, dtype: DType, cfg: FlashForwardKernelConfig, seq_k: int):
    from .api import plan_forward
    from .interop import CUPY, TensorView, contiguous_strides

    def fake(shape):
        return TensorView(0, shape, contiguous_strides(shape), dtype, dtype.numpy_dtype, args.device, CUPY)

    q = fake((args.batch, args.seq, args.heads, args.d_head))
    k = fake((args.batch, seq_k, args.heads, args.d_head))
    if isinstance(cfg, HopperForwardKernelConfig):  # the Hopper family's launch geometry
        from types import SimpleNamespace

        from .families.forward_sm90.launch import plan_sm90

        plan = plan_sm90(cfg, q, k, k, None, args.softmax_scale)
        return SimpleNamespace(grid=plan.grid, block=cfg.n_threads, smem_bytes=cfg.smem_bytes())
    return plan_forward(cfg, q, k, k, None, args.softmax_scale)


def _no_gpu_reason() -> str | None:
    """None when a GPU is usable, else why not."""
    try:
        from .device import require_gpu

        require_gpu()
    except ImportError as exc:
        return f"CuPy is not importable ({exc}); install with a CUDA extra, e.g. pip install '.[cuda12]'"
    except RuntimeError as exc:
        return str(exc)
    return None


def _round_to(x, dtype: DType):
    """Round a float32 CuPy array to `dtype` precision (kept in float32): the input-precision
    baseline of SPEC §5 without needing bf16 arithmetic in CuPy."""
    import cupy

    if dtype is DType.FP16:
        return x.astype(cupy.float16).astype(cupy.float32)
    bits = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
    rounded = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) & cupy.uint32(0xFFFF0000)
    return rounded.view(cupy.float32)


def _reference(q, k, v, scale: float, ref_dtype, low: DType | None = None):
    """softmax(q k^T * scale) v in `ref_dtype` from float32 (B, S, H, D) inputs, per batch and
    chunk of heads.

    With `low`, the softmax probabilities and the output are rounded to that precision, which is
    what an implementation working in the input precision would produce (SPEC §5 baseline).
    """
    import cupy

    batch, seq_q, heads, d_head = q.shape
    seq_k = k.shape[1]
    out = cupy.empty((batch, seq_q, heads, d_head), dtype=ref_dtype)
    itemsize = np.dtype(ref_dtype).itemsize
    chunk = max(1, min(heads, _REFERENCE_CHUNK_BYTES // max(1, seq_q * seq_k * itemsize * 2)))
    for b in range(batch):
        for h0 in range(0, heads, chunk):
            h1 = min(heads, h0 + chunk)
            qh = q[b, :, h0:h1].astype(ref_dtype).transpose(1, 0, 2)  # (h, S_q, D)
            kh = k[b, :, h0:h1].astype(ref_dtype).transpose(1, 0, 2)
            vh = v[b, :, h0:h1].astype(ref_dtype).transpose(1, 0, 2)
            s = cupy.matmul(qh, kh.transpose(0, 2, 1)) * scale
            s -= s.max(axis=-1, keepdims=True)
            p = cupy.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            if low is not None:
                p = _round_to(p, low)
            o = cupy.matmul(p, vh)
            if low is not None:
                o = _round_to(o, low)
            out[b, :, h0:h1] = o.transpose(1, 0, 2)
    return out


def _errors(out, ref) -> tuple[float, float]:
    import cupy

    diff = out.astype(ref.dtype) - ref
    max_abs = float(cupy.abs(diff).max())
    rel_l2 = float(cupy.linalg.norm(diff.ravel()) / cupy.linalg.norm(ref.ravel()))
    return max_abs, rel_l2


def run_from_args(args: argparse.Namespace) -> int:
    from .api import resolve_config

    dtype = _DTYPE_ALIASES[args.dtype]
    seq_k = args.seq if args.seq_k is None else args.seq_k
    try:
        cfg = resolve_config(args.config, dtype, args.d_head, args.seq, seq_k, args.device)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in _describe(args, dtype, cfg, seq_k):
        print(line)
    try:  # the same checks forward() makes, on fake views: bad combinations fail here, GPU or not
        plan = _plan(args, dtype, cfg, seq_k)
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"launch      grid {plan.grid}, block {plan.block}, {plan.smem_bytes} bytes dynamic shared memory")

    reason = _no_gpu_reason()
    if reason is not None:
        print(f"no CUDA GPU found: {reason}")
        print("would have run: the forward above, timed with CUDA events "
              f"({args.warmup} warm-up + {args.iters} timed runs), checked against a "
              f"{args.reference} reference; nothing was run.")
        return 0

    import cupy

    with cupy.cuda.Device(args.device):
        return _run_on_gpu(args, dtype, cfg, seq_k)


def _run_on_gpu(args, dtype: DType, cfg: FlashForwardKernelConfig, seq_k: int) -> int:
    import cupy

    from .api import forward

    props = cupy.cuda.runtime.getDeviceProperties(args.device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"device      {args.device}: {name} (compute capability {props['major']}.{props['minor']})")

    # Inputs made on the host (fp32 normal, rounded to the input dtype by numpy/ml_dtypes) and
    # uploaded: exact bit patterns, no reliance on bf16 arithmetic on the device.
    rng = np.random.default_rng(args.seed)
    np_dtype = dtype.numpy_dtype
    shape_q = (args.batch, args.seq, args.heads, args.d_head)
    shape_k = (args.batch, seq_k, args.heads, args.d_head)
    host = [rng.standard_normal(s, dtype=np.float32).astype(np_dtype) for s in (shape_q, shape_k, shape_k)]
    q, k, v = (cupy.asarray(h) for h in host)
    # Poisoned output: an element the kernel fails to write stays NaN and fails the check.
    out = cupy.asarray(np.full(shape_q, np.nan, dtype=np_dtype))
    scale = args.softmax_scale

    try:
        t0 = time.perf_counter()
        forward(cfg, q, k, v, out, softmax_scale=scale)
        cupy.cuda.get_current_stream().synchronize()
        first_call = time.perf_counter() - t0
    except (TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"first call  {first_call * 1e3:.1f} ms (includes compile or cache load)")

    # Accuracy first, on the poisoned output of the first call.
    ref_dtype = cupy.float64 if args.reference == "fp64" else cupy.float32
    s = (1.0 / math.sqrt(args.d_head)) if scale is None else scale
    # Upcasts happen on the host (ml_dtypes), so CuPy only ever copies bf16 bytes.
    qf, kf, vf = (cupy.asarray(h.astype(np.float32)) for h in host)
    ref = _reference(qf, kf, vf, s, ref_dtype)
    max_abs, rel_l2 = _errors(cupy.asarray(cupy.asnumpy(out).astype(np.float32)), ref)
    base_abs, _ = _errors(_reference(qf, kf, vf, s, cupy.float32, low=dtype), ref)
    del qf, kf, vf

    # Timing: one event pair per run, synchronised once at the end.
    stream = cupy.cuda.get_current_stream()
    for _ in range(args.warmup):
        forward(cfg, q, k, v, out, softmax_scale=scale)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(max(1, args.iters))]
    for start, end in events:
        start.record(stream)
        forward(cfg, q, k, v, out, softmax_scale=scale)
        end.record(stream)
    stream.synchronize()
    times_ms = sorted(cupy.cuda.get_elapsed_time(a, b) for a, b in events)
    median_ms = float(np.median(times_ms))
    flops = 4.0 * args.batch * args.heads * args.seq * seq_k * args.d_head
    tflops = flops / (median_ms * 1e-3) / 1e12

    print(f"time        median {median_ms:.4f} ms  (min {times_ms[0]:.4f} ms, {len(times_ms)} runs "
          f"after {args.warmup} warm-up)")
    print(f"throughput  {tflops:.1f} TFLOP/s  (4*B*H*S_q*S_k*D / t)")
    print(f"error       max abs {max_abs:.3e}  rel L2 {rel_l2:.3e}  vs {args.reference} reference "
          f"(input-precision baseline max abs {base_abs:.3e})")
    tol = REL_L2_TOLERANCE[dtype]
    ok_abs = max_abs <= 2 * base_abs + 1e-6
    ok_l2 = rel_l2 <= tol
    ok = ok_abs and ok_l2 and math.isfinite(max_abs)
    print(f"check       {'PASS' if ok else 'FAIL'}  (max abs <= 2x baseline: {ok_abs}; "
          f"rel L2 <= {tol:g}: {ok_l2})")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argparse.ArgumentParser(
        prog="run_attention", description="Run one cupyflash attention forward: time it and check it."))
    return run_from_args(parser.parse_args(argv))
