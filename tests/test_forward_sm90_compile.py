"""Compile the Hopper family's default, progression (with the cp.async loads of its first step)
and (bf16) tune configs for sm_90a with
NVRTC (no GPU): zero ptxas warnings (C7508 setmaxnreg ignored, C7515/C7511 wgmma serialised,
C7517 ...), no spills, registers reported."""
from __future__ import annotations

import concurrent.futures
import os
import re

import pytest

from cupyflash.compiler import compile_module
from cupyflash.config import DType
from cupyflash.families.forward_sm90 import config_sets
from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig
from cupyflash.render import name_expression, render_family_source

pytestmark = pytest.mark.compile

_WARNING = re.compile(r"warning|C75\d\d", re.IGNORECASE)


def _valid(cfg, **changes) -> list:
    """[cfg with `changes`], or [] where the family's rules refuse the combination."""
    try:
        return [cfg.replace(**changes)]
    except ValueError:
        return []


def _modules():
    defaults = config_sets.get_kernel_configs("defaults")
    tune = [c for c in config_sets.get_kernel_configs("tune") if c.dtype is DType.BF16]
    # the tune set's second-Q-tile configs and their exp2-emulation twins (a knob outside the tune
    # set), causal too: the emulation's temporaries and the pair schedule of causal persistent
    # CTAs add registers
    knobs = [c for c in tune if c.double_q and c.n_stages == 2]
    knobs += [c.replace(exp_emulation=1) for c in knobs if c.d_head == 64]
    # Q's fragments in registers (qreg, autotune's d_head 64 twin) on the two-consumer d_head 64
    # tiles, where its d_head / 4 registers fit beside the overlapped S, P and O
    knobs += [c.replace(q_regs=True) for c in tune if c.d_head == 64 and c.B_r == 128 and c.n_stages == 2]
    # the narrow last block (halflast): its own copy of the last loop step and a P V of half the
    # k-steps, on the two-stage tune configs whose rules allow it (B_c halves into whole k-steps)
    knobs += [twin for c in tune if c.n_stages == 2 for twin in _valid(c, half_last=True)]
    configs = list(dict.fromkeys(defaults + config_sets.get_kernel_configs("prog") + knobs
                                 + [c for c in tune if c.pingpong and c.persistent and c.n_stages == 2 and c.B_c != 64]))
    # the cp.async loads (the progressions' first step) at every d_head, and with the FMA-unit exp2
    # on one consumer warpgroup and a three-stage ring
    cp_async = [c for c in config_sets.get_kernel_configs("prog_all") if c.cp_async and c.dtype is DType.BF16]
    cp_async.append(HopperForwardKernelConfig.parse("forward_sm90(FP16, 64, 64, 176, 3): cpasync+emu1"))
    configs = list(dict.fromkeys(configs + cp_async))
    # other causal instantiations: the defaults only (the mask adds code, not structure), and the
    # cp.async loads
    out = [(c, False) for c in configs] + [(c, True) for c in dict.fromkeys(defaults + knobs + cp_async)]
    # every pick of the shipped H100 table, with the mask its row serves (oreg, ring, xtile, lazy
    # combinations outside the sets above)
    return list(dict.fromkeys(out + _table_picks()))


def _table_picks():
    from cupyflash.tuning.tables import TuningTable, default_table_path

    table = TuningTable.load(default_table_path("NVIDIA H100 80GB HBM3", "forward_sm90"))
    return [(e.config, e.causal) for e in table.entries()]


@pytest.fixture(scope="module")
def compiled():
    source = render_family_source("forward_sm90")

    def build(item):
        cfg, causal = item
        expr = name_expression(cfg, causal)
        module = compile_module(source, [expr], "sm_90a")
        return cfg, causal, module.resources.get(expr), module.log

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(build, _modules()))


def test_no_ptxas_warnings(compiled):
    bad = [(str(cfg), causal, [l for l in log.splitlines() if _WARNING.search(l)])
           for cfg, causal, _, log in compiled if _WARNING.search(log)]
    assert not bad, bad[:3]


def test_no_spills_and_registers_reported(compiled):
    for cfg, causal, res, _ in compiled:
        if res is None:  # NVRTC 13 may serve a module from its own cache without a ptxas report
            continue
        assert res.spill_bytes == 0 and res.stack_frame_bytes == 0, (str(cfg), causal, res)
        # __launch_bounds__(threads, 1): 384 threads leave ptxas 168 registers (the consumers
        # then raise theirs with setmaxnreg), 256 threads up to 255
        assert 0 < res.registers <= (168 if cfg.n_threads == 384 else 255), (str(cfg), res)
    assert any(res is not None for _, _, res, _ in compiled)


def test_cp_async_varlen_variants_compile_without_warnings():
    """forward_varlen runs a cp_async config too: its packed-batch variants, causal or not."""
    from cupyflash.families.forward_sm90 import FORWARD_SM90

    cfg = config_sets.progression_configs()[0]
    names = [n for causal in (False, True)
             for n in FORWARD_SM90.name_expressions(cfg, FORWARD_SM90.variant(causal=causal, varlen=True)).values()]
    module = compile_module(render_family_source("forward_sm90"), names, "sm_90a")
    assert not _WARNING.search(module.log), module.log[-2000:]
    for name in names:
        res = module.resources.get(name)
        assert res is None or (res.spill_bytes == 0 and 0 < res.registers <= 255), (name, res)
