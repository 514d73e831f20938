"""Persisted tuning tables and the cfg=None / 'auto' config choice, for every kernel family.

A `TuningTable` maps (dtype, d_head, seq bucket, causal) to the fastest config of one kernel
family (its `family` field; tables without one are the mma.sync forward family's) measured on
one GPU model. `cupyflash.autotune` writes them; `tuned_config` reads them for `forward(cfg=None)`:

1. the user's table for this exact device name, `<cache dir>/tuning/<device slug>.json`
   (cache dir: $CUPYFLASH_CACHE_DIR or ~/.cache/cupyflash), written by `cupyflash autotune`;
2. a table shipped in this package (`default_<gpu>.json` for the mma.sync forward family,
   `default_<gpu>.<family>.json` for the others) whose `match` token is one of the device name's
   words (e.g. 'H100' in 'NVIDIA H100 80GB HBM3'), then one that lists a word of it in
   `also_match` (another model it was measured on);
3. a shipped table whose `fallback_arch` is the device's arch ('sm_90'): the nearest measured
   model of that architecture serves those no table names (H800, GH200, H20);
4. otherwise None, and the caller uses the family's heuristic default (`KernelFamily.default_config`).

A tuned config serves any problem of its (dtype, d_head): the kernel masks sequence tails, so
lengths need not be multiples of the config's B_r/B_c. Causal calls use the table's causal rows
(`autotune --causal`) where it has any for their (dtype, d_head), else the non-causal rows; GQA/MQA
calls use the same rows as MHA (measured with as many k/v heads as q heads). A table file that is
unreadable or invalid is reported once with a RuntimeWarning and skipped, never an error.

Tables are read once per process and choices are cached per (dtype, d_head, seq_len_q,
seq_len_k, device, causal); `clear_caches()` forgets them (autotune calls it after writing a table).

The bucket is chosen by seq_len_k: in the tuning grid (batch*seq fixed) every bucket launches
the same number of CTAs, so what differs between buckets is the length of the K/V loop.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..atomic_file import write_atomic
from ..config import DType, KernelConfig
from ..families import DEFAULT_FAMILY, get_family

__all__ = [
    "SEQ_BUCKETS", "SCHEMA", "TuningEntry", "TuningTable", "TuningTableError", "pick_bucket",
    "device_slug", "device_family", "user_table_path", "default_tables_dir", "default_table_path",
    "tuned_config", "explain_choice", "device_name", "device_arch_name", "clear_caches",
]

SEQ_BUCKETS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
SCHEMA = "cupyflash-tuning-table/1"
DEFAULT_PREFIX = "default_"


class TuningTableError(ValueError):
    """A tuning table file or dict is malformed."""


@dataclass(frozen=True)
class TuningEntry:
    """The winner for one (dtype, d_head, seq bucket, causal), with what was measured."""

    config: KernelConfig
    seq: int
    tflops: float | None = None
    ms: float | None = None
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    causal: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {"dtype": self.config.dtype.name, "d_head": self.config.d_head, "seq": self.seq}
        if self.causal:  # absent means False: tables written before the field read the same
            out["causal"] = True
        return {**out, "config": self.config.short_form(), "tflops": self.tflops, "ms": self.ms, **self.info}


def pick_bucket(buckets: Iterable[int], seq_len: int) -> int | None:
    """The largest bucket <= seq_len, else the smallest bucket; None when there are none."""
    buckets = sorted(buckets)
    if not buckets:
        return None
    below = [b for b in buckets if b <= seq_len]
    return below[-1] if below else buckets[0]


_ARCH_RE = re.compile(r"^sm_\d{2,3}[a-z]?$")


def _name_tokens(name: str) -> set[str]:
    return {t for t in re.split(r"[^A-Z0-9]+", name.upper()) if t}


class TuningTable:
    """Tuned configs of one device (exact `device` name) or device family (`match` token), and
    optionally of other models measured to run its picks well (`also_match` tokens: a table that
    names the device itself comes first) and of the unnamed models of one architecture
    (`fallback_arch`, e.g. 'sm_90': used only where no table names the device)."""

    def __init__(self, device: str | None = None, match: str | None = None, comment: str | None = None,
                 meta: dict[str, Any] | None = None, family: str = DEFAULT_FAMILY,
                 also_match: Iterable[str] = (), fallback_arch: str | None = None) -> None:
        self.family = get_family(family).name
        self.device = device
        self.match = match
        self.also_match = tuple(t.upper() for t in also_match)
        if fallback_arch is not None and not _ARCH_RE.match(fallback_arch):
            raise TuningTableError(f"fallback_arch: expected an arch like 'sm_90', got {fallback_arch!r}")
        self.fallback_arch = fallback_arch
        self.comment = comment
        self.meta: dict[str, Any] = dict(meta or {})
        self._entries: dict[tuple[DType, int, bool, int], TuningEntry] = {}

    # ------------------------------------------------------------------ entries
    def set(self, config: KernelConfig, seq: int, tflops: float | None = None,
            ms: float | None = None, *, causal: bool = False, **info: Any) -> TuningEntry:
        """Record `config` as the winner for (config.dtype, config.d_head, seq, causal)."""
        if not get_family(self.family).is_config(config):
            raise TypeError(f"config: expected a {get_family(self.family).config_type.__name__} "
                            f"(the table's family is {self.family}), got {type(config).__name__}")
        if int(seq) <= 0:
            raise ValueError(f"seq: expected a positive bucket, got {seq!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal: expected a bool, got {causal!r}")
        entry = TuningEntry(config, int(seq), tflops, ms, dict(info), causal)
        self._entries[(config.dtype, config.d_head, causal, int(seq))] = entry
        return entry

    def entries(self) -> list[TuningEntry]:
        """All entries, sorted by (dtype, d_head, causal, seq)."""
        return [self._entries[k] for k in sorted(self._entries)]

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, dtype: DType, d_head: int, seq_len: int, causal: bool = False) -> TuningEntry | None:
        """The entry of the bucket `seq_len` falls in (see `pick_bucket`), or None. A causal
        problem takes the causal rows of its (dtype, d_head) when there are any, else the
        non-causal ones."""
        dtype = DType(dtype)
        for rows_causal in ((True, False) if causal else (False,)):
            bucket = pick_bucket((s for (dt, d, c, s) in self._entries
                                  if dt is dtype and d == d_head and c == rows_causal), seq_len)
            if bucket is not None:
                return self._entries[(dtype, d_head, rows_causal, bucket)]
        return None

    def match_strength(self, device_name: str | None) -> int:
        """2 when this table is `device_name`'s own: the same name (case-insensitive), or `match`
        is one of its words ('H100' matches 'NVIDIA H100 80GB HBM3', not 'H1000'); 1 when one of
        `also_match` is ('H200' matches 'NVIDIA H200', not 'NVIDIA H20'); 0 otherwise."""
        if not device_name:
            return 0
        if self.device and self.device.strip().lower() == device_name.strip().lower():
            return 2
        tokens = _name_tokens(device_name)
        if self.match and self.match.upper() in tokens:
            return 2
        return 1 if tokens.intersection(self.also_match) else 0

    def matches(self, device_name: str | None) -> bool:
        """True when this table applies to `device_name` (match_strength above 0)."""
        return self.match_strength(device_name) > 0

    def serves_arch(self, arch: str | None) -> bool:
        """True when this table is the fallback of devices of `arch` ('sm_90') that no table names."""
        return arch is not None and self.fallback_arch == arch

    def lookup(self, device_name: str | None, dtype: DType, d_head: int,
               seq_len: int, causal: bool = False, arch: str | None = None) -> KernelConfig | None:
        """The tuned config for this device and problem, or None (other device, or no entry). With
        `arch`, a table whose `fallback_arch` it is serves any device name; the caller tries the
        tables that name the device first (`explain_choice`)."""
        if not (self.matches(device_name) or self.serves_arch(arch)):
            return None
        entry = self.get(dtype, d_head, seq_len, causal)
        return entry.config if entry is not None else None

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "device": self.device, "match": self.match}
        if self.also_match:  # absent in older tables: they serve their own device or family only
            out["also_match"] = list(self.also_match)
        if self.fallback_arch:  # absent: the table serves only the models it names
            out["fallback_arch"] = self.fallback_arch
        if self.family != DEFAULT_FAMILY:  # absent means the mma.sync forward family: older tables read the same
            out["family"] = self.family
        if self.comment:
            out["comment"] = self.comment
        out.update({"meta": self.meta, "entries": [e.to_dict() for e in self.entries()]})
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "TuningTable":
        """Parse and validate; TuningTableError naming the first problem."""
        if not isinstance(data, dict):
            raise TuningTableError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise TuningTableError(f"schema is {data.get('schema')!r}, expected {SCHEMA!r}")
        device, match = data.get("device"), data.get("match")
        for key, value in (("device", device), ("match", match), ("comment", data.get("comment"))):
            if value is not None and not isinstance(value, str):
                raise TuningTableError(f"{key}: expected a string or null, got {value!r}")
        also_match = data.get("also_match", [])
        if not isinstance(also_match, list) or not all(isinstance(t, str) and t.strip() for t in also_match):
            raise TuningTableError(f"also_match: expected a list of model names (e.g. ['H200']), got {also_match!r}")
        fallback_arch = data.get("fallback_arch")
        if fallback_arch is not None and not (isinstance(fallback_arch, str) and _ARCH_RE.match(fallback_arch)):
            raise TuningTableError(f"fallback_arch: expected an arch like 'sm_90' or null, got {fallback_arch!r}")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise TuningTableError(f"meta: expected an object, got {type(meta).__name__}")
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise TuningTableError("entries: expected a list")
        family_name = data.get("family", DEFAULT_FAMILY)
        try:
            family = get_family(family_name)
        except ValueError as exc:
            raise TuningTableError(str(exc)) from None
        table = cls(device, match, data.get("comment"), meta, family.name, [t.strip() for t in also_match],
                    fallback_arch)
        for i, item in enumerate(entries):
            try:
                cfg = family.parse(item["config"])
                dtype, d_head, seq = DType.parse(item["dtype"]), int(item["d_head"]), int(item["seq"])
                tflops = None if item.get("tflops") is None else float(item["tflops"])
                ms = None if item.get("ms") is None else float(item["ms"])
                causal = item.get("causal", False)
                if not isinstance(causal, bool):
                    raise TypeError(f"causal: expected true or false, got {causal!r}")
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise TuningTableError(f"entries[{i}]: {type(exc).__name__}: {exc}") from None
            if (cfg.dtype, cfg.d_head) != (dtype, d_head):
                raise TuningTableError(f"entries[{i}]: config {cfg} does not match dtype {dtype.name} "
                                       f"and d_head {d_head}")
            if seq <= 0 or (tflops is not None and not math.isfinite(tflops)):
                raise TuningTableError(f"entries[{i}]: bad seq {seq} or tflops {tflops}")
            info = {k: v for k, v in item.items()
                    if k not in ("dtype", "d_head", "seq", "causal", "config", "tflops", "ms")}
            table.set(cfg, seq, tflops, ms, causal=causal, **info)
        return table

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TuningTable":
        """Read a table file; OSError if unreadable, TuningTableError if malformed."""
        raw = Path(path).read_bytes()
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
            raise TuningTableError(f"not valid UTF-8 JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file + rename), so a reader never sees half a table."""
        path = write_atomic(path, (json.dumps(self.to_dict(), indent=1) + "\n").encode("utf-8"))
        return path


