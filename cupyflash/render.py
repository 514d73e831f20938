"""Rendering of the NVRTC translation unit from kernel configs (Jinja2 only assembles text)."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Iterable

import jinja2

from .config import DType, FlashForwardKernelConfig
from .kernel_abi import PARAM_FIELDS

__all__ = ["render_source", "name_expression", "kernels_dir", "templates_dir", "KERNEL_HEADERS"]

# Headers of kernels_cu/ in dependency order; the rendered source inlines them so that its hash
# covers every line NVRTC compiles.
KERNEL_HEADERS = ("ptx.cuh", "tile_primitives.cuh", "online_softmax.cuh", "flash_forward.cuh")
TEMPLATE_NAME = "flash_forward.cu.j2"


def _resource_dir(name: str) -> Path:
    """kernels_cu/ and templates/ live inside the package in a wheel, at the repo root in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / name, here.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cupyflash resource folder {name!r} not found next to {here}")


@functools.cache
def kernels_dir() -> Path:
    return _resource_dir("kernels_cu")


@functools.cache
def templates_dir() -> Path:
    return _resource_dir("templates")


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _cpp_type(field: dataclasses.Field) -> str:
    return {"DType": "DType", "int": "int", "bool": "bool"}[str(field.type)]


def _cpp_value(value) -> str:
    if isinstance(value, DType):
        return f"DType::{value.name}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(int(value))


def name_expression(cfg: FlashForwardKernelConfig, causal: bool = False) -> str:
    """The C++ template instantiation NVRTC is asked for, e.g.
    flash_forward_kernel<StaticForwardKernelConfig<FlashForwardKernelConfig{DType::FP16, 128, ...}>, false>.
    `causal` selects the causally masked instantiation of the same config."""
    values = ", ".join(_cpp_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
    flag = "true" if causal else "false"
    return f"flash_forward_kernel<StaticForwardKernelConfig<FlashForwardKernelConfig{{{values}}}>, {flag}>"


@functools.cache
def _render_cached() -> str:
    template = _environment().get_template(TEMPLATE_NAME)
    return template.render(
        dtypes=[(d.name, int(d)) for d in DType],
        config_fields=[(f.name, _cpp_type(f)) for f in dataclasses.fields(FlashForwardKernelConfig)],
        param_fields=[(name, ctype) for name, ctype, _ in PARAM_FIELDS],
        # Headers are passed as text, not Jinja includes: their inline PTX is full of "{%".
        headers=[(name, (kernels_dir() / name).read_text()) for name in KERNEL_HEADERS],
    )


def render_source(configs: Iterable[FlashForwardKernelConfig] = ()) -> str:
    """The translation unit for `configs`.

    The text does not depend on which configs are asked for: C++ templates specialise, and each
    config is instantiated through its name expression at compile time. The argument is kept so
    callers state what the source is for (and for future per-config text).
    """
    for cfg in configs:
        if not isinstance(cfg, FlashForwardKernelConfig):
            raise TypeError(f"render_source: expected FlashForwardKernelConfig, got {type(cfg).__name__}")
    return _render_cached()
