"""Compile every kernel config of the `tune` and `prog` sets for sm_80 and sm_90 with NVRTC (no GPU),
through the prewarm library function, and check the shipped default configs do not spill."""
import os

import pytest

from cupyflash.config import SUPPORTED_D_HEADS, DType
from cupyflash.config_sets import default_config, get_kernel_configs
from cupyflash.compiler import ptxas_report_available
from cupyflash.prewarm import format_summary, prewarm

pytestmark = pytest.mark.compile

ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    defaults = [default_config(dtype, d) for dtype in DType for d in SUPPORTED_D_HEADS]
    configs = list(dict.fromkeys(get_kernel_configs("tune") + get_kernel_configs("prog") + defaults))
    cache_dir = tmp_path_factory.mktemp("kernel_cache")
    result = prewarm(configs, ARCHS, cache_dir=cache_dir, jobs=os.cpu_count(), progress=None)
    print(format_summary(result))
    return result


def test_every_config_compiles(report):
    failures = [f"{r.arch} {r.short_form}:\n{r.error}" for r in report.failed]
    assert not failures, "\n\n".join(failures[:5])
    expected = len(set(get_kernel_configs("tune") + get_kernel_configs("prog")))
    assert report.n_configs >= expected
    assert len(report.results) == report.n_configs * len(ARCHS)
    if ptxas_report_available():
        for r in report.results:
            assert r.registers is not None and 0 < r.registers <= 255, r


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d_head", SUPPORTED_D_HEADS)
@pytest.mark.parametrize("dtype", list(DType), ids=lambda d: d.name)
def test_default_configs_do_not_spill(report, dtype, d_head, arch):
    if not ptxas_report_available():
        pytest.skip("the NVRTC loaded in this process returns no ptxas report (see ptxas_report_available)")
    cfg = default_config(dtype, d_head)
    (result,) = [r for r in report.results if r.short_form == cfg.short_form() and r.arch == arch]
    assert result.ok, result.error
    assert result.spill_store_bytes == 0 and result.spill_load_bytes == 0, result
