"""How many splits of the keys (flash-decoding) a forward_kvcache call launches.

Decided on the host from shapes only (lengths live on the GPU and are never read back). One split
launches base = batch x n_kv_heads x row_tiles CTAs, and the rule aims at `target_ctas` CTAs
(never below one split, nor below MIN_STEPS_PER_WARP steps per warp for the longest possible
sequence). Measured on the H100 (NOTES.md, decode steps 3-4):
- contiguous cache: half the SMs streaming K/V already reach the copy rate (batch 1, 131k keys:
  64 CTAs 183 us, 128 CTAs 185 us, limit 179 us), and every extra split adds a fixed cost per
  CTA and rows to merge (batch 1, 8k keys: 8 splits 21.7 us, 16 splits 22.4 us, 128 splits
  54.5 us): target num_sms / 2;
- paged cache (shuffled pages): the same target while a CTA's share is short, and one CTA per
  SM once the contiguous count would leave a CTA more than PAGED_LONG_CTA_BYTES of K and V
  (choose_paged_num_splits). Measured 2026-11-23 after the paged loop's fix (NOTES.md item 69),
  bf16, page 16 shuffled: batch 1 x 8k keys at 8 splits against 16: d256 33.9 vs 36.0 us,
  d128 21.3 vs 21.6, d64 15.2 vs 15.4; batch 1 x 131k: d64 99.9 vs 102.0, d128 187.0 vs 186.6;
  batch 8 x 32k (32 MB a CTA at one split): d256 722.6 at 1 split, 711.9 at 2, d128 361.2 / 362.5.
  (Before that fix a paged CTA streamed at half the contiguous rate and the rule aimed at one CTA
  per SM throughout: batch 1 x 131k, d128, 8 splits 304 us, 16 splits 196 us.)
- GPUs with more DRAM bandwidth per SM than the H100 (streaming_ctas): half the SMs no longer
  reach the copy rate, and both rules aim at one CTA per SM. H200 (4.8 TB/s over 132 SMs), bf16,
  contiguous, NOTES.md item 176: batch 1 x 131k at 8 / 16 splits d64 90.0 / 69.0 us, d128 132.1 /
  128.1; batch 8 x 32k at 1 / 2 splits d256 584 / 482, d128 251 / 247 (SDPA's best 69.6, 127.9,
  474, 243).
"""
from __future__ import annotations

__all__ = ["MAX_SPLITS", "MIN_STEPS_PER_WARP", "PAGED_LONG_CTA_BYTES", "HALF_GRID_MAX_BYTES_PER_SM", "streaming_ctas",
           "choose_num_splits", "choose_paged_num_splits"]

MAX_SPLITS = 128          # CF_DECODE_MAX_SPLITS in kernels_cu/decode/decode_common.cuh
MIN_STEPS_PER_WARP = 2    # below this a split's pipeline never fills
PAGED_LONG_CTA_BYTES = 8 << 20  # K and V bytes a paged CTA streams before more CTAs pay (see above)
# Peak DRAM bytes per second per SM up to which num_sms / 2 streaming CTAs reach the copy rate: the
# H100 SXM's 3.35 TB/s over 132 SMs, where the rule was measured, with 20% margin (the H200 has
# 1.43x that per SM).
HALF_GRID_MAX_BYTES_PER_SM = 1.2 * 3.35e12 / 132


def streaming_ctas(num_sms: int, dram_bytes_per_s: float | None) -> float:
    """CTAs a decode step aims at on a GPU of `num_sms` SMs and peak DRAM bandwidth
    `dram_bytes_per_s` (None: unknown, taken as the H100's): half the SMs where that many
    streaming CTAs reach the copy rate, every SM where the bandwidth per SM is higher."""
    if dram_bytes_per_s and dram_bytes_per_s / max(1, num_sms) > HALF_GRID_MAX_BYTES_PER_SM:
        return float(num_sms)
    return num_sms / 2


def choose_num_splits(batch: int, n_kv_heads: int, row_tiles: int, max_keys: int, target_ctas: float,
                      keys_per_cta_step: int) -> int:
    """Split count for batch x n_kv_heads x row_tiles CTAs per split over sequences of at most
    `max_keys` keys, aiming at `target_ctas` CTAs; a CTA step covers `keys_per_cta_step` keys."""
    base = max(1, batch * n_kv_heads * row_tiles)
    wanted = max(1, round(target_ctas / base))
    useful = max(1, max_keys // max(1, keys_per_cta_step * MIN_STEPS_PER_WARP))
    return max(1, min(wanted, useful, MAX_SPLITS))


def choose_paged_num_splits(batch: int, n_kv_heads: int, row_tiles: int, max_keys: int, num_sms: int,
                            keys_per_cta_step: int, key_bytes: int, dram_bytes_per_s: float | None = None) -> int:
    """Split count for a paged cache: the contiguous rule's (streaming_ctas), or num_sms CTAs
    when that would leave a CTA more than PAGED_LONG_CTA_BYTES of K and V (`key_bytes` per key)."""
    splits = choose_num_splits(batch, n_kv_heads, row_tiles, max_keys, streaming_ctas(num_sms, dram_bytes_per_s),
                               keys_per_cta_step)
    if -(-max_keys // splits) * key_bytes > PAGED_LONG_CTA_BYTES:
        splits = choose_num_splits(batch, n_kv_heads, row_tiles, max_keys, num_sms, keys_per_cta_step)
    return splits
