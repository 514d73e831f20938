"""What bench.py's decode, varlen and backward modes share: check-then-time one implementation,
the target verdicts, the text table, the JSON file and a bar-chart PNG.

Every mode records one dict per (point, implementation): `impl`, `status` ("ok", "refused" when
the float64 check failed, "skipped" when the implementation cannot run here, "error" when it
raised), `reason`, `rel_l2` and the median time `us`. Nothing here imports torch or a GPU library.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from bench_impls import Skip  # one Skip for every mode: "cannot run here", with the reason

__all__ = ["Skip", "gpu_host", "finish", "check_then_time", "verdict", "ratio", "format_table", "fmt", "bar_plot", "collect_failures"]


def gpu_host(host: Any = None) -> Any:
    """bench.py's module (the GPU probes and metadata every mode uses), or None after printing why
    there is nothing to measure here (the caller then exits with 2)."""
    if host is None:
        import bench as host
    reason = host._no_gpu_reason()
    if reason:
        import sys

        print(f"bench.py: {reason}", file=sys.stderr)
        return None
    return host


def finish(mode: str, json_path: str, plot_arg: str | None, draw: Callable[[str], str | None],
           failures: Sequence[str]) -> int:
    """A mode's last lines: the plot (`draw(path)` returns why it was not written, or None) at
    --plot or next to the JSON ('' for none), the JSON path, the failures; the exit code."""
    import sys

    plot_path = plot_arg if plot_arg is not None else str(Path(json_path).with_suffix(".png"))
    if plot_path:
        why = draw(plot_path)
        print(f"plot: {plot_path}" if why is None else f"plot: not written: {why}")
    print(f"json: {json_path}")
    if failures:
        print(f"bench.py --mode {mode}: cupyflash FAILURES:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


def parse_d_heads(text: str) -> tuple[int, ...]:
    """--d-heads: comma-separated head dims, each one the library supports; ValueError naming the option."""
    from cupyflash.benchmarking import parse_ints
    from cupyflash.config import SUPPORTED_D_HEADS

    d_heads = parse_ints(text, "--d-heads")
    for d in d_heads:
        if d not in SUPPORTED_D_HEADS:
            raise ValueError(f"--d-heads: {d} is not supported (expected one of {SUPPORTED_D_HEADS})")
    return d_heads


def parse_impls(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """--impls: comma-separated column names, each from `known`; ValueError naming the option."""
    impls = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = sorted(set(impls) - set(known))
    if unknown or not impls:
        raise ValueError(f"--impls: unknown {unknown or 'empty list'}; expected names from {list(known)}")
    return impls


def host_cost_us(torch: Any, cases: dict[str, Callable[[], Any]], rounds: int = 9, calls: int = 100) -> dict:
    """Host cost of one call of each case, in microseconds: the steady figure of
    bench_impls.issue_burst_us (the second of two bursts of `calls` calls queued behind a GPU
    spin), in `rounds` rounds over all cases (not one case after the other, so drift of the host's
    speed spreads over every case); median of the rounds. Every case runs twice first (compile,
    plan, warm). Under "first_burst": the same cases' first bursts (the host just back from
    waiting on the GPU), shown beside the steady figures."""
    import statistics

    from bench_impls import issue_burst_us

    for fn in cases.values():
        fn()
        fn()
    torch.cuda.synchronize()
    first: dict = {name: [] for name in cases}
    steady: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            cold, warm = issue_burst_us(torch, fn, calls)
            first[name].append(cold)
            steady[name].append(warm)
    torch.cuda.synchronize()
    out: dict = {name: statistics.median(ts) for name, ts in steady.items()}
    out["first_burst"] = {name: statistics.median(ts) for name, ts in first.items()}
    return out


def check_then_time(impl: str, check: Callable[[], float], time_us: Callable[[], float], tol: float) -> dict:
    """Run `check` (-> relative L2 error against a float64 reference; inf for NaN/unwritten output)
    and, only when it is within `tol`, `time_us` (-> median microseconds). Never raises: a Skip
    becomes status "skipped", any other exception status "error" with its first line."""
    rec: dict[str, Any] = {"impl": impl, "status": None, "reason": None, "rel_l2": None, "us": None}
    try:
        rel = float(check())
        rec["rel_l2"] = rel
        if not rel <= tol:
            why = "NaN/inf or unwritten elements in the output" if not math.isfinite(rel) else \
                f"relative L2 error {rel:.3g} > {tol:g}"
            rec.update(status="refused", reason=why)
            return rec
        rec["us"] = float(time_us())
        rec["status"] = "ok"
    except Skip as exc:
        rec.update(status="skipped", reason=str(exc))
    except Exception as exc:  # reported with its error, never silently dropped
        first = str(exc).splitlines()[0] if str(exc) else ""
        rec.update(status="error", reason=f"{type(exc).__name__}: {first}"[:300])
    return rec


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def verdict(value: float | None, target: float | None, *, at_most: bool = False) -> str:
    """'ok' / 'MISS' for `value` against `target` (>= target, or <= with at_most); '-' when either
    is missing. Printed beside the figures, never a failure."""
    if value is None or target is None:
        return "-"
    good = value <= target if at_most else value >= target
    return "ok" if good else "MISS"


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table (pastes into README/NOTES as is) with columns padded for the terminal."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def collect_failures(records: Iterable[dict], prefix: str = "cupyflash") -> list[str]:
    """cupyflash records that were refused by the check or raised: what makes a mode exit 1."""
    return [f"{r.get('point', '')} {r['impl']}: {r['status']}: {r.get('reason')}".strip()
            for r in records if r["impl"].startswith(prefix) and r["status"] in ("refused", "error")]


def bar_plot(groups: Sequence[str], series: dict[str, Sequence[float | None]], path: str | os.PathLike,
             ylabel: str, title: str, log_y: bool = False) -> str | None:
    """Grouped bars (one group per table row, one bar per implementation). Returns None when the
    PNG is written, else why not (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not importable ({exc})"
    try:  # a plot that fails must not cost the run its table and JSON
        names = [n for n, vals in series.items() if any(v is not None for v in vals)]
        if not groups or not names:
            return "no successful measurements to plot"
        width = 0.8 / len(names)
        fig, ax = plt.subplots(figsize=(min(28.0, max(6.0, 0.22 * len(groups) * len(names) + 2)), 4.5))
        for i, name in enumerate(names):
            xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
            ys = [v if v is not None else math.nan for v in series[name]]  # a missing bar, not a zero
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return None
    except Exception as exc:
        return f"plotting failed ({type(exc).__name__}: {exc})"
