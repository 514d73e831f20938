"""The backward family's config, short forms, config sets, parameter ABI and argument validation
(no GPU needed)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from cupyflash import interop
from cupyflash.backward_validation import check_backward_args, resolve_backward_config
from cupyflash.config import SUPPORTED_D_HEADS, DType
from cupyflash.families.backward_sm80 import BackwardKernelConfig, default_config, get_kernel_configs
from cupyflash.families.backward_sm80.config_sets import all_configs, progression_configs, should_autotune
from cupyflash.families import family_of, get_family, parse_config
from cupyflash.families.backward_sm80 import BACKWARD_SM80, roles_for
from cupyflash.families.backward_sm80.params import PARAM_FIELDS, PARAMS_STRUCT, POINTER_FIELDS, param_names
from cupyflash.render import render_family_source
from cupyflash.interop import TensorView, contiguous_strides

CFG = BackwardKernelConfig(DType.BF16, 128, 64, 128, 8, 1, True, False, False)
BASE_PTR = 0x7F00_0000_0000


# ----------------------------------------------------------------------------- config
def test_short_form_round_trips_for_every_config():
    configs = all_configs()
    assert len(configs) > 50
    for cfg in configs:
        text = cfg.short_form()
        assert text.startswith("backward_sm80 (")
        assert BackwardKernelConfig.parse(text) == cfg
        assert str(cfg) == text


def test_short_form_text():
    assert CFG.short_form() == "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled"
    assert BackwardKernelConfig.parse("backward_sm80 (FP16, 64, 64, 64, 4): dsplit_2") == \
        BackwardKernelConfig(DType.FP16, 64, 64, 64, 4, 2, False, False, False)
    assert BackwardKernelConfig.parse("backward_sm80 (FP16, 64, 64, 64, 4): dsplit_1+swizzled+dbuf").double_buffer
    assert BackwardKernelConfig.parse("backward_sm80 (FP16, 64, 64, 64, 4): dsplit_1+swizzled+dbuf+pds").pds_smem


@pytest.mark.parametrize("text", [
    "(BF16, 128, 64, 128, 8): dsplit_1",                       # no family prefix
    "backward_sm80 (BF16, 128, 64, 128, 8): swizzled",         # dsplit missing
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+fast",    # unknown feature
    "backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+dsplit_2",
    "backward_sm80 (XX16, 128, 64, 128, 8): dsplit_1",
])
def test_parse_rejects_bad_short_forms(text):
    with pytest.raises(ValueError):
        BackwardKernelConfig.parse(text)


@pytest.mark.parametrize("changes, rule", [
    ({"d_head": 80}, "d_head"),
    ({"B_r": 32}, "B_r"),
    ({"n_warps": 16}, "n_warps"),
    ({"d_split": 4}, "d_split"),
    ({"B_c": 32, "n_warps": 8}, "key rows per warp"),
    ({"B_r": 128, "B_c": 64, "n_warps": 4}, "accumulators"),   # 128 dK/dV + 128 S^T/dP^T registers
    ({"d_head": 256, "d_split": 1, "B_c": 64, "n_warps": 4}, "accumulators"),
    ({"pds_smem": True}, "needs double_buffer"),
    ({"pds_smem": True, "double_buffer": True, "B_r": 128, "n_warps": 4, "d_head": 64}, "warp grids"),  # 128-row S tiles
    ({"kv_regs": True}, "kv_regs needs pds_smem"),
    ({"pds_smem": True, "double_buffer": True, "kv_regs": True}, "K/V fragments"),  # d_head 128: 192 + 128
    ({"pipelined": True}, "pipelined needs pds_smem"),
    ({"pds_smem": True, "double_buffer": True, "pipelined": True, "d_head": 64, "B_r": 128}, "shared memory"),
    ({"mbarrier": True}, "mbarrier needs pipelined"),
    ({"pds_smem": True, "double_buffer": True, "mbarrier": True}, "mbarrier needs pipelined"),
    ({"dq_first": True}, "dq_first needs pds_smem"),
    ({"load_mid": True, "double_buffer": True}, "load_mid needs pds_smem"),
    ({"pds_smem": True, "double_buffer": True, "dq_spread": True}, "dq_spread needs dq_first"),
    ({"pds_smem": True, "double_buffer": True, "dq_late": True}, "dq_late needs pipelined"),
    ({"pds_smem": True, "double_buffer": True, "pipelined": True, "dq_first": True, "dq_spread": True,
      "dq_late": True}, "not dq_spread"),
    ({"dq_v4": True}, "dq_v4 needs pds_smem"),
    ({"pds_smem": True, "double_buffer": True, "pipelined": True, "dq_late": True, "dq_v4": True}, "dq_v4 needs"),
    ({"pds_smem": True, "double_buffer": True, "d_head": 256, "d_split": 1}, "accumulators"),
])
def test_invalid_combinations_name_the_rule(changes, rule):
    with pytest.raises(ValueError, match=rule):
        dataclasses.replace(CFG, **changes)


def test_field_kinds_are_checked():
    with pytest.raises(ValueError, match="swizzled"):
        BackwardKernelConfig(DType.BF16, 128, 64, 128, 8, 1, 1, False, False)
    with pytest.raises(ValueError, match="d_head"):
        BackwardKernelConfig(DType.BF16, 128.0, 64, 128, 8, 1, True, False, False)
    assert BackwardKernelConfig("bf16", 128, 64, 128, 8, 1, True, False, False) == CFG


def test_configs_are_ordered_and_hashable():
    configs = all_configs()
    assert configs == sorted(configs)
    assert len({c: 1 for c in configs}) == len(configs)


def test_sets():
    tune = get_kernel_configs("tune")
    assert tune and all(should_autotune(c) and c.swizzled for c in tune)
    assert {c.d_head for c in tune} == set(SUPPORTED_D_HEADS)
    prog = get_kernel_configs("prog")
    assert prog == progression_configs() and len(prog) == 5
    assert not prog[0].swizzled and all(c.swizzled for c in prog[1:]) and prog[-2].double_buffer
    assert prog[-1].pds_smem and not prog[-2].pds_smem
    assert len(get_kernel_configs("prog_all")) == 10
    assert get_kernel_configs("all") == all_configs()
    with pytest.raises(ValueError, match="KERNELS"):
        get_kernel_configs("nope")


@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS)
@pytest.mark.parametrize("dtype", list(DType))
def test_default_configs_are_valid_and_in_the_tuning_set(dtype, d_head):
    cfg = default_config(dtype, d_head)
    assert cfg.dtype is dtype and cfg.d_head == d_head
    assert cfg in get_kernel_configs("tune")


def test_smem_and_threads():
    assert CFG.n_threads == 256 and CFG.dq_threads == 128
    # K, V (128 x 128), Q, dO (64 x 128), dS^T (128 x 64) in 16 bits, lse2 + dvec of 64 rows
    assert CFG.smem_bytes() == 2 * 128 * 128 * 2 + 2 * 64 * 128 * 2 + 128 * 64 * 2 + 2 * 64 * 4
    # double-buffered: a second Q, dO and statistics buffer; pds_smem: a P tile next to dS
    assert CFG.replace(double_buffer=True).smem_bytes() == CFG.smem_bytes() + 2 * 64 * 128 * 2 + 2 * 64 * 4
    pds = CFG.replace(double_buffer=True, pds_smem=True)
    assert pds.smem_bytes() == CFG.replace(double_buffer=True).smem_bytes() + 64 * 128 * 2
    assert pds.accumulator_registers() == 2 * 64 + 64  # 32 keys x 64 columns of dK and dV, 32 x 32 S and dP
    # FlashAttention-2's d_head 64 layout: 64 x 32 S/dP tiles, 32 keys x 32 columns of dK/dV
    fa2_d64 = pds.replace(d_head=64, B_r=128)
    assert fa2_d64.pds_s_rows == 64 and fa2_d64.accumulator_registers() == 2 * 32 + 2 * 64
    assert fa2_d64.smem_bytes() == 2 * 128 * 64 * 2 + 2 * (2 * 128 * 64 * 2 + 8 * 128) + 2 * 128 * 128 * 2
    # kv_regs keeps d_head registers of K/V fragments: only where the accumulators leave room
    assert pds.replace(d_head=64, kv_regs=True).short_form().endswith("+pds+kvreg")
    # pipelined: a third Q/dO/statistics buffer and a second P/dS pair
    pipe = pds.replace(pipelined=True)
    assert pipe.smem_bytes() == pds.smem_bytes() + 2 * 64 * 128 * 2 + 8 * 64 + 2 * 64 * 128 * 2
    assert pipe.short_form().endswith("+pds+pipe") and BackwardKernelConfig.parse(pipe.short_form()) == pipe
    assert CFG.dq_smem_bytes() == 2 * 64 * 128 * 2 + 2 * 128 * 128 * 2
    # mbarrier: back to two Q/dO/statistics buffers, plus two 8-byte mbarriers; d_head 64's 128 x 128
    # tiles then fit pipelined (226 KB), which three buffers do not
    mbar = pipe.replace(mbarrier=True)
    assert mbar.smem_bytes() == pds.smem_bytes() + 2 * 64 * 128 * 2 + 16
    d64 = mbar.replace(d_head=64, B_r=128)
    assert d64.smem_bytes() == 2 * 128 * 64 * 2 + 2 * (2 * 128 * 64 * 2 + 8 * 128) + 4 * 128 * 128 * 2 + 16
    assert d64.smem_bytes() <= 227 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        d64.replace(mbarrier=False)
    # dq_first / load_mid change the order of the work only
    order = pds.replace(dq_first=True, load_mid=True)
    assert order.smem_bytes() == pds.smem_bytes()
    assert d64.replace(dq_first=True, load_mid=True).short_form().endswith("+pds+pipe+mbar+dqf+ldmid")
    for text in ("backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dqf+ldmid",
                 "backward_sm80 (FP16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+ldmid",
                 "backward_sm80 (BF16, 64, 128, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+mbar+dqf+ldmid+dqs",
                 "backward_sm80 (FP16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds+pipe+dqf+dql"):
        assert BackwardKernelConfig.parse(text).short_form() == text
    # dq_spread / dq_late move the dQ reductions only: same shared memory, both in the tuning set
    # at the shipped layouts
    late = pipe.replace(dq_late=True)
    assert late.smem_bytes() == pipe.smem_bytes() and late.dq_late and late.short_form().endswith("+pipe+dql")
    tune = set(get_kernel_configs("tune"))
    assert late in tune and d64.replace(dq_first=True, dq_spread=True) in tune
    v4 = d64.replace(dq_first=True, dq_v4=True)  # the reductions' shape only
    assert v4.smem_bytes() == d64.smem_bytes() and v4.short_form().endswith("+pipe+mbar+dqf+dqv") and v4 in tune


# ----------------------------------------------------------------------------- render / ABI
def test_family_is_registered():
    assert get_family("backward_sm80") is BACKWARD_SM80 and family_of(CFG) is BACKWARD_SM80
    assert parse_config(CFG.short_form()) == CFG
    assert BACKWARD_SM80.kind == "backward" and BACKWARD_SM80.variant_flags == ("causal", "deterministic", "varlen")
    assert BACKWARD_SM80.config_set("tune") == get_kernel_configs("tune")
    assert BACKWARD_SM80.default_config(DType.FP16, 64) == default_config(DType.FP16, 64)
    assert BACKWARD_SM80.tune_candidates(DType.BF16, 128)
    assert all(c.d_head == 128 for c in BACKWARD_SM80.tune_candidates(DType.BF16, 128))


def test_geometry_per_role():
    f = BACKWARD_SM80
    assert f.block_threads(CFG, "dkdv") == 256 and f.block_threads(CFG, "dq") == 128
    assert f.block_threads(CFG, "preprocess") == f.block_threads(CFG, "convert") == 256
    assert f.smem_bytes(CFG, "dkdv") == CFG.smem_bytes() and f.smem_bytes(CFG, "dq") == CFG.dq_smem_bytes()
    assert f.smem_bytes(CFG, "convert") == 0
    with pytest.raises(ValueError, match="role"):
        f.block_threads(CFG, "nope")
    # batch 2, 4 q heads over 2 k/v heads, 100 queries (padded to 128), 300 keys
    assert f.grid(CFG, "dkdv", 2, 4, 2, 100, 300) == (3, 2, 2)
    assert f.grid(CFG, "dq", 2, 4, 2, 100, 300) == (2, 4, 2)
    assert f.grid(CFG, "preprocess", 2, 4, 2, 100, 300) == (2, 4, 2)
    assert f.grid(CFG, "convert", 2, 4, 2, 0, 300)[0] == 0


def test_name_expressions_per_variant():
    plain = BACKWARD_SM80.name_expressions(CFG)
    assert sorted(plain) == sorted(roles_for(False)) == ["convert", "dkdv", "preprocess"]
    assert list(plain)[0] == "dkdv" and roles_for(False)[0] == "preprocess"  # main kernel first; launch order
    det = BACKWARD_SM80.name_expressions(CFG, BACKWARD_SM80.variant(causal=True, deterministic=True))
    assert sorted(det) == ["dkdv", "dq", "preprocess"]
    literal = ("BackwardKernelConfig{DType::BF16, 128, 64, 128, 8, 1, true, false, false, false, false, false, false, "
               "false, false, false, false}")
    assert plain["dkdv"] == f"backward_dkdv_kernel<StaticBackwardKernelConfig<{literal}>, false, false, false>"
    assert det["dq"] == f"backward_dq_kernel<StaticBackwardKernelConfig<{literal}>, true, true, false>"
    varlen = BACKWARD_SM80.name_expressions(CFG, BACKWARD_SM80.variant(causal=True, varlen=True))
    assert sorted(varlen) == ["convert", "dkdv", "preprocess"]
    assert varlen["convert"] == f"backward_convert_dq_kernel<StaticBackwardKernelConfig<{literal}>, true, false, true>"


def test_rendered_source_has_the_structs_and_shared_headers():
    src = render_family_source("backward_sm80")
    assert "struct BackwardKernelConfig {" in src and "struct BackwardParams {" in src
    for f in dataclasses.fields(BackwardKernelConfig):
        assert re.search(rf"\b{f.name};", src)
    for name, _, _ in PARAM_FIELDS:
        assert re.search(rf"\b{name};", src), name
    # the shared primitives are included once, not copied into the family's headers
    assert BACKWARD_SM80.headers[0] == "common/ptx.cuh" and src.count("CF_DEVICE void ldmatrix_x4(") == 1


def test_param_struct_has_no_padding():
    assert PARAMS_STRUCT.size == len(POINTER_FIELDS) * 8 + 27 * 8 + 10 * 4
    assert param_names()[:len(POINTER_FIELDS)] == POINTER_FIELDS
    assert PARAMS_STRUCT.size % 8 == 0


# ----------------------------------------------------------------------------- validation
def view(shape, dtype=DType.BF16, strides=None, ptr=BASE_PTR, device=0, raw_dtype=None) -> TensorView:
    if raw_dtype is None:
        raw_dtype = dtype.numpy_dtype if dtype is not None else np.dtype(np.float32)
    return TensorView(ptr, tuple(shape), tuple(strides or contiguous_strides(tuple(shape))), dtype, raw_dtype,
                      device, interop.CUPY, None)


def args(b=2, sq=100, sk=70, h=4, hk=2, d=128, dtype=DType.BF16, **over):
    a = dict(dout=view((b, sq, h, d), dtype), q=view((b, sq, h, d), dtype), k=view((b, sk, hk, d), dtype),
             v=view((b, sk, hk, d), dtype), out=view((b, sq, h, d), dtype),
             lse=view((b, h, sq), None, raw_dtype=np.dtype(np.float32)))
    a.update(over)
    return a


def plan(cfg=None, **kw):
    extra = {k: kw.pop(k) for k in ("dq", "dk", "dv", "softmax_scale", "causal", "deterministic") if k in kw}
    a = args(**kw)
    return check_backward_args(cfg, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"],
                               select=lambda dt, d, sq, sk, dev, causal: default_config(dt, d), **extra)


def test_plan_defaults():
    p = plan()
    assert p.cfg == default_config(DType.BF16, 128)
    assert (p.batch, p.seq_len_q, p.seq_len_k, p.n_heads, p.n_kv_heads) == (2, 100, 70, 4, 2)
    assert p.seq_len_q_pad == 128 and p.stats_shape == (2, 4, 128) and p.dq_accum_shape == (2, 4, 128, 128)
    assert p.softmax_scale == pytest.approx(128 ** -0.5)
    assert p.launch and not p.causal and not p.deterministic
    assert p.strides[5] == contiguous_strides((2, 100, 4, 128))[:3]  # dq allocated contiguous
    packed = p.pack(tuple(range(1, 13)))
    assert len(packed) == PARAMS_STRUCT.size
    fields = dict(zip(param_names(), PARAMS_STRUCT.unpack(packed)))
    assert fields["dq_accum"] == 10 and fields["kv_group_size"] == 2 and fields["seq_len_q_pad"] == 128
    assert fields["lse_head_stride"] == 100 and fields["do_seq_stride"] == 4 * 128


def test_plan_with_outputs_and_flags():
    dq = view((2, 100, 4, 128), strides=(100 * 1024, 1024, 128, 1))
    p = plan(CFG.short_form() and CFG, dq=dq, causal=True, deterministic=True, softmax_scale=0.5)
    assert p.causal and p.deterministic and p.softmax_scale == 0.5 and p.strides[5] == (100 * 1024, 1024, 128)


def _raises(exc, name):
    return pytest.raises(exc, match=f"^{name}:")


def test_errors_name_the_argument():
    with _raises(TypeError, "causal"):
        plan(causal=1)
    with _raises(TypeError, "deterministic"):
        plan(deterministic="yes")
    with _raises(TypeError, "k"):
        plan(k=view((2, 70, 2, 128), DType.FP16))
    with _raises(ValueError, "k"):
        plan(k=view((2, 70, 3, 128)), v=view((2, 70, 3, 128)))
    with _raises(ValueError, "v"):
        plan(v=view((2, 71, 2, 128)))
    with _raises(ValueError, "out"):
        plan(out=view((2, 99, 4, 128)))
    with _raises(TypeError, "dout"):
        plan(dout=view((2, 100, 4, 128), DType.FP16))
    with _raises(ValueError, "lse"):
        plan(lse=view((2, 4, 99), None, raw_dtype=np.dtype(np.float32)))
    with _raises(TypeError, "lse"):
        plan(lse=view((2, 4, 100), None, raw_dtype=np.dtype(np.float16)))
    with _raises(ValueError, "q"):
        plan(d=80)
    with _raises(ValueError, "cfg"):
        plan(CFG.replace(dtype=DType.FP16))
    with _raises(ValueError, "cfg"):
        plan(default_config(DType.BF16, 64))
    with _raises(ValueError, "dq"):
        plan(dq=view((2, 100, 4, 128), strides=(0, 512, 128, 1)).__class__(
            BASE_PTR, (2, 100, 4, 128), (51200, 512, 0, 1), DType.BF16, DType.BF16.numpy_dtype, 0, interop.CUPY))
    with _raises(ValueError, "dk"):
        plan(dk=view((2, 70, 4, 128)))
    with _raises(ValueError, "q"):
        plan(q=view((2, 100, 4, 128), ptr=BASE_PTR + 2))
    with _raises(ValueError, "softmax_scale"):
        plan(softmax_scale=-1.0)
    with _raises(ValueError, "k"):
        plan(sk=0)


def test_selector_sees_the_problem():
    seen = []

    def select(dtype, d_head, sq, sk, device, causal):
        seen.append((dtype, d_head, sq, sk, device, causal))
        return default_config(dtype, d_head)

    a = args()
    check_backward_args(None, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], causal=True, select=select)
    assert seen == [(DType.BF16, 128, 100, 70, 0, True)]


def test_resolve_config():
    assert resolve_backward_config(None) is None and resolve_backward_config("auto") is None
    assert resolve_backward_config(CFG.short_form()) == CFG
    with _raises(ValueError, "cfg"):
        resolve_backward_config("backward_sm80 (BF16): x")
    with _raises(TypeError, "cfg"):
        resolve_backward_config(3)


# ----------------------------------------------------------------------------- shipped H100 table
def test_shipped_h100_table_serves_cfg_none(tmp_path, monkeypatch):
    """cupyflash/tuning/default_h100.backward_sm80.json (`autotune --family backward_sm80
    --write-default` on the H100; d_head 256's rows from an H200 sweep, NOTES.md item 301) answers
    every (dtype, d_head 64/128/256, causal) bucket it was tuned for with a valid tuning-set config
    that fits the H100's shared memory, for the device name an H100 reports (and an H200); other
    GPUs fall back to the family default."""
    from cupyflash.families.backward_sm80.config import MAX_SMEM_BYTES
    from cupyflash.tuning import clear_caches, default_table_path, explain_choice

    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))  # no user table in the way
    clear_caches()
    name = "NVIDIA H100 80GB HBM3"
    path = default_table_path(name, "backward_sm80")
    assert path.is_file(), path
    tune = set(get_kernel_configs("tune"))
    for dtype in DType:
        for d in (64, 128, 256):
            for causal in (False, True):
                for seq in (1024, 3000, 16384, 100_000):
                    cfg, source = explain_choice(dtype, d, seq, seq, name, causal, "backward_sm80")
                    assert source == f"default table {path}", source
                    assert cfg.dtype is dtype and cfg.d_head == d and cfg in tune
                    assert max(cfg.smem_bytes(), cfg.dq_smem_bytes()) <= MAX_SMEM_BYTES
    # the H200 (the same SM; its picks measured there, NOTES.md item 287) takes the same rows
    for causal in (False, True):
        assert explain_choice(DType.BF16, 128, 16384, 16384, "NVIDIA H200", causal, "backward_sm80") == \
            explain_choice(DType.BF16, 128, 16384, 16384, name, causal, "backward_sm80")
    for other in ("NVIDIA A100-SXM4-80GB", "NVIDIA H20", "NVIDIA H800"):  # unmeasured: the family default
        assert explain_choice(DType.BF16, 128, 4096, 4096, other, False, "backward_sm80")[1] == "heuristic"
    clear_caches()
