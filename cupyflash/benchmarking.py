"""Benchmark building blocks shared by `cupyflash.autotune` and `scripts/bench.py`.

The problem grid (SPEC §6), FLOP counts, how many input sets defeat the L2 cache, and, for CuPy
arrays, random inputs, CUDA-event timing and a spot check against a float64 reference. CuPy is
imported inside the functions that need it, so the pure helpers work anywhere.
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .config import DType

__all__ = [
    "GRID_TOKENS", "GRID_WIDTH", "REL_L2_TOLERANCE", "DEFAULT_L2_BYTES", "GridShape", "grid_shape",
    "parse_dtypes", "parse_ints",
    "attention_flops", "visible_pairs", "rotation_sets", "spot_rows", "Timing", "summarize", "random_inputs",
    "poison", "spot_check_rel_l2", "sustain_load", "time_cupy",
]

GRID_TOKENS = 16384   # batch * seq of every grid point (FlashAttention papers, SPEC §6)
GRID_WIDTH = 2048     # heads * d_head
# SPEC §5 bounds on the relative L2 error against an upcast reference.
REL_L2_TOLERANCE = {DType.BF16: 1e-2, DType.FP16: 2e-3}
DEFAULT_L2_BYTES = 50 * 1024 * 1024  # H100's L2, used when the device does not say
_L2_FACTOR = 3        # the data touched per call must exceed this many L2s to measure DRAM, not L2
_MAX_SETS = 64
_NAN_BITS = {DType.FP16: 0x7E00, DType.BF16: 0x7FC0}


@dataclass(frozen=True)
class GridShape:
    batch: int
    seq: int
    heads: int
    d_head: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, seq, heads, d_head), the cupyflash layout."""
        return (self.batch, self.seq, self.heads, self.d_head)


