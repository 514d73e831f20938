"""A handful of small forward_kvcache launches for compute-sanitizer (memcheck / racecheck):
contiguous and paged caches, ragged lengths with 0 and page boundaries, several splits (the
combine kernel), k_new appended (the append kernel), causal seq_q > 1 with several row tiles.

    compute-sanitizer --tool memcheck python scripts/sanitize_decode.py
"""
from __future__ import annotations

import sys

import cupy as cp
import numpy as np

import cupyflash
from cupyflash.config import DType


def main() -> int:
    rng = np.random.default_rng(0)
    cases = [  # dtype, d, batch, seq_q, heads, kv_heads, lengths, page, seq_new, splits
        (DType.BF16, 128, 3, 1, 8, 2, [0, 17, 300], None, 0, 3),
        (DType.BF16, 128, 3, 1, 8, 2, [0, 17, 300], 16, 1, 2),
        (DType.FP16, 64, 2, 4, 16, 4, [15, 70], 32, 2, 1),
        (DType.BF16, 256, 2, 16, 8, 8, [5, 100], 16, 0, 4),
        (DType.BF16, 128, 2, 16, 16, 2, [40, 200], None, 3, 5),  # 128 rows: 4 row tiles
        (DType.FP16, 128, 2, 1, 24, 6, [33, 250], 16, 1, 3),     # 4 KV heads per CTA, a partial block
    ]
    heads4 = "decode (FP16, 128, 16, 16, 8): stages_2+heads_4"
    for dt, d, b, sq, h, hk, lens, ps, new, splits in cases:
        npdt = dt.numpy_dtype
        cap = max(lens) + new
        cap = -(-cap // ps) * ps if ps else cap
        q = cp.asarray(rng.standard_normal((b, sq, h, d), dtype=np.float32).astype(npdt))
        kw = {}
        if ps:
            per = cap // ps
            table = cp.asarray(rng.permutation(b * per).astype(np.int32).reshape(b, per))
            shape = (b * per, ps, hk, d)
            kw["block_table"] = table
        else:
            shape = (b, cap, hk, d)
        kc = cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(npdt))
        vc = cp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(npdt))
        if new:
            kw["k_new"] = cp.asarray(rng.standard_normal((b, new, hk, d), dtype=np.float32).astype(npdt))
            kw["v_new"] = cp.asarray(rng.standard_normal((b, new, hk, d), dtype=np.float32).astype(npdt))
        out, lse = cupyflash.forward_kvcache(q, kc, vc, cache_seqlens=cp.asarray(np.array(lens, np.int32)),
                                             num_splits=splits, return_lse=True,
                                             cfg=heads4 if hk == 6 else None, **kw)
        cp.cuda.Device().synchronize()
        print("ok", dt.name, d, b, sq, h, hk, lens, ps, new, splits, bool(cp.isfinite(lse).any()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
