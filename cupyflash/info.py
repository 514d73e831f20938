"""Environment report for `cupyflash info`: versions, NVRTC, driver and devices, kernel families,
cache state (entries per family)."""
from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata

from .cache import default_cache

__all__ = ["collect_info", "format_info", "build_parser", "run_from_args"]

_PACKAGES = ("cupyflash", "cupy", "numpy", "jinja2", "ml_dtypes")


def _package_version(name: str) -> str:
    if name == "cupyflash":
        from . import __version__

        return __version__
    if name == "cupy":
        # CuPy ships under several distribution names (cupy-cuda12x, cupy-cuda13x, cupy).
        try:
            import cupy

            return cupy.__version__
        except Exception as exc:  # an info command reports problems instead of failing on them
            return f"not importable ({type(exc).__name__}: {exc})"
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}" if v else "none"


def collect_info() -> dict:
    """Everything `cupyflash info` prints, as plain data."""
    info: dict = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "packages": {name: _package_version(name) for name in _PACKAGES},
    }
    try:
        from .compiler import nvrtc_version, supported_archs

        info["nvrtc"] = {"version": ".".join(map(str, nvrtc_version())),
                         "archs": [f"sm_{a}" for a in supported_archs()]}
    except Exception as exc:
        info["nvrtc"] = {"error": f"{type(exc).__name__}: {exc}"}
    info["cuda"] = _cuda_info()
    info["families"] = _families_info(info["cuda"]["devices"])
    cache = default_cache()
    per_family: dict[str, int] = {}
    for path in cache.entries():
        meta = cache.read_metadata(path) or {}
        name = meta.get("family") or "(none)"
        per_family[name] = per_family.get(name, 0) + 1
    info["cache"] = {"dir": str(cache.directory), "entries": len(cache.entries()), "size_bytes": cache.size_bytes(),
                     "entries_per_family": per_family}
    return info


def _families_info(devices: list[dict]) -> list[dict]:
    """Each kernel family: what it is, its archs and config sets, and which devices it runs on."""
    from .families import FAMILIES

    out = []
    for family in FAMILIES.values():
        item = family.describe()
        sizes = {}
        for key in ("tune", "prog"):
            if key in family.set_keys:
                try:
                    sizes[key] = len(family.config_set(key))
                except ValueError:
                    pass
        item["set_sizes"] = sizes
        item["runs_on"] = [d["id"] for d in devices if family.supports(d["cc"])]
        out.append(item)
    return out


def _cuda_info() -> dict:
    out: dict = {"driver": "none", "runtime": "unknown", "devices": []}
    try:
        import cupy
        from cupy_backends.cuda.api.runtime import CUDARuntimeError
    except Exception as exc:
        out["error"] = f"CuPy not importable: {type(exc).__name__}: {exc}"
        return out
    try:
        out["runtime"] = _cuda_version(cupy.cuda.runtime.runtimeGetVersion())
        out["driver"] = _cuda_version(cupy.cuda.runtime.driverGetVersion())
    except CUDARuntimeError as exc:
        out["error"] = str(exc)
    from .device import compute_capability, device_arch, device_count

    for i in range(device_count()):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        cc = compute_capability(i)
        try:
            arch, kind = device_arch(i)
            target = f"{arch} ({kind})"
        except RuntimeError as exc:
            target = f"unsupported: {exc}"
        out["devices"].append({"id": i, "name": name, "compute_capability": f"{cc // 10}.{cc % 10}", "cc": cc,
                               "memory_gib": round(props["totalGlobalMem"] / 2**30, 1), "target": target})
    return out


def format_info(info: dict) -> str:
    lines = [f"python       {info['python']}"]
    lines += [f"{name:<12} {version}" for name, version in info["packages"].items()]
    nv = info["nvrtc"]
    lines.append(f"nvrtc        {nv['version']}  archs: {' '.join(nv['archs'])}" if "version" in nv
                 else f"nvrtc        unavailable: {nv['error']}")
    cuda = info["cuda"]
    lines.append(f"cuda         driver {cuda['driver']}, runtime {cuda['runtime']}")
    if cuda["devices"]:
        for d in cuda["devices"]:
            lines.append(f"device {d['id']}     {d['name']}, compute capability {d['compute_capability']}, "
                         f"{d['memory_gib']} GiB, kernels compiled for {d['target']}")
    else:
        reason = f" ({cuda['error']})" if cuda.get("error") else ""
        lines.append(f"device       no GPU found{reason}; compiling and prewarming still work")
    for fam in info["families"]:
        sets = ", ".join(f"{k} {n}" for k, n in fam["set_sizes"].items())
        runs = ("runs on device " + ",".join(map(str, fam["runs_on"]))) if fam["runs_on"] else "no device here"
        lines.append(f"family       {fam['family']} ({fam['kind']}): {fam['description']}; archs {' '.join(fam['archs'])}; "
                     f"configs: {sets}; {runs}")
    c = info["cache"]
    per = ", ".join(f"{k} {n}" for k, n in sorted(c["entries_per_family"].items()))
    lines.append(f"cache        {c['dir']}: {c['entries']} entries{f' ({per})' if per else ''}, "
                 f"{c['size_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="cupyflash info")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        import json

        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0
