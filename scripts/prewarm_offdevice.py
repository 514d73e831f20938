#!/usr/bin/env python
"""Fill a kernel cache here for a GPU this machine does not have, so that a device call compiles
nothing (device time is the scarce resource; an sm_90a module takes 10-20 s to build there).

    python3 -m venv /tmp/v13 && /tmp/v13/bin/pip install -q cupy-cuda13x==14.2.0 "nvidia-cuda-nvrtc==13.0.*" \
        jinja2 numpy ml_dtypes                                   # once: the device's CuPy and NVRTC
    LD_LIBRARY_PATH=$(echo /tmp/v13/lib/python3*/site-packages/nvidia/cu13/lib) \
        /tmp/v13/bin/python scripts/prewarm_offdevice.py --expect-nvrtc 13.0 --cache-dir .out/kcache \
        [--families forward_sm90,backward_sm90] [--sets forward_sm90:tune ...] [--configs "SHORT|SHORT"]

Then carry the directory to the device (git-ignored) and point CUPYFLASH_CACHE_DIR at it. The
cache key holds the NVRTC major.minor, not paths: build with the device's NVRTC (13.0 on the
H100 device: a virtual environment with cupy-cuda13x and nvidia-cuda-nvrtc 13.0.*, its
nvidia/cu13/lib on LD_LIBRARY_PATH), or the device will not find the entries. The version in use
is printed first; --expect-nvrtc makes a mismatch an error.

What it compiles, each family for its own target on that compute capability (sm_90a for the
Hopper families, sm_90 for the others on cc 9.0), with every variant of each config:
- every config named by the shipped tuning tables (cupyflash/tuning/*.json), so cfg=None on the
  tables' GPU runs from the cache;
- every family's default config for each (dtype, d_head) it supports (and its `defaults` and
  `varlen_defaults` sets: backward_varlen's Hopper picks are not the dense ones);
- with --sets FAMILY:SET[,SET...], those config sets too (e.g. forward_sm90:tune for an autotune
  call);
- with --configs, the '|'-separated short forms given (e.g. the configs a probe script names);
- with --test-modules, what those GPU test modules' prewarm fixtures compile (their
  `prewarm_plan`), so that their device run compiles nothing either.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import cupyflash  # an installed or editable cupyflash
except ImportError:  # a plain checkout: use the package next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import cupyflash

from cupyflash.config import SUPPORTED_D_HEADS, DType  # noqa: E402
from cupyflash.families import FAMILIES, get_family, parse_config  # noqa: E402


def table_configs(tables_dir: Path) -> list:
    """Every config a shipped tuning table names (entries' 'config' short forms)."""
    out = []
    for path in sorted(tables_dir.glob("*.json")):
        for entry in json.loads(path.read_text()).get("entries", []):
            if entry.get("config"):
                out.append(parse_config(entry["config"]))
    return out


def default_configs(cc: int) -> list:
    """Each family's default config per (dtype, d_head), and its `defaults` and `varlen_defaults`
    sets where it has them (e.g. both masks' defaults; backward_sm90's picks for backward_varlen,
    which differ from the dense ones), for the families that run on `cc`."""
    out = []
    for fam in FAMILIES.values():
        if not fam.supports(cc):
            continue
        for key in ("defaults", "varlen_defaults"):
            if key in getattr(fam, "set_keys", ()):
                out += list(fam.config_set(key))
        for dtype in DType:
            for d_head in SUPPORTED_D_HEADS:
                try:
                    out.append(fam.default_config(dtype, d_head))
                except (ValueError, KeyError):  # a head dim the family does not have
                    pass
    return out


TEST_MODULES = ("test_gpu_forward", "test_gpu_backward", "test_gpu_backward_sm90", "test_gpu_backward_varlen",
                "test_gpu_pad_rows")


def fixture_groups(names: list[str], cc: int) -> list[tuple[str, list, list[str], dict]]:
    """(module, configs, archs, prewarm options) of each group the named GPU test modules' prewarm
    fixtures compile on a GPU of compute capability `cc` (their `prewarm_plan`; the modules import
    without a GPU). test_gpu_backward_sm90 only runs on cc 9.0: elsewhere it has no groups."""
    tests_dir = Path(__file__).resolve().parent.parent / "tests"
    if str(tests_dir) not in sys.path:
        sys.path.insert(0, str(tests_dir))
    import importlib

    arch = f"sm_{cc}"  # the non-Hopper families' target on that GPU (gpu_prewarm.this_arch)
    out = []
    for name in names:
        if name not in TEST_MODULES:
            raise ValueError(f"--test-modules: unknown module {name!r}; expected some of {TEST_MODULES}")
        if name == "test_gpu_backward_sm90" and cc != 90:
            continue
        for configs, archs, options in importlib.import_module(name).prewarm_plan(arch, cc):
            out.append((name, list(configs), list(archs), dict(options)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cc", type=int, default=90, help="compute capability of the target GPU, e.g. 90 (default)")
    p.add_argument("--cache-dir", default=".out/kcache")
    p.add_argument("--sets", nargs="*", default=[], metavar="FAMILY:SET[,SET]")
    p.add_argument("--configs", default="", metavar="SHORT|SHORT", help="'|'-separated short forms to build too")
    p.add_argument("--no-tables", action="store_true", help="skip the shipped tables' configs")
    p.add_argument("--families", default=None, help="comma-separated: only these families (default all)")
    p.add_argument("--expect-nvrtc", default=None, metavar="MAJOR.MINOR",
                   help="refuse to run under another NVRTC version (e.g. 13.0 for the H100 device)")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--test-modules", default="", metavar="NAME[,NAME]",
                   help=f"also what these GPU test modules' prewarm fixtures compile ('all': {', '.join(TEST_MODULES)})")
    args = p.parse_args(argv)

    from cupyflash.compiler import nvrtc_version
    from cupyflash.families import family_of
    from cupyflash.prewarm import prewarm

    version = ".".join(map(str, nvrtc_version()))
    print(f"NVRTC {version}; cache {args.cache_dir}; compute capability {args.cc}", flush=True)
    if args.expect_nvrtc and version != args.expect_nvrtc:
        print(f"prewarm_offdevice.py: NVRTC {version} here, {args.expect_nvrtc} expected: the device would "
              "not find these entries", file=sys.stderr)
        return 2
    configs = default_configs(args.cc)
    if not args.no_tables:
        configs += table_configs(Path(cupyflash.__file__).resolve().parent / "tuning")
    for item in args.sets:
        name, _, sets = item.partition(":")
        fam = get_family(name)
        for key in filter(None, sets.split(",")):
            configs += list(fam.config_set(key))
    configs += [parse_config(text) for text in args.configs.split("|") if text.strip()]
    by_family: dict[str, list] = {}
    only = set(filter(None, (args.families or "").split(","))) or set(FAMILIES)
    for cfg in dict.fromkeys(configs):
        if family_of(cfg).supports(args.cc) and family_of(cfg).name in only:
            by_family.setdefault(family_of(cfg).name, []).append(cfg)
    failed = 0
    for name, cfgs in sorted(by_family.items()):
        fam = get_family(name)
        arch = f"sm_{args.cc}{fam.arch_suffix}"
        report = prewarm(cfgs, [arch], cache_dir=args.cache_dir, jobs=args.jobs, progress=sys.stderr,
                         variants=fam.all_variants())
        print(f"{name} {arch}: {len(cfgs)} configs x {len(fam.all_variants())} variants: {len(report.results)} "
              f"modules in {report.seconds:.0f} s, {len(report.failed)} failed", flush=True)
        for r in report.failed:
            print(f"  FAILED {r.label}: {r.error}", file=sys.stderr)
        failed += len(report.failed)
    names = list(TEST_MODULES) if args.test_modules.strip() == "all" else \
        [n.strip() for n in args.test_modules.split(",") if n.strip()]
    for module, cfgs, archs, options in fixture_groups(names, args.cc):
        report = prewarm(cfgs, archs, cache_dir=args.cache_dir, jobs=args.jobs, progress=sys.stderr, **options)
        print(f"{module} {'/'.join(archs)}: {len(cfgs)} configs: {len(report.results)} modules in "
              f"{report.seconds:.0f} s, {len(report.failed)} failed", flush=True)
        for r in report.failed:
            print(f"  FAILED {r.label}: {r.error}", file=sys.stderr)
        failed += len(report.failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
