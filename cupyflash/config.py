"""What every kernel family's configuration shares: the element type and the config base class.

A family's config is a frozen, ordered dataclass deriving from `KernelConfig`. Its fields are the
one source of truth: the C++ struct of the same name, the NVRTC name expression, the short form
and the cache key are all derived from them (see cupyflash.families and cupyflash.render).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, ClassVar, Iterator

import numpy as np

__all__ = ["DType", "KernelConfig", "SUPPORTED_D_HEADS", "is_pow2"]

SUPPORTED_D_HEADS = (64, 96, 128, 256)


class DType(enum.IntEnum):
    """Element type of Q, K, V and O. Softmax and accumulation are always fp32."""

    FP16 = 0
    BF16 = 1

    @property
    def itemsize(self) -> int:
        return 2

    @property
    def numpy_dtype(self) -> np.dtype:
        if self is DType.FP16:
            return np.dtype(np.float16)
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)

    @classmethod
    def from_numpy(cls, dtype) -> "DType":
        """Map a numpy/cupy dtype (fp16 or ml_dtypes.bfloat16) to a DType; ValueError otherwise."""
        dt = np.dtype(dtype)
        if dt == np.float16:
            return cls.FP16
        if dt.name == "bfloat16":
            return cls.BF16
        raise ValueError(f"unsupported dtype {dt}: expected float16 or bfloat16")

    @classmethod
    def parse(cls, text: str) -> "DType":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown dtype {text!r}: expected one of {[d.name for d in cls]}") from None


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


class KernelConfig:
    """Base of every family's config dataclass (declare it `@dataclass(frozen=True, order=True)`).

    Subclasses set FAMILY (the name of their kernel family), yield their rules from `_rules()`
    as (description, holds) pairs, and implement `short_form()` / `parse()`. This base checks
    field kinds and rules in `__post_init__`, so an invalid combination raises ValueError naming
    the rule instead of failing later in C++.
    """

    FAMILY: ClassVar[str] = ""

    def __post_init__(self) -> None:
        dtype = getattr(self, "dtype", None)
        if dtype is not None and not isinstance(dtype, DType):
            if isinstance(dtype, str):
                object.__setattr__(self, "dtype", DType.parse(dtype))
            else:
                raise ValueError(f"dtype: expected DType, got {dtype!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{f.name}: expected bool, got {value!r}")
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise ValueError(f"{f.name}: expected int, got {value!r}")
        for rule, ok in self._rules():
            if not ok:
                raise ValueError(f"invalid {type(self).__name__} {self.short_form()}: rule violated: {rule}")

    def _rules(self) -> Iterator[tuple[str, bool]]:
        return iter(())

    @staticmethod
    def _match_short_form(text: Any, pattern: re.Pattern, expected: str) -> re.Match:
        """`pattern`'s match of a short form (surrounding spaces ignored): TypeError for a
        non-string, ValueError quoting `expected` when it does not match (parse()'s first step)."""
        if not isinstance(text, str):
            raise TypeError(f"short form must be a str, got {type(text).__name__}")
        m = pattern.match(text.strip())
        if not m:
            raise ValueError(f"cannot parse kernel config {text!r}: expected {expected}")
        return m

    def short_form(self) -> str:  # pragma: no cover - every family defines its own
        raise NotImplementedError

    def __str__(self) -> str:
        return self.short_form()

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if "dtype" in d:
            d["dtype"] = self.dtype.name
        return d
