"""NVRTC compilation through cupy_backends (no GPU needed)."""
import pytest

from cupyflash import compiler
from cupyflash.compiler import (
    CompiledModule, KernelCompileError, KernelResources, compile_count, compile_module, compile_options,
    nvrtc_version, parse_ptxas_resources, supported_archs,
)
from tiny_kernels import BROKEN_SOURCE, TINY_NAMES, TINY_SOURCE


def test_nvrtc_version_and_archs():
    major, minor = nvrtc_version()
    assert major >= 12 and minor >= 0
    assert {80, 90} <= set(supported_archs())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tiny_kernel_compiles_to_cubin(arch):
    before = compile_count()
    module = compile_module(TINY_SOURCE, TINY_NAMES, arch)
    assert compile_count() == before + 1
    assert isinstance(module, CompiledModule)
    assert module.arch == arch and module.binary_kind == "cubin"
    assert module.binary[:4] == b"\x7fELF"
    assert module.nvrtc_version == nvrtc_version()
    assert module.compile_seconds > 0
    assert set(module.lowered_names) == set(TINY_NAMES)
    lowered = set(module.lowered_names.values())
    assert len(lowered) == 2 and all(name.startswith("_Z") and "tiny_kernel" in name for name in lowered)
    # Every kernel's resources come from the ptxas -v log, keyed by its name expression.
    if "ptxas" not in module.log:  # NVRTC answered from its own cache, without a report
        assert module.resources == {}
        return
    assert set(module.resources) == set(TINY_NAMES)
    for res in module.resources.values():
        assert isinstance(res, KernelResources)
        assert 0 < res.registers <= 255
        assert res.spill_store_bytes == res.spill_load_bytes == res.stack_frame_bytes == 0
    assert f"for '{arch}'" in module.log


def test_arch_specific_cubin_sm_90a():
    module = compile_module(TINY_SOURCE, TINY_NAMES[:1], "sm_90a")
    assert module.binary_kind == "cubin" and module.binary[:4] == b"\x7fELF"
    assert "sm_90a" in module.log


def test_compute_arch_gives_ptx_without_resources():
    module = compile_module(TINY_SOURCE, TINY_NAMES, "compute_90")
    assert module.binary_kind == "ptx"
    assert b".target sm_90" in module.binary
    assert set(module.lowered_names) == set(TINY_NAMES)
    assert module.resources == {}  # ptxas does not run for PTX output


def test_compile_error_raises_with_log():
    before = compile_count()
    with pytest.raises(KernelCompileError) as info:
        compile_module(BROKEN_SOURCE, ["broken_kernel<3>"], "sm_80")
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "error" in err.log and 'expected a ";"' in err.log
    assert err.log in str(err)
    assert err.arch == "sm_80" and err.name_expressions == ("broken_kernel<3>",)
    assert compile_count() == before + 1  # failed compiles are counted too


def test_unknown_name_expression_is_a_compile_error():
    with pytest.raises(KernelCompileError):
        compile_module(TINY_SOURCE, ["no_such_kernel<1>"], "sm_80")


@pytest.mark.parametrize("arch", ["sm_8", "sm80", "80", "sm_91", "sm_80a", "sm_90f", "sm_1000", "", "SM_80"])
def test_bad_arch_raises_value_error_naming_argument(arch):
    with pytest.raises(ValueError, match="arch"):
        compile_options(arch)
    with pytest.raises(ValueError, match="arch"):
        compile_module(TINY_SOURCE, TINY_NAMES, arch)


def test_bad_arch_type():
    with pytest.raises(ValueError, match="arch"):
        compile_options(90)


def test_compile_options():
    assert compile_options("sm_90") == ("-arch=sm_90", "-std=c++20", "--ptxas-options=-v", "-DNDEBUG")
    assert compile_options("sm_90a")[0] == "-arch=sm_90a"
    assert compile_options("compute_80")[0] == "-arch=compute_80"
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
        assert compile_options(arch)[0] == f"-arch={arch}"


def test_name_expressions_must_be_strings():
    with pytest.raises(TypeError):
        compile_module(TINY_SOURCE, TINY_NAMES[0], "sm_80")  # a bare str, not a sequence of them
    with pytest.raises(TypeError):
        compile_module(TINY_SOURCE, [1], "sm_80")


def test_parse_ptxas_resources():
    log = (
        "ptxas info    : 0 bytes gmem\n"
        "ptxas info    : Compiling entry function '_Z1aPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1aPf\n"
        "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 384 bytes cmem[0]\n"
        "ptxas info    : Compile time = 1.0 ms\n"
        "ptxas info    : Compiling entry function '_Z1bPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1bPf\n"
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 10 registers, used 0 barriers\n"
    )
    res = parse_ptxas_resources(log)
    assert res == {
        "_Z1aPf": KernelResources(registers=255, spill_store_bytes=8, spill_load_bytes=12, stack_frame_bytes=16),
        "_Z1bPf": KernelResources(registers=10, spill_store_bytes=0, spill_load_bytes=0, stack_frame_bytes=0),
    }
    assert res["_Z1aPf"].spill_bytes == 20
    assert parse_ptxas_resources("") == {}


def test_compile_count_is_thread_safe():
    import threading

    before = compile_count()

    def bump():
        for _ in range(1000):
            compiler._count_compile()

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compile_count() == before + 8000
