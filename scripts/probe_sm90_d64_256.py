#!/usr/bin/env python
"""forward_sm90 at d_head 64 and 256 (issue 11's rows; d_head 128 rows too) beside SDPA cuDNN,
one process: per grid point, the shipped table's pick (what cfg=None runs), candidate configs
derived from it (the `lazy` and `oreg` knobs, the 192-column key tile at d64, persistent CTAs
with the early Q release at d256; see _fixed for the current list) and cuDNN, each checked once
against float64 (bench.py's spot-row check), then timed in --rounds interleaved rounds (order
rotated per round; median of round medians), so clock drift falls on all alike.

    python scripts/probe_sm90_d64_256.py [--rows d64,d64c,d256] [--seqs 2k,4k,16k] [--rounds 2]
                                         [--iters 20] [--sustain S] [--twins 'lazy|ring+lazy'] [--json probe.json]
    python scripts/probe_sm90_d64_256.py --list-configs     # every config it may run (for prewarm)

Grid: bench.py's (batch*seq = 16384, heads*d_head = 2048), bf16 and fp16. Prints one line per
measurement, then a table: TFLOP/s per config and its ratio to cuDNN. Exit 0 when every config
passed its check, 1 otherwise, 2 when nothing could be measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.benchmarking import grid_shape, parse_ints  # noqa: E402
from cupyflash.config import DType  # noqa: E402
from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig as H  # noqa: E402

ROWS = {"d64": (64, False), "d64c": (64, True), "d96": (96, False), "d96c": (96, True), "d128": (128, False),
        "d128c": (128, True), "d256": (256, False), "d256c": (256, True)}
TABLE = Path(__file__).resolve().parent.parent / "cupyflash" / "tuning" / "default_h100.forward_sm90.json"


def _fixed(dtype: DType, d_head: int) -> list[H]:
    """Candidates independent of the table's pick: the tune set's lazy configs of the tile that
    won most rows (192x128 at d64, 128x80 at d256), at d64 also two of them with a quarter of
    the exponentials on the FMA units (emu1: lazy rescaling freed issue slots) and the 128x128
    tile; none at d128."""
    from cupyflash.families.forward_sm90.config_sets import autotune_configs

    tile = {64: (192, 128), 256: (128, 80)}.get(d_head)
    out = [c for c in autotune_configs([dtype], [d_head]) if c.lazy_rescale and (c.B_r, c.B_c) == tile]
    if d_head == 64:
        out += [c.replace(exp_emulation=1) for c in out if c.n_stages == 2]
        # two consumers on 128-row tiles: no ragged last query block at S = 2^k, a smaller causal
        # diagonal than 192x128 or 128x176
        base = H(dtype, 64, 128, 128, 2, True, True, True, False, lazy_rescale=True)
        out += [base, base.replace(persistent=True, double_q=True)]
    return out


def candidates(auto: H) -> list[H]:
    """The table's pick first, then its `lazy` twin, then the fixed candidates of its shape."""
    out = [auto, auto.replace(lazy_rescale=True)] + _fixed(auto.dtype, auto.d_head)
    return list(dict.fromkeys(out))


def with_features(cfg: H, features: str) -> H:
    """`cfg` with the '+'-separated short-form features added (those it has already are kept)."""
    have = str(cfg).split(": ", 1)[1].split("+")
    extra = [f for f in features.split("+") if f and f not in have]
    return H.parse("+".join([str(cfg)] + extra))


def _valid_twins(cfg: H, twins: list[str]) -> list[H]:
    """`cfg` with each twin's features added; a twin the family's rules refuse for this pick (for
    instance `wgblocks` on an `xtile` pick) is left out with a note, so one row cannot end the run."""
    out = []
    for features in twins:
        try:
            out.append(with_features(cfg, features))
        except ValueError as exc:
            print(f"  skip twin +{features} of {cfg}: {exc}", flush=True)
    return out


