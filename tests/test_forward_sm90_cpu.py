"""CPU tests of the Hopper forward family: config rules and short forms, config sets, the
parameter struct and TMA descriptor layout, validation, rendering. No GPU, no NVRTC."""
from __future__ import annotations

import dataclasses
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupyflash.config import SUPPORTED_D_HEADS, DType
from cupyflash import render
from cupyflash.families import FAMILIES, family_of, get_family, parse_config, pick_family
from cupyflash.families.forward_sm90 import FORWARD_SM90, config_sets, params, tma
from cupyflash.families.forward_sm90.config import D_HEADS, HopperForwardKernelConfig as H
from cupyflash.families.forward_sm90.launch import plan_sm90, unsupported_reason
from cupyflash.interop import TensorView, contiguous_strides

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- configs
def test_short_form_names_the_family_and_round_trips():
    cfg = H(DType.BF16, 128, 128, 128, 2, True, True, True, True)
    assert cfg.short_form() == "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent"
    for key in config_sets.KERNEL_SET_KEYS:
        for c in config_sets.get_kernel_configs(key):
            assert H.parse(c.short_form()) == c
            assert c.short_form().startswith("forward_sm90(")


def test_second_q_tile_and_exp_emulation_in_the_short_form():
    cfg = H(DType.FP16, 64, 192, 128, 3, True, True, True, True, True, 1)
    assert cfg.short_form() == "forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+persistent+qbuf2+emu1"
    assert H.parse(cfg.short_form()) == cfg
    assert H.parse("forward_sm90(FP16, 64, 192, 128, 3): tma+ws+pingpong+overlap+emu2").exp_emulation == 2
    # the second Q tile is counted in shared memory, with its two barriers
    single = cfg.replace(double_q=False)
    assert cfg.smem_bytes() - single.smem_bytes() == 192 * 64 * 2 + 16


def test_cp_async_loads_in_the_short_form():
    """`cpasync` replaces `tma` as the first feature; every other form parses as before."""
    cfg = H(DType.BF16, 128, 128, 128, 2, False, False, False, False, cp_async=True)
    assert cfg.short_form() == "forward_sm90(BF16, 128, 128, 128, 2): cpasync" and cfg.loads == "cpasync"
    assert H.parse(cfg.short_form()) == cfg and H.parse(" forward_sm90(BF16,128,128,128,2):cpasync ") == cfg
    emu = H.parse("forward_sm90(FP16, 64, 64, 176, 3): cpasync+emu1")
    assert emu.cp_async and emu.exp_emulation == 1 and emu.B_r == 64 and emu.n_threads == 128
    tma_twin = cfg.replace(cp_async=False)
    assert tma_twin.short_form().endswith(": tma") and not H.parse(tma_twin.short_form()).cp_async
    # the same tiles and barrier words: shared memory does not change with the loads
    assert cfg.smem_bytes() == tma_twin.smem_bytes() and cfg.n_threads == tma_twin.n_threads == 256
    assert cfg != tma_twin and sorted([cfg, tma_twin]) == [tma_twin, cfg]


def test_q_registers_in_the_short_form_and_rules():
    """`qreg`: Q K^T's A from registers, d_head / 4 more registers per consumer thread (so d_head
    64's three overlapped consumer warpgroups need psmem); TMA loads, no xtile, d_head <= 128."""
    text = "forward_sm90(BF16, 64, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+qreg"
    cfg = H.parse(text)
    assert cfg.q_regs and cfg.short_form() == text
    assert cfg.accumulator_registers() == cfg.replace(q_regs=False).accumulator_registers() + 16
    assert cfg.smem_bytes() == cfg.replace(q_regs=False).smem_bytes()
    assert H.parse("forward_sm90(FP16, 64, 192, 128, 2): tma+ws+pingpong+overlap+lazy+psmem+qreg").q_regs
    for bad, rule in [("forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+lazy+qreg", "accumulator registers"),
                      ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+xtile+qreg",
                       "q_regs needs"),
                      ("forward_sm90(BF16, 128, 128, 128, 2): cpasync+qreg", "q_regs needs"),
                      ("forward_sm90(BF16, 256, 128, 64, 2): tma+ws+pingpong+overlap+qreg", "q_regs needs")]:
        with pytest.raises(ValueError, match=rule):
            H.parse(bad)


