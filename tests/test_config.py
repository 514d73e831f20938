"""Kernel configuration model and config sets (SPEC §2), no GPU needed."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from cupyflash import get_kernel_configs
from cupyflash.config import SUPPORTED_D_HEADS, DType
from cupyflash.families.forward_sm80.config import FlashForwardKernelConfig
from cupyflash.families.forward_sm80.config_sets import (
    ACCUMULATOR_REGISTER_BUDGET, PROGRESSION_D_HEADS, accumulator_registers,
    KERNEL_SET_KEYS, _candidates, default_config, progression_configs, should_autotune,
)

FIELDS = ("dtype", "d_head", "B_r", "B_c", "n_warps", "async_copy", "eager_load_blocks", "swizzled",
          "Q_mma_load_K_fragments", "K_mma_load_K_fragments", "V_mma_load_K_fragments",
          "mma_double_buffer_loads", "optimized_softmax")

SPEC_EXAMPLE = "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax"


def make(**changes) -> FlashForwardKernelConfig:
    base = dict(dtype=DType.FP16, d_head=128, B_r=64, B_c=64, n_warps=4, async_copy=True,
                eager_load_blocks=True, swizzled=True, Q_mma_load_K_fragments=0, K_mma_load_K_fragments=2,
                V_mma_load_K_fragments=2, mma_double_buffer_loads=True, optimized_softmax=True)
    base.update(changes)
    return FlashForwardKernelConfig(**base)


# Enumerating the candidate space takes about a second; do it once per test module.
ALL_VALID = list(_candidates(tuple(DType), SUPPORTED_D_HEADS))
ALL = get_kernel_configs("all")
TUNE = get_kernel_configs("tune")


@pytest.fixture
def fast_sets(monkeypatch):
    """Serve all_configs()/autotune_configs() from the lists computed above, for tests of
    get_kernel_configs' key dispatch (the sets themselves are checked against ALL_VALID)."""
    from cupyflash.families.forward_sm80 import config_sets

    monkeypatch.setattr(config_sets, "all_configs", lambda *a, **k: list(ALL))
    monkeypatch.setattr(config_sets, "autotune_configs", lambda *a, **k: list(TUNE))


# ----------------------------------------------------------------------------- fields and DType
def test_fields_in_spec_order():
    assert tuple(f.name for f in dataclasses.fields(FlashForwardKernelConfig)) == FIELDS


