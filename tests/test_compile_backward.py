"""Compile the backward family's default configs (every variant) for sm_80 and sm_90 with NVRTC
(no GPU) and check ptxas' figures: zero spills where promised (d_head 64 defaults), small
elsewhere. Kept to a handful of modules: CI time is shared."""
import pytest

from cupyflash.cache import KernelCache
from cupyflash.config import DType
from cupyflash.families.backward_sm80.config_sets import default_config
from cupyflash.families.backward_sm80.kernels import compile_variant
from cupyflash.families.backward_sm80.render import name_expressions

pytestmark = pytest.mark.compile

ARCHS = ("sm_80", "sm_90")
VARIANTS = ((False, False), (True, True))  # plain; causal + deterministic (every kernel role)
# promised spill-free: d_head 64; the others are 8 warps at 255 registers with at most a few words
# spilled (measured 0-16 bytes with NVRTC 12.9)
SPILL_LIMIT = {64: 0, 128: 32, 256: 32}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return KernelCache(tmp_path_factory.mktemp("backward_cache"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d_head", sorted(SPILL_LIMIT))
def test_default_config_compiles_within_register_budget(cache, arch, d_head):
    cfg = default_config(DType.BF16 if d_head != 256 else DType.FP16, d_head)
    for causal, det in VARIANTS:
        module = compile_variant(cfg, arch, causal, det, cache).module
        assert "warning" not in module.log.lower(), module.log
        for role, expr in name_expressions(cfg, causal, det).items():
            res = module.resources.get(expr)
            if res is None:
                pytest.skip("NVRTC served this module without a ptxas report")
            assert res.registers <= 255
            limit = SPILL_LIMIT[d_head] if role in ("dkdv", "dq") else 0
            assert res.spill_bytes <= limit, (role, causal, det, res)
        # a second lookup is a cache hit: no recompile
        assert compile_variant(cfg, arch, causal, det, cache).cached
