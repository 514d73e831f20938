"""CPU tests of the Hopper backward family: config rules and short form, parameter packing,
registration next to backward_sm80, name expressions and the launch plan (no GPU, no driver)."""
from __future__ import annotations

import math

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cupyflash.backward_validation import check_backward_args, resolve_backward_config
from cupyflash.config import DType
from cupyflash.families import FAMILIES, family_of, get_family, parse_config, pick_family
from cupyflash.families.backward_sm80 import BACKWARD_SM80
from cupyflash.families.backward_sm80.config import BackwardKernelConfig
from cupyflash.families.backward_sm90 import BACKWARD_SM90, HopperBackwardKernelConfig
from cupyflash.families.backward_sm90 import config_sets, launch
from cupyflash.families.backward_sm90.params import DESCRIPTOR_OFFSETS, HOPPER_BACKWARD_PARAMS, PARAMS_SIZE, pack_params
from cupyflash.render import render_family_source

from fake_views import view

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ config

def _plain(dtype, d_head):
    """The d_head default with one CTA per tile (the fifth session's, rotate, dQ in swizzled
    panels): the grid and launch tests below check that geometry; the persistent knobs and dq_frag
    have their own tests."""
    return config_sets.default_config(dtype, d_head, causal=False).replace(persistent=False, dynamic=False,
                                                                           rotate=True, dq_frag=False)

def test_short_form_round_trip_every_config():
    configs = config_sets.get_kernel_configs("all")
    assert len(configs) == len(set(configs)) >= 8
    for cfg in configs:
        text = cfg.short_form()
        assert text.startswith("backward_sm90(")
        assert HopperBackwardKernelConfig.parse(text) == cfg
        assert parse_config(text) == cfg and family_of(cfg) is BACKWARD_SM90


def test_default_config_text():
    cfg = config_sets.default_config(DType.BF16, 128, causal=False)
    assert cfg.short_form() == ("backward_sm90(BF16, 128, 64, 128, 2): "
                                "dq_tma+dq_mid+pdl+dq_early+persistent+dynamic+dq_frag")
    assert cfg.n_threads == 384 and cfg.consumer_warpgroups == 2
    # K, V (64 KiB) + 2 stages of Q, dO (32 KiB each) + two dS^T buffers (16 KiB each) + the dQ
    # panels (32 KiB) + 2 stages of lse2, dvec (512 bytes each) + barriers (varlen's tail zeroer's
    # kv_ready, zero_done and q_tail per stage among them) + 1 KiB
    assert cfg.smem_bytes() == 65536 + 2 * 32768 + 2 * 16384 + 32768 + 2 * 512 + 48 + 40 + 32 + 1024
    # three stages fit beside the dQ panels (lse2/dvec are not in the 1 KiB-rounded stages)
    assert cfg.replace(n_stages=3).smem_bytes() == 65536 + 3 * 32768 + 2 * 16384 + 32768 + 3 * 512 + 64 + 40 + 40 + 1024
    d64 = config_sets.default_config(DType.FP16, 64, causal=False)
    assert d64.short_form() == "backward_sm90(FP16, 64, 128, 128, 2): dq_tma+dq_mid+lpt+pdl+persistent+dynamic+dq_frag"
    # 128 query rows: each consumer warpgroup computes dQ for 64 of them (one m64 tile, two panels)
    assert (d64.dq_rows, d64.dq_columns(0), cfg.dq_rows, cfg.dq_columns(1)) == (64, 64, 64, 64)
    # K, V (32 KiB) + 2 stages of Q, dO (32 KiB each) + two dS^T buffers (32 KiB each) + the dQ
    # panels (32 KiB) + 2 stages of lse2, dvec (512 bytes each) + barriers + 1 KiB
    assert d64.smem_bytes() == 32768 + 2 * 32768 + 2 * 32768 + 32768 + 2 * 1024 + 48 + 40 + 32 + 1024
    # one default per (dtype, d_head) for both masks (dynamic and lpt order only causal tiles), causal
    # calls with nomask (each head's walk in a masked and an unmasked loop), and for causal calls of
    # at least LONG_CAUSAL_ROWS query rows at d_head 128 three stages, for non-causal ones of at
    # least LONG_NONCAUSAL_ROWS rotate
    assert config_sets.CAUSAL_KNOBS == {"nomask": True}
    for dt, d in ((DType.BF16, 128), (DType.FP16, 64)):
        assert config_sets.default_config(dt, d, causal=True) == config_sets.default_config(dt, d, causal=False).replace(
            nomask=True)
    assert config_sets.LONG_CAUSAL_ROWS == {96: 0, 128: 4096} and config_sets.LONG_NONCAUSAL_ROWS == {96: 8192, 128: 8192}
    causal = cfg.replace(nomask=True)
    assert config_sets.default_config(DType.BF16, 128, True, 4095) == causal
    assert config_sets.default_config(DType.BF16, 128, True, 4096) == causal.replace(n_stages=3)
    assert config_sets.default_config(DType.BF16, 128, True, 1 << 16) == causal.replace(n_stages=3)
    assert config_sets.default_config(DType.BF16, 128, False, 8191) == cfg
    long_nc = config_sets.default_config(DType.BF16, 128, False, 8192)
    assert long_nc == cfg.replace(rotate=True, dynamic=False) and long_nc.persistent and long_nc.n_stages == 2
    assert config_sets.default_config(DType.FP16, 64, True, 1 << 16) == d64.replace(nomask=True)
    assert config_sets.default_config(DType.FP16, 64, False, 1 << 16) == d64
    defaults = config_sets.get_kernel_configs("defaults")
    assert len(defaults) == 20 and set(defaults) <= set(config_sets.get_kernel_configs("all"))
    # d_head 256: two warpgroups share 64 keys (kv_split), one stage, dQ staged in fragment order
    # for the writer warp, no nomask (items 302-303), score tiles by role (item 315), Q and dO on
    # barriers of their own (item 330)
    d256 = config_sets.default_config(DType.BF16, 256, causal=True, seq_len_q=1 << 16)
    assert d256 == config_sets.default_config(DType.BF16, 256, causal=False)
    assert d256.short_form() == "backward_sm90(BF16, 256, 64, 64, 1): dq_tma+pdl+dq_frag+sdp_roles+qdo_split"
    assert d256.kv_split
    assert (d256.consumer_warpgroups, d256.dq_rows, d256.dq_columns(1), d256.accumulator_registers()) == (2, 64, 128, 192)
    # K, V (32 KiB each) + one stage of Q, dO (64 KiB) + two buffers of P^T (sdp_roles: P^T's fp32
    # exchange) and dS^T (8 KiB each) +
    # both warpgroups' 64 x 128 fp32 dQ (64 KiB) + lse2, dvec (512 bytes) + barriers + 1 KiB: within the
    # 227 KiB; a second stage would not fit beside the staged dQ
    assert d256.smem_bytes() == 2 * 32768 + 65536 + 2 * 2 * 8192 + 65536 + 512 + 32 + 16 + 24 + 1024 <= 227 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        d256.replace(n_stages=2)
    # d_head 96: d_head 128's tile and knobs with dQ's columns split 64 + 32 (item 308), three stages
    # for every causal call
    assert {c for c in defaults if c.n_stages == 3} == {causal.replace(dtype=dt, d_head=d, n_stages=3, dq_colsplit=d == 96)
                                                        for dt in DType for d in (96, 128)}
    assert all(c.dq_colsplit == (c.d_head == 96) for c in defaults)
    assert {c for c in defaults if c.rotate} == {long_nc.replace(dtype=dt, d_head=d, dq_colsplit=d == 96)
                                                 for dt in DType for d in (96, 128)}
    assert config_sets.default_config(DType.BF16, 96, False) == cfg.replace(d_head=96, dq_colsplit=True)
    assert config_sets.default_config(DType.BF16, 96, True) == causal.replace(d_head=96, n_stages=3, dq_colsplit=True)
    prog = config_sets.progression_configs()
    assert prog[-1] == causal and not prog[0].rotate and not prog[0].dq_tma
    prog64 = config_sets.progression_configs(DType.BF16, 64)
    assert prog64[0].B_r == 64 and not prog64[0].dq_tma and prog64[-1] == config_sets.default_config(DType.BF16, 64)