def test_dtype_basics():
    assert [d.name for d in DType] == ["FP16", "BF16"]
    assert all(d.itemsize == 2 for d in DType)
    assert DType.from_numpy(np.float16) is DType.FP16
    assert DType.from_numpy(ml_dtypes.bfloat16) is DType.BF16
    assert DType.FP16.numpy_dtype == np.float16 and DType.BF16.numpy_dtype == np.dtype(ml_dtypes.bfloat16)
    assert DType.parse(" bf16 ") is DType.BF16
    with pytest.raises(ValueError, match="float32"):
        DType.from_numpy(np.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        DType.parse("FP32")


def test_dtype_given_as_string_is_converted():
    assert make(dtype="BF16").dtype is DType.BF16


# ----------------------------------------------------------------------------- rules
@pytest.mark.parametrize("changes,rule", [
    (dict(d_head=80), "d_head in"),
    (dict(d_head=96, K_mma_load_K_fragments=4, V_mma_load_K_fragments=2, Q_mma_load_K_fragments=0),
     "K_mma_load_K_fragments is 0"),
    (dict(B_r=32), "B_r in"),
    (dict(B_c=16), "B_c in"),
    (dict(n_warps=2), "n_warps in"),
    (dict(n_warps=8), "n_warps == 8 only with B_r == 128"),
    (dict(async_copy=False), "eager_load_blocks needs async_copy"),
    (dict(Q_mma_load_K_fragments=3, K_mma_load_K_fragments=3), "Q_mma_load_K_fragments is 0 or a power of two"),
    (dict(Q_mma_load_K_fragments=16, K_mma_load_K_fragments=16), "Q_mma_load_K_fragments is 0 or a power of two"),
    (dict(K_mma_load_K_fragments=8), "K_mma_load_K_fragments is 0"),  # 8 == d_head/16: use 0
    (dict(K_mma_load_K_fragments=3), "K_mma_load_K_fragments is 0"),
    (dict(V_mma_load_K_fragments=4), "V_mma_load_K_fragments is 0"),  # 4 == B_c/16: use 0
    (dict(Q_mma_load_K_fragments=1, K_mma_load_K_fragments=2), "Q_mma_load_K_fragments equals K_mma_load_K_fragments"),
    (dict(K_mma_load_K_fragments=0, V_mma_load_K_fragments=0), "mma_double_buffer_loads needs"),
])
def test_invalid_combinations_name_their_rule(changes, rule):
    with pytest.raises(ValueError, match="rule violated: " + rule.replace("(", r"\(")):
        make(**changes)


def test_rule_boundaries_that_are_valid():
    make(n_warps=8, B_r=128)
    make(Q_mma_load_K_fragments=8, K_mma_load_K_fragments=0)  # Q in steps of d/16 with whole K tiles
    make(Q_mma_load_K_fragments=2, K_mma_load_K_fragments=2)
    make(async_copy=False, eager_load_blocks=False)
    make(K_mma_load_K_fragments=0, V_mma_load_K_fragments=1)


@pytest.mark.parametrize("changes", [
    dict(async_copy=1), dict(swizzled="yes"), dict(d_head=128.0), dict(B_r=True), dict(dtype=1),
    dict(n_warps="4"),
])
def test_field_types_checked(changes):
    with pytest.raises(ValueError):
        make(**changes)


def test_replace_revalidates():
    cfg = make()
    assert cfg.replace(B_c=128).B_c == 128
    with pytest.raises(ValueError, match="rule violated"):
        cfg.replace(n_warps=8)


# ----------------------------------------------------------------------------- short form
def test_spec_example_short_form():
    cfg = make()
    assert cfg.short_form() == SPEC_EXAMPLE
    assert str(cfg) == SPEC_EXAMPLE
    assert FlashForwardKernelConfig.parse(SPEC_EXAMPLE) == cfg


def test_short_form_lists_only_enabled_features_and_always_loads():
    cfg = make(async_copy=False, eager_load_blocks=False, swizzled=False, mma_double_buffer_loads=False,
               optimized_softmax=False, K_mma_load_K_fragments=0, V_mma_load_K_fragments=0)
    assert cfg.short_form() == "(FP16, 128, 64, 64, 4): load_0_0_0_tiles"


@pytest.mark.parametrize("cfg", ALL, ids=str)
def test_round_trip_all_set(cfg):
    text = cfg.short_form()
    back = FlashForwardKernelConfig.parse(text)
    assert back == cfg and back.short_form() == text and hash(back) == hash(cfg)


def test_round_trip_every_valid_config():
    assert len(ALL_VALID) > 1000
    for cfg in ALL_VALID:
        assert FlashForwardKernelConfig.parse(cfg.short_form()) == cfg
    assert len({c.short_form() for c in ALL_VALID}) == len(ALL_VALID)  # the short form is injective


def test_parse_tolerates_spacing_and_feature_order():
    text = "( FP16 ,128,64 , 64,4 ) :  opt_softmax+buffer+load_0_2_2_tiles+swizzled+eager+async"
    assert FlashForwardKernelConfig.parse(text) == make()


@pytest.mark.parametrize("text,match", [
    ("", "cannot parse"),
    ("FP16, 128, 64, 64, 4: load_0_0_0_tiles", "cannot parse"),
    ("(FP16, 128, 64, 64): load_0_0_0_tiles", "cannot parse"),
    ("(FP16, 128, 64, 64, 4)", "cannot parse"),
    ("(FP16, 128, 64, 64, 4): async+eager", "missing load_Q_K_V_tiles"),
    ("(FP16, 128, 64, 64, 4): load_0_0_0_tiles+load_0_0_0_tiles", "given twice"),
    ("(FP16, 128, 64, 64, 4): async+async+load_0_0_0_tiles", "given twice"),
    ("(FP16, 128, 64, 64, 4): async+turbo+load_0_0_0_tiles", "unknown feature 'turbo'"),
    ("(FP16, 128, 64, 64, 4): load_0_0_tiles", "unknown feature"),
    ("(FP32, 128, 64, 64, 4): load_0_0_0_tiles", "unknown dtype"),
    ("(FP16, 80, 64, 64, 4): load_0_0_0_tiles", "rule violated: d_head"),
    ("(FP16, 128, 64, 64, 4): eager+load_0_0_0_tiles", "rule violated: eager_load_blocks needs async_copy"),
])
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        FlashForwardKernelConfig.parse(text)


def test_parse_rejects_non_strings():
    with pytest.raises(TypeError):
        FlashForwardKernelConfig.parse(b"(FP16, 128, 64, 64, 4): load_0_0_0_tiles")


# ----------------------------------------------------------------------------- order, hashing
def test_total_order_is_field_order():
    a = make(dtype=DType.FP16, d_head=128, B_r=128)
    b = make(dtype=DType.BF16, d_head=64)
    assert a < b  # dtype compares first, FP16 < BF16
    assert make(d_head=64) < make(d_head=128)
    assert make(B_c=64) < make(B_c=128)
    assert make(optimized_softmax=False) < make(optimized_softmax=True)
    assert sorted(ALL_VALID) == sorted(ALL_VALID, key=lambda c: tuple(getattr(c, f) for f in FIELDS))


def test_hashable_frozen_and_usable_as_dict_key():
    cfg = make()
    same = FlashForwardKernelConfig.parse(cfg.short_form())
    assert cfg == same and hash(cfg) == hash(same) and cfg is not same
    table = {cfg: "x"}
    assert table[same] == "x"
    assert len(set(ALL_VALID)) == len(ALL_VALID)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.B_r = 128  # type: ignore[misc]


def test_as_dict():
    d = make().as_dict()
    assert list(d) == list(FIELDS) and d["dtype"] == "FP16" and d["d_head"] == 128


# ----------------------------------------------------------------------------- resources
@pytest.mark.parametrize("d_head,B_r,B_c,expected", [
    (64, 64, 64, (64 + 128) * 64 * 2),
    (128, 64, 64, 49152),
    (128, 128, 128, (128 + 256) * 128 * 2),
    (128, 128, 32, (128 + 64) * 128 * 2),
])
def test_smem_bytes(d_head, B_r, B_c, expected):
    n_warps = 8 if B_r == 128 else 4
    cfg = make(d_head=d_head, B_r=B_r, B_c=B_c, n_warps=n_warps, V_mma_load_K_fragments=1)
    assert cfg.smem_bytes() == expected


def test_threads_and_rows_per_warp():
    assert make().n_threads == 128 and make().rows_per_warp == 16
    cfg = make(B_r=128, n_warps=8)
    assert cfg.n_threads == 256 and cfg.rows_per_warp == 16


def test_num_ctas_per_sm():
    cfg = make()  # 48 KiB, 128 threads
    assert cfg.num_ctas_per_sm(228 * 1024) == 4  # shared-memory bound (H100: 228 KiB per SM)
    assert cfg.num_ctas_per_sm(164 * 1024) == 3  # A100
    assert cfg.num_ctas_per_sm(10 ** 9) == 2048 // 128  # thread bound
    assert cfg.num_ctas_per_sm(10 ** 9, max_threads_per_sm=1536) == 12
    assert cfg.num_ctas_per_sm(1024) == 0


# ----------------------------------------------------------------------------- sets
def test_tune_set():
    assert TUNE == sorted(set(TUNE))
    assert TUNE and all(should_autotune(c) for c in TUNE)
    assert {(c.dtype, c.d_head) for c in TUNE} == {(d, h) for d in DType for h in SUPPORTED_D_HEADS}
    # the autotuning set is exactly the valid configs that pass the documented rule
    assert set(TUNE) == {c for c in ALL_VALID if should_autotune(c)}


def test_should_autotune_rule():
    for cfg in TUNE:
        assert cfg.async_copy and cfg.eager_load_blocks and cfg.swizzled and cfg.optimized_softmax
        assert cfg.B_c in (64, 128)
        assert accumulator_registers(cfg) <= ACCUMULATOR_REGISTER_BUDGET
        assert not (cfg.B_r == 64 and cfg.n_warps == 8)
        assert cfg.Q_mma_load_K_fragments in (0, cfg.K_mma_load_K_fragments)
    assert not should_autotune(make(async_copy=False, eager_load_blocks=False))
    assert not should_autotune(make(B_c=32, V_mma_load_K_fragments=1))
    assert should_autotune(make())
    # 32 rows per warp only with Q loaded from shared memory at d_head 128 (Q in registers spills)
    assert should_autotune(make(d_head=128, B_r=128, B_c=64, n_warps=4, Q_mma_load_K_fragments=2,
                                K_mma_load_K_fragments=2, V_mma_load_K_fragments=2))
    assert not should_autotune(make(d_head=128, B_r=128, B_c=64, n_warps=4, Q_mma_load_K_fragments=0,
                                    K_mma_load_K_fragments=2, V_mma_load_K_fragments=2))


def test_progression_set_is_the_seven_steps():
    prog = get_kernel_configs("prog")
    assert prog == progression_configs(DType.BF16, 128) and len(prog) == 7
    assert all((c.dtype, c.d_head, c.B_r, c.B_c, c.n_warps) == (DType.BF16, 128, 64, 64, 4) for c in prog)
    first = prog[0]
    assert first.async_copy and not (first.swizzled or first.eager_load_blocks or first.mma_double_buffer_loads
                                     or first.optimized_softmax)
    changed = [
        {f for f in FIELDS if getattr(a, f) != getattr(b, f)} for a, b in zip(prog, prog[1:])
    ]
    assert changed == [
        {"swizzled"}, {"eager_load_blocks"},
        {"Q_mma_load_K_fragments", "K_mma_load_K_fragments", "V_mma_load_K_fragments"},
        {"mma_double_buffer_loads"}, {"optimized_softmax"}, {"Q_mma_load_K_fragments"},
    ]
    assert prog[-1].Q_mma_load_K_fragments == 0  # Q kept in registers


def test_prog_all_and_all_sets():
    prog_all = get_kernel_configs("prog_all")
    assert len(prog_all) == len(set(prog_all)) == 7 * len(DType) * len(PROGRESSION_D_HEADS)
    assert {c.d_head for c in ALL} == set(SUPPORTED_D_HEADS)  # every head dim has configs
    assert ALL == sorted(set(ALL))
    assert set(TUNE) | set(prog_all) == set(ALL)


@pytest.mark.parametrize("key", ["64,64", "128,64", " 64 , 128 "])
def test_block_shape_key(key, fast_sets):
    br, bc = (int(x) for x in key.split(","))
    picked = get_kernel_configs(key)
    assert picked and all((c.B_r, c.B_c) == (br, bc) for c in picked)
    assert set(picked) == {c for c in ALL if (c.B_r, c.B_c) == (br, bc)}


def test_kernels_env_var(monkeypatch, fast_sets):
    monkeypatch.setenv("KERNELS", "prog")
    assert get_kernel_configs() == get_kernel_configs("prog")
    monkeypatch.setenv("KERNELS", "128,128")
    assert get_kernel_configs() == [c for c in ALL if (c.B_r, c.B_c) == (128, 128)]
    monkeypatch.setenv("KERNELS", "all")
    assert get_kernel_configs() == ALL
    monkeypatch.delenv("KERNELS")
    assert get_kernel_configs() == TUNE  # default


@pytest.mark.parametrize("key", ["everything", "", "64", "64,64,64", "a,b"])
def test_unknown_key(key):
    with pytest.raises(ValueError, match="unknown KERNELS key"):
        get_kernel_configs(key)


def test_block_shape_key_without_configs(fast_sets):
    with pytest.raises(ValueError, match="no configs with B_r=32, B_c=32"):
        get_kernel_configs("32,32")


def test_documented_keys(fast_sets):
    assert set(KERNEL_SET_KEYS) == {"all", "tune", "prog", "prog_all"}
    for key in KERNEL_SET_KEYS:
        assert get_kernel_configs(key)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS)
def test_default_config_is_shipped(dtype, d_head):
    cfg = default_config(dtype, d_head)
    assert (cfg.dtype, cfg.d_head) == (dtype, d_head)
    assert cfg in ALL  # so the compile tests and prewarm cover it
