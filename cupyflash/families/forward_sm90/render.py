"""Rendering of the Hopper forward family's NVRTC translation unit and its name expressions."""
from __future__ import annotations

import dataclasses
import functools

from ...config import DType
from ...render import _environment, kernels_dir
from .config import HopperForwardKernelConfig
from .params import DESCRIPTOR_OFFSETS, PARAM_FIELDS, PARAMS_SIZE

__all__ = ["HEADERS", "TEMPLATE", "KERNEL_TEMPLATE", "render_source", "name_expression"]

TEMPLATE = "forward_sm90.cu.j2"
KERNEL_TEMPLATE = "flash_forward_sm90_kernel"
STATIC_WRAPPER = "StaticHopperForwardConfig"
# kernels_cu/-relative, in include order; the rendered source inlines them (its hash covers them).
HEADERS = (
    "ptx.cuh", "online_softmax.cuh",
    "common/ptx_sm90.cuh", "common/wgmma_sm90.cuh",
    "forward_sm90/config.cuh", "forward_sm90/tile_scheduler.cuh", "forward_sm90/producer.cuh",
    "forward_sm90/softmax.cuh", "forward_sm90/mainloop.cuh", "forward_sm90/epilogue.cuh",
    "forward_sm90/kernel.cuh",
)


def _cpp_type(field: dataclasses.Field) -> str:
    return {"DType": "DType", "int": "int", "bool": "bool"}[str(field.type)]


def _cpp_value(value) -> str:
    if isinstance(value, DType):
        return f"DType::{value.name}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(int(value))


def name_expression(cfg: HopperForwardKernelConfig, causal: bool = False) -> str:
    """flash_forward_sm90_kernel<StaticHopperForwardConfig<HopperForwardKernelConfig{...}>, causal>."""
    values = ", ".join(_cpp_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
    flag = "true" if causal else "false"
    return f"{KERNEL_TEMPLATE}<{STATIC_WRAPPER}<HopperForwardKernelConfig{{{values}}}>, {flag}>"


@functools.cache
def render_source() -> str:
    """The translation unit (the same text for every config: C++ templates specialise)."""
    template = _environment().get_template(TEMPLATE)
    return template.render(
        dtypes=[(d.name, int(d)) for d in DType],
        config_fields=[(f.name, _cpp_type(f)) for f in dataclasses.fields(HopperForwardKernelConfig)],
        param_fields=[(name, ctype) for name, ctype, _ in PARAM_FIELDS],
        params_size=PARAMS_SIZE,
        descriptor_offsets=sorted(DESCRIPTOR_OFFSETS.items(), key=lambda kv: kv[1]),
        headers=[(name, (kernels_dir() / name).read_text()) for name in HEADERS],
    )