@pytest.mark.parametrize("text", ["backward_sm90(BF16, 128, 64, 128)", "backward_sm90 BF16, 128, 64, 128, 2",
                                  "backward_sm90(BF16, 128, 64, 128, 2): tma", "backward_sm80(BF16, 128, 64, 128, 2)"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="backward_sm90"):
        HopperBackwardKernelConfig.parse(text)


@pytest.mark.parametrize("fields, rule", [
    ((DType.BF16, 80, 64, 128, 2), "d_head in"),
    ((DType.BF16, 96, 128, 128, 2), "accumulator registers"),
    ((DType.BF16, 256, 64, 128, 2), "d_head 256 splits dK/dV's columns"),   # two warpgroups share 64 keys
    ((DType.BF16, 256, 64, 64, 2, False, True), "shared memory"),             # dq_tma: one stage only
    ((DType.BF16, 256, 64, 64, 1, False, True, True), "d_head 256 splits"),   # no dq_mid
    ((DType.BF16, 256, 64, 64, 3), "shared memory"),
    ((DType.BF16, 128, 96, 128, 2), "B_r in"),
    ((DType.BF16, 128, 128, 128, 2), "accumulator registers"),
    ((DType.BF16, 64, 128, 64, 2), "B_r 128 needs two consumer warpgroups"),
    ((DType.BF16, 64, 128, 128, 3, False, True), "shared memory"),
    ((DType.BF16, 64, 128, 128, 2, False, True, True, False, False, True, True), "dq_early needs pdl, dq_tma and B_r 64"),
    ((DType.BF16, 128, 64, 192, 2), "B_c in"),
    ((DType.FP16, 64, 64, 128, 4), "n_stages in"),
    ((DType.BF16, 64, 64, 128, 2, True), "dq_bulk needs"),
    ((DType.BF16, 128, 64, 64, 2, True), "dq_bulk needs"),
    ((DType.BF16, 128, 64, 128, 3, True), "shared memory"),
    ((DType.BF16, 64, 64, 64, 2, False, True), "dq_tma needs"),
    ((DType.BF16, 128, 64, 64, 2, False, True), "dq_tma needs"),
    ((DType.BF16, 128, 64, 128, 2, True, True), "exclude each other"),
    ((DType.BF16, 128, 64, 128, 2, False, False, True), "dq_mid needs dq_tma"),
    ((DType.BF16, 128, 64, 128, 2, False, False, False, False, False, True), "pdl needs dq_tma"),
    ((DType.BF16, 128, 64, 128, 2, False, True, True, False, False, False, True), "dq_early needs pdl"),
    ((DType.BF16, 128, 64, 128, 2, True, False, False, False, False, True, True), "pdl needs dq_tma"),
])
def test_rules(fields, rule):
    with pytest.raises(ValueError, match=rule):
        HopperBackwardKernelConfig(*fields)


def test_rules_registers_and_smem_hold_for_every_config():
    for cfg in config_sets.all_configs():
        assert cfg.accumulator_registers() <= 200 and cfg.smem_bytes() <= 227 * 1024


def test_dq_bulk_short_form_and_smem():
    cfg = HopperBackwardKernelConfig.parse("backward_sm90(BF16, 128, 64, 128, 2): dq_bulk")
    assert cfg.dq_bulk and cfg.short_form() == "backward_sm90(BF16, 128, 64, 128, 2): dq_bulk"
    plain = cfg.replace(dq_bulk=False)
    assert plain.short_form() == "backward_sm90(BF16, 128, 64, 128, 2)"
    assert cfg.smem_bytes() - plain.smem_bytes() == 64 * (128 + 8) * 4  # staged fp32 dQ rows, padded
    bulk = [c for c in config_sets.get_kernel_configs("all") if c.dq_bulk]
    assert {(c.d_head, c.B_c) for c in bulk} == {(128, 128)} and len(bulk) == 4  # 2 dtypes x 1-2 stages


def test_dq_tma_short_form_and_smem():
    cfg = HopperBackwardKernelConfig.parse("backward_sm90(BF16, 128, 64, 128, 2): dq_tma")
    assert cfg.dq_tma and not cfg.dq_bulk and cfg.short_form() == "backward_sm90(BF16, 128, 64, 128, 2): dq_tma"
    assert HopperBackwardKernelConfig.parse(cfg.short_form()) == cfg
    plain = cfg.replace(dq_tma=False)
    assert cfg.smem_bytes() - plain.smem_bytes() == 64 * 128 * 4  # two warpgroups' swizzled fp32 panels
    tma_cfgs = [c for c in config_sets.get_kernel_configs("all") if c.dq_tma and not c.dq_frag]
    assert {(c.d_head, c.B_r, c.B_c, c.n_stages) for c in tma_cfgs} == {
        (d, 64, 128, st) for d in (64, 96, 128) for st in (1, 2, 3)} | {(64, 128, 128, 1), (64, 128, 128, 2), (256, 64, 64, 1)}
    # per d_head with 64-row blocks: 2 dtypes x (3 stage counts x (plain, dq_mid, nomask) + the launch
    # knob sets on dq_mid: all at 2 stages; pdl+dq_early and the full set at 3; the block order knobs
    # at 2 and 3; the swizzled twins of the causal defaults, dq_mid+nomask: d_head 128 at 2 and 3
    # stages, d_head 96 at 3)
    for d, twins in ((64, 0), (96, 1), (128, 2)):
        assert len([c for c in tma_cfgs if c.d_head == d and c.B_r == 64 and not c.dq_colsplit]) == 2 * (
            3 * 3 + len(config_sets.LAUNCH_KNOB_SETS) + 2 + 2 * len(config_sets.ORDER_KNOB_SETS) + twins)
    # d_head 96: 64-byte swizzled tiles; each warpgroup stages all 96 dQ columns (three panels)
    d96 = cfg.replace(d_head=96)
    assert (d96.dq_rows, d96.dq_columns(0), d96.dq_columns(1)) == (64, 96, 96)
    assert d96.smem_bytes() - d96.replace(dq_tma=False).smem_bytes() == 2 * 64 * 96 * 4
    # 128-row blocks (d_head 64, two stages at most): plain, dq_mid, nomask at 1 and 2 stages, the
    # launch knob sets without dq_early (lpt, pdl) and B_R128_KNOB_SETS at 2, the causal default's twin
    assert len([c for c in tma_cfgs if c.B_r == 128]) == 2 * (3 * 2 + 2 + len(config_sets.B_R128_KNOB_SETS) + 1)
    rows = HopperBackwardKernelConfig.parse("backward_sm90(BF16, 64, 128, 128, 2): dq_tma")
    assert rows.smem_bytes() - rows.replace(dq_tma=False).smem_bytes() == 2 * 64 * 64 * 4  # two 64-row panels each
    knobs = HopperBackwardKernelConfig.parse("backward_sm90(FP16, 128, 64, 128, 2): nomask + dq_tma")
    assert knobs == cfg.replace(dtype=DType.FP16, nomask=True)
    assert knobs.short_form() == "backward_sm90(FP16, 128, 64, 128, 2): dq_tma+nomask"
    for bad in ("dq_tma+dq_tma", "dq_fast", "dq_tma+"):
        with pytest.raises(ValueError, match="cannot parse"):
            HopperBackwardKernelConfig.parse(f"backward_sm90(BF16, 128, 64, 128, 2): {bad}")


def test_dq_colsplit_short_form_rules_columns_and_set():
    """d_head 96's dQ split by columns, 64 + 32 (each warpgroup over all keys): only there, its
    staged dQ half of the by-keys layout's, and a twin of every such config in `all`."""
    cfg = config_sets.default_config(DType.BF16, 96, causal=False)
    base = cfg.replace(dq_colsplit=False)
    assert cfg.short_form().endswith("+dq_frag+dq_colsplit")
    assert HopperBackwardKernelConfig.parse(cfg.short_form()) == cfg
    assert (base.dq_split, cfg.dq_split) == (False, True)
    assert [cfg.dq_columns(w) for w in (0, 1)] == [64, 32] and [base.dq_columns(w) for w in (0, 1)] == [96, 96]
    assert base.smem_bytes() - cfg.smem_bytes() == 64 * 96 * 4  # 64 x (96 + 96) fp32 staged against 64 x (64 + 32)
    for bad in (dict(d_head=128), dict(d_head=64), dict(B_c=64, dq_tma=False, dq_mid=False, pdl=False, dq_early=False,
                                                           persistent=False, dynamic=False, dq_frag=False)):
        with pytest.raises(ValueError, match="dq_colsplit needs d_head 96, B_r 64 and two consumer warpgroups"):
            cfg.replace(**bad)
    everything = config_sets.get_kernel_configs("all")
    d96 = [c for c in everything if c.d_head == 96 and c.consumer_warpgroups == 2 and not c.dq_colsplit]
    assert d96 and all(c.replace(dq_colsplit=True) in everything for c in d96)
    assert all(c.d_head == 96 for c in everything if c.dq_colsplit)


def test_sdp_roles_short_form_rules_registers_and_set():
    """d_head 256's score tiles by role (warpgroup 0 S^T, warpgroup 1 dP^T, each over all 64
    queries): only there, the same shared memory (P^T's fp32 exchange takes the two P^T tiles'
    bytes), one score tile of 64 queries per thread, a twin of every d_head 256 config in `all`."""
    base = HopperBackwardKernelConfig(DType.BF16, 256, 64, 64, 1, dq_tma=True, pdl=True, dq_frag=True)
    cfg = base.replace(sdp_roles=True)
    assert cfg.short_form() == "backward_sm90(BF16, 256, 64, 64, 1): dq_tma+pdl+dq_frag+sdp_roles"
    assert HopperBackwardKernelConfig.parse(cfg.short_form()) == cfg
    assert cfg.smem_bytes() == base.smem_bytes() == 2 * 32768 + 65536 + 2 * 2 * 8192 + 65536 + 512 + 32 + 24 + 1024
    assert (base.accumulator_registers(), cfg.accumulator_registers()) == (128 + 64, 128 + 64)
    for d in (64, 96, 128):
        with pytest.raises(ValueError, match="sdp_roles needs d_head 256"):
            config_sets.default_config(DType.BF16, d).replace(sdp_roles=True)
    everything = config_sets.get_kernel_configs("all")
    d256 = [c for c in everything if c.kv_split and not c.sdp_roles]
    assert d256 and all(c.replace(sdp_roles=True) in everything for c in d256)
    assert all(c.d_head == 256 for c in everything if c.sdp_roles)


def test_qdo_split_short_form_rules_barriers_and_set():
    """Q and dO of a stage on barriers of their own (d_head 256's score tiles by role): the short
    form's last knob, only with sdp_roles, two more barriers per stage, a twin of every sdp_roles
    config in `all`."""
    cfg = config_sets.default_config(DType.FP16, 256)
    roles = cfg.replace(qdo_split=False)
    assert cfg.short_form() == "backward_sm90(FP16, 256, 64, 64, 1): dq_tma+pdl+dq_frag+sdp_roles+qdo_split"
    assert HopperBackwardKernelConfig.parse(cfg.short_form()) == cfg
    assert cfg.smem_bytes() == roles.smem_bytes() + 16 * roles.n_stages
    with pytest.raises(ValueError, match="qdo_split needs sdp_roles"):
        roles.replace(sdp_roles=False, qdo_split=True)
    everything = config_sets.get_kernel_configs("all")
    by_role = [c for c in everything if c.sdp_roles and not c.qdo_split]
    assert by_role and all(c.replace(qdo_split=True) in everything for c in by_role)
    assert all(c.sdp_roles for c in everything if c.qdo_split)


def test_park_short_form_smem_and_varlen_defaults():
    """park (the varlen consumers' tile values in a shared-memory slot per warp, and the tail
    zeroer's barrier): the short form's last knob, 40 bytes per consumer warp and 8, backward_varlen's
    d_head 128 defaults (with dq_frag and dq_mid, as the dense defaults), not the dense defaults."""
    dense = config_sets.default_config(DType.BF16, 128, causal=True)
    cfg = config_sets.varlen_default_config(DType.BF16, 128, causal=True)
    assert cfg == dense.replace(park=True) and cfg.dq_frag and not dense.park
    assert cfg.short_form() == ("backward_sm90(BF16, 128, 64, 128, 2): "
                                "dq_tma+dq_mid+nomask+pdl+dq_early+persistent+dynamic+dq_frag+park")
    assert HopperBackwardKernelConfig.parse(cfg.short_form()) == cfg
    assert cfg.smem_bytes() == dense.smem_bytes() + 4 * 2 * 40  # a slot per consumer warp
    long_causal = config_sets.varlen_default_config(DType.FP16, 128, causal=True, seq_len_q=1 << 16)
    assert long_causal.park and long_causal.n_stages == 3 and long_causal.smem_bytes() <= 227 * 1024
    non_causal = config_sets.varlen_default_config(DType.BF16, 128, causal=False, seq_len_q=1 << 16)
    assert non_causal == config_sets.default_config(DType.BF16, 128, causal=False).replace(park=True)
    assert non_causal.dq_mid and non_causal.dq_frag and non_causal.dynamic and not non_causal.rotate
    assert not any(c.park for c in config_sets.default_configs())
    assert {cfg, non_causal} <= set(config_sets.get_kernel_configs("varlen_defaults"))


def test_dq_frag_short_form_rules_and_set():
    cfg = config_sets.default_config(DType.BF16, 128, causal=False)
    assert cfg.dq_frag and cfg.short_form() == "backward_sm90(BF16, 128, 64, 128, 2): dq_tma+dq_mid+pdl+dq_early+persistent+dynamic+dq_frag"
    assert HopperBackwardKernelConfig.parse(cfg.short_form()) == cfg
    assert cfg.smem_bytes() == cfg.replace(dq_frag=False).smem_bytes()  # the panels' bytes, in another order
    with pytest.raises(ValueError, match="dq_frag needs dq_tma and pdl"):
        cfg.replace(pdl=False, dq_early=False, dynamic=False)
    with pytest.raises(ValueError, match="dq_frag needs dq_tma and pdl"):
        HopperBackwardKernelConfig(DType.BF16, 128, 64, 128, 2, dq_frag=True)
    frag = [c for c in config_sets.get_kernel_configs("all") if c.dq_frag]
    # every default and d_head 256's knob combinations, d_head 96's with and without dq_colsplit,
    # and their swizzled-panel twins
    defaults = set(config_sets.default_configs())
    assert set(frag) == defaults | {c.replace(dq_colsplit=not c.dq_colsplit) for c in defaults if c.d_head == 96} | {
        c for c in config_sets.get_kernel_configs("all") if c.kv_split and c.dq_frag}
    assert all(c.replace(dq_frag=False) in config_sets.get_kernel_configs("all") for c in frag)


def test_config_sets():
    assert {c.d_head for c in config_sets.get_kernel_configs("defaults")} == {64, 96, 128, 256}
    assert all(c.n_stages >= 2 for c in config_sets.get_kernel_configs("tune"))
    prog = config_sets.get_kernel_configs("prog")
    assert [c.short_form().partition(": ")[2] for c in prog] == ["", "dq_tma", "dq_tma+dq_mid",
                                                                 "dq_tma+dq_mid+pdl+dq_early+persistent+dynamic",
                                                                 "dq_tma+dq_mid+pdl+dq_early+persistent+dynamic+dq_frag",
                                                                 "dq_tma+dq_mid+nomask+pdl+dq_early+persistent+dynamic+dq_frag"]
    assert prog[-1] == config_sets.default_config(DType.BF16, 128)
    assert [c.short_form().partition("(")[2] for c in config_sets.progression_configs(DType.FP16, 64)] == [
        "FP16, 64, 64, 128, 2)", "FP16, 64, 128, 128, 2)", "FP16, 64, 128, 128, 2): dq_tma",
        "FP16, 64, 128, 128, 2): dq_tma+dq_mid", "FP16, 64, 128, 128, 2): dq_tma+dq_mid+lpt+pdl+persistent+dynamic",
        "FP16, 64, 128, 128, 2): dq_tma+dq_mid+lpt+pdl+persistent+dynamic+dq_frag",
        "FP16, 64, 128, 128, 2): dq_tma+dq_mid+nomask+lpt+pdl+persistent+dynamic+dq_frag"]
    prog96 = [c.short_form().partition(": ")[2] for c in config_sets.progression_configs(DType.BF16, 96)]
    assert prog96[-3:] == ["dq_tma+dq_mid+pdl+dq_early+persistent+dynamic+dq_frag",
                           "dq_tma+dq_mid+pdl+dq_early+persistent+dynamic+dq_frag+dq_colsplit",
                           "dq_tma+dq_mid+nomask+pdl+dq_early+persistent+dynamic+dq_frag+dq_colsplit"]
    with pytest.raises(ValueError, match="KERNELS"):
        config_sets.get_kernel_configs("nope")
    with pytest.raises(ValueError, match="^q: d_head 80"):
        config_sets.default_config(DType.BF16, 80)


def test_companion_config_pads_like_this_family():
    for cfg in config_sets.all_configs():
        comp = config_sets.companion_config(cfg)
        assert isinstance(comp, BackwardKernelConfig)
        assert (comp.dtype, comp.d_head, comp.B_r) == (cfg.dtype, cfg.d_head, cfg.B_r)
        assert cfg.pad_rows % 64 == 0 and cfg.pad_rows % comp.B_r == 0


# ------------------------------------------------------------------------------ params
def test_params_layout():
    assert PARAMS_SIZE % 64 == 0
    names = HOPPER_BACKWARD_PARAMS.names()
    assert names[:5] == ("tma_q", "tma_k", "tma_v", "tma_do", "tma_dq")
    fmt = "<"
    for name, _, f in HOPPER_BACKWARD_PARAMS.fields:
        if name in DESCRIPTOR_OFFSETS:
            assert struct.calcsize(fmt) == DESCRIPTOR_OFFSETS[name]
        fmt += f
    assert struct.calcsize(fmt) == PARAMS_SIZE


def test_params_pack_round_trip():
    descs = [bytes([i]) * 128 for i in range(1, 6)]
    # pointers: dk, dv, dq_accum, lse2, dvec, cu_seqlens_q, cu_seqlens_k
    values = (*descs, 0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 1, 2, 3, 4, 5, 6, 77, 130, 128, 8, 2,
              4, 3, 0.125, 0.18, 300, 400)
    raw = pack_params(*values)
    assert len(raw) == PARAMS_SIZE
    back = HOPPER_BACKWARD_PARAMS.layout.unpack(raw)
    assert back[:5] == tuple(descs) and back[5:25] == values[5:25]
    assert back[25] == pytest.approx(0.125) and back[26] == pytest.approx(0.18, rel=1e-6)
    assert back[27:29] == (300, 400)  # varlen: the packed arrays' token counts


def test_rendered_source_has_both_param_structs_and_configs():
    src = render_family_source("backward_sm90")
    for text in ("struct HopperBackwardParams", "struct BackwardParams", "struct HopperBackwardKernelConfig",
                 "struct BackwardKernelConfig", "struct alignas(64) TmaDescriptor", "backward_sm90_dkdv_kernel",
                 "backward_preprocess_kernel", "wgmma_ss_tt"):
        assert text in src, text
    assert src.count("struct BackwardKernelConfig {") == 1
    assert render_family_source("backward_sm80").count("struct BackwardKernelConfig {") == 1


def test_wgmma_wrapper_header_is_generated():
    rc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_wgmma_bwd_wrappers.py"), "--check"],
                        capture_output=True, text=True)
    assert rc.returncode == 0, rc.stdout + rc.stderr


