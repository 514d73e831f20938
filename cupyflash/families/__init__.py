"""Kernel families: one object per kind of kernel (see base.KernelFamily), looked up by name, by
config type, or by the prefix of a short form.

Short forms name their family: every family's short form starts with its name, e.g.
'decode (BF16, 128, ...): ...', except the mma.sync forward family's, SPEC §2's original form,
which is the only one that starts with '('. So no two families' strings can collide, and
`parse_config` needs no hint.
"""
from __future__ import annotations

import re
from typing import Any

from ..config import KernelConfig
from .base import KernelFamily, KernelRole, ParamStruct, Variant
from .decode import DECODE
from .forward_sm80 import FORWARD_SM80
from .forward_sm90 import FORWARD_SM90
from .backward_sm80 import BACKWARD_SM80
from .backward_sm90 import BACKWARD_SM90

__all__ = ["FAMILIES", "KernelFamily", "KernelRole", "ParamStruct", "Variant", "get_family", "family_of",
           "parse_config", "pick_family", "register_family", "DEFAULT_FAMILY"]

DEFAULT_FAMILY = FORWARD_SM80.name
FAMILIES: dict[str, KernelFamily] = {}
_BY_TYPE: dict[type, KernelFamily] = {}
_PREFIX_RE = re.compile(r"^\s*(?P<name>[a-z][a-z0-9_]*)\s*(?=\()")


def register_family(family: KernelFamily) -> KernelFamily:
    """Add `family` to the tables (its name and config type must be new)."""
    if not family.name or family.name in FAMILIES:
        raise ValueError(f"family name {family.name!r} is empty or taken")
    if family.config_type in _BY_TYPE or family.config_type.FAMILY != family.name:
        raise ValueError(f"family {family.name}: config type {family.config_type.__name__} is taken or "
                         f"names another family ({family.config_type.FAMILY!r})")
    FAMILIES[family.name] = family
    _BY_TYPE[family.config_type] = family
    return family


def get_family(name: str | KernelFamily) -> KernelFamily:
    """The family called `name` (or `name` itself if it is one); ValueError listing the known ones."""
    if isinstance(name, KernelFamily):
        return name
    family = FAMILIES.get(str(name).strip())
    if family is None:
        raise ValueError(f"family: unknown kernel family {name!r}; known: {', '.join(FAMILIES)}")
    return family


def family_of(cfg: Any) -> KernelFamily:
    """The family whose config type `cfg` is; TypeError for anything else."""
    family = _BY_TYPE.get(type(cfg))
    if family is None:
        raise TypeError(f"cfg: expected a kernel config of one of the families {list(FAMILIES)}, "
                        f"got {type(cfg).__name__}")
    return family


def pick_family(kind: str, compute_capability: int) -> KernelFamily:
    """The family `cfg=None` uses for `kind` ('forward', 'decode', ...) on a device of
    `compute_capability`: the highest `priority` among those that run there (ties: registration
    order). ValueError when none does."""
    best = None
    for family in FAMILIES.values():
        if family.kind == kind and family.supports(compute_capability):
            if best is None or family.priority > best.priority:
                best = family
    if best is None:
        raise ValueError(f"no {kind} kernel family runs on compute capability "
                         f"{compute_capability // 10}.{compute_capability % 10}")
    return best


def parse_config(text: str) -> KernelConfig:
    """Any family's short form -> its config (the family is read off the prefix)."""
    if not isinstance(text, str):
        raise TypeError(f"short form must be a str, got {type(text).__name__}")
    m = _PREFIX_RE.match(text)
    return (get_family(m.group("name")) if m else FORWARD_SM80).parse(text)


register_family(FORWARD_SM80)
register_family(FORWARD_SM90)
register_family(BACKWARD_SM80)
register_family(BACKWARD_SM90)
register_family(DECODE)
