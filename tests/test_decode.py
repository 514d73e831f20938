"""CPU tests of the decode family: config rules, short forms, config sets, the split-count rule,
forward_kvcache's argument checks and the opt-in index check (no GPU needed)."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from cupyflash.config import DType
from cupyflash.families.decode.config import DecodeKernelConfig
from cupyflash.families.decode import config_sets
from cupyflash.families.decode.splits import MAX_SPLITS, PAGED_LONG_CTA_BYTES, choose_num_splits, choose_paged_num_splits
from fake_views import ints, view
from cupyflash.kvcache_checks import check_index_values, check_kvcache_args, check_num_splits

BF16 = DType.BF16


def cfg(**changes) -> DecodeKernelConfig:
    base = dict(dtype=BF16, d_head=128, rows=16, B_c=16, n_warps=4, stages=3, evict_first=False)
    base.update(changes)
    return DecodeKernelConfig(**base)


# ----------------------------------------------------------------------------- config
def test_short_form_examples_and_round_trip_of_every_config():
    assert cfg().short_form() == "decode (BF16, 128, 16, 16, 4): stages_3"
    assert cfg(evict_first=True, dtype=DType.FP16).short_form() == "decode (FP16, 128, 16, 16, 4): stages_3+evict_first"
    every = config_sets.all_configs()
    assert len(every) > 100
    for c in every:
        assert DecodeKernelConfig.parse(c.short_form()) == c
    assert DecodeKernelConfig.parse("  decode ( bf16 ,128,16,16,4 ) : stages_3+evict_first ") == cfg(evict_first=True)


@pytest.mark.parametrize("text", [
    "(BF16, 128, 16, 16, 4): stages_3",             # no family prefix: the forward family's form
    "decode (BF16, 128, 16, 16, 4)",                 # no stages
    "decode (BF16, 128, 16, 16, 4): stages_3+fast",  # unknown feature
    "decode (BF16, 128, 16, 16, 4): stages_3+evict_first+evict_first",
    "decode (BF16, 96, 16, 16, 4): stages_3",        # rule: d_head
    "decode (INT8, 128, 16, 16, 4): stages_3",
])
def test_parse_rejects(text):
    with pytest.raises(ValueError):
        DecodeKernelConfig.parse(text)


@pytest.mark.parametrize("changes, rule", [
    ({"d_head": 96}, "d_head"),
    ({"rows": 8}, "rows in"),
    ({"B_c": 128}, "B_c in"),
    ({"n_warps": 3}, "n_warps in"),
    ({"stages": 5}, "stages in"),
    ({"rows": 32, "d_head": 256}, "output registers"),
    ({"rows": 64, "d_head": 64, "B_c": 32}, "score registers"),
    ({"d_head": 256, "B_c": 64, "n_warps": 8, "stages": 4}, "shared memory"),
    ({"stages": 2.0}, "stages: expected int"),
    ({"evict_first": 1}, "evict_first: expected bool"),
])
def test_rules_raise_naming_the_rule(changes, rule):
    with pytest.raises(ValueError, match=rule):
        cfg(**changes)


def test_config_is_ordered_hashable_and_frozen():
    a, b = cfg(stages=2), cfg(stages=3)
    assert a < b and len({a, b, cfg(stages=2)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.stages = 4  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(DecodeKernelConfig)] == [
        "dtype", "d_head", "rows", "B_c", "n_warps", "stages", "evict_first", "heads", "interleave"]


def test_interleave_short_form():
    c = cfg(n_warps=8, stages=2, evict_first=True, interleave=True)
    assert c.short_form() == "decode (BF16, 128, 16, 16, 8): stages_2+evict_first+interleave"
    assert DecodeKernelConfig.parse(c.short_form()) == c and not cfg().interleave
    assert DecodeKernelConfig.parse("decode (BF16, 128, 16, 16, 8): stages_2+interleave+heads_2") == \
        cfg(n_warps=8, stages=2, interleave=True, heads=2)
    assert c.smem_bytes() == cfg(n_warps=8, stages=2, evict_first=True).smem_bytes()  # a schedule, no memory
    with pytest.raises(ValueError, match="interleave: expected bool"):
        cfg(interleave=1)


def test_heads_per_cta_short_form_rules_and_shared_memory():
    c = cfg(n_warps=8, stages=2, heads=8)
    assert c.short_form() == "decode (BF16, 128, 16, 16, 8): stages_2+heads_8" and c.team == 1
    assert DecodeKernelConfig.parse(c.short_form()) == c
    assert DecodeKernelConfig.parse("decode (BF16, 128, 16, 16, 8): stages_2+evict_first+heads_4").heads == 4
    with pytest.raises(ValueError, match="heads in"):
        cfg(heads=3)
    with pytest.raises(ValueError, match="multiple of heads"):
        cfg(n_warps=2, heads=4)
    with pytest.raises(ValueError):
        DecodeKernelConfig.parse("decode (BF16, 128, 16, 16, 8): stages_2+heads_8+evict_first")
    # eight Q tiles of 16 x 128 x 2, then 8 warps x 2 stages x 8 KB
    assert c.smem_bytes() == 8 * 4096 + 8 * 2 * 8192


def test_fit_to_rows_keeps_the_tuned_knobs():
    tuned = cfg(n_warps=8, stages=3, heads=8)
    assert config_sets.fit_to_rows(tuned, 4) == tuned
    tall = config_sets.fit_to_rows(tuned, 64)  # 32 rows at d128 (register budget), a shorter ring
    assert tall.rows == 32 and (tall.n_warps, tall.heads) == (8, 8) and tall.smem_bytes() <= 227 * 1024
    assert config_sets.fit_to_rows(cfg(d_head=64, B_c=32), 64).B_c == 16  # 64 x (64 + 32) / 32 > 160


def test_shared_memory_formula():
    c = cfg()  # Q 16x128x2 = 4 KB; 4 warps x 3 stages x (K+V 16x128x2) = 96 KB
    assert c.smem_bytes() == 4096 + 4 * 3 * 8192
    # one warp, one stage: the merge area (row statistics + 16 fp32 rows of 136) is the larger
    small = cfg(n_warps=1, stages=1)
    assert small.smem_bytes() == 4096 + (2 * 16 + 2 * 16) * 4 + 16 * 136 * 4
    assert cfg(stages=4).ctas_per_sm(228 * 1024) == 1 and cfg(stages=2, n_warps=2).ctas_per_sm(228 * 1024) == 6


def test_config_sets():
    tune = config_sets.get_kernel_configs("tune")
    assert tune == sorted(tune) and len(tune) == len(set(tune))
    assert set(tune) <= set(config_sets.all_configs())
    assert all(config_sets.should_autotune(c) for c in tune)
    for dt in DType:
        for d in (64, 128, 256):
            assert any(c.dtype is dt and c.d_head == d for c in tune)
    prog = config_sets.progression_configs()
    assert len(prog) == len(set(prog)) == 5
    # every step changes exactly one knob
    for before, after in zip(prog, prog[1:]):
        diff = [f.name for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(after, f.name)]
        assert len(diff) == 1, (before, after)
    with pytest.raises(ValueError, match="KERNELS"):
        config_sets.get_kernel_configs("nope")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_default_configs_fit_the_packed_rows(d):
    for rows in (1, 4, 8, 16, 17, 32, 64, 128, 512):
        c = config_sets.default_config(BF16, d, rows)
        assert c.rows * d // 32 <= 128
        assert c.rows >= min(rows, 4096 // d) or c.rows == max(r for r in (16, 32, 64) if r * d <= 4096)
    with pytest.raises(ValueError, match="^q: d_head"):
        config_sets.default_config(BF16, 96)


# ----------------------------------------------------------------------------- splits
def test_num_splits_aims_at_the_target():
    # contiguous (target 66 CTAs on 132 SMs), batch 1, 8 KV heads: 8 splits x 8 heads
    assert choose_num_splits(1, 8, 1, 131072, 66, 64) == 8
    assert choose_num_splits(1, 8, 1, 131072, 132, 128) == 16  # paged: one CTA per SM
    assert choose_num_splits(1, 1, 1, 131072, 66, 64) == 66  # MQA: one KV head
    # a grid that reaches the target already: one split
    assert choose_num_splits(64, 8, 1, 8192, 66, 64) == 1
    assert choose_num_splits(8, 8, 1, 32768, 66, 64) == 1
    assert choose_num_splits(8, 8, 1, 32768, 132, 128) == 2
    # short sequences cannot be split below two steps per warp
    assert choose_num_splits(1, 8, 1, 100, 66, 64) == 1
    assert choose_num_splits(1, 8, 1, 300, 66, 64) == 2
    assert choose_num_splits(1, 1, 1, 10**7, 500, 64) == MAX_SPLITS
    for batch in (1, 2, 3, 8, 16, 32, 64):
        for keys in (0, 1, 1000, 8192, 131072):
            assert 1 <= choose_num_splits(batch, 8, 1, keys, 66, 64) <= MAX_SPLITS


def test_paged_num_splits_follows_the_bytes_per_cta():
    # short CTA shares: the contiguous rule (66 CTAs on 132 SMs)
    assert choose_paged_num_splits(1, 8, 1, 8192, 132, 128, 4 * 256) == 8
    assert choose_paged_num_splits(1, 8, 1, 131072, 132, 128, 4 * 64) == 8  # 16k keys x 256 B = 4 MB a CTA
    # long ones (d256, batch 8 x 32k: 32 MB a CTA at one split): one CTA per SM
    assert choose_paged_num_splits(8, 8, 1, 32768, 132, 128, 4 * 256) == 2
    assert choose_paged_num_splits(1, 8, 1, 131072, 132, 128, 4 * 256) == 16
    # the threshold itself: exactly PAGED_LONG_CTA_BYTES a CTA keeps the contiguous count
    keys = 8 * PAGED_LONG_CTA_BYTES // (4 * 128)
    assert choose_paged_num_splits(1, 8, 1, keys, 132, 128, 4 * 128) == 8
    assert choose_paged_num_splits(1, 8, 1, keys + 8 * 128, 132, 128, 4 * 128) == 16
    assert choose_paged_num_splits(64, 8, 1, 8192, 132, 128, 4 * 128) == 1  # wide: one split either way


def test_streaming_ctas_follows_the_dram_bandwidth_per_sm():
    from cupyflash.families.decode.splits import HALF_GRID_MAX_BYTES_PER_SM, streaming_ctas

    assert streaming_ctas(132, None) == 66  # unknown bandwidth: the H100 rule
    assert streaming_ctas(132, 3.35e12) == 66  # H100 SXM
    assert streaming_ctas(108, 2.04e12) == 54  # A100 80GB
    assert streaming_ctas(132, 4.8e12) == 132  # H200: half the SMs cannot reach its copy rate
    edge = HALF_GRID_MAX_BYTES_PER_SM * 132
    assert streaming_ctas(132, edge) == 66 and streaming_ctas(132, edge * 1.001) == 132
    # the contiguous split counts that follow (batch 1 x 131k and batch 8 x 32k, 8 KV heads)
    assert choose_num_splits(1, 8, 1, 131072, streaming_ctas(132, 4.8e12), 128) == 16
    assert choose_num_splits(8, 8, 1, 32768, streaming_ctas(132, 4.8e12), 64) == 2
    assert choose_num_splits(8, 8, 1, 32768, streaming_ctas(132, 3.35e12), 64) == 1
    # paged: one CTA per SM on such a GPU even where a CTA's share is short
    assert choose_paged_num_splits(1, 8, 1, 131072, 132, 128, 4 * 64, 4.8e12) == 16
    assert choose_paged_num_splits(1, 8, 1, 131072, 132, 128, 4 * 64, 3.35e12) == 8


def test_plan_num_splits_reads_the_bandwidth():
    from cupyflash.kvcache import plan_num_splits

    class Plan:  # the fields plan_num_splits reads
        batch, n_kv_heads, rows_total, max_keys, d_head, paged = 1, 8, 4, 131072, 128, False

    cfg = DecodeKernelConfig.parse("decode (BF16, 128, 16, 16, 8): stages_2")
    assert plan_num_splits(Plan, cfg, 132) == 8
    assert plan_num_splits(Plan, cfg, 132, 3.35e12) == 8
    assert plan_num_splits(Plan, cfg, 132, 4.8e12) == 16
    Plan.paged = True
    assert plan_num_splits(Plan, cfg, 132, 4.8e12) == 16


def test_tuning_batch_streams_the_same_bytes_per_bucket():
    from cupyflash.families.decode.tuning import TUNING_KV_BYTES, tuning_batch

    assert tuning_batch(131072, 128) == 1 and tuning_batch(8192, 128) == 8 and tuning_batch(1024, 64) == 128
    assert tuning_batch(1 << 20, 256) == 1
    for seq in (1024, 8192, 32768):
        assert 2 * tuning_batch(seq, 128) * seq * 8 * 128 * 2 == TUNING_KV_BYTES


def test_paged_defaults_use_many_warps_and_the_evict_first_hint():
    """Narrow paged caches: 8 warps x at most 2 stages (d_head 64, 128); d_head 256, whose 8 x 2
    ring does not fit, 4 x 2 (measured faster than 8 x 1, NOTES.md item 63); all with the hint,
    d_head 64 and 128 with interleaved splits (item 64)."""
    for d in (64, 128, 256):
        c = config_sets.default_config(BF16, d, 4, paged=True)
        assert c.n_warps == (4 if d == 256 else 8) and c.stages <= 2 and c.evict_first, c
        assert c.interleave == (d != 256), c  # first page-table reads beside the length read
        # the same shape is in the tune set
        assert config_sets.should_autotune(c.replace(evict_first=False, interleave=False))
    assert not config_sets.default_config(BF16, 128, 4, paged=True, wide=True).interleave


def test_wide_defaults_fit_two_ctas_per_sm():
    """Problems with a CTA per SM without splits take the 2-CTA shape at d_head 128, so one CTA's
    prologue and merge overlap another's streaming; wide d_head 64 two KV heads per CTA instead,
    contiguous and paged (NOTES.md items 64, 69); narrow ones 8 warps (d_head 128)."""
    for paged in (False, True):
        d64 = config_sets.default_config(BF16, 64, 4, paged=paged, wide=True)
        assert (d64.heads, d64.n_warps, d64.team, d64.stages) == (2, 8, 4, 2), d64
    for d, rows in ((64, 4), (64, 16), (64, 64), (128, 64), (256, 32)):
        for paged in (False, True):
            for wide in (False, True):
                assert config_sets.default_config(BF16, d, rows, paged=paged, wide=wide).rows >= min(rows, 16)
    for paged in (False, True):
        c = config_sets.default_config(BF16, 128, 4, paged=paged, wide=True)
        # the hint on wide paged caches only
        assert c.ctas_per_sm() >= 2 and c.evict_first == paged, c
    narrow = config_sets.default_config(BF16, 128, 4)
    assert (narrow.n_warps, narrow.stages, narrow.evict_first) == (8, 2, False)


def test_check_num_splits():
    assert check_num_splits(None) is None and check_num_splits(np.int64(7)) == 7
    for bad, err in ((0, ValueError), (129, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(err, match="^num_splits"):
            check_num_splits(bad)


# ----------------------------------------------------------------------------- argument checks
def args(paged=False, **over):
    a = dict(q=view((2, 1, 32, 128)), k_cache=view((2, 1024, 8, 128)), v_cache=view((2, 1024, 8, 128)),
             cache_seqlens=ints((2,)), block_table=None, k_new=None, v_new=None, out=None)
    if paged:
        a.update(k_cache=view((40, 16, 8, 128)), v_cache=view((40, 16, 8, 128)), block_table=ints((2, 20)))
    a.update(over)
    return a


def test_valid_plans():
    p = check_kvcache_args(**args())
    assert (p.batch, p.seq_q, p.n_heads, p.n_kv_heads, p.group, p.rows_total) == (2, 1, 32, 8, 4, 4)
    assert not p.paged and p.max_keys == 1024 and p.out_shape == (2, 1, 32, 128) and p.causal
    p = check_kvcache_args(**args(paged=True), causal=False, return_lse=True)
    assert p.paged and p.page_size == 16 and p.page_shift == 4 and p.max_keys == 320 and p.num_pages == 40
    assert p.block_table_stride == 20 and not p.causal and p.want_lse
    p = check_kvcache_args(**args(k_new=view((2, 3, 8, 128)), v_new=view((2, 3, 8, 128))))
    assert p.seq_new == 3


@pytest.mark.parametrize("over, paged, err, prefix", [
    ({"q": view((2, 1, 32, 128), dtype=None, raw=np.dtype(np.float32))}, False, TypeError, "q: dtype"),
    ({"q": view((2, 32, 128))}, False, ValueError, "q: expected 4"),
    ({"k_cache": view((2, 1024, 8, 128), dtype=DType.FP16)}, False, TypeError, "k_cache: dtype"),
    ({"v_cache": view((2, 1000, 8, 128))}, False, ValueError, "v_cache: shape"),
    ({"k_cache": view((2, 1024, 8, 64)), "v_cache": view((2, 1024, 8, 64))}, False, ValueError, "k_cache: d_head"),
    ({"q": view((2, 1, 32, 96)), "k_cache": view((2, 1024, 8, 96)), "v_cache": view((2, 1024, 8, 96))},
     False, ValueError, "q: d_head 96"),
    ({"k_cache": view((2, 1024, 5, 128)), "v_cache": view((2, 1024, 5, 128))}, False, ValueError, "k_cache: has 5"),
    ({"k_cache": view((3, 1024, 8, 128)), "v_cache": view((3, 1024, 8, 128))}, False, ValueError, "k_cache: batch"),
    ({"cache_seqlens": ints((3,))}, False, ValueError, "cache_seqlens: batch size 3"),
    ({"cache_seqlens": view((2,), dtype=None, raw=np.dtype(np.int64))}, False, TypeError, "cache_seqlens: expected dtype int32"),
    ({"cache_seqlens": ints((2,), strides=(2,))}, False, ValueError, "cache_seqlens: the last dimension"),
    ({"cache_seqlens": ints((2,), device=1)}, False, ValueError, "cache_seqlens: is on CUDA device 1"),
    ({"block_table": ints((3, 20))}, True, ValueError, "block_table: batch size 3"),
    ({"block_table": view((2, 20), dtype=None, raw=np.dtype(np.int64))}, True, TypeError, "block_table: expected dtype"),
    ({"block_table": ints((2, 20, 1))}, True, ValueError, "block_table: expected 2"),
    ({"k_cache": view((40, 24, 8, 128)), "v_cache": view((40, 24, 8, 128))}, True, ValueError, "k_cache: page size 24"),
    ({"k_cache": view((40, 8, 8, 128)), "v_cache": view((40, 8, 8, 128))}, True, ValueError, "k_cache: page size 8"),
    ({"k_cache": view((4, 512, 8, 128)), "v_cache": view((4, 512, 8, 128))}, True, ValueError, "k_cache: page size 512"),
    ({"k_new": view((2, 1, 8, 128))}, False, ValueError, "v_new: k_new and v_new"),
    ({"k_new": view((2, 1, 4, 128)), "v_new": view((2, 1, 4, 128))}, False, ValueError, "k_new: expected shape"),
    ({"k_new": view((2, 1, 8, 128)), "v_new": view((2, 2, 8, 128))}, False, ValueError, "v_new: shape"),
    ({"k_new": view((2, 1, 8, 128), dtype=DType.FP16), "v_new": view((2, 1, 8, 128))}, False, TypeError, "k_new: dtype"),
    ({"out": view((2, 1, 32, 64))}, False, ValueError, "out: expected shape"),
    ({"out": view((2, 1, 32, 128), dtype=DType.FP16)}, False, TypeError, "out: expected dtype"),
    ({"q": view((2, 1, 32, 128), ptr=(1 << 30) + 8)}, False, ValueError, "q: data pointer"),
    ({"k_cache": view((2, 1024, 8, 128), strides=(1024 * 8 * 128, 8 * 128, 129, 1))}, False, ValueError,
     "k_cache: the head stride"),
    ({"v_cache": view((2, 1024, 8, 128), strides=(1024 * 8 * 128 * 2, 8 * 128 * 2, 256, 2))}, False, ValueError,
     "v_cache: the last dimension"),
])
def test_bad_arguments_name_the_argument(over, paged, err, prefix):
    with pytest.raises(err) as info:
        check_kvcache_args(**args(paged=paged, **over))
    assert str(info.value).startswith(prefix), str(info.value)


def test_bad_flags_and_scale():
    with pytest.raises(TypeError, match="^causal"):
        check_kvcache_args(**args(), causal=1)
    with pytest.raises(TypeError, match="^return_lse"):
        check_kvcache_args(**args(), return_lse="yes")
    with pytest.raises(ValueError, match="^softmax_scale"):
        check_kvcache_args(**args(), softmax_scale=-1.0)


def test_index_check_on_host_copies():
    plan = check_kvcache_args(**args(paged=True, k_new=view((2, 2, 8, 128)), v_new=view((2, 2, 8, 128))))
    table = np.arange(40, dtype=np.int32).reshape(2, 20)
    check_index_values(plan, np.array([0, 318], np.int32), table)  # 318 + 2 = 320 rows: exactly full
    with pytest.raises(ValueError, match=r"^cache_seqlens: sequence 1 needs 321"):
        check_index_values(plan, np.array([0, 319], np.int32), table)
    with pytest.raises(ValueError, match="^cache_seqlens: sequence 0 has negative"):
        check_index_values(plan, np.array([-1, 3], np.int32), table)
    bad = table.copy()
    bad[1, 2] = 40  # the third page of sequence 1 (rows 32..47) does not exist
    with pytest.raises(ValueError, match=r"^block_table: entry \[1, 2\] = 40"):
        check_index_values(plan, np.array([0, 40], np.int32), bad)
    check_index_values(plan, np.array([0, 30], np.int32), bad)  # that page is not used by 32 rows
    contiguous = check_kvcache_args(**args())
    with pytest.raises(ValueError, match="k_cache capacity"):
        check_index_values(contiguous, np.array([1025, 0], np.int32), None)


def test_workspace_bytes():
    from cupyflash.kvcache import workspace_bytes

    assert workspace_bytes(2, 1, 32, 128, 1) == 0
    assert workspace_bytes(2, 4, 32, 128, 8) == 8 * 2 * 4 * 32 * 129 * 4


# ----------------------------------------------------------------------------- programmatic dependent launch
def test_pdl_structs_match_the_driver_layout():
    import ctypes

    from cupyflash.kvcache_pdl import _LaunchAttribute, _LaunchConfig

    # CUlaunchAttribute: int id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: seven
    # unsigned ints, then hStream, attrs (8-byte aligned) and numAttrs
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert (_LaunchConfig.hStream.offset, _LaunchConfig.attrs.offset, _LaunchConfig.numAttrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(_LaunchConfig) == 56


def test_pdl_launch_falls_back_to_the_ordinary_launch_when_off():
    from cupyflash import kvcache_pdl

    calls = []
    launch = kvcache_pdl.PDLLaunch(1234, (3, 2, 1), 128, 0, lambda *args: calls.append(args))
    saved = dict(kvcache_pdl._state)
    try:
        kvcache_pdl.disable("test")
        assert not kvcache_pdl.available()
        launch(77, 88, 0)
    finally:
        kvcache_pdl._state.clear()
        kvcache_pdl._state.update(saved)
    assert calls == [(77, 88, 0)]
    assert (launch.config.gridDimX, launch.config.gridDimY, launch.config.blockDimX) == (3, 2, 128)
    assert launch.attr.id == 6 and launch.attr.value == 1  # programmatic stream serialization on


def test_decode_tuning_table_round_trip():
    from cupyflash.tuning import TuningTable

    table = TuningTable(match="H100", family="decode")
    tuned = cfg(n_warps=8, stages=2)
    table.set(tuned, 8192, 1.5, 0.2, batch=8)
    table.set(cfg(stages=2, heads=4, n_warps=8), 131072, 1.0, 0.4)
    again = TuningTable.from_dict(table.to_dict())
    assert again.family == "decode" and len(again) == 2
    # a cache of 4k keys takes the smallest bucket, 200k the largest at or below it
    assert again.lookup("NVIDIA H100 80GB HBM3", BF16, 128, 4096) == tuned
    assert again.lookup("NVIDIA H100 80GB HBM3", BF16, 128, 200_000).heads == 4
    assert again.lookup("NVIDIA A100-SXM4-80GB", BF16, 128, 8192) is None


def test_decode_tuning_problem_has_every_protocol_method():
    """autotune calls these on the problem (families.base.TuningProblem); a missing one would
    only show on a GPU."""
    from cupyflash.families.base import TuningProblem
    from cupyflash.families.decode import DECODE
    from cupyflash.families.decode.tuning import DecodeTuningProblem

    for name in ("skip_reason", "check", "timed_call", "close"):
        assert name in TuningProblem.__dict__ and callable(getattr(DecodeTuningProblem, name, None)), name
    assert type(DECODE).tuning_problem is not type(DECODE).__mro__[1].tuning_problem


def test_is_wide_counts_ctas_without_splits():
    from types import SimpleNamespace

    from cupyflash.kvcache import is_wide

    def plan(batch, kv, rows_total):
        return SimpleNamespace(batch=batch, n_kv_heads=kv, rows_total=rows_total, d_head=128)
    assert not is_wide(plan(1, 8, 4), 132) and not is_wide(plan(16, 8, 4), 132)  # 128 CTAs
    assert is_wide(plan(17, 8, 4), 132) and is_wide(plan(32, 8, 4), 132)
    # 64 packed rows of d128 take 2 row tiles of 32: 8 x 8 x 2 = 128 CTAs, 9 x 8 x 2 = 144
    assert not is_wide(plan(8, 8, 64), 132) and is_wide(plan(9, 8, 64), 132)


def test_index_check_env_follows_os_environ(monkeypatch):
    from cupyflash.validation import index_check_env

    monkeypatch.delenv("CUPYFLASH_CHECK_INDICES", raising=False)
    assert not index_check_env()
    monkeypatch.setenv("CUPYFLASH_CHECK_INDICES", "1")
    assert index_check_env()
    monkeypatch.setenv("CUPYFLASH_CHECK_INDICES", "")
    assert not index_check_env()


def test_tuning_table_serves_narrow_contiguous_problems_only(monkeypatch):
    """The decode table is tuned on narrow, streaming problems on contiguous caches
    (families/decode/tuning.py): paged caches, wide batches and latency-bound steps (K/V below
    kvcache.TABLE_MIN_KV_BYTES) keep their own heuristic shapes."""
    import cupyflash.tuning
    from cupyflash import kvcache

    tuned = config_sets.default_config(BF16, 128).replace(n_warps=2, stages=3)
    monkeypatch.setattr(cupyflash.tuning, "tuned_config", lambda *args: tuned)
    kvcache._choice_for.cache_clear()
    try:
        pick = functools.partial(kvcache._choice_for, BF16, 128, 4, causal=False, max_keys=8192, device=0,
                                 smem_limit=227 * 1024)
        assert pick(paged=False, wide=False, streaming=True) == tuned
        assert pick(paged=False, wide=False, streaming=False) == config_sets.default_config(BF16, 128, 4)
        assert pick(paged=True, wide=False, streaming=True) == config_sets.default_config(BF16, 128, 4, paged=True)
        assert pick(paged=False, wide=True, streaming=True) == config_sets.default_config(BF16, 128, 4, wide=True)
    finally:
        kvcache._choice_for.cache_clear()


def test_one_wave_heads_fill_one_wave_of_multi_head_ctas():
    """Wide contiguous d_head 128 steps with one query tile take H KV heads per CTA where
    batch x KV heads / H lands within 0.9-1.0 CTAs per SM (config_sets.ONE_WAVE_SHAPES)."""
    heads = functools.partial(config_sets.one_wave_heads, 128, 4, False, n_kv_heads=8, num_sms=132)
    assert heads(64) == 4 and heads(32) == 2  # 128 CTAs each: the two measured shapes
    assert heads(66) == 4 and heads(60) == 4  # 132 and 120 CTAs
    assert heads(48) is None and heads(16) is None and heads(128) is None  # 96 / 192, 64 / 32, 256 / 512
    assert config_sets.one_wave_heads(128, 4, True, 64, 8, 132) is None  # paged
    assert config_sets.one_wave_heads(128, 32, False, 64, 8, 132) is None  # two query tiles
    assert config_sets.one_wave_heads(64, 4, False, 64, 8, 132) is None  # d64 has its own wide shape
    assert config_sets.one_wave_heads(128, 4, False, 96, 6, 132) is None  # 4 does not divide 6 (2: 288 CTAs)
    four, two = (config_sets.default_config(BF16, 128, 4, wide=True, wave_heads=h) for h in (4, 2))
    assert four.short_form() == "decode (BF16, 128, 16, 32, 4): stages_2+heads_4"
    assert two.short_form() == "decode (BF16, 128, 16, 16, 4): stages_2+heads_2"


def test_resolve_takes_the_one_wave_shape_only_for_streaming_contiguous_steps():
    from types import SimpleNamespace

    from cupyflash import kvcache

    def plan(batch, keys, paged=False):
        return SimpleNamespace(batch=batch, n_kv_heads=8, rows_total=4, d_head=128, dtype=BF16, paged=paged,
                               max_keys=keys, causal=False, seq_q=1, device=0)
    kvcache._choice_for.cache_clear()
    try:
        assert kvcache.resolve_decode_config(None, plan(64, 8192)).heads == 4
        assert kvcache.resolve_decode_config(None, plan(32, 4096)).heads == 2
        wide = config_sets.default_config(BF16, 128, 4, wide=True)
        assert kvcache.resolve_decode_config(None, plan(64, 128)) == wide  # under 64 MB of K/V: latency-bound
        assert kvcache.resolve_decode_config(None, plan(48, 8192)) == wide
        assert kvcache.resolve_decode_config(None, plan(64, 8192, paged=True)).heads == 1
        # a GPU with less shared memory than the 4-head shape needs keeps the wide default
        assert kvcache.resolve_decode_config(None, plan(64, 8192), smem_limit=99 * 1024).heads == 1
    finally:
        kvcache._choice_for.cache_clear()
