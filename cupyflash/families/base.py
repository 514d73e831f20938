"""The kernel-family interface: what the cache, registry, prewarm, autotune, CLI and bench need
to know about one kind of kernel, and nothing about any particular kind.

A family names its config dataclass (a `cupyflash.config.KernelConfig`; its fields become the C++
struct of the same name), its translation-unit template and kernel headers, its parameter structs
(passed by value as `__grid_constant__` kernel arguments), the kernels it instantiates per config
(roles), its template flags (variants, e.g. causal masking), its config sets, its launch
geometry and the archs it compiles for. Everything else is generic over families.

One config and one variant compile into one module holding every role's kernel, so the cache
entry of (family, config, variant, arch) is the same whoever asks for it (registry or prewarm).
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Protocol, Sequence

from ..config import DType, KernelConfig

__all__ = ["ParamStruct", "KernelRole", "KernelFamily", "Variant", "TuningProblem"]

# A variant is the tuple of a family's bool template flags, in `variant_flags` order, e.g. (causal,).
Variant = tuple[bool, ...]


@dataclass(frozen=True)
class ParamStruct:
    """A kernel parameter struct: rendered to C++ from `fields` and packed by `pack` from the
    same list, so the two cannot drift. Fields are (member, C++ type, struct format char);
    order them so the struct has no padding (pointers and 64-bit values first)."""

    name: str
    fields: tuple[tuple[str, str, str], ...]

    @cached_property
    def layout(self) -> struct.Struct:
        return struct.Struct("<" + "".join(fmt for _, _, fmt in self.fields))

    @property
    def size(self) -> int:
        return self.layout.size

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.fields)

    def pack(self, *values: Any) -> bytes:
        """The struct's bytes from positional values in field order."""
        return self.layout.pack(*values)


def stride_fields(*tensors: str) -> tuple[tuple[str, str, str], ...]:
    """ParamStruct fields `<t>_batch_stride`, `<t>_seq_stride`, `<t>_head_stride` (64-bit element
    strides) for each tensor name in order: the layout every family passes for its
    (batch, seq, heads, d_head) arrays."""
    return tuple((f"{t}_{dim}_stride", "long long", "q") for t in tensors for dim in ("batch", "seq", "head"))


class TuningProblem(Protocol):
    """One row of a tuning table as a timed problem (see cupyflash.autotune): its own buffers in
    `n_sets` rotating sets, a correctness check and a timed call per config."""

    label: str                 # e.g. 'BF16 d128 S=4096 causal', for progress lines
    flops: float               # per call, for TFLOP/s in the table
    n_sets: int
    info: dict[str, Any]       # stored with the table entry (shape figures)

    def skip_reason(self, cfg: KernelConfig) -> str | None: ...
    def check(self, cfg: KernelConfig) -> str | None: ...
    def timed_call(self, cfg: KernelConfig) -> Callable[[int], Any]: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class KernelRole:
    """One kernel a family instantiates per config: `template` is the C++ `__global__` template,
    instantiated as template<StaticConfig<Config{...}>, flags...>; `params` its argument struct."""

    role: str
    template: str
    params: ParamStruct