# ---------------------------------------------------------------------------- where tables live
def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (file-name safe)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


_FAMILY_RE = re.compile(r"^[A-Z]{1,3}\d{2,4}[A-Z]?$")


def device_family(name: str) -> str | None:
    """The model token of a device name ('H100', 'A100', 'L40S', 'A6000'), or None."""
    for token in re.split(r"[^A-Z0-9]+", name.upper()):
        if _FAMILY_RE.match(token):
            return token
    return None


def user_table_path(name: str, cache_dir: str | os.PathLike | None = None, family: str = DEFAULT_FAMILY) -> Path:
    """`<cache dir>/tuning/<device slug>[.<family>].json`, the table `cupyflash autotune` writes by
    default (no family suffix for the mma.sync forward family)."""
    if cache_dir is None:
        from ..cache import default_cache_dir

        cache_dir = default_cache_dir()
    suffix = "" if get_family(family).name == DEFAULT_FAMILY else f".{family}"
    return Path(cache_dir) / "tuning" / f"{device_slug(name)}{suffix}.json"


def default_tables_dir() -> Path:
    """The folder of the tables shipped in the package (this package's folder)."""
    return Path(__file__).resolve().parent


def default_table_path(name: str, family: str = DEFAULT_FAMILY) -> Path:
    """Where `autotune --write-default` stores the shipped table of kernel family `family` for the
    GPU model of device `name`."""
    gpu = (device_family(name) or device_slug(name)).lower()
    suffix = "" if get_family(family).name == DEFAULT_FAMILY else f".{family}"
    return default_tables_dir() / f"{DEFAULT_PREFIX}{gpu}{suffix}.json"