# ------------------------------------------------------------------------------ family
def test_registered_next_to_backward_sm80():
    assert FAMILIES["backward_sm90"] is BACKWARD_SM90 and get_family("backward_sm90") is BACKWARD_SM90
    assert BACKWARD_SM90.kind == BACKWARD_SM80.kind == "backward"
    assert BACKWARD_SM90.variant_flags == BACKWARD_SM80.variant_flags
    assert [r.role for r in BACKWARD_SM90.roles] == [r.role for r in BACKWARD_SM80.roles]
    assert pick_family("backward", 90) is BACKWARD_SM90
    assert pick_family("backward", 80) is BACKWARD_SM80 and pick_family("backward", 100) is BACKWARD_SM80
    BACKWARD_SM90.check_arch("sm_90a")
    for arch in ("sm_90", "sm_80"):
        with pytest.raises(ValueError, match="^arch: family backward_sm90"):
            BACKWARD_SM90.check_arch(arch)
    assert BACKWARD_SM90.default_archs() == ("sm_90a",)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_name_expressions(causal, deterministic, varlen):
    cfg = HopperBackwardKernelConfig.parse("backward_sm90(FP16, 64, 128, 128, 2): dq_tma+dq_mid")  # no pdl: companion row kernels
    exprs = BACKWARD_SM90.name_expressions(cfg, BACKWARD_SM90.variant(causal=causal, deterministic=deterministic,
                                                                      varlen=varlen))
    assert list(exprs) == ["dkdv", "preprocess", "dq" if deterministic else "convert"]
    flags = "".join(f", {'true' if f else 'false'}" for f in (causal, deterministic, varlen)) + ">"
    assert exprs["dkdv"] == ("backward_sm90_dkdv_kernel<StaticHopperBackwardConfig<HopperBackwardKernelConfig"
                             "{DType::FP16, 64, 128, 128, 2, false, true, true, false, false, false, false, false, false, false, false, false, false, false, false}>"
                             + flags)
    comp = BACKWARD_SM80.config_literal(config_sets.companion_config(cfg))
    for role in list(exprs)[1:]:
        assert exprs[role].endswith(f"<StaticBackwardKernelConfig<{comp}>" + flags)


