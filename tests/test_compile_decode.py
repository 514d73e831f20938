"""Compile a handful of decode configs (the defaults and the tune set's corners, every variant
of one) for sm_80 and sm_90 with NVRTC (no GPU): no ptxas warning, no spill."""
from __future__ import annotations

import pytest

from cupyflash.compiler import compile_module
from cupyflash.config import DType
from cupyflash.families import get_family
from cupyflash.families.decode import config_sets
from cupyflash.families.decode.config import DecodeKernelConfig
from cupyflash.render import render_family_source

pytestmark = pytest.mark.compile


def _configs():
    tune = config_sets.get_kernel_configs("tune")
    picks = {config_sets.default_config(DType.BF16, d) for d in (64, 128, 256)}
    picks.add(config_sets.default_config(DType.FP16, 64, 64))  # a 64-row tile
    picks.add(config_sets.default_config(DType.BF16, 256, 16, paged=True))  # 8 single-slot warps
    picks.update(config_sets.default_config(DType.BF16, d, 4, paged=True) for d in (64, 128))  # 8 warps, interleaved
    picks.update({tune[0], tune[-1]})
    picks.update(DecodeKernelConfig(DType.BF16, 128, 16, 16, 8, st, False, 8) for st in (1, 2, 3))  # heads 8
    picks.update(config_sets.default_config(DType.FP16, 128, 4, wide=True, wave_heads=h)  # the one-wave shapes
                 for h in config_sets.ONE_WAVE_SHAPES)
    return sorted(picks)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_decode_configs_compile_without_warnings_or_spills(arch):
    family = get_family("decode")
    configs = _configs()
    names = []
    for i, cfg in enumerate(configs):
        variants = family.all_variants() if i == 0 else [(False, False), (True, True)]
        for v in variants:
            names += list(family.name_expressions(cfg, v).values())
    module = compile_module(render_family_source("decode"), names, arch)
    warnings = [line for line in module.log.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings[:10])
    assert module.resources, "ptxas reported no resources"  # NVRTC 12.9 here always reports them
    for name, res in module.resources.items():
        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0, (name, res)
        assert res.registers <= 255