# ---------------------------------------------------------------------------- loading, cached
_lock = threading.Lock()
_tables: dict[Path, TuningTable | None] = {}  # path -> table, None when missing or invalid
_device_names: dict[int, str | None] = {}
_device_archs: dict[int, str | None] = {}


def _load_cached(path: Path) -> TuningTable | None:
    with _lock:
        if path in _tables:
            return _tables[path]
    table: TuningTable | None = None
    if path.is_file():
        try:
            table = TuningTable.load(path)
        except (OSError, TuningTableError) as exc:
            warnings.warn(f"cupyflash: ignoring tuning table {str(path)!r} ({exc}); "
                          "falling back to the next table or the default config. "
                          "Rerun `python -m cupyflash autotune` to rewrite it.", RuntimeWarning, stacklevel=2)
    with _lock:
        _tables[path] = table
    return table


def _default_tables() -> list[tuple[Path, TuningTable]]:
    out = []
    for path in sorted(default_tables_dir().glob(f"{DEFAULT_PREFIX}*.json")):
        table = _load_cached(path)
        if table is not None:
            out.append((path, table))
    return out


def device_name(device: int) -> str | None:
    """CUDA device name of `device`, or None when it cannot be read (no GPU). Cached."""
    if device in _device_names:
        return _device_names[device]
    name: str | None
    try:
        import cupy

        raw = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:  # no driver / no device: no table applies, the heuristic is used
        name = None
    _device_names[device] = name
    return name


