"""forward_sm90's `oreg`, `lazy`, `ring`, `xtile`, `wgblocks`, `psmem`, `cluster2` and `lptN` knobs and the 192-column key tile without a GPU: short forms
(the new flags after emuN, earlier forms unchanged), the rendered struct, and (compile) the
configs the knobs' GPU tests run, built for sm_90a with zero ptxas warnings and no spills."""
from __future__ import annotations

import concurrent.futures
import os
import re

import pytest

from cupyflash.config import DType
from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig as H
from test_gpu_forward_sm90_knobs import KNOB_CONFIGS


@pytest.mark.parametrize("text", KNOB_CONFIGS + (
    "forward_sm90(FP16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+emu1+oreg+lazy",))
def test_short_forms_round_trip(text):
    cfg = H.parse(text)
    assert cfg.short_form() == text and H.parse(cfg.short_form()) == cfg


def test_new_flags_default_off_and_keep_older_short_forms():
    cfg = H(DType.BF16, 64, 192, 128, 2, True, True, True, True, True, 1)
    assert not cfg.o_direct and not cfg.lazy_rescale and not cfg.turn_ring
    assert cfg.short_form() == "forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+emu1"
    both = cfg.replace(o_direct=True, lazy_rescale=True)
    assert both.short_form().endswith("+emu1+oreg+lazy") and both.smem_bytes() == cfg.smem_bytes()
    assert cfg.replace(lazy_rescale=True, turn_ring=True).short_form().endswith("+emu1+lazy+ring")


def test_turn_ring_needs_persistent_ping_pong():
    ok = H.parse("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+ring")
    assert ok.turn_ring and ok.smem_bytes() == ok.replace(turn_ring=False).smem_bytes()
    for text in ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+ring",
                 "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+overlap+persistent+ring"):
        with pytest.raises(ValueError, match="turn_ring needs persistent and pingpong"):
            H.parse(text)


@pytest.mark.parametrize("text, message", [
    ("forward_sm90(BF16, 64, 192, 128, 2): tma+ws+oreg+oreg", "given twice"),
    ("forward_sm90(BF16, 64, 192, 128, 2): tma+ws+lazier", "unknown feature"),
])
def test_parse_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        H.parse(text)


def test_wide_key_tile_only_where_its_accumulators_fit():
    assert H(DType.BF16, 64, 128, 192, 2, True, True, True, False).B_c == 192  # 96 + 32 + 48 <= 200
    with pytest.raises(ValueError, match="accumulator registers"):  # 96 + 32 + 48 > 128 (three consumers)
        H(DType.BF16, 64, 192, 192, 2, True, True, True, False)
    with pytest.raises(ValueError, match="accumulator registers"):  # 96 + 64 + 48 > 200
        H(DType.BF16, 128, 128, 192, 2, True, True, True, False)


def test_rendered_struct_carries_the_knobs():
    from cupyflash.render import name_expression

    cfg = H.parse("forward_sm90(FP16, 256, 128, 80, 2): tma+ws+pingpong+overlap+persistent+oreg+lazy")
    assert name_expression(cfg, False).endswith("0, false, true, true, false, false, false, false, false, 0, false, false}>, false, false>")
    ring = cfg.replace(o_direct=False, turn_ring=True)
    assert name_expression(ring, True).endswith("0, false, false, true, true, false, false, false, false, 0, false, false}>, true, false>")
    assert name_expression(ring.replace(wg_blocks=True), True).endswith("true, false, true, false, false, 0, false, false}>, true, false>")
    pair = cfg.replace(persistent=False, o_direct=False, cluster=True)
    assert name_expression(pair, False).endswith("false, false, false, true, 0, false, false}>, false, false>")
    assert name_expression(cfg.replace(persistent=False, o_direct=False, lpt_mib=16), True).endswith(
        "false, false, false, false, 16, false, false}>, true, false>")
    assert name_expression(cfg.replace(d_head=64, B_c=128, q_regs=True), False).endswith(
        "0, false, true, true, false, false, false, false, false, 0, true, false}>, false, false>")
    assert name_expression(cfg.replace(B_c=64, persistent=False, o_direct=False, half_last=True), True).endswith(
        "false, false, false, false, 0, false, true}>, true, false>")


def test_wg_blocks_needs_a_producer_and_no_cross_tile():
    ok = H.parse("forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+wgblocks")
    assert ok.wg_blocks and ok.short_form().endswith("+overlap+wgblocks")
    assert ok.smem_bytes() == ok.replace(wg_blocks=False).smem_bytes()
    assert H.parse("forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+ring+wgblocks")
    for text in ("forward_sm90(BF16, 128, 128, 128, 2): tma+overlap+wgblocks",
                 "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+xtile+wgblocks"):
        with pytest.raises(ValueError, match="wg_blocks needs warp_specialized and no cross_tile"):
            H.parse(text)