def test_half_last_in_the_short_form_and_rules():
    """`halflast`: the overlapped mainloop's last block cut to its first half; no registers or shared
    memory of its own; B_c a multiple of 32 (whole P V k-steps per half), no xtile."""
    text = "forward_sm90(BF16, 64, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy+ring+qreg+halflast"
    cfg = H.parse(text)
    assert cfg.half_last and cfg.short_form() == text
    assert cfg.accumulator_registers() == cfg.replace(half_last=False).accumulator_registers()
    assert cfg.smem_bytes() == cfg.replace(half_last=False).smem_bytes()
    assert H.parse("forward_sm90(FP16, 64, 128, 192, 2): tma+ws+pingpong+overlap+halflast").half_last
    for bad in ("forward_sm90(BF16, 128, 128, 176, 2): tma+ws+pingpong+overlap+halflast",
                "forward_sm90(BF16, 256, 128, 80, 2): tma+ws+pingpong+overlap+halflast",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+halflast",
                "forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+ring+xtile+halflast"):
        with pytest.raises(ValueError, match="half_last needs"):
            H.parse(bad)
    with pytest.raises(ValueError, match="half_last at d_head 128"):
        H.parse("forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+persistent+psmem+halflast")
    assert H.parse("forward_sm90(BF16, 128, 192, 128, 2): tma+ws+pingpong+overlap+lazy+wgblocks+psmem+halflast").half_last


def test_shipped_table_parses_unchanged():
    import json

    table = json.loads((ROOT / "cupyflash" / "tuning" / "default_h100.forward_sm90.json").read_text())
    entries = [e for e in table["entries"] if e.get("config")]
    assert entries
    for e in entries:
        cfg = H.parse(e["config"])
        assert cfg.short_form() == e["config"] and not cfg.cp_async


@pytest.mark.parametrize("text, message", [
    ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+overlap+emu1+emu2", "given twice"),
    ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+overlap+emu0", "written as no feature"),
    ("(BF16, 128, 128, 128, 2): tma", "expected 'forward_sm90"),
    ("forward_sm90(BF16, 128, 128, 128, 2): ws", "start with 'tma' or 'cpasync'"),
    ("forward_sm90(BF16, 128, 128, 128, 2): tma+cpasync", "unknown feature 'cpasync'"),
    ("forward_sm90(BF16, 128, 128, 128, 2): cpasync+tma", "unknown feature 'tma'"),
    ("forward_sm90(BF16, 128, 128, 128, 2): cpasync+ws", "cp_async loads need the plain mainloop"),
    ("forward_sm90(BF16, 128, 128, 128, 2): cpasync+overlap", "cp_async loads need the plain mainloop"),
    ("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+ws", "given twice"),
    ("forward_sm90(BF16, 128, 128, 128, 2): tma+fast", "unknown feature"),
    ("forward_sm90(FP32, 128, 128, 128, 2): tma", "unknown dtype"),
])
def test_parse_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        H.parse(text)