@pytest.mark.parametrize("deterministic", [False, True])
def test_name_expressions_pdl_use_own_row_kernels(deterministic):
    cfg = _plain(DType.BF16, 128).replace(pdl=True)
    exprs = BACKWARD_SM90.name_expressions(cfg, BACKWARD_SM90.variant(causal=True, deterministic=deterministic))
    own = f"<StaticHopperBackwardConfig<{BACKWARD_SM90.config_literal(cfg)}>, true, {str(deterministic).lower()}, false>"
    assert exprs["preprocess"] == "backward_sm90_preprocess_kernel" + own
    if deterministic:  # backward_sm80's dQ pass, launched plainly
        assert exprs["dq"].startswith("backward_dq_kernel<StaticBackwardKernelConfig<")
    else:
        assert exprs["convert"] == "backward_sm90_convert_kernel" + own


def test_geometry():
    cfg = _plain(DType.BF16, 128)
    assert BACKWARD_SM90.block_threads(cfg) == 384 and BACKWARD_SM90.smem_bytes(cfg) == cfg.smem_bytes()
    assert BACKWARD_SM90.block_threads(cfg, "preprocess") == 256 and BACKWARD_SM90.smem_bytes(cfg, "convert") == 0
    assert BACKWARD_SM90.grid(cfg, "dkdv", 2, 8, 2, 300, 257) == (3, 2, 2)
    assert BACKWARD_SM90.grid(cfg, "dq", 2, 8, 2, 300, 257) == (5, 8, 2)
    assert BACKWARD_SM90.grid(cfg, "preprocess", 2, 8, 2, 300, 257) == (5, 8, 2)
    with pytest.raises(ValueError, match="role"):
        BACKWARD_SM90.block_threads(cfg, "nope")


