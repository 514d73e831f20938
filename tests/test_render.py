"""Rendering of the NVRTC translation unit (no GPU, no NVRTC needed)."""
from __future__ import annotations

import dataclasses
import hashlib
import re
import subprocess
import sys

import pytest

from cupyflash.config import DType
from cupyflash.families.forward_sm80.config import FlashForwardKernelConfig
from cupyflash.families.forward_sm80.config_sets import progression_configs
from cupyflash.families.forward_sm80.params import PARAM_FIELDS
from cupyflash.render import KERNEL_HEADERS, kernels_dir, name_expression, render_source, templates_dir

CFG = FlashForwardKernelConfig.parse(
    "(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax")


@pytest.fixture(scope="module")
def source() -> str:
    return render_source([CFG])


def struct_body(source: str, name: str) -> list[tuple[str, str]]:
    """(C++ type, member name) pairs of `struct name { ... };` in the rendered source."""
    m = re.search(r"struct " + name + r" \{(.*?)\};", source, re.S)
    assert m, f"struct {name} not found in the rendered source"
    members = []
    for line in m.group(1).strip().splitlines():
        decl = re.fullmatch(r"\s*(.+?)\s*(\w+);\s*", line)
        assert decl, f"unexpected line in struct {name}: {line!r}"
        members.append((decl.group(1), decl.group(2)))
    return members


def test_config_struct_matches_dataclass_in_order(source):
    expected_types = {"DType": "DType", "int": "int", "bool": "bool"}
    expected = [(expected_types[str(f.type)], f.name) for f in dataclasses.fields(FlashForwardKernelConfig)]
    assert struct_body(source, "FlashForwardKernelConfig") == expected


def test_params_struct_matches_kernel_abi_in_order(source):
    assert struct_body(source, "ForwardParams") == [(ctype, name) for name, ctype, _ in PARAM_FIELDS]


def test_dtype_enum_matches_python(source):
    m = re.search(r"enum class DType : int \{(.*?)\};", source, re.S)
    assert m
    values = dict(re.findall(r"(\w+) = (\d+),", m.group(1)))
    assert values == {d.name: str(int(d)) for d in DType}


def test_structs_come_before_the_kernel_headers(source):
    first_header = source.index(f"// ---- kernels_cu/{KERNEL_HEADERS[0]}")
    assert source.index("struct FlashForwardKernelConfig {") < first_header
    assert source.index("struct ForwardParams {") < first_header


def test_every_kernel_header_exists_and_is_inlined_in_order(source):
    positions = []
    for name in KERNEL_HEADERS:
        path = kernels_dir() / name
        assert path.is_file(), f"kernels_cu/{name} is listed in KERNEL_HEADERS but missing"
        marker = f"// ---- kernels_cu/{name}\n"
        assert source.count(marker) == 1
        start = source.index(marker) + len(marker)
        text = path.read_text()
        assert source[start:start + len(text)] == text, f"kernels_cu/{name} is not inlined verbatim"
        positions.append(start)
    assert positions == sorted(positions)


def test_no_includes_left_and_no_toolkit_headers(source):
    # Everything NVRTC compiles is in the rendered text (so its hash is the cache key) and no CUDA
    # toolkit header is needed on a driver-only machine.
    assert re.search(r"^\s*#\s*include\b", source, re.M) is None


def test_no_machine_specific_text(source):
    # The source is hashed into the cache key: no paths, so that caches move between machines.
    for directory in (kernels_dir(), templates_dir()):
        assert str(directory) not in source
        assert str(directory.parent) not in source


def test_rendering_is_deterministic(source):
    assert render_source([CFG]) == source
    assert render_source() == source  # the text does not depend on which configs are asked for
    assert render_source(progression_configs(DType.BF16, 64)) == source


def test_rendering_is_deterministic_across_processes(source):
    code = ("import hashlib, sys; from cupyflash.render import render_source; "
            "sys.stdout.write(hashlib.sha256(render_source().encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == hashlib.sha256(source.encode()).hexdigest()


def test_render_rejects_non_configs():
    with pytest.raises(TypeError):
        render_source(["(FP16, 128, 64, 64, 4): load_0_0_0_tiles"])


def test_name_expression_exact_format():
    assert name_expression(CFG) == (
        "flash_forward_kernel<StaticForwardKernelConfig<FlashForwardKernelConfig{"
        "DType::FP16, 128, 64, 64, 4, true, true, true, 0, 2, 2, true, true}>, false, false>"
    )
    assert name_expression(CFG, causal=True) == name_expression(CFG)[:-len("false, false>")] + "true, false>"


NAME_RE = re.compile(
    r"^flash_forward_kernel<StaticForwardKernelConfig<FlashForwardKernelConfig\{(?P<values>[^{}]*)\}>, false, false>$")


def test_name_expression_values_follow_field_order():
    for cfg in progression_configs(DType.BF16, 64):
        m = NAME_RE.match(name_expression(cfg))
        assert m, name_expression(cfg)
        values = m.group("values").split(", ")
        fields = dataclasses.fields(cfg)
        assert len(values) == len(fields)
        for value, f in zip(values, fields):
            attr = getattr(cfg, f.name)
            if isinstance(attr, DType):
                assert value == f"DType::{attr.name}"
            elif isinstance(attr, bool):
                assert value == ("true" if attr else "false")
            else:
                assert value == str(attr)


def test_name_expressions_are_unique():
    configs = progression_configs(DType.BF16, 128) + progression_configs(DType.FP16, 64)
    assert len({name_expression(c) for c in configs}) == len(set(configs))


def test_resource_folders_found():
    assert (templates_dir() / "forward_sm80.cu.j2").is_file() and (templates_dir() / "base.cu.j2").is_file()
    assert kernels_dir().is_dir()