@pytest.mark.parametrize("fields, rule", [
    ((DType.BF16, 80, 128, 128, 2, True, True, True, False), "d_head in"),
    ((DType.BF16, 128, 256, 128, 2, True, False, True, False), "B_r in"),
    ((DType.BF16, 64, 192, 128, 2, False, False, False, False), "B_r == 192"),
    ((DType.BF16, 128, 192, 128, 2, True, True, True, False), "accumulator registers"),
    ((DType.BF16, 128, 128, 32, 2, True, False, True, False), "B_c in"),
    ((DType.BF16, 128, 128, 96, 2, True, False, True, False), "B_c in"),
    ((DType.BF16, 128, 128, 128, 5, True, False, True, False), "n_stages in"),
    ((DType.BF16, 128, 64, 128, 2, True, True, True, False), "pingpong needs two or three consumer warpgroups"),
    ((DType.BF16, 128, 128, 128, 2, False, True, True, False), "pingpong needs two or three consumer warpgroups"),
    ((DType.BF16, 128, 128, 128, 1, True, False, True, False), "intra_wg_overlap needs n_stages >= 2"),
    ((DType.BF16, 128, 128, 128, 2, False, False, False, True), "persistent needs warp_specialized"),
    ((DType.BF16, 256, 128, 128, 2, True, False, False, False), "accumulator registers"),
    ((DType.BF16, 128, 128, 128, 4, True, False, False, False), "shared memory"),
    ((DType.BF16, 128, 128, 128, 2, True, True, True, False, True), "double_q needs persistent"),
    ((DType.BF16, 128, 128, 176, 2, True, True, True, True, True), "shared memory"),
    ((DType.BF16, 128, 128, 128, 2, True, True, True, False, False, 3), "exp_emulation in"),
    ((DType.BF16, 128, 128, 128, 2, True, False, False, False, False, 0, True), "cp_async loads need the plain"),
    ((DType.BF16, 128, 128, 128, 2, False, False, True, False, False, 0, True), "cp_async loads need the plain"),
    ((DType.BF16, 128, 128, 128, 2, True, True, True, True, True, 0, True), "cp_async loads need the plain"),
])
def test_rules_name_the_violation(fields, rule):
    with pytest.raises(ValueError, match=rule):
        H(*fields)


def test_field_kinds_are_checked():
    with pytest.raises(ValueError, match="warp_specialized: expected bool"):
        H(DType.BF16, 128, 128, 128, 2, 1, False, False, False)
    with pytest.raises(ValueError, match="d_head: expected int"):
        H(DType.BF16, 128.0, 128, 128, 2, True, False, False, False)
    assert H("bf16", 128, 128, 128, 2, True, False, False, False).dtype is DType.BF16


def test_configs_are_ordered_hashable_keys():
    configs = config_sets.get_kernel_configs("tune")
    assert configs == sorted(configs) and len(set(configs)) == len(configs)
    assert {c: 1 for c in configs}[configs[0]] == 1


def test_smem_and_threads():
    cfg = H(DType.FP16, 128, 128, 128, 2, True, True, True, False)
    assert cfg.n_threads == 384 and cfg.consumer_warpgroups == 2
    assert cfg.smem_bytes() == (128 + 2 * 2 * 128) * 128 * 2 + 8 * 11 + 1024  # 11 mbarriers (tail_cleared)
    assert H(DType.FP16, 128, 128, 128, 2, False, False, False, False).n_threads == 256
    assert H(DType.FP16, 128, 64, 128, 2, True, False, True, False).n_threads == 256


# ----------------------------------------------------------------------------- sets
def test_progression_adds_one_feature_per_step():
    steps = config_sets.progression_configs()
    assert [s.short_form().split(": ")[1] for s in steps] == [
        "cpasync", "tma", "tma+ws", "tma+ws+pingpong", "tma+ws+pingpong+overlap", "tma+ws+pingpong+overlap+persistent"]
    assert all(s.B_c == steps[0].B_c for s in steps)


def test_cp_async_step_is_in_the_progression_only():
    """The first step of every progression loads with cp.async; no tune candidate and no default does."""
    for dt in DType:
        for d in D_HEADS:
            steps = config_sets.progression_configs(dt, d)
            assert steps[0].cp_async and steps[0].replace(cp_async=False) == steps[1]
            assert not any(s.cp_async for s in steps[1:])
            for causal in (False, True):
                assert not config_sets.default_config(dt, d, causal).cp_async
                assert not config_sets.varlen_default_config(dt, d, causal).cp_async
    assert not any(c.cp_async for c in config_sets.get_kernel_configs("tune"))
    assert not config_sets.should_autotune(config_sets.progression_configs()[0])
    assert sum(c.cp_async for c in config_sets.get_kernel_configs("prog_all")) == 2 * len(D_HEADS)