# ------------------------------------------------------------------------------ launch plan
def _args(b=2, sq=100, sk=70, h=4, hk=2, d=128, dtype=DType.BF16):
    return dict(dout=view((b, sq, h, d), dtype), q=view((b, sq, h, d), dtype), k=view((b, sk, hk, d), dtype),
                v=view((b, sk, hk, d), dtype), out=view((b, sq, h, d), dtype),
                lse=view((b, h, sq), None, raw=np.dtype(np.float32)))


def _plan(cfg, deterministic=False, causal=False, **kw):
    a = _args(**kw)
    p = check_backward_args(cfg, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], causal=causal,
                            deterministic=deterministic, select=None)
    return p, a


def test_resolve_config_accepts_the_hopper_family():
    cfg = _plain(DType.BF16, 128)
    assert resolve_backward_config(cfg) is cfg
    assert resolve_backward_config(" backward_sm90(BF16, 128, 64, 128, 2): dq_tma+dq_mid+pdl+dq_early+rotate") == cfg
    with pytest.raises(ValueError, match="^cfg: cannot parse"):
        resolve_backward_config("backward_sm90(BF16, 128)")


@pytest.mark.parametrize("deterministic", [False, True])
def test_launch_sequence(deterministic):
    cfg = _plain(DType.BF16, 128)
    p, _ = _plan(cfg, deterministic, b=2, sq=100, sk=200, h=4, hk=2)
    assert p.seq_len_q_pad == 128
    steps = launch.launch_sequence(p)
    assert [s.role for s in steps] == ["preprocess", "dkdv", "dq" if deterministic else "convert"]
    dkdv = steps[1]
    assert dkdv.grid == (2, 2, 2) and dkdv.block == 384 and dkdv.smem == cfg.smem_bytes() and dkdv.hopper_params
    assert steps[0].grid == (2, 4, 2) and not steps[0].hopper_params


@pytest.mark.parametrize("deterministic", [False, True])
def test_launch_sequence_pdl(deterministic):
    cfg = _plain(DType.BF16, 128).replace(pdl=False, dq_early=False)
    p, _ = _plan(cfg, deterministic, b=2, sq=100, sk=200, h=4, hk=2)
    assert not any(s.pdl for s in launch.launch_sequence(p))
    p, _ = _plan(cfg.replace(pdl=True), deterministic, b=2, sq=100, sk=200, h=4, hk=2)
    # the dK/dV kernel and the convert kernel wait for their predecessor themselves; the dQ pass does not
    assert [s.pdl for s in launch.launch_sequence(p)] == [False, True, not deterministic]


def test_dq_workspace_shape():
    cfg = _plain(DType.BF16, 128).replace(pdl=False, dq_early=False)
    p, _ = _plan(cfg, b=2, sq=100, sk=200, h=4, hk=2)
    assert launch.dq_workspace_shape(p) == p.dq_accum_shape == (2, 4, 128, 128)
    p, _ = _plan(cfg.replace(pdl=True, dq_early=True), b=2, sq=100, sk=200, h=4, hk=2)
    assert launch.dq_workspace_shape(p) == (2 * 4 * 128 * 128 + 2 * 4 * 2,)  # + one counter per query block
    p, _ = _plan(cfg.replace(pdl=True, dq_early=True), True, b=2, sq=100, sk=200, h=4, hk=2)
    assert launch.dq_workspace_shape(p) == p.dq_accum_shape  # deterministic: no dq_accum is allocated


def test_launch_sequence_no_query_rows_runs_dkdv_only():
    cfg = HopperBackwardKernelConfig.parse("backward_sm90(BF16, 64, 128, 128, 2): dq_tma+dq_mid")  # one CTA per tile
    p, _ = _plan(cfg, sq=0, sk=70, d=64)
    assert [s.role for s in launch.launch_sequence(p)] == ["dkdv"]


