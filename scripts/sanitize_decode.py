"""A handful of small forward_kvcache launches for compute-sanitizer (memcheck / racecheck):
contiguous and paged caches, ragged lengths with 0 and page boundaries, several splits (the
combine kernel), k_new appended (by the attention kernel), causal seq_q > 1 with several row tiles.

    compute-sanitizer --tool memcheck python scripts/sanitize_decode.py
    compute-sanitizer --tool memcheck python scripts/sanitize_check.py --family decode   # the same launches

Each launch writes into a NaN-poisoned out, and is checked on the host: the appended
rows are k_new/v_new, and out/lse match a float64 reference over the cache contents as read back
(sanitize_common.check: relative L2 <= 2e-2, lse -inf exactly on rows that see no key).
Exit 0 when all pass, 1 when any fails.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.config import DType  # noqa: E402
from sanitize_common import Launch, check, reference, run_launches  # noqa: E402

HEADS4 = "decode (FP16, 128, 16, 16, 8): stages_2+heads_4"
INTERLEAVED = "decode (BF16, 128, 16, 16, 8): stages_2+evict_first+interleave"
INTERLEAVED_32 = "decode (FP16, 64, 16, 32, 8): stages_1+interleave"
WIDE = "decode (BF16, 128, 16, 16, 4): stages_3"
WIDE_IL = "decode (FP16, 64, 16, 32, 8): stages_2+interleave+heads_2"
ONE_WAVE_4 = "decode (BF16, 128, 16, 32, 4): stages_2+heads_4"  # config_sets.ONE_WAVE_SHAPES
ONE_WAVE_2 = "decode (FP16, 128, 16, 16, 4): stages_2+heads_2"
LONG_64 = "decode (FP16, 64, 16, 64, 4): stages_2"  # page lists of 8 steps (4 sub-blocks a step)
WAVES = [0, 1, 17, 300] * 10  # 40 sequences: several waves of CTAs on an H100
CASES = [  # dtype, d, batch, seq_q, heads, kv_heads, lengths, page, seq_new, splits, cfg (None: the library's)
    (DType.BF16, 128, 3, 1, 8, 2, [0, 17, 300], None, 0, 3, None),
    (DType.BF16, 128, 3, 1, 8, 2, [0, 17, 300], 16, 1, 2, None),
    (DType.FP16, 64, 2, 4, 16, 4, [15, 70], 32, 2, 1, None),
    (DType.BF16, 256, 2, 16, 8, 8, [5, 100], 16, 0, 4, None),
    (DType.BF16, 128, 2, 16, 16, 2, [40, 200], None, 3, 5, None),  # 128 rows: 4 row tiles
    (DType.FP16, 128, 2, 1, 24, 6, [33, 250], 16, 1, 3, HEADS4),   # 4 KV heads per CTA, a partial block
    (DType.BF16, 128, 3, 1, 8, 2, [0, 17, 300], 16, 1, 5, INTERLEAVED),  # splits take steps round-robin
    (DType.FP16, 64, 2, 4, 16, 4, [15, 70], 16, 0, 3, INTERLEAVED_32),   # 32-key steps: two pages each
    (DType.BF16, 128, 40, 1, 32, 8, WAVES, None, 0, 1, WIDE),          # several waves of CTAs
    (DType.FP16, 64, 80, 4, 32, 8, WAVES * 2, None, 1, 3, WIDE_IL),    # ... of round-robin splits, causal
    (DType.BF16, 128, 40, 1, 32, 8, WAVES, None, 0, 1, ONE_WAVE_4),    # one warp per head, 32-key steps
    (DType.FP16, 128, 3, 1, 32, 8, [0, 17, 300], 16, 1, 2, ONE_WAVE_2),  # two warps per head, paged, appended
    (DType.BF16, 128, 2, 1, 8, 2, [3000, 4500], 16, 1, 1, None),       # 35 steps a warp: a second page list
    (DType.FP16, 64, 2, 1, 8, 2, [1000, 2600], 32, 0, 1, LONG_64),      # 64-key steps: lists of 8 steps
]


def launches(rng: np.random.Generator) -> Iterator[Launch]:
    for case in CASES:
        dt, d, b, sq, h, hk, lens, ps, new, splits, cfg = case
        shown = lens if len(lens) <= 8 else f"{lens[:4]}*{len(lens) // 4}"
        label = (f"{dt.name} d{d} B={b} seq_q={sq} H={h}/{hk} lens={shown} page={ps or '-'} new={new} "
                 f"splits={splits}" + (f" cfg={cfg}" if cfg else ""))
        yield Launch("decode", label, functools.partial(_once, case, rng))


def _keys(cache: np.ndarray, table: np.ndarray | None, b: int, n: int) -> np.ndarray:
    """Rows 0..n-1 of sequence b's keys: (n, kv_heads, d), through the page table when paged."""
    if table is None:
        return cache[b, :n]
    ps = cache.shape[1]
    return np.concatenate([cache[table[b, j // ps], j % ps][None] for j in range(n)]) if n else cache[0, :0]


def _once(case: tuple, rng: np.random.Generator) -> tuple[bool, str]:
    import cupy as cp

    import cupyflash

    dt, d, b, sq, h, hk, lens, ps, new, splits, cfg = case
    npdt = dt.numpy_dtype
    cap = max(lens) + new
    cap = -(-cap // ps) * ps if ps else cap
    host_q = rng.standard_normal((b, sq, h, d), dtype=np.float32).astype(npdt)
    q = cp.asarray(host_q)
    kw = {}
    table = None
    if ps:
        per = cap // ps
        table = rng.permutation(b * per).astype(np.int32).reshape(b, per)
        shape = (b * per, ps, hk, d)
        kw["block_table"] = cp.asarray(table)
    else:
        shape = (b, cap, hk, d)
    kc = cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(npdt))
    vc = cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(npdt))
    k_new = v_new = None
    if new:
        k_new, v_new = (rng.standard_normal((b, new, hk, d), dtype=np.float32).astype(npdt) for _ in range(2))
        kw["k_new"], kw["v_new"] = cp.asarray(k_new), cp.asarray(v_new)
    out = cp.asarray(np.full(host_q.shape, np.nan, dtype=npdt))  # poisoned (lse is a new array: no lse= argument)
    got_out, got_lse = cupyflash.forward_kvcache(q, kc, vc, cache_seqlens=cp.asarray(np.array(lens, np.int32)),
                                                 num_splits=splits, return_lse=True, out=out, cfg=cfg, **kw)
    cp.cuda.Device().synchronize()
    host_k, host_v, host_out, host_lse = (cp.asnumpy(x) for x in (kc, vc, got_out, got_lse))
    worst, figures = True, []
    for i, n in enumerate(lens):
        keys, values = _keys(host_k, table, i, n + new), _keys(host_v, table, i, n + new)
        if new and not (np.array_equal(keys[n:], k_new[i]) and np.array_equal(values[n:], v_new[i])):
            return False, f"sequence {i}: the appended cache rows are not k_new/v_new"
        ref, ref_lse = reference(host_q[i:i + 1], keys[None], values[None], causal=True)
        ok, fig = check(host_out[i:i + 1], host_lse[i:i + 1], ref, ref_lse)
        worst = worst and ok
        figures.append(f"[{i}] {fig}")
    return worst, "; ".join(figures)


def main() -> int:
    """Thin wrapper: the same launches run by `sanitize_check.py --family decode`."""
    import cupy as cp

    cp.cuda.set_allocator(None)  # exact-size allocations: memcheck sees every overrun
    done = run_launches(launches(np.random.default_rng(0)), lambda line: print(line, flush=True))
    print(f"sanitize_decode: {done.runs} launches, {done.ok} ok, {len(done.failures)} failed in {done.seconds:.1f} s")
    return 1 if done.failures else 0


if __name__ == "__main__":
    sys.exit(main())