def test_tune_set_follows_the_rule_and_covers_every_head_dim():
    tune = config_sets.get_kernel_configs("tune")
    assert all(config_sets.should_autotune(c) for c in tune)
    assert {(c.dtype, c.d_head) for c in tune} == {(dt, d) for dt in DType for d in D_HEADS}
    for dt in DType:
        for d in D_HEADS:
            for causal in (False, True):  # wgblocks is one of autotune's knob twins of a causal row
                assert config_sets.default_config(dt, d, causal).replace(wg_blocks=False) in tune
    with pytest.raises(ValueError, match="^key: expected one of"):
        config_sets.get_kernel_configs("fastest")


def test_exp2_emulation_constants_meet_the_stated_error():
    """The header's poly_exp2, re-run in float32 with its own constants: relative error <= 1.1e-4
    over the clamped range, exact zeros at -127 and below (masked scores), 1 at 0."""
    text = (ROOT / "kernels_cu" / "common" / "online_softmax.cuh").read_text()
    body = text[text.index("CF_DEVICE float poly_exp2"):]
    body = body[:body.index("\n}")]
    c3, c2, c1 = (np.float32(x) for x in re.findall(r"fmaf\(fmaf\(fmaf\(([0-9.e-]+)f, f, ([0-9.e-]+)f\), f, "
                                                    r"([0-9.e-]+)f\), f, 1\.f\)", body)[0])
    shift = np.float32(float(re.search(r"__fadd_rn\(x, ([0-9.]+)f\)", body).group(1)))

    def poly_exp2(x):
        x = np.maximum(np.float32(x), np.float32(-127))
        shifted = (x + shift).astype(np.float32)
        j = (shifted - shift).astype(np.float32)
        f = (x - j).astype(np.float32)
        p = ((c3 * f + c2) * f + c1) * f + np.float32(1)
        bits = p.astype(np.float32).view(np.int32) + (shifted.view(np.int32) << 23)
        return bits.astype(np.int32).view(np.float32)

    x = np.linspace(-120, 0, 200001, dtype=np.float32)
    rel = np.abs(poly_exp2(x).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= 1.1e-4
    assert poly_exp2(np.array([0.0], np.float32))[0] == 1.0
    assert (poly_exp2(np.array([-127.0, -300.0, -np.inf], np.float32)) == 0.0).all()
    assert (poly_exp2(np.linspace(-127, -120, 1001, dtype=np.float32)) >= 0).all()


# ----------------------------------------------------------------------------- params
def test_param_struct_places_descriptors_at_64_byte_offsets():
    assert params.PARAMS_SIZE % 64 == 0 and params.HOPPER_FORWARD_PARAMS.size == params.PARAMS_SIZE
    descs = [bytes([i]) * 128 for i in (1, 2, 3)]
    packed = params.pack_params(*descs, 0x1111, 0x2222, 0x3333, 0x4444, 10, 20, 30, 7, 9, 4, 2, 0.5, 0.72, 2, 3, 5, 6, 8)
    assert len(packed) == params.PARAMS_SIZE
    for (name, offset), desc in zip(sorted(params.DESCRIPTOR_OFFSETS.items(), key=lambda kv: kv[1]), descs):
        assert offset % 64 == 0 and packed[offset:offset + 128] == desc, name
    o, lse, cu_q, cu_k, sb, ss, sh = struct.unpack_from("<QQQQqqq", packed, 384)
    assert (o, lse, cu_q, cu_k, sb, ss, sh) == (0x1111, 0x2222, 0x3333, 0x4444, 10, 20, 30)
    seq_q, seq_k, heads, kv_heads = struct.unpack_from("<iiii", packed, 384 + 56)
    assert (seq_q, seq_k, heads, kv_heads) == (7, 9, 4, 2)
    assert struct.unpack_from("<ffiiiii", packed, 384 + 72) == (0.5, pytest.approx(0.72), 2, 3, 5, 6, 8)
    assert packed[params.PARAMS_SIZE - 8:] == b"\0" * 8  # tail padding to sizeof


def test_rendered_source_checks_the_struct_and_names_the_kernel():
    src = render.render_family_source("forward_sm90")
    assert "sizeof(HopperForwardParams) % 64 == 0" in src
    assert src.index("struct alignas(64) TmaDescriptor") < src.index("struct HopperForwardParams")
    for name, _, _ in params.PARAM_FIELDS:
        assert f" {name};" in src
    for f in dataclasses.fields(H):
        assert f" {f.name};" in src
    for header in FORWARD_SM90.headers:
        assert f"// ---- kernels_cu/{header}" in src
    cfg = H(DType.FP16, 64, 128, 128, 2, True, True, True, True)
    assert render.name_expression(cfg, True) == (
        "flash_forward_sm90_kernel<StaticHopperForwardConfig<HopperForwardKernelConfig"
        "{DType::FP16, 64, 128, 128, 2, true, true, true, true, false, 0, false, false, false, false, false, false, false, false, 0, false, false}>, "
        "true, false>")


def test_registered_as_a_family_of_the_seam():
    assert FAMILIES["forward_sm90"] is FORWARD_SM90 is get_family("forward_sm90")
    cfg = config_sets.default_config(DType.BF16, 128)
    assert family_of(cfg) is FORWARD_SM90 and parse_config(cfg.short_form()) == cfg
    assert FORWARD_SM90.kind == "forward" and FORWARD_SM90.variant(causal=True) == (True, False)
    FORWARD_SM90.check_arch("sm_90a")
    for arch in ("sm_90", "sm_80"):
        with pytest.raises(ValueError, match="compiles for sm_90a"):
            FORWARD_SM90.check_arch(arch)
    assert FORWARD_SM90.supports(90) and not FORWARD_SM90.supports(80) and not FORWARD_SM90.supports(100)
    assert FORWARD_SM90.default_archs() == ("sm_90a",)
    # forward(cfg=None) prefers this family on Hopper, the mma.sync family everywhere else
    assert pick_family("forward", 90) is FORWARD_SM90 and pick_family("forward", 80).name == "forward_sm80"
    assert FORWARD_SM90.smem_bytes(cfg) == cfg.smem_bytes() and FORWARD_SM90.block_threads(cfg) == 384


def test_generated_wgmma_header_is_up_to_date():
    rc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_wgmma_wrappers.py"), "--check"],
                        capture_output=True, text=True)
    assert rc.returncode == 0, rc.stdout + rc.stderr