def test_pack_dkdv(monkeypatch):
    calls = []

    def fake_descriptor(ptr, dtype, shape, strides, rows):
        calls.append((ptr, shape, rows))
        return bytes([len(calls)]) * 128

    monkeypatch.setattr(launch.tma, "descriptor", fake_descriptor)
    cfg = _plain(DType.FP16, 128).replace(dq_tma=False, dq_mid=False, pdl=False,
                                                               dq_early=False)  # no dQ map
    p, a = _plan(cfg, b=1, sq=77, sk=130, h=8, hk=2, dtype=DType.FP16)
    raw = launch.pack_dkdv(p, a["q"], a["k"], a["v"], a["dout"], 0x10, 0x20, 0x30, 0x40, 0x50)
    assert [c[2] for c in calls] == [64, 128, 128, 64] and calls[0][0] == a["q"].ptr and calls[3][0] == a["dout"].ptr
    vals = HOPPER_BACKWARD_PARAMS.layout.unpack(raw)
    assert vals[:4] == tuple(bytes([i]) * 128 for i in range(1, 5))
    assert vals[4] == bytes(128)  # no dq_tma: the workspace map is left zero
    assert vals[5:10] == (0x10, 0x20, 0x30, 0x40, 0x50)
    assert vals[10:12] == (0, 0)  # cu_seqlens_q/k: dense
    assert vals[12:18] == (130 * 2 * 128, 2 * 128, 128) * 2  # contiguous dk, dv strides
    assert vals[18:25] == (77, 130, 128, 8, 2, 4, 1)  # ..., kv_group_size, batch
    assert vals[25] == pytest.approx(128 ** -0.5)


def test_pack_dkdv_dq_tma_map(monkeypatch):
    specs = []

    def fake_encode(spec):
        specs.append(spec)
        return b"\x07" * 128

    monkeypatch.setattr(launch.tma, "descriptor", lambda *a: bytes(128))
    monkeypatch.setattr(launch.tma, "encode_cached", fake_encode)
    cfg = _plain(DType.BF16, 128).replace(dq_tma=True)
    p, a = _plan(cfg, b=3, sq=77, sk=130, h=8, hk=2)
    raw = launch.pack_dkdv(p, a["q"], a["k"], a["v"], a["dout"], 0x10, 0x20, 0x30, 0x40, 0x50)
    assert HOPPER_BACKWARD_PARAMS.layout.unpack(raw)[4] == b"\x07" * 128
    (spec,) = specs
    rows = p.seq_len_q_pad
    assert rows % 64 == 0 and rows >= 77
    assert spec.data_type == 7 and spec.address == 0x30  # fp32, the dq_accum workspace
    assert spec.dims == (128, rows, 8, 3) and spec.box == (32, 64, 1, 1)
    assert spec.byte_strides == (128 * 4, rows * 128 * 4, 8 * rows * 128 * 4)
    assert launch.dq_descriptor(cfg, p, 0) == bytes(128)  # no workspace (deterministic): no map
    frag = config_sets.default_config(DType.BF16, 128).replace(dq_frag=True)
    assert launch.dq_descriptor(frag, p, 0x30) == bytes(128)  # dq_frag: 1-D bulk reductions, no map


@pytest.mark.parametrize("knobs, deterministic", [("dq_tma", False), ("dq_tma+pdl+dq_early", False),
                                                   ("dq_tma+pdl+dq_frag", False), ("dq_tma", True)])
def test_packed_launch_stores_what_a_pack_would(monkeypatch, knobs, deterministic):
    """A replay's packed blocks (stand-in descriptors with the address in one word): for any
    twelve pointers, each launch reads, byte for byte, the BackwardParams or HopperBackwardParams
    a pack of those pointers gives, the workspace map's address word included."""
    import ctypes

    from fake_views import stand_in_encoder

    launch.tma.clear_cache()
    monkeypatch.setattr(launch.tma, "encode", stand_in_encoder(lambda a: (a, 0)))
    cfg = HopperBackwardKernelConfig.parse(f"backward_sm90(BF16, 128, 64, 128, 2): {knobs}")
    p, a = _plan(cfg, deterministic, causal=True, b=2, sq=100, sk=200, h=4, hk=2)
    monkeypatch.setattr(launch, "get_kernels", lambda *args: {s.role: s.role for s in launch.launch_sequence(p)})
    launched = []

    def argv_launcher(role, grid, block, smem, pdl):
        def go(stream, argv):
            block_ptr = ctypes.c_void_p.from_address(argv).value
            size = PARAMS_SIZE if role == "dkdv" else len(p.pack((0,) * 12))
            launched.append((role, pdl, stream, ctypes.string_at(block_ptr, size)))
        return go

    monkeypatch.setattr(launch, "argv_launcher", argv_launcher)
    shapes = tuple(tuple(a[n].shape) for n in ("q", "k", "v", "dout"))
    strides = tuple(tuple(a[n].strides) for n in ("q", "k", "v", "dout"))
    packed = launch.packed_launch(p, shapes, strides)
    assert packed is not None
    rng = np.random.default_rng(1)
    for _ in range(5):
        ptrs = tuple(int(x) * 16 for x in rng.integers(1, 1 << 43, 12))
        if deterministic:
            ptrs = ptrs[:9] + (0,) + ptrs[10:]
        launched.clear()
        packed.launch(99, ptrs)
        inputs = (launch.Operand(ptr, s, t) for ptr, s, t in zip(ptrs[:3] + ptrs[4:5], shapes, strides))
        hopper = launch.pack_dkdv(p, *inputs, *ptrs[7:9], *ptrs[9:])
        steps = launch.launch_sequence(p)
        assert [(r, pdl, s) for r, pdl, s, _ in launched] == [(s.role, s.pdl, 99) for s in steps]
        for (role, _, _, raw), step in zip(launched, steps):
            assert raw == (hopper if step.hopper_params else p.pack(ptrs)), role
    launch.tma.clear_cache()


def test_packed_varlen_launch_stores_what_a_pack_would(monkeypatch):
    """A varlen plan's packed blocks: fourteen pointers (the cu_seqlens too) and the tail sizes
    (total_q, total_k) the preprocess zeroes past, as a pack of the same values gives."""
    import ctypes

    from cupyflash.backward_varlen import check_backward_varlen_args
    from fake_views import ints, stand_in_encoder

    launch.tma.clear_cache()
    monkeypatch.setattr(launch.tma, "encode", stand_in_encoder(lambda a: (a, 0)))
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)  # persistent configs size their grid by it
    cfg = config_sets.varlen_default_config(DType.BF16, 128, True, 60)
    q, dout, out = (view((100, 16, 128)) for _ in range(3))
    k, v = view((300, 4, 128)), view((300, 4, 128))
    lse = view((16, 100), dtype=None, raw=np.dtype(np.float32))
    _, p = check_backward_varlen_args(cfg, dout, q, k, v, out, lse, ints((4,)), ints((4,)), 60, 200, None, None, None,
                                      None, True, False, select=None)
    monkeypatch.setattr(launch, "get_kernels", lambda *args: {s.role: s.role for s in launch.launch_sequence(p)})
    launched = []

    def argv_launcher(role, grid, block, smem, pdl):
        def go(stream, argv):
            size = PARAMS_SIZE if role == "dkdv" else len(p.pack((0,) * 12))
            launched.append(ctypes.string_at(ctypes.c_void_p.from_address(argv).value, size))
        return go

    monkeypatch.setattr(launch, "argv_launcher", argv_launcher)
    as_4d = lambda x: ((1, *x.shape), (x.shape[0] * x.strides[0], *x.strides))  # noqa: E731
    shapes, strides = zip(*(as_4d(x) for x in (q, k, v, dout)))
    packed = launch.packed_launch(p, shapes, strides, (100, 300))
    assert packed is not None
    ptrs = tuple(int(x) * 16 for x in np.random.default_rng(2).integers(1, 1 << 43, 14))
    packed.launch(5, ptrs)
    inputs = (launch.Operand(ptr, s, t) for ptr, s, t in zip(ptrs[:3] + ptrs[4:5], shapes, strides))
    hopper = launch.pack_dkdv(p, *inputs, *ptrs[7:12], ptrs[12:14])
    want = [hopper if step.hopper_params else p.pack(ptrs[:12], ptrs[12:14], (100, 300))
            for step in launch.launch_sequence(p)]
    assert launched == want
    launch.tma.clear_cache()


