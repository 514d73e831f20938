"""Kernel registry on the CPU: cache keys shared with the prewarm, lazy thread-safe loading, the
launch argument block. CUDA objects are replaced by fakes; the real launch is in the GPU tests."""
import ctypes
import threading
import time

import pytest

from cupyflash import registry as registry_mod
from cupyflash.cache import KernelCache
from cupyflash.config import DType
from cupyflash.families.forward_sm80.config_sets import progression_configs
from cupyflash.families.forward_sm80.params import PARAMS_STRUCT, pack_params, param_names
from cupyflash.registry import (
    DEFAULT_DYNAMIC_SMEM_LIMIT, KernelRegistry, LoadedKernel, compile_config, config_cache_key, get_registry,
)
from cupyflash.render import name_expression, render_source

SMALL = progression_configs(DType.FP16, 64)[-1]  # 24 KiB of shared memory
BIG = progression_configs(DType.BF16, 128)[-1].replace(B_r=128, n_warps=8)  # 64 KiB: needs the opt-in


def test_config_cache_key_is_the_key_compile_config_uses(tmp_path):
    cache = KernelCache(tmp_path)
    key = config_cache_key(SMALL, "sm_80")
    assert key == KernelCache.key(render_source([SMALL]), [name_expression(SMALL)], "sm_80", family="forward_sm80")
    assert key != KernelCache.key(render_source([SMALL]), [name_expression(SMALL)], "sm_80")  # the family counts
    lookup = compile_config(SMALL, "sm_80", cache)
    assert lookup.key == key and not lookup.cached
    assert [p.name for p in cache.entries()] == [f"{key}.cfk"]
    assert list(lookup.module.lowered_names) == [name_expression(SMALL)]  # one config per module
    assert cache.read_metadata(cache.entries()[0])["short_forms"] == [SMALL.short_form()]


class _FakeFunction:
    def __init__(self, ptr: int = 0xF00D) -> None:
        self.ptr = ptr


def _params() -> bytes:
    names = param_names()
    values = [i + 1 for i in range(len(names))]
    values[names.index("softmax_scale")] = 0.125
    values[names.index("softmax_scale_log2")] = 0.125 * 1.4426950408889634
    return pack_params(*values)


def test_launch_passes_one_pointer_to_the_packed_params(monkeypatch):
    seen = []

    def fake_launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        # Read through the pointers now, as the driver does during cuLaunchKernel.
        arg0 = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        seen.append((func, gx, gy, gz, bx, by, bz, smem, stream, extra,
                     ctypes.string_at(arg0, PARAMS_STRUCT.size)))

    monkeypatch.setattr(registry_mod, "_launch_kernel", fake_launch)
    kernel = LoadedKernel(cfg=SMALL, device_id=0, arch="sm_80", function=_FakeFunction(), resources=None,
                          lowered_name="_Zfake", params_size=PARAMS_STRUCT.size)
    params = _params()
    kernel.launch((4, 16, 2), 128, SMALL.smem_bytes(), 0xABC, params)
    other = bytes(reversed(params))
    kernel.launch((1, 1, 1), 128, 0, 0, other)
    assert seen[0] == (0xF00D, 4, 16, 2, 128, 1, 1, SMALL.smem_bytes(), 0xABC, 0, params)
    assert seen[1][-1] == other


def test_launch_rejects_wrong_params_size(monkeypatch):
    monkeypatch.setattr(registry_mod, "_launch_kernel", lambda *a: pytest.fail("must not launch"))
    kernel = LoadedKernel(cfg=SMALL, device_id=0, arch="sm_80", function=_FakeFunction(), resources=None,
                          lowered_name="_Zfake", params_size=PARAMS_STRUCT.size)
    with pytest.raises(ValueError, match="params"):
        kernel.launch((1, 1, 1), 128, 0, 0, b"\0" * (PARAMS_STRUCT.size - 1))