def device_arch_name(device: int) -> str | None:
    """'sm_XY' of `device`'s compute capability, or None when it cannot be read (no GPU). Cached."""
    if device in _device_archs:
        return _device_archs[device]
    arch: str | None
    try:
        from ..device import compute_capability

        arch = f"sm_{compute_capability(device)}"
    except Exception:  # no driver / no device: no fallback table applies
        arch = None
    _device_archs[device] = arch
    return arch


@functools.lru_cache(maxsize=4096)
def explain_choice(dtype: DType, d_head: int, seq_len_q: int, seq_len_k: int,
                   name: str | None, causal: bool = False,
                   family: str = DEFAULT_FAMILY, arch: str | None = None) -> tuple[KernelConfig | None, str]:
    """(tuned config of `family` or None, where it came from) for a device called `name` of
    architecture `arch` ('sm_90'; None: no fallback tables).

    Sources: 'user table <path>', 'default table <path>' (a table naming the device),
    'default table <path> (fallback for sm_XY)' (the nearest measured model of the arch), or
    'heuristic' (config None: the caller uses the family's default config).
    """
    candidates: list[tuple[str, TuningTable | None]] = []
    shipped = _default_tables()
    if name:
        path = user_table_path(name, family=family)
        candidates.append((f"user table {path}", _load_cached(path)))
        # shipped tables of this model before those that only also serve it (sorted is stable)
        named = sorted((item for item in shipped if item[1].matches(name)),
                       key=lambda item: -item[1].match_strength(name))
        candidates += [(f"default table {path}", table) for path, table in named]
    if arch:
        candidates += [(f"default table {path} (fallback for {arch})", table) for path, table in shipped
                       if table.serves_arch(arch) and not (name and table.matches(name))]
    for source, table in candidates:
        if table is None or table.family != family:
            continue
        cfg = table.lookup(name, dtype, d_head, seq_len_k, causal, arch)
        if cfg is not None:
            return cfg, source
    return None, "heuristic"


@functools.lru_cache(maxsize=4096)
def tuned_config(dtype: DType, d_head: int, seq_len_q: int, seq_len_k: int,
                 device: int, causal: bool = False, family: str = DEFAULT_FAMILY) -> KernelConfig | None:
    """The tuned config of `family` for this problem on CUDA device `device`, or None (use the
    family's heuristic). Cached per argument tuple, so a forward call pays one dict lookup."""
    return explain_choice(dtype, d_head, seq_len_q, seq_len_k, device_name(device), causal, family,
                          device_arch_name(device))[0]


def clear_caches() -> None:
    """Forget loaded tables, device names and choices (after writing a table, or in tests)."""
    with _lock:
        _tables.clear()
        _device_names.clear()
        _device_archs.clear()
    explain_choice.cache_clear()
    tuned_config.cache_clear()
