"""How many splits of the keys (flash-decoding) a forward_kvcache call launches.

Decided on the host from shapes only (lengths live on the GPU and are never read back). One split
launches base = batch x n_kv_heads x row_tiles CTAs, and the rule aims at `target_ctas` CTAs
(never below one split, nor below MIN_STEPS_PER_WARP steps per warp for the longest possible
sequence). Measured on the H100 (NOTES.md, decode steps 3-4):
- contiguous cache: half the SMs streaming K/V already reach the copy rate (batch 1, 131k keys:
  64 CTAs 183 us, 128 CTAs 185 us, limit 179 us), and every extra split adds a fixed cost per
  CTA and rows to merge (batch 1, 8k keys: 8 splits 21.7 us, 16 splits 22.4 us, 128 splits
  54.5 us): target num_sms / 2;
- paged cache (shuffled pages): each CTA streams slower (a page-table read and a new DRAM page
  every 16 keys), so it takes about one CTA per SM (batch 1, 131k keys, 8 warps: 8 splits 304 us,
  16 splits 196 us): target num_sms.
"""
from __future__ import annotations

__all__ = ["MAX_SPLITS", "MIN_STEPS_PER_WARP", "choose_num_splits"]

MAX_SPLITS = 128          # CF_DECODE_MAX_SPLITS in kernels_cu/decode/decode_common.cuh
MIN_STEPS_PER_WARP = 2    # below this a split's pipeline never fills


def choose_num_splits(batch: int, n_kv_heads: int, row_tiles: int, max_keys: int, target_ctas: float,
                      keys_per_cta_step: int) -> int:
    """Split count for batch x n_kv_heads x row_tiles CTAs per split over sequences of at most
    `max_keys` keys, aiming at `target_ctas` CTAs; a CTA step covers `keys_per_cta_step` keys."""
    base = max(1, batch * n_kv_heads * row_tiles)
    wanted = max(1, round(target_ctas / base))
    useful = max(1, max_keys // max(1, keys_per_cta_step * MIN_STEPS_PER_WARP))
    return max(1, min(wanted, useful, MAX_SPLITS))
