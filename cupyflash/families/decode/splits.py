"""How many splits of the keys (flash-decoding) a forward_kvcache call launches.

Decided on the host from shapes only (lengths live on the GPU and are never read back). One split
launches base = batch x n_kv_heads x row_tiles CTAs. Measured on the H100 (NOTES.md, decode step
3): half the SMs streaming K/V already reach the copy rate (batch 1, 131k keys: 64 CTAs 183 us,
128 CTAs 185 us, limit 179 us), while every extra split adds a fixed cost per CTA and more rows
for the combine kernel to merge (batch 1, 8k keys, d_head 128: 8 splits 21.7 us, 16 splits
22.4 us, 128 splits 54.5 us). So the rule aims at about num_sms / 2 CTAs, never below one split
nor below MIN_STEPS_PER_WARP steps per warp for the longest possible sequence.
"""
from __future__ import annotations

__all__ = ["MAX_SPLITS", "MIN_STEPS_PER_WARP", "choose_num_splits"]

MAX_SPLITS = 128          # CF_DECODE_MAX_SPLITS in kernels_cu/decode/decode_common.cuh
MIN_STEPS_PER_WARP = 2    # below this a split's pipeline never fills


def choose_num_splits(batch: int, n_kv_heads: int, row_tiles: int, max_keys: int, num_sms: int,
                      keys_per_cta_step: int) -> int:
    """Split count for batch x n_kv_heads x row_tiles CTAs per split over sequences of at most
    `max_keys` keys, on a GPU of `num_sms` SMs; a CTA step covers `keys_per_cta_step` keys."""
    base = max(1, batch * n_kv_heads * row_tiles)
    wanted = max(1, round(num_sms / 2 / base))
    useful = max(1, max_keys // max(1, keys_per_cta_step * MIN_STEPS_PER_WARP))
    return max(1, min(wanted, useful, MAX_SPLITS))
