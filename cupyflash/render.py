"""Rendering of the NVRTC translation unit of a kernel family (Jinja2 only assembles text).

Every family's template extends templates/base.cu.j2, which emits the DType enum, the family's
config struct (generated from its dataclass, so the field list has one source of truth), its
parameter structs, and inlines its kernel headers from kernels_cu/ (so the rendered text, whose
hash is the cache key, covers every line NVRTC compiles).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Iterable

import jinja2

from .config import DType, KernelConfig
from .families import DEFAULT_FAMILY, KernelFamily, Variant, family_of, get_family
from .families.base import cpp_type

__all__ = ["render_source", "render_family_source", "name_expression", "name_expressions", "kernels_dir",
           "templates_dir", "KERNEL_HEADERS"]

# The mma.sync forward family's headers (kept as a name for callers that list them).
KERNEL_HEADERS = get_family(DEFAULT_FAMILY).headers


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


def name_expressions(cfg: KernelConfig, variant: Variant | None = None) -> dict[str, str]:
    """role -> C++ template instantiation of every kernel of `cfg`'s family for `variant`."""
    return family_of(cfg).name_expressions(cfg, variant)


def name_expression(cfg: KernelConfig, causal: bool = False) -> str:
    """The forward kernel's instantiation, e.g. flash_forward_kernel<StaticForwardKernelConfig<
    FlashForwardKernelConfig{DType::FP16, 128, ...}>, false>; `causal` selects the masked one.
    (For a family with several kernels or other flags, use `name_expressions`.)"""
    family = family_of(cfg)
    (expr,) = family.name_expressions(cfg, family.variant(causal=causal)).values()
    return expr


@functools.cache
def render_family_source(family: str | KernelFamily) -> str:
    """The translation unit of `family`. It does not depend on the configs: C++ templates
    specialise, and each config is instantiated through its name expressions."""
    fam = get_family(family)
    seen: set[str] = set()
    structs = []
    for role in fam.roles:
        if role.params.name not in seen:
            seen.add(role.params.name)
            structs.append((role.params.name, [(name, ctype) for name, ctype, _ in role.params.fields]))
    return _environment().get_template(fam.template).render(
        family=fam.name,
        dtypes=[(d.name, int(d)) for d in DType],
        config_name=fam.config_type.__name__,
        config_fields=[(f.name, cpp_type(f)) for f in dataclasses.fields(fam.config_type)],
        param_structs=structs,
        extra_configs=[(t.__name__, [(f.name, cpp_type(f)) for f in dataclasses.fields(t)])
                       for t in fam.extra_config_types],
        # Headers are passed as text, not Jinja includes: their inline PTX is full of "{%".
        headers=[(name, (kernels_dir() / name).read_text()) for name in fam.headers],
    )


def render_source(configs: Iterable[KernelConfig] = (), family: str | KernelFamily | None = None) -> str:
    """The translation unit for `configs` (all of one family; default the mma.sync forward family)."""
    fams = {family_of(cfg).name for cfg in configs}
    if family is not None:
        fams.add(get_family(family).name)
    if len(fams) > 1:
        raise ValueError(f"configs: one translation unit per family, got configs of {sorted(fams)}")
    return render_family_source(fams.pop() if fams else DEFAULT_FAMILY)
