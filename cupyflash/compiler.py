"""NVRTC compilation of rendered kernel source, straight through cupy_backends' NVRTC bindings.

Why not `cupy.RawModule`: it picks the target arch from the current device, so it can neither
compile on a machine without a GPU (prewarming caches in CI) nor target an arch-specific variant
such as sm_90a. Calling NVRTC directly gives one path that serves both the run time and the
prewarm, and the resulting cubin/PTX is loaded with `cupy.cuda.function.Module`.

Arch strings: `sm_XY` (optionally `sm_XYa` from sm_90, `sm_XYf` from sm_100) compiles to a cubin
(SASS for that exact arch); `compute_XY` compiles to PTX for the driver to JIT, the fallback for
GPUs newer than the NVRTC in use.
"""
from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from cupy_backends.cuda.libs import nvrtc

__all__ = [
    "KernelCompileError", "KernelResources", "CompiledModule", "BinaryKind",
    "nvrtc_version", "supported_archs", "parse_arch", "binary_kind_of", "compile_options",
    "compile_module", "compile_count", "parse_ptxas_resources",
]

BinaryKind = Literal["cubin", "ptx"]

# C++20 for class-type non-type template parameters (the config struct is the template argument);
# -v makes ptxas report registers and spills per kernel, which we record and test for.
_BASE_OPTIONS = ("-std=c++20", "--ptxas-options=-v", "-DNDEBUG")
_ARCH_RE = re.compile(r"^(?P<prefix>sm|compute)_(?P<number>\d+)(?P<suffix>[af]?)$")
# Arch-specific ('a') variants start at sm_90a, family-specific ('f') ones at sm_100f (CUDA 12.9).
_SUFFIX_MIN_ARCH = {"a": 90, "f": 100}


class KernelCompileError(RuntimeError):
    """NVRTC rejected the source; `log` holds NVRTC's full program log."""

    def __init__(self, message: str, log: str, arch: str, name_expressions: Sequence[str]) -> None:
        super().__init__(f"{message}\n--- NVRTC log ({arch}) ---\n{log}")
        self.log = log
        self.arch = arch
        self.name_expressions = tuple(name_expressions)


@dataclass(frozen=True)
class KernelResources:
    """Per-kernel resource usage reported by ptxas -v."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass(frozen=True)
class CompiledModule:
    """One NVRTC compilation result: a binary plus what is needed to fetch and judge its kernels."""

    arch: str
    binary: bytes
    binary_kind: BinaryKind
    lowered_names: Mapping[str, str]  # name expression -> mangled (lowered) name
    resources: Mapping[str, KernelResources]  # name expression -> ptxas figures (empty for PTX)
    log: str = field(compare=False)  # has ptxas timings, so two identical compiles differ here
    nvrtc_version: tuple[int, int]
    compile_seconds: float = field(default=0.0, compare=False)


# ----------------------------------------------------------------------------- NVRTC facts
@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loaded."""
    major, minor = nvrtc.getVersion()
    return int(major), int(minor)


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """Compute capabilities (e.g. 80, 90) this NVRTC can target, ascending."""
    return tuple(sorted(int(a) for a in nvrtc.getSupportedArchs()))


def parse_arch(arch: str) -> tuple[str, int, str]:
    """Split and validate an arch string into (prefix 'sm'|'compute', number, suffix '', 'a' or 'f')."""
    if not isinstance(arch, str):
        raise ValueError(f"arch: expected a string such as 'sm_90', got {arch!r}")
    m = _ARCH_RE.match(arch.strip())
    if not m:
        raise ValueError(
            f"arch: {arch!r} is not an arch string; expected 'sm_XY' (cubin), 'sm_XYa', or 'compute_XY' (PTX), "
            "e.g. 'sm_80', 'sm_90a'"
        )
    prefix, number, suffix = m.group("prefix"), int(m.group("number")), m.group("suffix")
    if number not in supported_archs():
        listed = ", ".join(f"sm_{a}" for a in supported_archs())
        raise ValueError(
            f"arch: {arch!r} is not supported by NVRTC {'.'.join(map(str, nvrtc_version()))}; supported: {listed}"
        )
    if suffix and number < _SUFFIX_MIN_ARCH[suffix]:
        raise ValueError(
            f"arch: {arch!r}: the '{suffix}' suffix exists only from sm_{_SUFFIX_MIN_ARCH[suffix]}{suffix} on"
        )
    return prefix, number, suffix