def table_picks() -> list[H]:
    """Every config of the shipped H100 table."""
    return [H.parse(e["config"]) for e in json.loads(TABLE.read_text())["entries"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="d64,d64c,d256",
                   help="rows, each optionally with its own lengths: d64,d256@512/1k/8k (default lengths --seqs)")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--seqs", default="2k,4k,16k")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default="probe_sm90_d64_256.json")
    p.add_argument("--twins", default="",
                   help="'|'-separated feature sets, e.g. 'lazy|emu1+lazy': time only the table's pick and, "
                        "per set, the pick with those features added (a same-run A/B of knobs; replaces the "
                        "derived candidates)")
    p.add_argument("--sustain", type=float, default=0.0, metavar="S",
                   help="seconds of back-to-back calls before each timing (bench.py --sustain: power-capped clocks)")
    p.add_argument("--list-configs", action="store_true")
    p.add_argument("--configs", default="",
                   help="'|'-separated extra short forms, each tried on the rows of its d_head (dtype taken from "
                        "the row) after the table's pick and its derived candidates")
    args = p.parse_args(argv)
    if args.list_configs:
        print("|".join(str(c) for c in dict.fromkeys(x for a in table_picks() for x in candidates(a))))
        return 0

    from cupyflash.benchmarking import parse_dtypes

    import bench
    from bench_impls import CupyflashImpl, SdpaImpl, make_problem

    reason = bench._no_gpu_reason()
    if reason:
        print(f"probe: {reason}", file=sys.stderr)
        return 2
    import torch

    device = torch.cuda.current_device()
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    timing = argparse.Namespace(warmup=args.warmup, iters=args.iters, sustain=args.sustain)
    twins = [t.strip() for t in args.twins.split("|") if t.strip()]
    explicit = [H.parse(t) for t in args.configs.split("|") if t.strip()]
    results, failures = [], []
    for item in args.rows.split(","):
        row, _, own = item.partition("@")
        d_head, causal = ROWS[row]
        for dtype in parse_dtypes(args.dtypes):
            for seq in parse_ints(own.replace("/", ",") if own else args.seqs, "--rows"):
                auto, source = bench._auto_choice(dtype, d_head, seq, device, causal)
                extra = [c.replace(dtype=dtype) for c in explicit if c.d_head == d_head]
                found = [auto] + _valid_twins(auto, twins) if twins else candidates(auto)
                impls = [CupyflashImpl(c, f"cf{i}") for i, c in enumerate(dict.fromkeys(found + extra))]
                impls.append(SdpaImpl(torch, "CUDNN_ATTENTION", "sdpa_cudnn"))
                problem = make_problem(torch, dtype, grid_shape(seq, d_head), causal, l2, seed=seq)
                samples: dict[str, list[float]] = {}
                for rnd in range(args.rounds):
                    order = impls[rnd % len(impls):] + impls[:rnd % len(impls)]
                    for impl in order:
                        rec = {"cfg": str(getattr(impl, "cfg", None) or impl.name)}
                        if rnd == 0:
                            bench._measure(torch, impl, problem, rec, timing)
                            if rec.get("status") != "ok":
                                failures.append(f"{row} {dtype.name} {seq} {rec['cfg']}: {rec.get('reason')}")
                                print(f"  FAIL {row} {dtype.name} S={seq} {rec['cfg']}: {rec.get('reason')}", flush=True)
                                continue
                            tf = rec["tflops"]
                        else:
                            if impl.name not in samples:
                                continue
                            impl.prepare(problem)
                            with impl.context():
                                tf = impl.time(torch, args.warmup, args.iters, args.sustain).tflops(problem.flops)
                            torch.cuda.synchronize()
                        samples.setdefault(impl.name, []).append(tf)
                        print(f"  {row} {dtype.name.lower()} S={seq:<6} r{rnd} {tf:7.1f}  {rec['cfg']}", flush=True)
                cudnn = statistics.median(samples["sdpa_cudnn"]) if "sdpa_cudnn" in samples else None
                for impl in impls:
                    if impl.name not in samples:
                        continue
                    tf = statistics.median(samples[impl.name])
                    results.append({"row": row, "dtype": dtype.name.lower(), "d_head": d_head, "causal": causal,
                                    "seq": seq, "impl": impl.name, "config": str(getattr(impl, "cfg", "") or ""),
                                    "table_pick": impl.name == "cf0", "source": source, "tflops": tf,
                                    "samples": samples[impl.name], "vs_cudnn": tf / cudnn if cudnn else None})
                Path(args.json).write_text(json.dumps({"results": results, "failures": failures}, indent=1))
                del problem
                torch.cuda.empty_cache()
    print("\nrow   dtype   seq    TFLOP/s  x cuDNN  config")
    for r in results:
        ratio = f"{r['vs_cudnn']:.3f}" if r["vs_cudnn"] else "-"
        print(f"{r['row']:<5} {r['dtype']:<6} {r['seq']:<6} {r['tflops']:7.1f}  {ratio:>7}  "
              f"{'*' if r['table_pick'] else ' '}{r['config'] or r['impl']}")
    # one line per point: cuDNN, the table's pick and the fastest config, with their ratios
    points: dict[tuple, list[dict]] = {}
    for r in results:
        points.setdefault((r["row"], r["dtype"], r["seq"]), []).append(r)
    for (row, dtype, seq), rs in points.items():
        mine = [r for r in rs if r["config"]]
        pick = next((r for r in mine if r["table_pick"]), None)
        best = max(mine, key=lambda r: r["tflops"]) if mine else None
        cud = next((r for r in rs if not r["config"]), None)
        if pick and best:
            feats = best["config"].split("(", 1)[1].replace(": tma+ws+", " ")
            print(f"best {row:<5} {dtype} {seq:<6} cudnn {cud['tflops'] if cud else 0:6.1f} pick {pick['tflops']:6.1f} "
                  f"{pick['vs_cudnn'] or 0:.3f} best {best['tflops']:6.1f} {best['vs_cudnn'] or 0:.3f} {feats}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