def grid_shape(seq: int, d_head: int, tokens: int = GRID_TOKENS, width: int = GRID_WIDTH) -> GridShape:
    """The SPEC §6 problem at `seq`: batch = tokens/seq (1 beyond `tokens`), heads = width/d_head,
    rounded where d_head does not divide the width (d_head 96: 21 heads, 2016 wide)."""
    if seq <= 0 or (seq < tokens and tokens % seq) or d_head <= 0 or d_head > width:
        raise ValueError(f"seq {seq} must divide {tokens} (or exceed it) and d_head {d_head} must be in 1..{width}")
    return GridShape(max(1, tokens // seq), seq, round(width / d_head), d_head)


_DTYPE_ALIASES = {"bf16": DType.BF16, "bfloat16": DType.BF16, "fp16": DType.FP16, "float16": DType.FP16,
                  "half": DType.FP16}


def parse_dtypes(text: str) -> tuple[DType, ...]:
    """'bf16,fp16' -> (DType.BF16, DType.FP16); ValueError naming a bad item."""
    out = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        if item in _DTYPE_ALIASES:
            out.append(_DTYPE_ALIASES[item])
        else:
            out.append(DType.parse(item))  # also 'BF16' / 'FP16'; ValueError otherwise
    if not out:
        raise ValueError("expected at least one dtype, e.g. 'bf16,fp16'")
    return tuple(dict.fromkeys(out))


def parse_ints(text: str, what: str = "value") -> tuple[int, ...]:
    """'512,1k,2048' -> (512, 1024, 2048) ('k' = 1024); ValueError naming a bad item."""
    out = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        try:
            value = int(item[:-1]) * 1024 if item.endswith("k") else int(item)
        except ValueError:
            raise ValueError(f"{what}: {item!r} is not an integer") from None
        if value <= 0:
            raise ValueError(f"{what}: expected positive integers, got {value}")
        out.append(value)
    if not out:
        raise ValueError(f"{what}: expected at least one integer")
    return tuple(dict.fromkeys(out))


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, d_head: int, causal: bool = False) -> float:
    """4*B*H*S_q*S_k*D (two matmuls of 2 FLOPs per multiply-add), half of it for causal."""
    flops = 4.0 * batch * heads * seq_q * seq_k * d_head
    return flops / 2 if causal else flops


def visible_pairs(len_q: int, len_k: int, causal: bool) -> int:
    """(query, key) pairs attention computes. Causal is bottom-right aligned: query i sees key j
    iff j <= i + len_k - len_q, so the last query sees all len_k keys and each earlier one one
    fewer, down to 0: n*len_k - n(n-1)/2 with n = min(len_q, len_k)."""
    if len_q < 0 or len_k < 0:
        raise ValueError(f"lengths must be >= 0, got {len_q}, {len_k}")
    if not causal:
        return len_q * len_k
    n = min(len_q, len_k)
    return n * len_k - n * (n - 1) // 2


def rotation_sets(set_bytes: int, l2_bytes: int | None) -> int:
    """Input sets to cycle through so that consecutive calls do not find their data in L2:
    enough sets to touch more than 3x L2 between two uses of one set (1 if one set already does)."""
    l2 = l2_bytes if l2_bytes and l2_bytes > 0 else DEFAULT_L2_BYTES
    if set_bytes <= 0:
        raise ValueError(f"set_bytes must be positive, got {set_bytes}")
    return max(1, min(_MAX_SETS, math.ceil(_L2_FACTOR * l2 / set_bytes)))


def spot_rows(seq: int, n_edge: int = 64, n_random: int = 128, seed: int = 0) -> np.ndarray:
    """Query rows the spot check compares: all rows for short sequences, else the first and last
    `n_edge` (tile boundaries) plus `n_random` rows drawn with a fixed seed."""
    if seq <= 2 * n_edge + n_random:
        return np.arange(seq)
    rng = np.random.default_rng(seed)
    middle = rng.choice(np.arange(n_edge, seq - n_edge), size=n_random, replace=False)
    return np.unique(np.concatenate([np.arange(n_edge), np.sort(middle), np.arange(seq - n_edge, seq)]))


@dataclass(frozen=True)
class Timing:
    """Per-call times in milliseconds."""

    median_ms: float
    min_ms: float
    max_ms: float
    samples: int

    def tflops(self, flops: float) -> float:
        return flops / (self.median_ms * 1e-3) / 1e12

    def to_dict(self) -> dict[str, Any]:
        return {"ms_median": self.median_ms, "ms_min": self.min_ms, "ms_max": self.max_ms, "samples": self.samples}


def summarize(times_ms: Sequence[float]) -> Timing:
    """Median/min/max of positive, finite samples; RuntimeError otherwise (a broken timer must
    never produce a number)."""
    times = [float(t) for t in times_ms]
    if not times or any(not math.isfinite(t) or t <= 0 for t in times):
        raise RuntimeError(f"invalid timing samples: {times[:8]}{'...' if len(times) > 8 else ''}")
    return Timing(statistics.median(times), min(times), max(times), len(times))


# ---------------------------------------------------------------------------- CuPy side
def random_inputs(shape: Sequence[int], dtype: DType, seed: int) -> Any:
    """Standard-normal CuPy array of `dtype`, made on the device (bf16 by rounding fp32 bits to
    nearest even, which needs no bf16 arithmetic in CuPy)."""
    import cupy

    x = cupy.random.default_rng(seed).standard_normal(tuple(shape), dtype=cupy.float32)
    if dtype is DType.FP16:
        return x.astype(cupy.float16)
    bits = x.view(cupy.uint32)
    rounded = (bits + cupy.uint32(0x7FFF) + ((bits >> 16) & cupy.uint32(1))) >> 16
    return rounded.astype(cupy.uint16).view(dtype.numpy_dtype)


def poison(out: Any, dtype: DType) -> None:
    """Fill a CuPy fp16/bf16 array with NaN, so any element a kernel fails to write shows up."""
    out.view("uint16").fill(_NAN_BITS[dtype])


def _bits(x: Any, dtype: DType) -> Any:
    """A view CuPy can index and convert: bf16 as its uint16 bit patterns (a same-itemsize view,
    valid for any strides), fp16 as is."""
    import cupy

    return x.view(cupy.uint16) if dtype is DType.BF16 else x


def _to_float(x: Any, dtype: DType, float_dtype: Any) -> Any:
    """`_bits` output -> float32/float64 (bf16 widened by shifting its bits into a float32)."""
    import cupy

    if dtype is DType.FP16:
        return x.astype(float_dtype)
    return (x.astype(cupy.uint32) << 16).view(cupy.float32).astype(float_dtype, copy=False)


def spot_check_rel_l2(q: Any, k: Any, v: Any, out: Any, dtype: DType, scale: float | None = None,
                      causal: bool = False) -> float:
    """Relative L2 error of `out` against a float64 reference, on the first and last (batch, head)
    and the `spot_rows` query rows (all keys). inf if `out` holds any NaN/inf anywhere.

    CuPy arrays in (batch, seq, heads, d_head) layout; cheap enough to run at every grid size.
    """
    import cupy

    if not bool(cupy.isfinite(_to_float(_bits(out, dtype), dtype, cupy.float32)).all()):
        return math.inf
    batch, seq_q, heads, d_head = q.shape
    seq_k = k.shape[1]
    scale = 1.0 / math.sqrt(d_head) if scale is None else scale
    rows = cupy.asarray(spot_rows(seq_q))
    qb, kb, vb, ob = (_bits(x, dtype) for x in (q, k, v, out))
    num = den = 0.0
    for b in sorted({0, batch - 1}):
        for h in sorted({0, heads - 1}):
            qs = _to_float(qb[b, :, h][rows], dtype, cupy.float64)
            ks = _to_float(kb[b, :, h], dtype, cupy.float64)
            vs = _to_float(vb[b, :, h], dtype, cupy.float64)
            s = (qs @ ks.T) * scale
            if causal:  # key j is visible to query i when j <= i + (seq_k - seq_q) (bottom-right;
                # the same as top-left for the square problems benchmarked here)
                keys = cupy.arange(seq_k)[None, :]
                s = cupy.where(keys > rows[:, None] + (seq_k - seq_q), -cupy.inf, s)
            s -= s.max(axis=1, keepdims=True)
            p = cupy.exp(s)
            ref = (p / p.sum(axis=1, keepdims=True)) @ vs
            got = _to_float(ob[b, :, h][rows], dtype, cupy.float64)
            num += float(((got - ref) ** 2).sum())
            den += float((ref ** 2).sum())
    return math.sqrt(num / den) if den > 0 else math.inf


def sustain_load(fn: Callable[[], Any], seconds: float, sync: Callable[[], Any]) -> None:
    """Run fn() back to back for `seconds` (host clock; `sync` every 8 calls keeps the queue short):
    long enough and the GPU sits at the steady state of its power cap, as in a training loop or a
    long prefill batch, instead of at the boost clock an idle GPU starts a short burst with."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            fn()
        sync()


def time_cupy(run: Callable[[int], Any], n_sets: int, warmup: int, iters: int, sustain: float = 0.0) -> Timing:
    """Median per-call time of `run(set_index)` with CUDA events on CuPy's current stream.

    One call outside the timing (kernel load), then `warmup` calls and `iters` event-bracketed
    calls queued back to back with no synchronisation in between: while the GPU is busy the host
    runs ahead, so each event pair brackets GPU time, not Python launch overhead. sustain > 0
    (seconds): first that long of back-to-back calls (`sustain_load`), so the timed calls run at
    the power-capped clock.
    """
    import cupy

    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    stream = cupy.cuda.get_current_stream()
    run(0)
    stream.synchronize()
    if sustain > 0:
        calls = itertools.count()
        sustain_load(lambda: run(next(calls) % n_sets), sustain, stream.synchronize)
    for i in range(warmup):
        run(i % n_sets)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record(stream)
        run((warmup + i) % n_sets)
        end.record(stream)
    end.synchronize()
    return summarize([cupy.cuda.get_elapsed_time(s, e) for s, e in events])