def binary_kind_of(arch: str) -> BinaryKind:
    """'cubin' for sm_XY targets, 'ptx' for compute_XY targets."""
    return "cubin" if parse_arch(arch)[0] == "sm" else "ptx"


def compile_options(arch: str) -> tuple[str, ...]:
    """The NVRTC options for `arch`; part of every cache key, so change them only on purpose."""
    prefix, number, suffix = parse_arch(arch)
    return (f"-arch={prefix}_{number}{suffix}",) + _BASE_OPTIONS


# ----------------------------------------------------------------------------- ptxas log
_ENTRY_RE = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_FRAME_RE = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<store>\d+) bytes spill stores, (?P<load>\d+) bytes spill loads"
)
_REGS_RE = re.compile(r"Used (?P<regs>\d+) registers")


def parse_ptxas_resources(log: str) -> dict[str, KernelResources]:
    """Map each mangled entry name in a `ptxas -v` log to its registers, spills and stack frame.

    The map can be empty although the compile succeeded: NVRTC 13.0 on the H100 machine served
    programs it had compiled before (in any process) in ~0.04 s with an empty log. Registers and
    spills are then unknown (None in prewarm reports, '-' in its table); the kernels are fine.

    ptxas reports per entry: 'Compiling entry function' then a 'stack frame / spill' line, then
    'Used N registers'. The figures belong to the entry named last.
    """
    out: dict[str, KernelResources] = {}
    current: str | None = None
    frame = (0, 0, 0)
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current, frame = m.group("name"), (0, 0, 0)
            continue
        if current is None:
            continue
        m = _FRAME_RE.search(line)
        if m:
            frame = (int(m.group("stack")), int(m.group("store")), int(m.group("load")))
            continue
        m = _REGS_RE.search(line)
        if m:
            stack, store, load = frame
            out[current] = KernelResources(int(m.group("regs")), store, load, stack)
            current = None
    return out


# ----------------------------------------------------------------------------- compile counter
_count_lock = threading.Lock()
_compile_count = 0


def compile_count() -> int:
    """Number of NVRTC compilations this process has run (tests assert warm starts add none)."""
    return _compile_count


def _count_compile() -> None:
    global _compile_count
    with _count_lock:
        _compile_count += 1


# ----------------------------------------------------------------------------- compile
def compile_module(source: str, name_expressions: Sequence[str], arch: str) -> CompiledModule:
    """Compile `source` for `arch`, instantiating every name expression; raise KernelCompileError on failure."""
    if not isinstance(source, str):
        raise TypeError(f"source: expected str, got {type(source).__name__}")
    names = list(name_expressions)
    if isinstance(name_expressions, str) or not all(isinstance(n, str) for n in names):
        raise TypeError("name_expressions: expected a sequence of str")
    options = compile_options(arch)
    kind = binary_kind_of(arch)
    _count_compile()
    start = time.perf_counter()
    prog = nvrtc.createProgram(source, "cupyflash.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(
                f"NVRTC failed to compile {len(names)} kernel(s) for {arch}: {exc}",
                _read_log(prog), arch, names,
            ) from None
        log = _read_log(prog)
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        binary = nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    seconds = time.perf_counter() - start
    by_mangled = parse_ptxas_resources(log)
    resources = {name: by_mangled[low] for name, low in lowered.items() if low in by_mangled}
    return CompiledModule(
        arch=arch, binary=bytes(binary), binary_kind=kind, lowered_names=lowered, resources=resources,
        log=log, nvrtc_version=nvrtc_version(), compile_seconds=seconds,
    )


def _read_log(prog: int) -> str:
    try:
        return nvrtc.getProgramLog(prog).rstrip("\x00")
    except nvrtc.NVRTCError:  # the log is a diagnostic; never let it mask the real error
        return ""