def test_packed_launch_refused_when_descriptors_hide_the_address(monkeypatch):
    from fake_views import stand_in_encoder

    launch.tma.clear_cache()
    monkeypatch.setattr(launch.tma, "encode", stand_in_encoder(lambda a: (a >> 4, 0)))
    p, a = _plan(_plain(DType.BF16, 128), b=1, sq=64, sk=64, h=2, hk=2)
    monkeypatch.setattr(launch, "get_kernels", lambda *args: pytest.fail("no kernels for a refused pack"))
    shapes = tuple(tuple(a[n].shape) for n in ("q", "k", "v", "dout"))
    strides = tuple(tuple(a[n].strides) for n in ("q", "k", "v", "dout"))
    assert launch.packed_launch(p, shapes, strides) is None
    launch.tma.clear_cache()


def test_check_sm90_problem():
    cfg = _plain(DType.BF16, 128)
    p, a = _plan(cfg)
    launch.check_sm90_problem(p, a["q"], a["k"], a["v"], a["dout"], 90)
    launch.check_sm90_problem(p, a["q"], a["k"], a["v"], a["dout"], None)
    for cc in (80, 89, 100):
        with pytest.raises(ValueError, match="^cfg: backward_sm90.*compute capability 9.0 only"):
            launch.check_sm90_problem(p, a["q"], a["k"], a["v"], a["dout"], cc)
    bcast = view((2, 70, 2, 128), strides=(0, 256, 128, 1))
    with pytest.raises(ValueError, match="^k: the batch stride"):
        launch.check_sm90_problem(p, a["q"], bcast, a["v"], a["dout"], 90)


# ------------------------------------------------------------------------------ backward() wiring
class _FakeDevice:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeCupy:
    class cuda:
        Device = _FakeDevice


@pytest.fixture
def faked_backward(monkeypatch):
    """cupyflash.backward end to end on fake views: compute capability and launches captured."""
    from cupyflash import api, backward_api

    state = {"cc": 90, "launches": [], "workspaces": []}
    monkeypatch.setattr(api, "_gpu_ready", True)
    monkeypatch.setattr(api, "_checked_devices", {0})
    monkeypatch.setattr(api, "_compute_capability", lambda device: state["cc"])
    monkeypatch.setattr(backward_api, "as_view", lambda x, name: x)
    monkeypatch.setattr(backward_api, "output_view", lambda x, name: x)
    monkeypatch.setattr(backward_api, "resolve_stream", lambda stream, like: 0x1234)
    monkeypatch.setattr(backward_api, "allocate_output", lambda like, shape: view(shape, like.dtype))
    monkeypatch.setattr(backward_api, "wrap_output", lambda v: v)
    monkeypatch.setattr(backward_api, "_cupy", _FakeCupy)

    def workspace(like, shape, stream_ptr):
        state["workspaces"].append(shape)
        return None, 0x7000000 + 0x100000 * len(state["workspaces"])

    monkeypatch.setattr(backward_api, "_workspace", workspace)
    monkeypatch.setattr(launch.tma, "descriptor", lambda ptr, dtype, shape, strides, rows: ptr.to_bytes(8, "little") * 16)
    monkeypatch.setattr(launch.tma, "encode_cached", lambda spec: spec.address.to_bytes(8, "little") * 16)  # dq_tma
    monkeypatch.setattr(launch, "launch_backward_sm90",
                        lambda plan, sm80, hopper, stream: state["launches"].append((plan, sm80, hopper, stream)))
    return state


def _call(cfg, deterministic=False, causal=True, **kw):
    import cupyflash

    a = _args(**kw)
    return a, cupyflash.backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], causal=causal,
                                 deterministic=deterministic, cfg=cfg)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launches_the_hopper_family(faked_backward, deterministic):
    cfg = _plain(DType.BF16, 128)
    a, (dq, dk, dv) = _call(cfg.short_form(), deterministic, b=2, sq=100, sk=200, h=4, hk=2)
    assert dq.shape == a["q"].shape and dk.shape == a["k"].shape
    [(plan, sm80, hopper, stream)] = faked_backward["launches"]
    assert plan.cfg == cfg and plan.causal and plan.deterministic is deterministic and stream == 0x1234
    # one workspace block: lse2, dvec (B_r-padded rows) and dq_accum unless deterministic
    from cupyflash.backward_plans import workspace_layout

    layout = workspace_layout(plan)
    assert faked_backward["workspaces"] == [(layout.floats,)]
    stats = 4 * 2 * 4 * 128  # bytes of (batch, heads, padded rows) fp32, a multiple of 256 already
    assert (layout.lse2, layout.dvec, layout.acc) == (0, stats, -1 if deterministic else 2 * stats)
    acc, lse2, dvec = layout.pointers(0x7100000)
    vals = HOPPER_BACKWARD_PARAMS.layout.unpack(hopper)
    assert vals[0] == a["q"].ptr.to_bytes(8, "little") * 16 and vals[3] == a["dout"].ptr.to_bytes(8, "little") * 16
    # tma_dq: the default's dq_tma map of the dq_accum workspace (none when deterministic)
    assert vals[4] == (bytes(128) if deterministic else acc.to_bytes(8, "little") * 16)
    assert vals[5:7] == (dk.ptr, dv.ptr)
    assert vals[7] == (0 if deterministic else 0x7100000 + 2 * stats) and vals[8:10] == (0x7100000, 0x7100000 + stats)
    assert vals[10:12] == (0, 0) and vals[18:24] == (100, 200, 128, 4, 2, 2)
    from cupyflash.families.backward_sm80.params import PARAMS_STRUCT

    assert len(sm80) == PARAMS_STRUCT.size


def test_backward_refuses_the_hopper_family_off_sm90(faked_backward):
    faked_backward["cc"] = 80
    with pytest.raises(ValueError, match=r"^cfg: backward_sm90\(BF16, 128, 64, 128, 2\): dq_tma\+dq_mid\+pdl\+dq_early\+rotate .*compute "
                                         r"capability 9.0 only"):
        _call(_plain(DType.BF16, 128))
    assert not faked_backward["launches"]


