"""The decode family's tuning problem: one decode step of a serving batch at one cache length.

A bucket `seq` is the number of keys per sequence. The batch holds as many sequences as make
about TUNING_KV_BYTES of K and V (so every bucket streams the same bytes: 1 sequence of 128k
keys at d_head 128, 8 of 8k, 64 of 1k), with 32 query heads on 8 KV heads (GQA 4) and one
query row per sequence (four with causal=True, bottom-right aligned); from 8k keys up (d_head
128) that is at most 16 sequences, a narrow problem (cupyflash.kvcache.is_wide). A timed call is the step against a contiguous
cache with num_splits=None (the library's split rule for the config is part of what is timed);
each config is also checked on a paged cache (page size 16, shuffled pages) with the same
contents. The table's winners serve narrow problems on contiguous caches; paged caches and wide
batches keep the heuristic defaults of config_sets, whose shapes were chosen for them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ...benchmarking import REL_L2_TOLERANCE, poison, random_inputs, rotation_sets
from ...config import DType
from .config import DecodeKernelConfig

__all__ = ["DecodeTuningProblem", "TUNING_KV_BYTES", "TUNING_HEADS", "TUNING_KV_HEADS", "TUNING_PAGE_SIZE",
           "tuning_batch"]

TUNING_KV_BYTES = 256 << 20   # K + V bytes one layout's step reads (5x the H100's L2)
TUNING_HEADS, TUNING_KV_HEADS = 32, 8
TUNING_PAGE_SIZE = 16         # vLLM's default, the hardest page size to stream


def tuning_batch(seq: int, d_head: int) -> int:
    """Sequences per step at bucket `seq`: about TUNING_KV_BYTES of K and V, at least one."""
    return max(1, TUNING_KV_BYTES // (2 * seq * TUNING_KV_HEADS * d_head * 2))


def _to_f64(x: Any, dtype: DType) -> Any:
    import cupy

    if dtype is DType.FP16:
        return x.astype(cupy.float64)
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32).astype(cupy.float64)


class DecodeTuningProblem:
    """Contiguous and paged caches with the same contents, a query per sequence and output
    buffers; each config is checked once (both layouts, poisoned outputs) against a float64
    reference on the first and last sequence before it is timed."""

    def __init__(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int) -> None:
        import cupy

        if seq % TUNING_PAGE_SIZE:
            raise ValueError(f"seq: decode buckets must be multiples of the page size {TUNING_PAGE_SIZE}, got {seq}")
        self.dtype, self.d_head, self.seq, self.causal = dtype, d_head, seq, causal
        self.batch = batch = tuning_batch(seq, d_head)
        self.seq_q = 4 if causal else 1
        kv_shape = (batch, seq, TUNING_KV_HEADS, d_head)
        self.n_sets = rotation_sets(2 * batch * seq * TUNING_KV_HEADS * d_head * 2, l2_bytes)
        self.sets = []
        pages_per_seq = seq // TUNING_PAGE_SIZE
        n_pages = batch * pages_per_seq
        for i in range(self.n_sets):
            base = 10_000 * seq + 8 * i
            q = random_inputs((batch, self.seq_q, TUNING_HEADS, d_head), dtype, seed=base)
            k = random_inputs(kv_shape, dtype, seed=base + 1)
            v = random_inputs(kv_shape, dtype, seed=base + 2)
            perm = cupy.asarray(np.random.default_rng(base + 3).permutation(n_pages).astype(np.int32))
            page_shape = (n_pages, TUNING_PAGE_SIZE, TUNING_KV_HEADS, d_head)
            k_pages, v_pages = cupy.empty_like(k).reshape(page_shape), cupy.empty_like(v).reshape(page_shape)
            # logical page j of the batch lives in physical page perm[j] (bit copies: no bf16 math)
            k_pages.view(cupy.uint16)[perm] = k.view(cupy.uint16).reshape(page_shape)
            v_pages.view(cupy.uint16)[perm] = v.view(cupy.uint16).reshape(page_shape)
            table = perm.reshape(batch, pages_per_seq)
            self.sets.append((q, k, v, k_pages, v_pages, table, cupy.empty_like(q), cupy.empty_like(q)))
        self.seqlens = cupy.full((batch,), seq, dtype=cupy.int32)
        # QK^T and PV, 2 flops per multiply-add, of the timed (contiguous) step
        self.flops = 4.0 * batch * self.seq_q * TUNING_HEADS * seq * d_head
        self.label = f"{dtype.name} d{d_head} keys={seq} batch={batch}{' causal' if causal else ''} decode"
        self.info: dict[str, Any] = {"batch": batch, "seq_q": self.seq_q, "heads": TUNING_HEADS,
                                     "kv_heads": TUNING_KV_HEADS, "page_size": TUNING_PAGE_SIZE}
        _prewarm_paged(dtype, d_head, causal)

    def skip_reason(self, cfg: DecodeKernelConfig) -> str | None:
        from ...kvcache import _device_limits
        import cupy

        limit = _device_limits(cupy.cuda.runtime.getDevice())[2]
        if cfg.smem_bytes() > limit:
            return f"needs {cfg.smem_bytes()} bytes of shared memory per CTA; this GPU allows {limit}"
        return None

    def _run(self, cfg: DecodeKernelConfig, i: int) -> tuple[Any, Any]:
        from ...kvcache import forward_kvcache

        q, k, v, k_pages, v_pages, table, o_contig, o_paged = self.sets[i]
        forward_kvcache(q, k, v, cache_seqlens=self.seqlens, causal=self.causal, out=o_contig, cfg=cfg)
        forward_kvcache(q, k_pages, v_pages, cache_seqlens=self.seqlens, block_table=table, causal=self.causal,
                        out=o_paged, cfg=cfg)
        return o_contig, o_paged

    def _rel_l2(self, out: Any, q: Any, k: Any, v: Any) -> float:
        """Relative L2 error of `out` on the first and last sequence against float64."""
        import cupy

        group = TUNING_HEADS // TUNING_KV_HEADS
        scale = 1.0 / math.sqrt(self.d_head)
        num = den = 0.0
        for b in sorted({0, self.batch - 1}):
            got = _to_f64(out[b], self.dtype)                      # (seq_q, heads, d)
            if not bool(cupy.isfinite(got).all()):
                return math.inf
            qb = _to_f64(q[b], self.dtype)
            kb, vb = _to_f64(k[b], self.dtype), _to_f64(v[b], self.dtype)  # (seq, kv_heads, d)
            for h in range(TUNING_HEADS):
                s = (qb[:, h] @ kb[:, h // group].T) * scale         # (seq_q, seq)
                if self.causal:
                    rows = cupy.arange(self.seq_q)[:, None]
                    keys = cupy.arange(self.seq)[None, :]
                    s = cupy.where(keys > rows + self.seq - self.seq_q, -cupy.inf, s)
                p = cupy.exp(s - s.max(axis=1, keepdims=True))
                ref = (p / p.sum(axis=1, keepdims=True)) @ vb[:, h // group]
                num += float(((got[:, h] - ref) ** 2).sum())
                den += float((ref ** 2).sum())
        return math.sqrt(num / den) if den > 0 else math.inf

    def check(self, cfg: DecodeKernelConfig) -> str | None:
        """None if `cfg` is right on both layouts, else what is wrong."""
        q, k, v, *_, o_contig, o_paged = self.sets[0]
        poison(o_contig, self.dtype)
        poison(o_paged, self.dtype)
        self._run(cfg, 0)
        tol = REL_L2_TOLERANCE[self.dtype]
        for name, out in (("contiguous", o_contig), ("paged", o_paged)):
            rel = self._rel_l2(out, q, k, v)
            if not rel <= tol:  # also catches NaN (unwritten rows)
                return f"wrong result ({name} cache): relative L2 error {rel:.3g} > {tol:g}"
        return None

    def timed_call(self, cfg: DecodeKernelConfig) -> Callable[[int], Any]:
        from ...kvcache import forward_kvcache

        def call(i: int, c: DecodeKernelConfig = cfg) -> Any:
            q, k, v, _, _, _, o_contig, _ = self.sets[i]
            return forward_kvcache(q, k, v, cache_seqlens=self.seqlens, causal=self.causal, out=o_contig, cfg=c)
        return call

    def close(self) -> None:
        import cupy

        self.sets.clear()
        cupy.get_default_memory_pool().free_all_blocks()


def _prewarm_paged(dtype: DType, d_head: int, causal: bool) -> None:
    """Compile the tune set's paged variant in parallel (autotune prewarms the contiguous one);
    otherwise each would compile on its first timed call, one after another. Cached kernels cost
    a cache lookup only, so later buckets pay nothing."""
    import cupy

    from ...prewarm import prewarm
    from . import DECODE

    configs = DECODE.tune_candidates(dtype, d_head)
    arch = DECODE.arch_for_device(cupy.cuda.runtime.getDevice())
    prewarm(configs, [arch], progress=None, variants=[DECODE.variant(causal=causal, paged=True)])