class KernelFamily:
    """One kind of kernel. Subclasses set the class attributes and implement the geometry and
    config-set methods; the rest (name expressions, variants, arch checks) is generic."""

    name: str = ""                        # short, unique; prefixes the family's short forms
    kind: str = ""                        # what it computes: "forward", "decode", "backward", ...
    description: str = ""
    config_type: type[KernelConfig] = KernelConfig
    # Config types of other families whose kernels this family's module also instantiates (their
    # C++ structs are rendered too), e.g. backward_sm90 reusing backward_sm80's row kernels.
    extra_config_types: tuple[type[KernelConfig], ...] = ()
    template: str = ""                    # templates/<family>.cu.j2
    headers: tuple[str, ...] = ()         # kernels_cu/-relative paths, in include order
    static_wrapper: str = ""              # C++ template wrapping the config value (derived constants)
    roles: tuple[KernelRole, ...] = ()
    variant_flags: tuple[str, ...] = ()   # bool template arguments after the config
    min_compute_capability: int = 80
    arch_suffix: str = ""                 # "a" for arch-specific instructions (wgmma, setmaxnreg)
    exact_compute_capability: int | None = None  # arch-specific code runs on that capability only
    set_keys: tuple[str, ...] = ()
    priority: int = 0                     # cfg=None prefers the highest among the families that run

    # ------------------------------------------------------------------ configs
    def parse(self, text: str) -> KernelConfig:
        return self.config_type.parse(text)  # type: ignore[attr-defined]

    def is_config(self, cfg: Any) -> bool:
        return type(cfg) is self.config_type

    def config_set(self, key: str) -> list[KernelConfig]:
        """The named config set (keys in `set_keys`), sorted."""
        raise NotImplementedError

    # ------------------------------------------------------------------ variants
    def variant(self, **flags: bool) -> Variant:
        """The variant tuple from flag keywords (unnamed flags are False); ValueError for unknown ones."""
        unknown = set(flags) - set(self.variant_flags)
        if unknown:
            raise ValueError(f"variant: family {self.name} has no flag(s) {sorted(unknown)}; "
                             f"its flags are {list(self.variant_flags)}")
        return tuple(bool(flags.get(name, False)) for name in self.variant_flags)

    def default_variant(self) -> Variant:
        return (False,) * len(self.variant_flags)

    def check_variant(self, variant: Sequence[bool]) -> Variant:
        v = tuple(variant)
        if len(v) != len(self.variant_flags) or not all(isinstance(x, bool) for x in v):
            raise ValueError(f"variant: family {self.name} expects {len(self.variant_flags)} bools "
                             f"({', '.join(self.variant_flags) or 'none'}), got {variant!r}")
        return v

    def variant_label(self, variant: Variant) -> str:
        """' [causal]'-style suffix naming the flags that are on ('' for none)."""
        on = [name for name, value in zip(self.variant_flags, variant) if value]
        return f" [{','.join(on)}]" if on else ""

    def all_variants(self) -> list[Variant]:
        out: list[Variant] = [()]
        for _ in self.variant_flags:
            out = [v + (b,) for v in out for b in (False, True)]
        return out

    # ------------------------------------------------------------------ C++ names
    def config_literal(self, cfg: KernelConfig) -> str:
        """The C++ aggregate of `cfg`, e.g. FlashForwardKernelConfig{DType::FP16, 128, ...}."""
        values = ", ".join(_cpp_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
        return f"{type(cfg).__name__}{{{values}}}"

    def name_expressions(self, cfg: KernelConfig, variant: Variant | None = None) -> dict[str, str]:
        """role -> the C++ template instantiation NVRTC is asked for."""
        variant = self.default_variant() if variant is None else self.check_variant(variant)
        args = "".join(", true" if flag else ", false" for flag in variant)
        static = f"{self.static_wrapper}<{self.config_literal(cfg)}>"
        return {r.role: f"{r.template}<{static}{args}>" for r in self.roles}

    def role(self, role: str | None = None) -> KernelRole:
        if role is None:
            return self.roles[0]
        for r in self.roles:
            if r.role == role:
                return r
        raise ValueError(f"role: family {self.name} has no kernel {role!r}; it has {[r.role for r in self.roles]}")

    # ------------------------------------------------------------------ geometry
    def block_threads(self, cfg: KernelConfig, role: str | None = None) -> int:
        raise NotImplementedError

    def smem_bytes(self, cfg: KernelConfig, role: str | None = None) -> int:
        """Dynamic shared memory of one CTA of `role` (the registry raises the limit above 48 KB)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ tuning
    def default_config(self, dtype: DType, d_head: int) -> KernelConfig:
        """The heuristic pick when no tuning table has an entry."""
        raise NotImplementedError

    def tune_candidates(self, dtype: DType, d_head: int) -> list[KernelConfig]:
        """The autotuning candidates for (dtype, d_head), sorted."""
        return sorted(c for c in self.config_set("tune") if c.dtype is dtype and c.d_head == d_head)  # type: ignore[attr-defined]

    def knob_twins(self, cfg: KernelConfig, causal: bool) -> list[KernelConfig]:
        """Configs that differ from an autotune finalist `cfg` only by launch knobs the tune set
        leaves out (their worth depends on the row); autotune times those of its fastest
        finalists beside the winner and keeps the fastest. None by default."""
        return []

    def progression_configs(self, dtype: DType, d_head: int) -> list[KernelConfig]:
        """The family's optimisation history at (dtype, d_head), in order, each step one knob."""
        raise NotImplementedError

    def tuning_problem(self, dtype: DType, d_head: int, seq: int, causal: bool, l2_bytes: int) -> "TuningProblem":
        """The problem `cupyflash autotune` times for one (dtype, d_head, seq bucket, causal) row."""
        raise NotImplementedError

    # ------------------------------------------------------------------ archs
    def supports(self, compute_capability: int) -> bool:
        if self.exact_compute_capability is not None:
            return compute_capability == self.exact_compute_capability
        return compute_capability >= self.min_compute_capability

    def check_arch(self, arch: str) -> None:
        """ValueError unless this family compiles for `arch` (e.g. sm_90a only for wgmma code)."""
        from ..compiler import parse_arch

        _, number, suffix = parse_arch(arch)
        ok = self.supports(number) and (not self.arch_suffix or suffix == self.arch_suffix)
        if not ok:
            need = (f"sm_{self.exact_compute_capability}{self.arch_suffix}" if self.exact_compute_capability
                    else f"sm_{self.min_compute_capability}{self.arch_suffix} or newer")
            raise ValueError(f"arch: family {self.name} compiles for {need}, not {arch!r}")

    def arch_for_device(self, device_id: int) -> str:
        """The compile target for `device_id` (the device's own SASS where NVRTC knows it)."""
        from ..device import compute_capability, device_arch

        cc = compute_capability(device_id)
        if not self.supports(cc):
            raise ValueError(f"family {self.name} does not run on compute capability {cc // 10}.{cc % 10}")
        if self.arch_suffix:
            return f"sm_{cc}{self.arch_suffix}"
        return device_arch(device_id)[0]

    def default_archs(self) -> tuple[str, ...]:
        """What prewarm builds when asked for this family's usual targets."""
        if self.exact_compute_capability is not None:
            return (f"sm_{self.exact_compute_capability}{self.arch_suffix}",)
        return ("sm_80", "sm_90")

    # ------------------------------------------------------------------ misc
    def describe(self) -> dict[str, Any]:
        return {"family": self.name, "kind": self.kind, "description": self.description,
                "config": self.config_type.__name__, "template": self.template,
                "roles": [r.role for r in self.roles], "variants": list(self.variant_flags),
                "archs": list(self.default_archs()), "sets": list(self.set_keys)}

    def __repr__(self) -> str:
        return f"<KernelFamily {self.name}>"


def _cpp_value(value: Any) -> str:
    if isinstance(value, DType):
        return f"DType::{value.name}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(int(value))


def cpp_type(field: dataclasses.Field) -> str:
    """The C++ member type of a config field (DType, int or bool)."""
    return {"DType": "DType", "int": "int", "bool": "bool"}[str(field.type)]


def sorted_unique(configs: Iterable[KernelConfig]) -> list[KernelConfig]:
    return sorted(set(configs))
