"""GPU detection and the compile target chosen per device (device queries faked)."""
import warnings

import pytest

from cupyflash import device


def test_has_gpu_matches_device_count():
    assert device.has_gpu() == (device.device_count() > 0)


def test_require_gpu_message_without_gpu():
    if device.has_gpu():
        device.require_gpu()
        return
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        device.require_gpu()


def test_device_count_is_zero_when_cuda_fails(monkeypatch):
    import cupy
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    def fail():
        raise CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", fail)
    assert device.device_count() == 0 and not device.has_gpu()
    with pytest.raises(RuntimeError, match="GPU"):
        device.require_gpu()


@pytest.fixture
def fake_cc(monkeypatch):
    device._arch_for_capability.cache_clear()
    device._warned_ptx.clear()
    current = {}
    monkeypatch.setattr(device, "compute_capability", lambda i: current[i])
    yield current
    device._arch_for_capability.cache_clear()
    device._warned_ptx.clear()


@pytest.mark.parametrize("cc", [80, 86, 89, 90])
def test_supported_device_gets_its_own_cubin(fake_cc, cc):
    fake_cc[0] = cc
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert device.device_arch(0) == (f"sm_{cc}", "cubin")


def test_newer_device_falls_back_to_ptx_with_one_warning(fake_cc, monkeypatch):
    monkeypatch.setattr(device, "supported_archs", lambda: (75, 80, 86, 89, 90))
    fake_cc.update({0: 100, 1: 100, 2: 95})
    with pytest.warns(RuntimeWarning, match="compute_90") as record:
        assert device.device_arch(0) == ("compute_90", "ptx")
        assert device.device_arch(1) == ("compute_90", "ptx")
        assert device.device_arch(0) == ("compute_90", "ptx")
    assert len(record) == 1
    with pytest.warns(RuntimeWarning):
        assert device.device_arch(2) == ("compute_90", "ptx")  # another capability warns once too


def test_device_older_than_any_nvrtc_arch(fake_cc, monkeypatch):
    monkeypatch.setattr(device, "supported_archs", lambda: (75, 80))
    fake_cc[0] = 70
    with pytest.raises(RuntimeError, match="7.0"):
        device.device_arch(0)
