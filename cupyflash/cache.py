"""Content-addressed disk cache of compiled kernel modules, with an in-process memory layer.

Key: sha256 over the kernel family's name, the rendered source, the name expressions, the NVRTC
options (which include the target arch), the NVRTC version, the arch and the cupyflash version. Nothing time-based goes in, so
a cache prewarmed on a CPU-only CI machine is valid on any GPU machine with the same NVRTC.

Entry file `<key>.cfk` layout (all integers little-endian):
    MAGIC (8 bytes) | meta_len u64 | bin_len u64 | meta JSON | binary | sha256 of all preceding bytes
An entry that is truncated, fails its checksum, has another format or belongs to another key is a
miss: it is recompiled and overwritten, never an error. Writes go to a unique temp file in the same
directory, then `os.replace`, so readers and concurrent writers only ever see complete entries.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .atomic_file import write_atomic
from .compiler import CompiledModule, KernelResources, compile_module, compile_options, nvrtc_version

__all__ = ["KernelCache", "CacheLookup", "default_cache", "default_cache_dir", "ENTRY_SUFFIX"]

ENTRY_SUFFIX = ".cfk"
_MAGIC = b"CFKC\x00\x01\r\n"  # format 1; the CR/LF bytes catch text-mode mangling
_HEADER = struct.Struct("<8sQQ")
_DIGEST_SIZE = hashlib.sha256().digest_size
_KEY_SCHEMA = "cupyflash-kernel-cache-key/2"  # /2: the family is part of the key


def _package_version() -> str:
    # Imported at call time: the package __init__ may import modules that import this one.
    from . import __version__

    return __version__


def default_cache_dir() -> Path:
    """$CUPYFLASH_CACHE_DIR if set, else ~/.cache/cupyflash."""
    env = os.environ.get("CUPYFLASH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "cupyflash"


@dataclass(frozen=True)
class CacheLookup:
    """Result of `KernelCache.lookup_or_compile`: the module, its key, and whether it was cached."""

    module: CompiledModule
    key: str
    cached: bool


class KernelCache:
    """Disk cache of `CompiledModule`s (one file per key) plus a per-process memory layer.

    Thread-safe. If the directory cannot be created or written, the cache keeps working in
    memory only and warns exactly once.
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self._memory: dict[str, CompiledModule] = {}
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._disk_ok = True
        self._warned = False

    # --------------------------------------------------------------------- keys
    @staticmethod
    def key(source: str, name_expressions: Sequence[str], arch: str,
            options: Sequence[str] | None = None, family: str = "") -> str:
        """sha256 hex digest naming the compilation of `source` for `arch` (see module doc);
        `family` is the kernel family's name ('' for sources that belong to none)."""
        opts = list(compile_options(arch) if options is None else options)
        payload = json.dumps(
            [_KEY_SCHEMA, family, source, list(name_expressions), opts, list(nvrtc_version()), arch,
             _package_version()],
            ensure_ascii=True, separators=(",", ":"),
        )
        return hashlib.sha256(payload.encode("ascii")).hexdigest()

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}{ENTRY_SUFFIX}"

    @property
    def memory_only(self) -> bool:
        """True once the directory proved unusable and the cache fell back to memory."""
        return not self._disk_ok

    # --------------------------------------------------------------------- get / put
    def get(self, key: str) -> CompiledModule | None:
        """The cached module for `key`, or None (missing, corrupt, truncated or foreign entry)."""
        module = self._memory.get(key)
        if module is not None:
            return module
        if not self._disk_ok:
            return None
        module = self._read(key)
        if module is not None:
            with self._lock:
                self._memory[key] = module
        return module

    def put(self, key: str, module: CompiledModule, short_forms: Sequence[str] = (), family: str = "") -> None:
        """Store `module` under `key` in memory and, if possible, atomically on disk."""
        with self._lock:
            self._memory[key] = module
        if self._disk_ok:
            try:
                self._write(key, module, short_forms, family)
            except OSError as exc:
                self._fall_back_to_memory(exc)

    def lookup_or_compile(self, source: str, name_expressions: Sequence[str], arch: str,
                          short_forms: Sequence[str] = (), family: str = "") -> CacheLookup:
        """Return the cached module for this compilation, compiling and storing it on a miss.

        Threads asking for the same key wait for one compile; separate processes may both
        compile, and the atomic replace leaves one valid entry either way.
        """
        key = self.key(source, name_expressions, arch, family=family)
        module = self.get(key)
        if module is not None:
            return CacheLookup(module, key, True)
        with self._key_lock(key):
            module = self.get(key)
            if module is not None:
                return CacheLookup(module, key, True)
            module = compile_module(source, name_expressions, arch)
            self.put(key, module, short_forms, family)
        return CacheLookup(module, key, False)

    def get_or_compile(self, source: str, name_expressions: Sequence[str], arch: str,
                       short_forms: Sequence[str] = (), family: str = "") -> CompiledModule:
        """`lookup_or_compile(...).module`."""
        return self.lookup_or_compile(source, name_expressions, arch, short_forms, family).module

    # --------------------------------------------------------------------- inspection
    def entries(self) -> list[Path]:
        """Entry files on disk (complete ones only: temp files are skipped)."""
        try:
            return sorted(p for p in self.directory.glob(f"*{ENTRY_SUFFIX}") if p.is_file())
        except OSError:
            return []

    def size_bytes(self) -> int:
        total = 0
        for p in self.entries():
            try:
                total += p.stat().st_size
            except OSError:  # removed by another process meanwhile
                pass
        return total

    def read_metadata(self, path: str | os.PathLike) -> dict | None:
        """Metadata of one entry file, or None if it is not a valid entry."""
        parsed = _parse_entry(Path(path))
        return parsed[0] if parsed else None

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()

    # --------------------------------------------------------------------- internals
    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def _fall_back_to_memory(self, exc: OSError) -> None:
        with self._lock:
            self._disk_ok = False
            if self._warned:
                return
            self._warned = True
        warnings.warn(
            f"cupyflash kernel cache directory {str(self.directory)!r} is not writable ({exc}); "
            "caching compiled kernels in memory only for this process. Set CUPYFLASH_CACHE_DIR to a "
            "writable directory to keep them across runs.",
            RuntimeWarning, stacklevel=4,
        )

    def _read(self, key: str) -> CompiledModule | None:
        parsed = _parse_entry(self.path_for(key))
        if parsed is None:
            return None
        meta, binary = parsed
        try:
            if meta.get("key") != key:  # a file copied or renamed under another key
                return None
            return CompiledModule(
                arch=str(meta["arch"]),
                binary=binary,
                binary_kind=meta["binary_kind"],
                lowered_names={str(k): str(v) for k, v in meta["lowered_names"].items()},
                resources={str(k): KernelResources(**v) for k, v in meta["resources"].items()},
                log=str(meta["log"]),
                nvrtc_version=tuple(int(x) for x in meta["nvrtc_version"]),
                compile_seconds=float(meta["compile_seconds"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def _write(self, key: str, module: CompiledModule, short_forms: Sequence[str], family: str = "") -> None:
        meta = {
            "key": key,
            "family": family,
            "cupyflash_version": _package_version(),
            "arch": module.arch,
            "binary_kind": module.binary_kind,
            "nvrtc_version": list(module.nvrtc_version),
            "lowered_names": dict(module.lowered_names),
            "resources": {k: asdict(v) for k, v in module.resources.items()},
            "short_forms": list(short_forms),
            "compile_seconds": module.compile_seconds,
            "log": module.log,
        }
        meta_bytes = json.dumps(meta, sort_keys=True).encode("utf-8")
        body = _HEADER.pack(_MAGIC, len(meta_bytes), len(module.binary)) + meta_bytes + module.binary
        data = body + hashlib.sha256(body).digest()
        # fsync before the rename: a crash must never expose an entry whose data is not on disk.
        write_atomic(self.path_for(key), data, durable=True)


def _parse_entry(path: Path) -> tuple[dict, bytes] | None:
    """(metadata, binary) of a well-formed entry file, else None. Never raises for bad content."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _HEADER.size + _DIGEST_SIZE:
        return None
    magic, meta_len, bin_len = _HEADER.unpack_from(data)
    if magic != _MAGIC or _HEADER.size + meta_len + bin_len + _DIGEST_SIZE != len(data):
        return None
    body, digest = data[:-_DIGEST_SIZE], data[-_DIGEST_SIZE:]
    if hashlib.sha256(body).digest() != digest:
        return None
    meta_end = _HEADER.size + meta_len
    try:
        meta = json.loads(body[_HEADER.size:meta_end].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    return meta, bytes(body[meta_end:])


_default_lock = threading.Lock()
_default_caches: dict[Path, KernelCache] = {}


def default_cache() -> KernelCache:
    """The process-wide cache for the current default directory ($CUPYFLASH_CACHE_DIR or ~/.cache).

    One instance per directory, so changing the environment variable mid-process switches caches
    instead of silently writing to the old one.
    """
    directory = default_cache_dir()
    with _default_lock:
        cache = _default_caches.get(directory)
        if cache is None:
            cache = _default_caches[directory] = KernelCache(directory)
        return cache
