"""GPU tests of the Hopper forward family (forward_sm90) against the SPEC §5 rule: every
progression (its first step's cp.async loads on ragged shapes too), default config and pick of
the shipped H100 table, lengths around and off the tile sizes (TMA zero fill at ragged
edges), seq_q != seq_k, causal (bottom-right), GQA/MQA, LSE, out= and free strides.
Skipped cleanly without a compute capability 9.0 GPU."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.device import has_gpu


def _is_sm90() -> bool:
    if not has_gpu():
        return False
    from cupyflash.device import compute_capability

    return compute_capability(0) == 90


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90(), reason="needs a compute capability 9.0 GPU")]

if _is_sm90():
    import cupy as cp

    from gpu_reference import check_attention, poisoned, random_inputs
    from cupyflash.families.forward_sm90 import forward_sm90
    from cupyflash.families.forward_sm90.config_sets import default_config, get_kernel_configs

    from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig as H

    # + the other key-tile widths (80, 176) and a three-stage ring, persistent
    EXTRA = [H.parse(t) for t in ("forward_sm90(BF16, 256, 128, 80, 2): tma+ws+pingpong+overlap+persistent",
                                  "forward_sm90(FP16, 64, 128, 176, 3): tma+ws+pingpong+overlap+persistent",
                                  "forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+persistent",
                                  "forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap",
                                  "forward_sm90(FP16, 64, 192, 64, 3): tma+ws+overlap+persistent",
                                  # d_head 96 (64-byte swizzled tiles): three consumer warpgroups, P
                                  # through shared memory, O from registers, a three-stage ring
                                  "forward_sm90(BF16, 96, 192, 80, 2): tma+ws+pingpong+overlap+lazy",
                                  "forward_sm90(FP16, 96, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem",
                                  "forward_sm90(BF16, 96, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+ring",
                                  "forward_sm90(FP16, 96, 128, 176, 3): tma+ws+pingpong+overlap+persistent+lazy")]
    # the second Q tile and the FMA-unit exp2 (one and two quarters of the scores)
    KNOBS = [H.parse(t) for t in ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2",
                                  "forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+emu1",
                                  "forward_sm90(FP16, 64, 128, 176, 2): tma+ws+pingpong+overlap+emu2",
                                  "forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+emu1")]
    EXTRA += KNOBS
    CONFIGS = sorted(set(get_kernel_configs("prog_all")) | set(get_kernel_configs("defaults")) | set(EXTRA))
    # one per mainloop (cp.async, TMA without and with the producer warpgroup, overlapped,
    # persistent, cross-tile, per-warpgroup blocks, P through shared memory) and per key-tile width of the defaults (64 .. 176)
    _PROG = get_kernel_configs("prog")
    WIDTHS = [_PROG[0], _PROG[1], _PROG[2], _PROG[5], default_config(DType.BF16, 128), default_config(DType.FP16, 64),
              default_config(DType.BF16, 256), default_config(DType.FP16, 256, True),
              H.parse("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+xtile"),
              H.parse("forward_sm90(FP16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+wgblocks"),
              H.parse("forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem"),
              default_config(DType.BF16, 96), default_config(DType.FP16, 96, True),
              H.parse("forward_sm90(BF16, 96, 128, 176, 2): tma+ws+pingpong+overlap"),
              H.parse("forward_sm90(FP16, 96, 192, 80, 2): tma+ws+pingpong+overlap+lazy+wgblocks")]

    from cupyflash.tuning.tables import TuningTable, default_table_path

    # every pick of the shipped H100 table, with the mask its row serves (what cfg=None runs there)
    _TABLE = TuningTable.load(default_table_path("NVIDIA H100 80GB HBM3", "forward_sm90"))
    TABLE_PICKS = sorted({(e.config, e.causal) for e in _TABLE.entries()})
else:
    CONFIGS, TABLE_PICKS, WIDTHS = [], [], []


@pytest.fixture(scope="module", autouse=True)
def prewarmed(request):
    """Compile every module the selected tests use once, in parallel processes, into the kernel
    cache (with -k, only the configs of the selected tests; the defaults when a selected test
    runs cfg=None)."""
    from cupyflash.prewarm import prewarm

    mine = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    named = {item.callspec.params.get("cfg") if hasattr(item, "callspec") else None for item in mine}
    configs = [c for c in CONFIGS + WIDTHS + [pick for pick, _ in TABLE_PICKS] if c in named]
    if None in named:
        configs += get_kernel_configs("defaults")
    report = prewarm(sorted(set(configs)), ["sm_90a"], progress=None, causal=(False, True))
    assert report.ok, [r for r in report.results if not r.ok][:2]


@pytest.fixture
def rng():
    return np.random.default_rng()


def _inputs(rng, dtype, batch, seq_q, seq_k, heads, kv_heads, d):
    q = random_inputs(cp, dtype, (batch, seq_q, heads, d), rng)
    k = random_inputs(cp, dtype, (batch, seq_k, kv_heads, d), rng)
    v = random_inputs(cp, dtype, (batch, seq_k, kv_heads, d), rng)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_config_matches_reference(cfg, causal, rng):
    seq = 3 * cfg.B_r  # several key blocks: every ring stage is reused
    q, k, v = _inputs(rng, cfg.dtype, 2, seq, seq, 3, 3, cfg.d_head)
    out = poisoned(cp, cfg.dtype, q.shape)
    assert forward_sm90(cfg, q, k, v, out=out, causal=causal) is out
    check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, context=str(cfg))


@pytest.mark.parametrize("cfg, causal", TABLE_PICKS, ids=lambda x: str(x) if not isinstance(x, bool) else
                         ("causal" if x else "full"))
def test_table_picks_match_reference(cfg, causal, rng):
    """Each config the shipped table hands cfg=None, with its row's mask: a ragged last query
    block, S_q != S_k, GQA, more tiles than SMs for the persistent ones, LSE."""
    seq = 2 * cfg.B_r + 37
    q, k, v = _inputs(rng, cfg.dtype, 2, seq, seq + 29, 36, 6, cfg.d_head)
    out = poisoned(cp, cfg.dtype, q.shape)
    lse = cp.full((2, 36, seq), np.nan, dtype=cp.float32)
    forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
    check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, lse=lse, context=f"{cfg} causal={causal}")


PERSISTENT = [c for c in CONFIGS if c.persistent]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", PERSISTENT, ids=str)
def test_persistent_over_many_tiles(cfg, causal, rng):
    """More tiles (and causal pairs of tiles) than SMs, an odd query-block count (the middle block
    of each causal pair list runs alone) and a ragged last block: every CTA takes several tiles,
    so the K/V ring, the Q tile(s) and their phases carry across tiles."""
    seq = 3 * cfg.B_r - 17
    q, k, v = _inputs(rng, cfg.dtype, 2, seq, seq + 5, 40, 8, cfg.d_head)
    out = poisoned(cp, cfg.dtype, q.shape)
    forward_sm90(cfg, q, k, v, out=out, causal=causal)
    check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, context=str(cfg))


CP_ASYNC = [c for c in CONFIGS if c.cp_async]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", CP_ASYNC, ids=str)
def test_cp_async_ragged_edges_with_lse(cfg, causal, rng):
    """The cp.async loads (progression step 1) zero-fill rows past each sequence end as TMA does:
    lengths off the tile sizes, S_q != S_k both ways (causal tiles with no visible key), GQA and
    MQA, LSE; the first case reads head-major storage (free strides in the records)."""
    for i, (batch, sq, sk, h, hkv) in enumerate([(2, 77, 200, 4, 2), (1, 1, 300, 4, 1), (2, 130, 63, 4, 2),
                                                  (1, 257, 257, 2, 2), (1, 513, 1537, 8, 2)]):
        if i == 0:
            store = [random_inputs(cp, cfg.dtype, (batch, n, s, cfg.d_head), rng)
                     for n, s in ((h, sq), (hkv, sk), (hkv, sk))]
            q, k, v = (x.transpose(0, 2, 1, 3) for x in store)
        else:
            q, k, v = _inputs(rng, cfg.dtype, batch, sq, sk, h, hkv, cfg.d_head)
        out = poisoned(cp, cfg.dtype, q.shape)
        lse = cp.full((batch, h, sq), np.nan, dtype=cp.float32)
        forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
        check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, lse=lse, context=f"{cfg} {(batch, sq, sk, h, hkv)}")


# (batch, seq_q, seq_k, heads, kv_heads): tails of every tile size, S_q != S_k both ways, GQA, MQA
SHAPES = [(1, 1, 1, 2, 2), (1, 1, 300, 4, 1), (2, 77, 200, 4, 2), (2, 130, 63, 4, 2), (1, 257, 257, 2, 2),
          (1, 128, 384, 2, 1), (1, 1000, 1000, 4, 4), (1, 513, 1537, 8, 2)]


@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
@pytest.mark.parametrize("d_head", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_with_lse(shape, causal, d_head, dtype, rng):
    batch, sq, sk, h, hkv = shape
    q, k, v = _inputs(rng, dtype, batch, sq, sk, h, hkv, d_head)
    out = poisoned(cp, dtype, q.shape)
    lse = cp.full((batch, h, sq), np.nan, dtype=cp.float32)
    res, res_lse = forward_sm90(None, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
    assert res is out and res_lse is lse
    check_attention(cp, dtype, q, k, v, out, causal=causal, lse=lse, context=f"{shape} d{d_head}")


def test_free_strides_and_scale(rng):
    """Head-major storage viewed as (batch, seq, heads, d), an output with padded rows, a scale."""
    dtype, d = DType.BF16, 128
    store = [random_inputs(cp, dtype, (2, 4, 320, d), rng) for _ in range(3)]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in store)  # (2, 320, 4, 128), seq stride d
    out_store = poisoned(cp, dtype, (2, 320, 4, d + 64))
    out = out_store[..., :d]
    forward_sm90(None, q, k, v, out=out, softmax_scale=0.2)
    check_attention(cp, dtype, q, k, v, out, scale=0.2)
    # the padding past d_head stays untouched (still the bf16 NaN poison)
    assert bool((out_store[..., d:].view(cp.uint16) == 0x7FC0).all())


def test_short_form_and_default(rng):
    cfg = default_config(DType.FP16, 128)
    q, k, v = _inputs(rng, DType.FP16, 1, 256, 256, 2, 2, 128)
    out = forward_sm90(cfg.short_form(), q, k, v)
    check_attention(cp, DType.FP16, q, k, v, out)


def test_rejects_what_it_cannot_run(rng):
    q, k, v = _inputs(rng, DType.BF16, 1, 64, 64, 2, 2, 80)
    with pytest.raises(ValueError, match="^q: d_head 80"):
        forward_sm90(None, q, k, v)
    q, k, v = _inputs(rng, DType.BF16, 1, 64, 64, 2, 2, 128)
    with pytest.raises(ValueError, match="^cfg: config dtype"):
        forward_sm90(default_config(DType.FP16, 128), q, k, v)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", WIDTHS, ids=str)
def test_last_key_block_at_every_width(cfg, causal, rng):
    """Key lengths ending at every 16-key step of a key block and between them (the last
    block's mask and TMA zero fill at each width, and the whole block): alone (one block) and
    after two whole ones, seq_q shorter and longer than seq_k, GQA, LSE."""
    for r in sorted({*range(1, cfg.B_c + 1, 7), *range(16, cfg.B_c + 1, 16), cfg.B_c - 1}):
        for sk in (r, 2 * cfg.B_c + r):
            sq = 150 if sk > 150 else 2 * cfg.B_r + 5
            q, k, v = _inputs(rng, cfg.dtype, 2, sq, sk, 4, 2, cfg.d_head)
            out = poisoned(cp, cfg.dtype, q.shape)
            lse = cp.full((2, 4, sq), np.nan, dtype=cp.float32)
            forward_sm90(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
            check_attention(cp, cfg.dtype, q, k, v, out, causal=causal, lse=lse, context=f"{cfg} {(sq, sk)}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cfg", [c for c in WIDTHS if not c.cp_async], ids=str)
def test_last_key_block_width_per_sequence(cfg, causal, rng):
    """Packed sequences whose key lengths end at different steps of a key block: each tile
    masks its own sequence's last block (the keys past it belong to the next sequence)."""
    import cupyflash
    from gpu_reference import packed_batch
    from test_gpu_varlen import check_per_sequence

    lens_q = [37, 300, 1, 129, 64]
    lens_k = [cfg.B_c + 17, 33, 2 * cfg.B_c, 3 * cfg.B_c - 1, 16]
    q, k, v, cu_q, cu_k, hq, hk = packed_batch(cp, rng, cfg.dtype, lens_q, lens_k, 4, 2, cfg.d_head)
    out = poisoned(cp, cfg.dtype, q.shape)
    cupyflash.forward_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out=out, causal=causal, cfg=cfg)
    check_per_sequence(cfg.dtype, q, k, v, out, hq, hk, causal)