# ----------------------------------------------------------------------------- TMA
def test_tensor_map_spec_is_innermost_first_in_bytes():
    shape = (2, 1000, 8, 128)
    strides = (1000 * 8 * 128, 8 * 128, 128, 1)
    spec = tma.tensor_map_spec(0x10000, DType.BF16, shape, strides, 128)
    assert spec.dims == (128, 1000, 8, 2)
    assert spec.byte_strides == (8 * 128 * 2, 128 * 2, 1000 * 8 * 128 * 2)
    assert spec.box == (64, 128, 1, 1) and spec.data_type == 9 and spec.swizzle == 3  # 128B
    assert tma.tensor_map_spec(0, DType.FP16, shape, strides, 64).data_type == 6


def test_tensor_map_spec_d96_uses_64_byte_swizzled_boxes():
    """d_head 96: boxes of 32 columns (64 bytes) with the 64B swizzle, three per row, as the
    kernel's COL_BLOCK / ROW_BYTES for that head dimension (SwizzledTiles, common/ptx_sm90.cuh)."""
    shape = (1, 300, 4, 96)
    spec = tma.tensor_map_spec(0, DType.BF16, shape, contiguous_strides(shape), 192)
    assert spec.dims == (96, 300, 4, 1) and spec.box == (32, 192, 1, 1) and spec.swizzle == 2
    assert [tma.col_block(d) for d in D_HEADS] == [64, 32, 64, 64]
    text = (ROOT / "kernels_cu" / "common" / "ptx_sm90.cuh").read_text()
    assert "ROW_BYTES = D % 64 == 0 ? 128 : 64" in text and "COL_BLOCK = ROW_BYTES / 2" in text


