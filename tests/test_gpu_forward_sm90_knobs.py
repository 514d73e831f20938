"""GPU tests of forward_sm90's `oreg` (O stored from registers; persistent CTAs release their Q
tile after the last Q K^T), `lazy` (threshold rescaling), `ring` (ping-pong turns carried across
a persistent CTA's tiles), `xtile`, `wgblocks` (causal: each warpgroup stops at its own last
visible key block), `psmem` (P V reads P from shared memory), `cluster2` (K/V multicast to CTA
pairs), `lptN` (causal grids longest tiles first, in chunks of heads), `qreg` (Q K^T reads Q's fragments
from registers), `halflast` (a warpgroup's last key block cut to its first half when no row of it
sees the second) and the 192-column key tile,
against
the SPEC §5 rule: several key blocks, many tiles per persistent CTA, ragged edges with LSE,
S_q != S_k both ways, GQA/MQA, and scores whose running max grows past the lazy threshold
several times. Skipped cleanly without a compute capability 9.0 GPU."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.device import has_gpu


def _is_sm90() -> bool:
    if not has_gpu():
        return False
    from cupyflash.device import compute_capability

    return compute_capability(0) == 90


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90(), reason="needs a compute capability 9.0 GPU")]

# Every new code path once per d_head it serves, persistent or not, with one or two Q tiles.
KNOB_CONFIGS = ("forward_sm90(BF16, 256, 128, 80, 2): tma+ws+pingpong+overlap+persistent+oreg",
                "forward_sm90(FP16, 256, 128, 80, 2): tma+ws+pingpong+overlap+persistent+oreg+lazy",
                "forward_sm90(BF16, 256, 128, 80, 2): tma+ws+overlap+lazy",
                "forward_sm90(FP16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy",
                "forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+lazy",
                "forward_sm90(BF16, 64, 128, 192, 2): tma+ws+pingpong+overlap",
                "forward_sm90(FP16, 64, 128, 192, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy",
                "forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+oreg+lazy",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+oreg",
                # the turn ring: three and two consumer warpgroups, overlapped and plain loops, one
                # and two Q tiles (causal tiles without a visible key take no turns)
                "forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+ring",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+ring",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+persistent+ring",
                # cross-tile overlap: the next tile's first block computed under this tile's last
                # P V (staged and direct O stores, lazy rescaling, three consumer warpgroups)
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+xtile",
                "forward_sm90(FP16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+ring+xtile",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+ring+xtile",
                "forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+ring+xtile",
                # wg_blocks (causal): lower warpgroups stop early and take idle turns; overlapped
                # and plain loops, per-tile turns and the ring, staged and direct O, and B_c 64,
                # where a warpgroup skips more blocks than the ring has stages
                "forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+wgblocks",
                "forward_sm90(FP16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+wgblocks",
                "forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+wgblocks",
                "forward_sm90(FP16, 64, 192, 64, 2): tma+ws+pingpong+overlap+wgblocks",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+persistent+ring+wgblocks",
                # psmem: P through shared memory - d_head 64's 192 x 192 tiles (plain, persistent
                # with the ring, causal warpgroup blocks), the cross-tile carry at d_head 128, the
                # sequential loop, and B_c 176 (a last P column block of 48 keys)
                "forward_sm90(BF16, 64, 192, 192, 2): tma+ws+pingpong+overlap+lazy+psmem",
                "forward_sm90(FP16, 64, 192, 192, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+psmem",
                "forward_sm90(BF16, 64, 192, 192, 2): tma+ws+pingpong+overlap+wgblocks+psmem",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+xtile+psmem",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+psmem",
                "forward_sm90(FP16, 64, 128, 176, 2): tma+ws+pingpong+overlap+psmem",
                # d_head 128's three consumer warpgroups (the table's long rows), persistent too
                "forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem",
                "forward_sm90(FP16, 128, 192, 128, 2): tma+ws+pingpong+overlap+persistent+lazy+psmem",
                # cluster2: K/V multicast to CTA pairs (non-causal; causal runs the pair
                # independently), odd query-block counts (the pad's CTA), d_head 128 and 256
                "forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+cluster2",
                "forward_sm90(FP16, 128, 128, 176, 2): tma+ws+pingpong+overlap+cluster2",
                "forward_sm90(BF16, 128, 128, 128, 3): tma+ws+pingpong+cluster2",
                "forward_sm90(FP16, 256, 128, 80, 2): tma+ws+pingpong+overlap+oreg+lazy+cluster2",
                # d_head 96's 64-byte swizzled tiles under the cross-tile carry, O from registers
                # with the ring and per-warpgroup blocks, and P through shared memory (persistent)
                "forward_sm90(BF16, 96, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+ring+xtile",
                "forward_sm90(FP16, 96, 192, 80, 3): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+wgblocks",
                "forward_sm90(BF16, 96, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+psmem",
                # lpt: causal grids start the longest tiles of a chunk of heads first (three and
                # two consumer warpgroups, every d_head's swizzle)
                "forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+wgblocks+lpt8",
                "forward_sm90(FP16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+lpt32",
                "forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+lpt4",
                "forward_sm90(FP16, 96, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+lpt16",
                "forward_sm90(BF16, 256, 128, 64, 2): tma+ws+pingpong+overlap+lazy+lpt64",
                # qreg: Q K^T reads Q's fragments from registers - d_head 64's two-consumer picks
                # (persistent, the early Q release after block 0 with oreg, the ring), the plain
                # loop on three consumers with per-warpgroup blocks, P through shared memory, and
                # the 64-byte swizzled d_head 96 and two column blocks of d_head 128
                "forward_sm90(BF16, 64, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+qreg",
                "forward_sm90(FP16, 64, 128, 128, 2): tma+ws+pingpong+overlap+lazy+qreg",
                "forward_sm90(BF16, 64, 128, 176, 3): tma+ws+pingpong+overlap+persistent+oreg+qreg",
                "forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+qreg",
                "forward_sm90(BF16, 96, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+qreg",
                "forward_sm90(FP16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+wgblocks+qreg",
                "forward_sm90(BF16, 128, 128, 80, 2): tma+overlap+qreg",
                # halflast: a warpgroup's last key block cut to its first half when no row of the
                # warpgroup sees the second (causal diagonals, key ends) - the d_head 64 causal
                # picks (two consumers persistent with qreg; three with per-warpgroup blocks and
                # lpt), the plain tile (every warpgroup visits the tile's blocks, so the lower one's
                # last block may be wholly masked), P through shared memory, d_head 96's 64-byte
                # swizzle, d_head 256's B_c 64 (two P V k-steps) and B_c 192 (halves of 96 keys)
                "forward_sm90(BF16, 64, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+qreg+halflast",
                "forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+wgblocks+halflast",
                "forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+halflast+lpt8",
                "forward_sm90(FP16, 64, 128, 128, 2): tma+ws+pingpong+overlap+halflast",
                "forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+halflast",
                "forward_sm90(FP16, 96, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+halflast",
                "forward_sm90(BF16, 256, 128, 64, 2): tma+ws+pingpong+overlap+lazy+halflast",
                "forward_sm90(FP16, 64, 128, 192, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+halflast")

if _is_sm90():
    import cupy as cp

    from gpu_reference import check_attention, poisoned, random_inputs
    from cupyflash.families.forward_sm90 import forward_sm90
    from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig as H

    CONFIGS = [H.parse(t) for t in KNOB_CONFIGS]
else:
    CONFIGS = []


@pytest.fixture(scope="module", autouse=True)
def prewarmed():
    from cupyflash.prewarm import prewarm

    report = prewarm(sorted(CONFIGS), ["sm_90a"], progress=None, causal=(False, True))
    assert report.ok, [r for r in report.results if not r.ok][:2]


@pytest.fixture
def rng():
    return np.random.default_rng()


def _inputs(rng, dtype, batch, seq_q, seq_k, heads, kv_heads, d):
    return (random_inputs(cp, dtype, (batch, seq_q, heads, d), rng),
            random_inputs(cp, dtype, (batch, seq_k, kv_heads, d), rng),
            random_inputs(cp, dtype, (batch, seq_k, kv_heads, d), rng))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_many_tiles_ragged_edges_with_lse(cfg, causal, rng):
    """More tiles than SMs for the persistent ones (each CTA takes several, so the early Q
    release and its phases carry across tiles), then lengths off the tile sizes, S_q != S_k
    both ways (causal tiles with no visible key), GQA and MQA, LSE."""
    cases = [(2, 3 * cfg.B_r - 17, 3 * cfg.B_r - 12, 40, 8), (2, 77, 200, 4, 2), (1, 1, 300, 4, 1),
             (2, 130, 63, 4, 2), (1, 513, 1537, 8, 2)]
    for batch, sq, sk, h, hkv in cases:
        q, k, v = _inputs(rng, cfg.dtype, batch, sq, sk, h, hkv, cfg.d_head)
        out = poisoned(cp, cfg.dtype, q.shape)
        lse = cp.full((batch, h, sq), np.nan, dtype=cp.float32)
        forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
        check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, lse=lse, context=f"{cfg} {(batch, sq, sk, h, hkv)}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.lazy_rescale], ids=str)
def test_lazy_rescale_with_growing_scores(cfg, causal, rng):
    """Keys scaled up along the sequence (x0.25 .. x6): each row's max grows by far more than
    the lazy threshold (2^8) over the key blocks, so rows move their max several times, some
    lanes of a warp do while others keep theirs, and probabilities reach up to 2^8 in between."""
    seq = 6 * cfg.B_c + 37
    q, _, v = _inputs(rng, cfg.dtype, 2, seq, seq, 4, 4, cfg.d_head)
    ramp = np.linspace(0.25, 6.0, seq, dtype=np.float32).reshape(1, seq, 1, 1)
    k = cp.asarray((rng.standard_normal(q.shape, dtype=np.float32) * ramp).astype(cfg.dtype.numpy_dtype))
    out = poisoned(cp, cfg.dtype, q.shape)
    lse = cp.full((2, 4, seq), np.nan, dtype=cp.float32)
    forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
    check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, lse=lse, context=str(cfg))


LPT_CONFIGS = [c for c in CONFIGS if c.lpt_mib]


@pytest.mark.parametrize("cfg", LPT_CONFIGS, ids=str)
def test_lpt_chunks_of_heads(cfg, rng):
    """Causal grids whose (head, batch) pairs' K and V exceed the config's lpt budget: several
    chunks of heads, the last one smaller (12 pairs in chunks of 8), S_q != S_k, and GQA (a group's
    heads share K/V, so a chunk holds more heads: 24 in chunks of 8 pairs of 2). Every tile is
    computed once: poisoned outputs and the LSE catch a tile missed or written twice."""
    seq_k = cfg.lpt_mib * 32768 // cfg.d_head  # K + V of a pair: 4 * seq_k * d_head bytes = lpt_mib / 8 MiB
    assert seq_k <= 8192, "the float64 reference's (heads, seq_q, seq_k) scores must fit the GPU"
    for batch, sq, sk, h, hkv in ((3, seq_k, seq_k, 4, 4), (2, seq_k // 2 + 77, seq_k, 6, 6),
                                  (1, 1000, 2 * seq_k, 24, 12)):
        q, k, v = _inputs(rng, cfg.dtype, batch, sq, sk, h, hkv, cfg.d_head)
        out = poisoned(cp, cfg.dtype, q.shape)
        lse = cp.full((batch, h, sq), np.nan, dtype=cp.float32)
        forward_sm90(cfg, q, k, v, out=out, causal=True, return_lse=True, lse=lse)
        check_attention(cp, cfg.dtype, q, k, v, out, causal=True, lse=lse, context=f"{cfg} {(batch, sq, sk, h, hkv)}")


HALF_LAST_CONFIGS = [c for c in CONFIGS if c.half_last]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", HALF_LAST_CONFIGS, ids=str)
def test_half_last_block_at_each_side_of_the_half(cfg, causal, rng):
    """Key lengths and causal shifts that put each warpgroup's last visible key just before, at and
    just after the middle of its last key block (narrow or not, by one key), and at a block's first
    and last key; S_q below, equal to and above S_k (causal rows before the first key)."""
    half = cfg.B_c // 2
    for sk in (2 * cfg.B_c + half - 1, 2 * cfg.B_c + half, 2 * cfg.B_c + half + 1, 2 * cfg.B_c + 1, 3 * cfg.B_c):
        for sq in (sk, sk - 33, sk + 17, cfg.B_r + 1):
            q, k, v = _inputs(rng, cfg.dtype, 2, sq, sk, 4, 2, cfg.d_head)
            out = poisoned(cp, cfg.dtype, q.shape)
            lse = cp.full((2, 4, sq), np.nan, dtype=cp.float32)
            forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
            check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, lse=lse, context=f"{cfg} {(sq, sk)}")