# ------------------------------------------------------------------------------ cfg=None picks
@pytest.fixture
def sm80_launches(faked_backward, monkeypatch):
    """backward_sm80's launcher faked too: (cfg, causal, deterministic) of each launch."""
    from cupyflash.families.backward_sm80 import kernels

    class FakeLauncher:
        def __init__(self, cfg, device, causal, deterministic):
            self.key = (cfg, causal, deterministic)

        def launch(self, params, *sizes):
            faked_backward.setdefault("sm80", []).append(self.key)

    monkeypatch.setattr(kernels, "get_launcher", FakeLauncher)
    monkeypatch.setattr("cupyflash.backward_api._cupy.cuda.runtime",
                        type("rt", (), {"getDevice": staticmethod(lambda: 0)}), raising=False)
    return faked_backward


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("dtype", list(DType))
def test_cfg_none_runs_the_hopper_default_on_sm90(faked_backward, dtype, d, causal):
    _call(None, causal=causal, b=1, sq=300, sk=300, h=2, hk=2, d=d, dtype=dtype)
    _call(None, causal=causal, b=1, sq=4096, sk=300, h=2, hk=2, d=d, dtype=dtype)  # a long call
    [(plan, _, _, _), (long_plan, _, _, _)] = faked_backward["launches"]
    assert plan.cfg == config_sets.default_config(dtype, d, causal)
    assert plan.cfg.dq_tma and plan.cfg.dq_mid
    # persistent CTAs for both masks, causal tiles from a counter; d_head 64: 128-row blocks
    want = (True, True, 128 if d == 64 else 64)
    assert (plan.cfg.persistent, plan.cfg.dynamic, plan.cfg.B_r) == want
    # 4096 query rows: a causal call at d_head 128 takes three stages (d_head 96: every causal
    # call), everything else as before
    assert long_plan.cfg == plan.cfg.replace(n_stages=3 if causal and d == 128 else plan.cfg.n_stages)
    assert plan.cfg.n_stages == (3 if causal and d == 96 else 2)
    _call(None, causal=causal, b=1, sq=8192, sk=300, h=2, hk=2, d=d, dtype=dtype)  # longer: non-causal rotates
    rotate = not causal and d in (96, 128)
    assert faked_backward["launches"][2][0].cfg == long_plan.cfg.replace(rotate=rotate, dynamic=not rotate)


@pytest.mark.parametrize("cc, d, why", [(80, 128, "compute capability 8.0; backward_sm90 needs 9.0"),
                                        (89, 64, "compute capability 8.9"),
                                        (89, 256, "compute capability 8.9")])
def test_cfg_none_falls_back_to_backward_sm80_with_a_reason(sm80_launches, cc, d, why):
    from cupyflash.backward_api import hopper_reason

    sm80_launches["cc"] = cc
    a, _ = _call(None, b=1, sq=100, sk=100, h=2, hk=2, d=d)
    assert not sm80_launches["launches"]
    [(cfg, causal, det)] = sm80_launches["sm80"]
    assert isinstance(cfg, BackwardKernelConfig) and cfg.d_head == d and causal and not det
    assert why in hopper_reason(a["dout"], a["q"], a["k"], a["v"])


def test_hopper_reason_names_a_layout_tma_cannot_read(faked_backward):
    from cupyflash.backward_api import hopper_reason

    a = _args(b=2, sq=64, sk=64, h=2, hk=2, d=128)
    assert hopper_reason(a["dout"], a["q"], a["k"], a["v"]) is None
    k = view((2, 64, 2, 128), DType.BF16, strides=(0, 256, 128, 1))  # broadcast over the batch
    assert hopper_reason(a["dout"], a["q"], k, a["v"]).startswith("k: the batch stride is 0")


def test_hopper_reason_without_a_device(monkeypatch):
    from cupyflash import api
    from cupyflash.backward_api import hopper_reason

    def no_gpu(device):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(api, "_compute_capability", no_gpu)
    a = _args()
    assert "no CUDA device" in hopper_reason(a["dout"], a["q"], a["k"], a["v"])


def test_persistent_knob_short_form_rule_and_grid():
    cfg = _plain(DType.BF16, 128).replace(persistent=True)
    text = "backward_sm90(BF16, 128, 64, 128, 2): dq_tma+dq_mid+pdl+dq_early+rotate+persistent"
    assert cfg.short_form() == text and HopperBackwardKernelConfig.parse(text) == cfg
    with pytest.raises(ValueError, match="persistent needs dq_tma"):
        HopperBackwardKernelConfig(DType.BF16, 128, 64, 128, 2, persistent=True)
    # one CTA per SM, at most one per tile (3 key blocks x 2 kv heads x 2 batch = 12 tiles)
    assert BACKWARD_SM90.grid(cfg, "dkdv", 2, 4, 2, 100, 300, sm_count=132) == (12, 1, 1)
    assert BACKWARD_SM90.grid(cfg, "dkdv", 2, 4, 2, 100, 300, sm_count=5) == (5, 1, 1)
    assert BACKWARD_SM90.grid(cfg, "dkdv", 2, 4, 2, 100, 0, sm_count=5)[0] == 0  # no keys: nothing to launch
    with pytest.raises(ValueError, match="sm_count"):
        BACKWARD_SM90.grid(cfg, "dkdv", 2, 4, 2, 100, 300)
    assert BACKWARD_SM90.grid(cfg.replace(persistent=False), "dkdv", 2, 4, 2, 100, 300) == (3, 2, 2)
    assert cfg.smem_bytes() == cfg.replace(persistent=False).smem_bytes()  # kv_empty is always allocated


def test_dynamic_knob_rule_smem_and_workspace():
    cfg = config_sets.default_config(DType.BF16, 128, causal=False).replace(lpt=True, dq_frag=False)
    text = "backward_sm90(BF16, 128, 64, 128, 2): dq_tma+dq_mid+lpt+pdl+dq_early+persistent+dynamic"
    assert cfg.short_form() == text and HopperBackwardKernelConfig.parse(text) == cfg
    with pytest.raises(ValueError, match="dynamic needs persistent and pdl"):
        cfg.replace(persistent=False)
    with pytest.raises(ValueError, match="dynamic needs persistent and pdl"):
        cfg.replace(pdl=False, dq_early=False)
    assert cfg.smem_bytes() == cfg.replace(dynamic=False).smem_bytes() + 40  # two tile slots, four barriers
    p, _ = _plan(cfg, b=2, sq=300, sk=300, h=4, hk=2)
    static = launch.dq_workspace_shape(p._replace(cfg=cfg.replace(dynamic=False)))
    assert launch.dq_workspace_shape(p) == (static[0] + 1,)  # + the tile counter
    # without dq_early (B_r 128): the dq_accum elements, then the tile counter alone
    rows = HopperBackwardKernelConfig.parse("backward_sm90(BF16, 64, 128, 128, 2): dq_tma+dq_mid+pdl+persistent+dynamic")
    p, _ = _plan(rows, b=2, sq=300, sk=300, h=4, hk=2, d=64)
    assert launch.dq_workspace_shape(p._replace(cfg=rows.replace(dynamic=False))) == p.dq_accum_shape
    assert launch.dq_workspace_shape(p) == (math.prod(p.dq_accum_shape) + 1,)