def test_tensor_map_spec_head_major_and_unit_extents():
    # (batch, heads, seq, d) storage viewed as (batch, seq, heads, d)
    spec = tma.tensor_map_spec(0, DType.FP16, (1, 320, 4, 64), (4 * 320 * 64, 64, 320 * 64, 1), 128)
    assert spec.byte_strides == (64 * 2, 320 * 64 * 2, 320 * 4 * 64 * 2)  # batch of extent 1: placeholder
    spec = tma.tensor_map_spec(0, DType.FP16, (1, 5, 1, 64), (0, 64, 3, 1), 64)
    assert spec.byte_strides == (64 * 2, 64 * 2, 5 * 64 * 2)


def test_tma_layout_problem():
    assert tma.tma_layout_problem("k", (2, 10, 4, 64), (2560, 256, 64, 1)) is None
    assert "batch stride is 0" in tma.tma_layout_problem("k", (2, 10, 4, 64), (0, 256, 64, 1))
    assert "2**40" in tma.tma_layout_problem("q", (2, 10, 4, 64), (2**40, 256, 64, 1))


# ----------------------------------------------------------------------------- validation
def _view(shape, dtype=DType.BF16, strides=None, ptr=1 << 20):
    return TensorView(ptr, shape, strides or contiguous_strides(shape), dtype, dtype.numpy_dtype, 0, "cupy")


def test_plan_uses_the_library_validation_and_family_rules():
    q, k = _view((2, 300, 8, 128)), _view((2, 500, 2, 128))
    plan = plan_sm90(None, q, k, k, causal=True)
    assert plan.cfg == config_sets.default_config(DType.BF16, 128, causal=True)
    assert plan_sm90(None, q, k, k).cfg == config_sets.default_config(DType.BF16, 128, causal=False)
    assert plan.n_tiles == 3 * 8 * 2 and plan.base.kv_group_size == 4 and plan.base.causal
    persistent = plan._replace(cfg=config_sets.progression_configs()[5])
    # causal persistent CTAs take pairs of query blocks (3 blocks: pairs {2, 0} and {1}): 2 per (head, batch)
    assert persistent._replace(sm_count=132).grid == (32, 1, 1) and persistent._replace(sm_count=20).grid == (20, 1, 1)
    full = plan_sm90(config_sets.progression_configs()[5], q, k, k)
    assert full._replace(sm_count=132).grid == (48, 1, 1)
    plain = plan_sm90(config_sets.progression_configs()[4], q, k, k)
    assert plain.grid == (3, 8, 2)
    with pytest.raises(ValueError, match="^v: seq_len"):
        plan_sm90(None, q, k, _view((2, 400, 2, 128)))
    # every head dimension the library takes is this family's (d_head 96 through 64-byte swizzling)
    assert D_HEADS == SUPPORTED_D_HEADS
    d96 = _view((1, 8, 2, 96))
    assert plan_sm90(None, d96, d96, d96).cfg == config_sets.default_config(DType.BF16, 96)
    with pytest.raises(ValueError, match="^q: d_head 80 is not supported"):
        plan_sm90(None, _view((1, 8, 2, 80)), _view((1, 8, 2, 80)), _view((1, 8, 2, 80)))
    with pytest.raises(ValueError, match="^cfg: config dtype FP16"):
        plan_sm90(config_sets.default_config(DType.FP16, 128), q, k, k)
    with pytest.raises(ValueError, match="^cfg: config d_head 64"):
        plan_sm90(config_sets.default_config(DType.BF16, 64), q, k, k)
    with pytest.raises(TypeError, match="^cfg: expected a HopperForwardKernelConfig"):
        plan_sm90("forward_sm90(BF16, 128, 128, 128, 2): tma", q, k, k)
    broadcast = _view((2, 500, 2, 128), strides=(0, 256, 128, 1))
    assert "batch stride is 0" in unsupported_reason(q, broadcast, k)


