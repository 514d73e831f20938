#!/usr/bin/env python
"""Write the backward family's tuning-table entries from a scripts/bench_backward.py sweep.

    python scripts/backward_table_from_bench.py SWEEP.json [SWEEP2.json ...] [--table PATH] [--margin 0.005]

For every point of the sweep (dtype, d_head, S, causal) the candidates are the configs it timed
(`--cfgs`, and "auto", i.e. the table's own choice at the time, `auto_config`); a candidate whose
(dq, dk, dv) differ from SDPA flash's by more than twice the SPEC §5 relative L2 bound of its dtype
(both sides carry their own rounding) is dropped. The fastest of the rest becomes the table's entry
for that bucket, unless it beats the table's own choice by less than `--margin` (relative): then
the entry stays (noise must not churn the table); an entry without figures (written before its
config was measured) takes them from the sweep. Points the sweep did not measure keep their
entries. The table's meta appends the sweep's command and date to the earlier sweeps'. This is the short path when a
device session cannot afford `python -m cupyflash autotune` over the whole grid: the sweep's grid
is the bench grid (batch*seq = 16k, 16 heads), where the autotune grid keeps heads*d_head = 2048.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.benchmarking import REL_L2_TOLERANCE  # noqa: E402
from cupyflash.config import DType  # noqa: E402
from cupyflash.families.backward_sm80.config import BackwardKernelConfig  # noqa: E402
from cupyflash.tuning import TuningTable  # noqa: E402

DEFAULT_TABLE = Path(__file__).resolve().parent.parent / "cupyflash" / "tuning" / "default_h100.backward_sm80.json"


def pick(row: dict, margin: float) -> tuple[BackwardKernelConfig, dict, int, bool] | None:
    """(config, its figures, number of correct candidates, whether it replaces the table's own
    choice) for one sweep point, or None when nothing was measured."""
    dtype = DType.parse(row["dtype"].upper())
    bound = 2 * REL_L2_TOLERANCE[dtype]
    timed = {}
    for name, fig in row.get("configs", {}).items():
        if "deterministic" in name:
            continue
        errs = fig.get("rel_l2_vs_flash")
        if errs is not None and not all(e <= bound for e in errs):
            continue
        text = row.get("auto_config") if name == "auto" else name
        if not text or not text.startswith("backward_sm80"):  # cfg=None ran the Hopper family there
            continue
        cfg = BackwardKernelConfig.parse(text).replace(dtype=dtype)
        if cfg not in timed or fig["tflops"] > timed[cfg]["tflops"]:
            timed[cfg] = fig
    if not timed:
        return None
    best = max(timed, key=lambda c: timed[c]["tflops"])
    auto = row.get("auto_config") or ""
    current = BackwardKernelConfig.parse(auto).replace(dtype=dtype) if auto.startswith("backward_sm80") else None
    if current in timed and timed[best]["tflops"] < timed[current]["tflops"] * (1 + margin):
        return current, timed[current], len(timed), False
    return best, timed[best], len(timed), True


def update(table: TuningTable, sweep: dict, margin: float) -> list[str]:
    """Apply the sweep's winners to `table`; returns one line per changed entry."""
    changes = []
    for row in sweep["rows"]:
        chosen = pick(row, margin)
        if chosen is None:
            continue
        cfg, fig, n, replaces = chosen
        causal, seq = bool(row["causal"]), int(row["seq"])
        old = table.get(cfg.dtype, cfg.d_head, seq, causal)
        own = old is not None and old.seq == seq and old.causal == causal
        if not replaces and own and old.tflops is not None:
            continue  # the table's choice stays, with the figures it was chosen on
        # (an entry written before it was measured, tflops None, takes its config's figures here)
        old_text = old.config.short_form() if own else "-"
        table.set(cfg, seq, round(fig["tflops"], 2), round(fig["ms"], 5), causal=causal, batch=row["batch"],
                  heads=row["heads"], candidates=n, correct=n, source="bench_backward sweep")
        changes.append(f"{cfg.dtype.name} d{cfg.d_head} S={seq} causal={int(causal)}: {old_text} -> "
                       f"{cfg.short_form()} ({fig['tflops']:.1f} TFLOP/s)")
    return changes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", help="bench_backward.py --json outputs (e.g. its causal and non-causal runs)")
    ap.add_argument("--table", default=str(DEFAULT_TABLE), help="table to update in place (default: shipped H100)")
    ap.add_argument("--margin", type=float, default=0.005,
                    help="relative gain a new config needs over the table's own choice (default 0.5%%)")
    args = ap.parse_args(argv)
    path = Path(args.table)
    table = TuningTable.from_dict(json.loads(path.read_text()))
    changes, sources = [], []
    for name in args.sweeps:
        sweep = json.loads(Path(name).read_text())
        changes += update(table, sweep, args.margin)
        meta = sweep.get("meta", {})
        sources.append({"command": meta.get("command"), "date": meta.get("date"), "device": meta.get("device")})
    if changes:  # earlier sweeps' records stay: the entries they set are still in the table
        table.meta.update({"sweeps": list(table.meta.get("sweeps", [])) + sources,
                           "changed_by_sweeps": int(table.meta.get("changed_by_sweeps", 0)) + len(changes)})
        table.save(path)
    print("\n".join(changes) if changes else "no entry changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
