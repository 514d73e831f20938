#!/usr/bin/env python
"""Several backward_sm90 configs beside SDPA cuDNN in one run: bench.py --mode backward's own
measurement (bench_mode_backward.measure_point: same grid, inputs, reference check and CUDA-event
timing) per point, once for cuDNN and once per config, the configs interleaved point by point so
that clock drift and heat fall on all of them alike.

    python scripts/bench_sm90_compare.py --configs "backward_sm90(BF16, 128, 64, 128, 2)|backward_sm90(BF16, 128, 64, 128, 2): dq_tma" \
        [--seqs 1k,4k,16k] [--causal both] [--reps 10] [--rounds 1] [--json bench_sm90_compare.json]

Each config's dtype and d_head are the point's (bf16 d_head 128 unless --dtypes/--d-heads say
otherwise). With --rounds N every point is measured N times (config order rotated each round)
and the median is reported. Prints one line per measurement, then a table of TFLOP/s and each
config's ratio to cuDNN. Exit 0 when every config passed its reference check, 1 otherwise, 2
when nothing could be measured.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import bench_mode_backward as bmb
from bench_mode_common import gpu_host, parse_d_heads
from cupyflash.benchmarking import parse_dtypes, parse_ints


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="'|'-separated backward_sm90 short forms")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--d-heads", default="128")
    p.add_argument("--seqs", default="1k,4k,16k")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="measurements per (point, config); the median is reported")
    p.add_argument("--json", default="bench_sm90_compare.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cupyflash.families.backward_sm90.config import HopperBackwardKernelConfig

    try:
        configs = [HopperBackwardKernelConfig.parse(t) for t in args.configs.split("|") if t.strip()]
        dtypes, d_heads = parse_dtypes(args.dtypes), parse_d_heads(args.d_heads)
        seqs = parse_ints(args.seqs, "--seqs")
        if not configs or args.rounds < 1 or args.reps < 1:
            raise ValueError("--configs names none, or --rounds/--reps < 1")
    except ValueError as exc:
        print(f"bench_sm90_compare: error: {exc}", file=sys.stderr)
        return 2
    host = gpu_host()
    if host is None:
        return 2
    import torch

    from bench_report import write_json

    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    columns = ["sdpa_cudnn"] + [c.short_form() for c in configs]
    rows: list[dict[str, Any]] = []
    failed = False
    for d in d_heads:
        for dtype in dtypes:
            for seq, batch in bmb.grid(seqs):
                for causal in causals:
                    times: dict[str, list[float]] = {c: [] for c in columns}
                    point = None
                    for rnd in range(args.rounds):
                        order = columns[rnd % len(columns):] + columns[:rnd % len(columns)]
                        for col in order:
                            cfg = None if col == "sdpa_cudnn" else configs[columns.index(col) - 1]
                            impls = ("sdpa_cudnn",) if cfg is None else ("backward_sm90",)
                            [rec] = bmb.measure_point(torch, dtype, d, seq, batch, causal, args.warmup, args.reps,
                                                      None, impls, cfg)
                            torch.cuda.empty_cache()
                            point = rec["point"]
                            if rec["status"] == "ok":
                                times[col].append(rec["tflops"])
                            elif cfg is not None:
                                failed = True
                    row = {"point": point, **{c: statistics.median(v) if v else None for c, v in times.items()}}
                    rows.append(row)
                    write_json(args.json, {"columns": columns, "rows": rows, "args": vars(args)})
    print()
    print("| point | cuDNN | " + " | ".join(f"{c} (x cuDNN)" for c in columns[1:]) + " |")
    print("|---|---|" + "---|" * (len(columns) - 1))
    for row in rows:
        ref = row["sdpa_cudnn"]
        cells = [f"{row[c]:.1f} ({row[c] / ref:.2f}x)" if row[c] and ref else ("-" if row[c] is None else f"{row[c]:.1f}")
                 for c in columns[1:]]
        print(f"| {row['point']} | {ref:.1f} | " + " | ".join(cells) + " |" if ref else
              f"| {row['point']} | - | " + " | ".join(cells) + " |")
    print(f"json: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