def test_cp_async_configs_pack_records_not_tensor_maps(monkeypatch):
    """A cp_async config's descriptor slots hold (pointer, batch, seq, head strides) and encode no
    tensor map; TMA configs keep tma.descriptor. The pointer is each slot's first word, so the
    op launcher's five-word rewrite finds it."""
    from cupyflash.families.forward_sm90.launch import make_repack

    monkeypatch.setattr(tma, "encode", lambda spec: pytest.fail("a cp_async config encoded a tensor map"))
    tma.clear_cache()
    q = _view((2, 300, 8, 128), strides=(300 * 8 * 128, 8 * 128, 128, 1), ptr=1 << 20)
    k = _view((2, 500, 2, 128), strides=(2 * 500 * 128, 128, 500 * 128, 1), ptr=1 << 24)  # head-major
    cfg = config_sets.progression_configs()[0]
    assert params.operand_encoder(cfg) is params.global_tensor_record
    raw = make_repack(plan_sm90(cfg, q, k, k), q, k, k)(1 << 20, 1 << 24, 1 << 25, 0x4000, 0)
    assert len(raw) == params.PARAMS_SIZE
    for name, ptr, strides in (("tma_q", 1 << 20, q.strides), ("tma_k", 1 << 24, k.strides),
                               ("tma_v", 1 << 25, k.strides)):
        at = params.DESCRIPTOR_OFFSETS[name]
        assert struct.unpack_from("<Qqqq", raw, at) == (ptr, *strides[:3]), name
        assert raw[at + 32:at + 128] == b"\0" * 96
    assert struct.unpack_from("<Q", raw, 384)[0] == 0x4000
    assert params.operand_encoder(config_sets.progression_configs()[1]) is tma.descriptor
    tma.clear_cache()


def test_descriptors_are_cached_by_what_they_encode(monkeypatch):
    calls = []
    monkeypatch.setattr(tma, "encode", lambda spec: calls.append(spec) or bytes([len(calls)]) * 128)
    tma.clear_cache()
    shape, strides = (1, 64, 2, 128), (64 * 2 * 128, 256, 128, 1)
    a = tma.descriptor(1 << 20, DType.BF16, shape, strides, 128)
    assert tma.descriptor(1 << 20, DType.BF16, shape, strides, 128) == a and len(calls) == 1
    assert tma.descriptor(1 << 21, DType.BF16, shape, strides, 128) != a  # another pointer
    assert tma.descriptor(1 << 20, DType.BF16, shape, strides, 176) != a  # another box
    assert len(calls) == 3 and calls[2].box == (64, 176, 1, 1)
    tma.clear_cache()