def test_p_smem_frees_the_probability_registers():
    wide = H.parse("forward_sm90(BF16, 64, 192, 192, 2): tma+ws+pingpong+overlap+lazy+psmem")
    assert wide.p_smem and wide.accumulator_registers() == 96 + 32  # no B_c/4 for P
    plain = H(DType.BF16, 64, 192, 128, 2, True, True, True, False, lazy_rescale=True)
    assert plain.replace(p_smem=True).smem_bytes() == plain.smem_bytes() + 3 * 2 * 8192  # 3 x (64 x 128 keys)
    # B_c 176: three 64-column blocks per warpgroup (the last one 48 keys wide)
    odd = H.parse("forward_sm90(FP16, 64, 128, 176, 2): tma+ws+pingpong+overlap+psmem")
    assert odd.smem_bytes() == odd.replace(p_smem=False).smem_bytes() + 2 * 3 * 8192
    with pytest.raises(ValueError, match="shared memory"):  # 24 + 3 x 48 + 72 KiB
        H.parse("forward_sm90(BF16, 64, 192, 192, 3): tma+ws+pingpong+overlap+psmem")
    assert wide.short_form().endswith("+overlap+lazy+psmem")


def test_cluster_pairs_whole_column_blocks_of_single_tiles():
    pair = H.parse("forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+cluster2")
    assert pair.cluster and pair.short_form().endswith("+psmem+cluster2")
    assert pair.smem_bytes() == pair.replace(cluster=False).smem_bytes()  # the same stages, shared loads
    assert H.parse("forward_sm90(FP16, 256, 128, 80, 2): tma+ws+pingpong+overlap+lazy+cluster2").cluster
    for text in ("forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+cluster2",  # one 64-column block
                 "forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+persistent+cluster2",
                 "forward_sm90(BF16, 128, 128, 128, 2): tma+cluster2"):
        with pytest.raises(ValueError, match="cluster needs"):
            H.parse(text)


def test_cluster_grid_pads_the_query_blocks_to_pairs():
    from types import SimpleNamespace

    from cupyflash.families.forward_sm90.launch import Sm90Plan, cluster_padded

    pair = H.parse("forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+cluster2")
    assert [cluster_padded(pair, n) for n in (1, 2, 3, 32)] == [2, 2, 4, 32]
    assert cluster_padded(pair.replace(cluster=False), 3) == 3
    base = SimpleNamespace(seq_len_q=3 * 128 - 17, n_heads=5, out_shape=(2,), causal=False)
    assert Sm90Plan(pair, base).grid == (4, 5, 2)
    assert Sm90Plan(pair.replace(cluster=False), base).grid == (3, 5, 2)


def test_lpt_orders_single_tile_grids_only():
    cfg = H.parse("forward_sm90(BF16, 64, 192, 128, 3): tma+ws+pingpong+overlap+wgblocks+lpt16")
    assert cfg.lpt_mib == 16 and cfg.short_form().endswith("+wgblocks+lpt16")
    assert cfg.smem_bytes() == cfg.replace(lpt_mib=0).smem_bytes()  # the order of the grid only
    assert H.parse(str(cfg.replace(lpt_mib=0))) == cfg.replace(lpt_mib=0)  # earlier forms read as before
    for text, error in (("forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy+lpt8",
                         "lpt needs one CTA per tile"),
                        ("forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+cluster2+lpt8",
                         "lpt needs one CTA per tile"),
                        ("forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+lpt12", "lpt_mib in"),
                        ("forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+lpt0", "lpt0"),
                        ("forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+lpt8+lpt16", "given twice")):
        with pytest.raises(ValueError, match=error):
            H.parse(text)


_WARNING = re.compile(r"warning|C75\d\d", re.IGNORECASE)


@pytest.mark.compile
def test_knob_configs_compile_clean():
    from cupyflash.compiler import compile_module
    from cupyflash.render import name_expression, render_family_source

    source = render_family_source("forward_sm90")
    items = [(H.parse(t), causal) for t in KNOB_CONFIGS for causal in (False, True)]

    def build(item):
        cfg, causal = item
        expr = name_expression(cfg, causal)
        module = compile_module(source, [expr], "sm_90a")
        return str(cfg), causal, module.resources.get(expr), module.log

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        built = list(pool.map(build, items))
    for name, causal, res, log in built:
        assert not _WARNING.search(log), (name, causal, [l for l in log.splitlines() if _WARNING.search(l)][:2])
        if res is not None:  # NVRTC may serve a module from its own cache without a ptxas report
            assert res.spill_bytes == 0 and res.stack_frame_bytes == 0, (name, causal, res)
    assert any(res is not None for _, _, res, _ in built)


@pytest.mark.compile
def test_smem_bytes_match_cpp():
    """The launch's dynamic shared memory (Python) is the kernel's layout (C++), P tiles included."""
    from cupyflash.compiler import compile_module
    from cupyflash.families.forward_sm90 import FORWARD_SM90
    from cupyflash.render import name_expression, render_family_source

    cfgs = [H.parse(t) for t in KNOB_CONFIGS]
    checks = "\n".join(f"static_assert({FORWARD_SM90.static_wrapper}<{FORWARD_SM90.config_literal(c)}>::SMEM_BYTES"
                       f" == {c.smem_bytes()}, \"{c}\");" for c in cfgs)
    compile_module(render_family_source("forward_sm90") + "\n" + checks + "\n", [name_expression(cfgs[0], False)],
                   "sm_90a")
