"""Rendering of the backward family's translation unit and its NVRTC name expressions."""
from __future__ import annotations

import dataclasses
import functools

from ...config import DType
from ...render import _environment, kernels_dir
from .config import BackwardKernelConfig
from .params import PARAM_FIELDS

__all__ = ["HEADERS", "TEMPLATE", "ROLES", "render_source", "name_expressions", "config_literal"]

TEMPLATE = "backward_sm80.cu.j2"
# Shared primitives first (one copy in kernels_cu/, not forked), then the family's own headers.
HEADERS = ("ptx.cuh", "tile_primitives.cuh", "backward_sm80/backward_common.cuh",
           "backward_sm80/backward_rows.cuh", "backward_sm80/backward_dkdv.cuh", "backward_sm80/backward_dq.cuh")
# role -> C++ kernel template; each is instantiated as <StaticBackwardKernelConfig<cfg>, causal, deterministic>.
ROLES = {
    "preprocess": "backward_preprocess_kernel",
    "dkdv": "backward_dkdv_kernel",
    "dq": "backward_dq_kernel",            # deterministic mode only
    "convert": "backward_convert_dq_kernel",  # atomic mode only
}


def _cpp_type(field: dataclasses.Field) -> str:
    return {"DType": "DType", "int": "int", "bool": "bool"}[str(field.type)]


def _cpp_value(value) -> str:
    if isinstance(value, DType):
        return f"DType::{value.name}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(int(value))


def config_literal(cfg: BackwardKernelConfig) -> str:
    values = ", ".join(_cpp_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
    return f"BackwardKernelConfig{{{values}}}"


def roles_for(deterministic: bool) -> tuple[str, ...]:
    """The kernels one backward call launches, in launch order."""
    return ("preprocess", "dkdv", "dq") if deterministic else ("preprocess", "dkdv", "convert")


def name_expressions(cfg: BackwardKernelConfig, causal: bool = False, deterministic: bool = False) -> dict[str, str]:
    """role -> the C++ instantiation NVRTC is asked for (only the roles this variant launches)."""
    static = f"StaticBackwardKernelConfig<{config_literal(cfg)}>"
    flags = f"{'true' if causal else 'false'}, {'true' if deterministic else 'false'}"
    return {role: f"{ROLES[role]}<{static}, {flags}>" for role in roles_for(deterministic)}


@functools.cache
def render_source() -> str:
    """The translation unit (the same text for every config: C++ templates specialise)."""
    template = _environment().get_template(TEMPLATE)
    return template.render(
        dtypes=[(d.name, int(d)) for d in DType],
        config_name="BackwardKernelConfig",
        config_fields=[(f.name, _cpp_type(f)) for f in dataclasses.fields(BackwardKernelConfig)],
        param_fields=[(name, ctype) for name, ctype, _ in PARAM_FIELDS],
        headers=[(name, (kernels_dir() / name).read_text()) for name in HEADERS],
    )