# ----------------------------------------------------------------------------- tuning
def test_tuning_problem_takes_any_length_and_cfg_none_reads_the_table(tmp_path, monkeypatch):
    """`autotune --family forward_sm90` times HopperForwardTuningProblem (no tile-multiple rule:
    TMA zero-fills); a table it writes is what forward(cfg=None) and plan_sm90(None) use on
    that GPU, the measured defaults elsewhere."""
    from cupyflash.families.forward_sm90.launch import auto_config
    from cupyflash.tuning import tables as tuning
    from cupyflash.families.forward_sm90.tuning import HopperForwardTuningProblem
    from cupyflash.tuning import TuningTable

    problem = object.__new__(HopperForwardTuningProblem)  # no GPU buffers: only the rule is tested
    assert problem.skip_reason(config_sets.default_config(DType.BF16, 128)) is None
    assert type(FORWARD_SM90).tuning_problem is not type(FORWARD_SM90).__mro__[1].tuning_problem

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "default_tables_dir", lambda: shipped)
    monkeypatch.setattr(tuning, "device_name", lambda device: "NVIDIA H100 80GB HBM3" if device == 0 else "other")
    tuning.clear_caches()
    try:
        tuned = H(DType.BF16, 128, 128, 128, 3, True, True, True, False)
        table = TuningTable(device="NVIDIA H100 80GB HBM3", family="forward_sm90")
        table.set(tuned, 4096, tflops=650.0, ms=1.0)
        table.save(shipped / "default_h100.forward_sm90.json")
        tuning.clear_caches()
        assert auto_config(DType.BF16, 128, 4096, 4096, 0, False) == tuned
        assert auto_config(DType.BF16, 128, 4096, 4096, 1, False) == config_sets.default_config(DType.BF16, 128)
        assert auto_config(DType.FP16, 128, 4096, 4096, 0, False) == config_sets.default_config(DType.FP16, 128)
        # a table without causal rows answers causal problems with its non-causal row (as for forward_sm80)
        assert auto_config(DType.BF16, 128, 4096, 4096, 0, True) == tuned
    finally:
        tuning.clear_caches()


@pytest.mark.parametrize("causal", [False, True])
def test_knob_twins_add_only_launch_knobs_the_rules_allow(causal):
    """autotune's knob twins of a winner (FORWARD_SM90.knob_twins): the winner with ring / oreg
    (and at d_head 64 qreg, causal halflast) and xtile or (causal rows and 192-row tiles only)
    wgblocks added, never both of those two, on causal rows of one CTA per tile also lpt16 / lpt32,
    never the winner itself; every twin is a valid config that keeps the winner's other fields;
    sorted."""
    knobs = {"turn_ring", "o_direct", "cross_tile", "wg_blocks", "lpt_mib", "q_regs", "half_last"}
    winners = [c for c in config_sets.autotune_configs() if c.dtype is DType.BF16]
    seen = set()
    for cfg in winners:
        twins = FORWARD_SM90.knob_twins(cfg, causal)
        assert twins == sorted(set(twins)) and cfg not in twins
        for t in twins:
            changed = {f.name for f in dataclasses.fields(cfg) if getattr(t, f.name) != getattr(cfg, f.name)}
            assert changed and changed <= knobs and all(getattr(t, k) for k in changed)
            assert not (t.cross_tile and t.wg_blocks) and t.lpt_mib in (0, 16, 32)
            assert not t.q_regs or (t.d_head == 64 and not t.cross_tile)
            assert not t.half_last or (causal and t.d_head == 64 and not t.cross_tile)
            assert not t.wg_blocks or causal or t.B_r == 192
            seen |= changed
    assert seen == (knobs if causal else knobs - {"lpt_mib", "half_last"})
    x = H.parse("forward_sm90(BF16, 128, 128, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+lazy")
    assert len(FORWARD_SM90.knob_twins(x, True)) == 9 and len(FORWARD_SM90.knob_twins(x, False)) == 5
    plain = x.replace(persistent=False, double_q=False)  # one CTA per tile: oreg, wgblocks, lpt16/32
    assert len(FORWARD_SM90.knob_twins(plain, True)) == 11 and len(FORWARD_SM90.knob_twins(plain, False)) == 1
    # d_head 64's two consumer warpgroups take qreg too; three overlapped ones have no registers for it
    d64 = x.replace(d_head=64, lazy_rescale=True)
    assert any(t.q_regs for t in FORWARD_SM90.knob_twins(d64, False))
    assert not any(t.q_regs for t in FORWARD_SM90.knob_twins(d64.replace(B_r=192), False))
    # unmasked, wgblocks only where a tile can have warpgroups past the end at power-of-two lengths
    assert not any(t.wg_blocks for t in FORWARD_SM90.knob_twins(d64, False))
    assert any(t.wg_blocks for t in FORWARD_SM90.knob_twins(d64.replace(B_r=192), False))
