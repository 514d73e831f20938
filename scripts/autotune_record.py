#!/usr/bin/env python
"""`python -m cupyflash autotune ...` that also records every candidate's figure per bucket, not
only the winners, so one tuning run doubles as the A/B measurement of each knob.

    python scripts/autotune_record.py RECORD.jsonl --family forward_sm90 --d-heads 128 [autotune args]

Appends one JSON line per (bucket, candidate) to RECORD.jsonl: the bucket's label (dtype, d_head,
S, causal), the config's short form, TFLOP/s (mean of the two sweeps' medians, or the final
rounds' median for finalists) or the error that excluded it.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the module, not the function of the same name that the package exports
autotune = importlib.import_module("cupyflash.autotune")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    record = Path(argv[0])
    tune_bucket = autotune._tune_bucket

    def recording(results, checked, problem, *args, **kwargs):
        winner, results = tune_bucket(results, checked, problem, *args, **kwargs)
        try:
            with record.open("a") as f:
                for r in results:
                    f.write(json.dumps({
                        "bucket": problem.label, "config": r.cfg.short_form(),
                        "tflops": round(r.timing.tflops(problem.flops), 2) if r.timing else None,
                        "ms": round(r.timing.median_ms, 5) if r.timing else None,
                        "winner": winner is not None and r.cfg == winner.cfg, "error": r.error}) + "\n")
        except Exception as exc:  # the record is a by-product: never lose the tuning run over it
            print(f"autotune_record: could not record {problem.label}: {exc}", file=sys.stderr)
        return winner, results

    autotune._tune_bucket = recording
    return autotune.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
