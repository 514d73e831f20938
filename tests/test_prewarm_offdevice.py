"""scripts/prewarm_offdevice.py: what it would compile for a GPU that is not here (CPU only)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import prewarm_offdevice  # noqa: E402
from cupyflash.families import family_of  # noqa: E402


def test_every_shipped_table_config_parses():
    configs = prewarm_offdevice.table_configs(ROOT / "cupyflash" / "tuning")
    families = {family_of(c).name for c in configs}
    assert {"forward_sm80", "forward_sm90", "backward_sm80"} <= families


def test_defaults_follow_the_compute_capability():
    on_hopper = {family_of(c).name for c in prewarm_offdevice.default_configs(90)}
    on_ampere = {family_of(c).name for c in prewarm_offdevice.default_configs(80)}
    assert {"forward_sm90", "backward_sm90"} <= on_hopper
    assert not on_ampere & {"forward_sm90", "backward_sm90"}
    assert {"forward_sm80", "backward_sm80", "decode"} <= on_ampere


def test_refuses_another_nvrtc(capsys):
    assert prewarm_offdevice.main(["--expect-nvrtc", "0.1", "--families", "decode"]) == 2
    assert "0.1 expected" in capsys.readouterr().err


def test_defaults_hold_backward_varlens_picks():
    """backward_varlen's Hopper picks (the varlen_defaults set) differ from the dense defaults (at
    d_head 128 with park, non-causal with claims instead of rotate): prewarmed too, so a warm
    backward_varlen compiles nothing."""
    from cupyflash.families.backward_sm90 import config_sets

    varlen = {cfg for cfg, _ in config_sets.varlen_default_launches()}
    assert set(config_sets.get_kernel_configs("varlen_defaults")) == varlen
    assert varlen - set(config_sets.get_kernel_configs("defaults"))  # not covered by the dense set
    assert varlen <= set(prewarm_offdevice.default_configs(90))


def test_defaults_hold_forward_varlens_picks():
    """forward_varlen's Hopper picks (d_head 128: 192 x 128 psmem tiles) are not dense defaults:
    the varlen_defaults set names them and the off-device prewarm builds them."""
    from cupyflash.config import DType
    from cupyflash.families.forward_sm90 import config_sets

    varlen = set(config_sets.get_kernel_configs("varlen_defaults"))
    assert config_sets.varlen_default_config(DType.FP16, 128, True) in varlen
    assert varlen - set(config_sets.get_kernel_configs("defaults"))
    assert varlen <= set(prewarm_offdevice.default_configs(90))


def test_fixture_groups_follow_the_modules_prewarm_plans():
    """--test-modules builds what the GPU test modules' prewarm fixtures compile (their
    prewarm_plan, importable without a GPU): on cc 9.0 the Hopper families' sm_90a groups (the
    backward's d_head 96 with and without dq_colsplit among them), elsewhere none of them."""
    import pytest

    hopper = prewarm_offdevice.fixture_groups(list(prewarm_offdevice.TEST_MODULES), 90)
    ampere = prewarm_offdevice.fixture_groups(list(prewarm_offdevice.TEST_MODULES), 80)
    assert {m for m, *_ in hopper} == set(prewarm_offdevice.TEST_MODULES)
    assert "test_gpu_backward_sm90" not in {m for m, *_ in ampere}
    assert all(archs in (["sm_90"], ["sm_90a"]) for _, _, archs, _ in hopper)
    assert all(archs == ["sm_80"] for _, _, archs, _ in ampere)
    sm90 = {c for m, cfgs, archs, _ in hopper if archs == ["sm_90a"] for c in cfgs}
    d96 = {c.dq_colsplit for c in sm90 if c.d_head == 96 and family_of(c).name == "backward_sm90"}
    assert d96 == {False, True} and {family_of(c).name for c in sm90} == {"backward_sm90", "forward_sm90"}
    with pytest.raises(ValueError, match="--test-modules: unknown module"):
        prewarm_offdevice.fixture_groups(["test_nope"], 90)