def test_launch_from_many_threads_never_mixes_params(monkeypatch):
    errors = []

    def fake_launch(func, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        arg0 = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        time.sleep(0)  # let other threads run mid-launch
        if ctypes.string_at(arg0, PARAMS_STRUCT.size) != bytes([gx]) * PARAMS_STRUCT.size:
            errors.append(gx)

    monkeypatch.setattr(registry_mod, "_launch_kernel", fake_launch)
    kernel = LoadedKernel(cfg=SMALL, device_id=0, arch="sm_80", function=_FakeFunction(), resources=None,
                          lowered_name="_Zfake", params_size=PARAMS_STRUCT.size)

    def worker(tag: int):
        for _ in range(300):
            kernel.launch((tag, 1, 1), 128, 0, 0, bytes([tag]) * PARAMS_STRUCT.size)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_registry_loads_each_key_once_under_contention(monkeypatch):
    calls = []

    def fake_load(self, cfg, device_id, variant):
        calls.append((device_id, cfg))
        time.sleep(0.05)
        return {"forward": LoadedKernel(cfg=cfg, device_id=device_id, arch="sm_80", function=_FakeFunction(),
                                        resources=None, lowered_name="_Zfake", params_size=PARAMS_STRUCT.size)}

    monkeypatch.setattr(KernelRegistry, "_load", fake_load)
    reg = KernelRegistry()
    got = []
    barrier = threading.Barrier(12)

    def worker(i):
        barrier.wait()
        got.append(reg.get(SMALL if i % 2 else BIG, device_id=i % 3))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls, key=str) == sorted({(i % 3, SMALL if i % 2 else BIG) for i in range(12)}, key=str)
    assert len(calls) == 6  # 3 devices x 2 configs, each loaded once
    assert reg.get(SMALL, device_id=1) is reg.get(SMALL, device_id=1)
    assert len(reg.loaded()) == 6
    reg.clear()
    assert reg.loaded() == []


def test_registry_rejects_non_config():
    with pytest.raises(TypeError, match="cfg"):
        KernelRegistry().get("(FP16, 64, 64, 64, 4): async+load_0_0_0_tiles", device_id=0)


def test_get_registry_is_a_singleton():
    assert get_registry() is get_registry()


@pytest.mark.parametrize("cfg", [SMALL, BIG], ids=["24KiB", "64KiB"])
def test_load_compiles_through_cache_and_raises_smem_limit(cfg, tmp_path, monkeypatch):
    """The load path with CUDA faked: the binary comes from the shared cache entry, the function is
    fetched by its lowered name, and only kernels above 48 KiB get the dynamic smem attribute."""
    import cupy
    from cupy_backends.cuda.api import driver

    from cupyflash import device

    loaded_images, set_attrs, devices = [], [], []

    class FakeModule:
        def load(self, image):
            loaded_images.append(image)

        def get_function(self, name):
            self.name = name
            return _FakeFunction(0x1234)

    class FakeDevice:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            devices.append(self.i)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(device, "device_arch", lambda i: ("sm_80", "cubin"))
    monkeypatch.setattr(device, "compute_capability", lambda i: 80)
    monkeypatch.setattr(cupy.cuda.function, "Module", FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", FakeDevice)
    monkeypatch.setattr(driver, "funcSetAttribute", lambda *a: set_attrs.append(a))

    cache = KernelCache(tmp_path)
    expected = compile_config(cfg, "sm_80", cache).module  # as the prewarm would have made it
    kernel = KernelRegistry(cache).get(cfg, device_id=3)
    assert devices == [3]
    assert loaded_images == [expected.binary]
    assert kernel.lowered_name == expected.lowered_names[name_expression(cfg)]
    assert kernel.resources == expected.resources.get(name_expression(cfg))
    assert kernel.arch == "sm_80" and kernel.device_id == 3 and kernel.cfg == cfg
    if cfg.smem_bytes() > DEFAULT_DYNAMIC_SMEM_LIMIT:
        assert set_attrs == [(0x1234, 8, cfg.smem_bytes())]
    else:
        assert set_attrs == []
