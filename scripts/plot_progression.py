#!/usr/bin/env python
"""Draw a progression file (docs/progression_*.json: steps, each with TFLOP/s per sequence length)
as grouped bars, one group per sequence length, one bar per step.

    python scripts/plot_progression.py docs/progression_sm90_h100.json [--out docs/progression_sm90_h100.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mode_common import bar_plot  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json")
    p.add_argument("--out", default=None, help="PNG path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    groups = [f"S={s // 1024}k" if s >= 1024 else f"S={s}" for s in data["seqs"]]
    series = {step["step"]: step["tflops"] for step in data["steps"]}
    out = args.out or str(Path(args.json).with_suffix(".png"))
    why = bar_plot(groups, series, out, "TFLOP/s", data.get("title", data["what"]))
    if why:
        print(f"no plot: {why}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
