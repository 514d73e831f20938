"""Reporting for scripts/bench.py: the text tables, the JSON file and the PNG plot."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from cupyflash.atomic_file import write_atomic

__all__ = ["target_ratio", "find_ok", "impl_columns", "format_grid", "format_progression", "format_overhead", "write_json", "plot",
           "PEER_ORDER", "BASELINE"]

BASELINE = "sdpa_flash"
PEER_ORDER = ("sdpa_flash", "sdpa_cudnn", "jax_cudnn", "fa3")


def target_ratio(d_head: int, seq: int, causal: bool, dtype: str | None = None) -> float | None:
    """The target for cupyflash(auto) / SDPA flash at this grid point, or None if none.
    Non-causal (issue 3): d_head 128: >= 1.00 for S >= 1k, >= 0.95 at S = 512; d_head 64: >= 1.00
    for S >= 2k. Causal (issue 4): d_head 128 bf16 (dtype None: any) >= 1.00 for S >= 2k."""
    if causal:
        return 1.0 if d_head == 128 and seq >= 2048 and dtype in (None, "bf16") else None
    if d_head == 128:
        return 1.0 if seq >= 1024 else 0.95
    if d_head == 64 and seq >= 2048:
        return 1.0
    return None


def find_ok(records: Iterable[dict], **key: Any) -> dict | None:
    for r in records:
        if r.get("status") == "ok" and all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def _cell(r: dict | None, records: Iterable[dict], width: int, **key: Any) -> str:
    if r is not None:
        return f"{r['tflops']:>{width}.1f}"
    bad = [x for x in records if all(x.get(k) == v for k, v in key.items())]
    status = bad[0]["status"].upper() if bad else "-"
    return f"{status[:width]:>{width}}"


def impl_columns(records: list[dict]) -> list[str]:
    """Column order: cupyflash (auto), the best of the tune set, explicit configs, then the peers."""
    names = list(dict.fromkeys(r["impl"] for r in records))
    first = [n for n in ("cupyflash", "cupyflash_best") if n in names]
    explicit = sorted((n for n in names if n.startswith("cupyflash[")), key=lambda n: int(n[10:-1]))
    peers = [n for n in PEER_ORDER if n in names]
    return first + explicit + peers


def format_grid(records: list[dict], causal: bool) -> str:
    """One row per (dtype, d_head, seq): TFLOP/s per implementation, ratios to SDPA flash, target,
    and the config cupyflash(auto) used with where it came from."""
    grid = [r for r in records if r["impl"] != "cupyflash_tune"]
    cols = impl_columns(grid)
    w = max([10] + [len(c) for c in cols])
    head = f"{'dtype':<5} {'d_head':>6} {'seq':>6} {'B':>3} {'H':>3} " + " ".join(f"{c:>{w}}" for c in cols)
    head += f" {'cf/flash':>8}"
    if "cupyflash_best" in cols:
        head += f" {'best/fl':>8}"
    head += f" {'target':>9}  cupyflash(auto) config [source]"
    lines = [head]
    points = list(dict.fromkeys((r["dtype"], r["d_head"], r["seq"]) for r in grid))
    for dtype, d_head, seq in points:
        key = {"dtype": dtype, "d_head": d_head, "seq": seq}
        some = next(r for r in grid if all(r[k] == v for k, v in key.items()))
        row = f"{dtype:<5} {d_head:>6} {seq:>6} {some['batch']:>3} {some['heads']:>3} "
        row += " ".join(_cell(find_ok(grid, impl=c, **key), grid, w, impl=c, **key) for c in cols)
        base = find_ok(grid, impl=BASELINE, **key)
        auto = find_ok(grid, impl="cupyflash", **key)
        ratio = auto["tflops"] / base["tflops"] if auto and base else None
        row += f" {ratio:>7.3f}x" if ratio else f" {'-':>8}"
        if "cupyflash_best" in cols:
            best = find_ok(grid, impl="cupyflash_best", **key)
            row += f" {best['tflops'] / base['tflops']:>7.3f}x" if best and base else f" {'-':>8}"
        target = target_ratio(d_head, seq, causal, dtype)
        verdict = "-" if target is None or ratio is None else ("ok" if ratio >= target else "MISS")
        row += f" {verdict + ('>=' + format(target, '.2f') if target else ''):>9}"
        auto_any = next((r for r in grid if r["impl"] == "cupyflash" and all(r[k] == v for k, v in key.items())), None)
        if auto_any:
            row += f"  {auto_any.get('config')} [{auto_any.get('config_source')}]"
        lines.append(row)
    notes = _notes(records)
    best = [r for r in grid if r["impl"] == "cupyflash_best" and r["status"] == "ok"]
    if best:
        lines.append("best of the tune set: " + "; ".join(f"{r['dtype']} d{r['d_head']} S={r['seq']}: {r['config']}"
                                                         for r in best))
    explicit = {r["impl"]: r["config"] for r in grid if r["impl"].startswith("cupyflash[")}
    lines += [f"{name} = {cfg}" for name, cfg in explicit.items()]
    return "\n".join(lines + notes)


def _notes(records: list[dict]) -> list[str]:
    seen, out = set(), []
    for r in records:
        if r["status"] != "ok" and r.get("reason"):
            msg = f"  {r['impl']} {r['dtype']} d{r['d_head']} S={r['seq']}: {r['status']}: {r['reason']}"
            short = (r["impl"], r["status"], r["reason"])
            if short not in seen:
                seen.add(short)
                out.append(msg)
    return (["not reported:"] + out) if out else []


def format_progression(records: list[dict], baselines: dict) -> str:
    """Each progression step's TFLOP/s and gain over the previous step, per (dtype, d_head, seq)."""
    lines = []
    for key in dict.fromkeys((r["dtype"], r["d_head"], r["seq"]) for r in records):
        dtype, d_head, seq = key
        rows = [r for r in records if (r["dtype"], r["d_head"], r["seq"]) == key]
        lines.append(f"progression {dtype} d_head {d_head} S={seq} (batch {rows[0]['batch']}, heads {rows[0]['heads']})")
        lines.append(f"{'step':>4} {'TFLOP/s':>8} {'gain':>8}  config")
        prev = None
        for r in rows:
            if r["status"] == "ok":
                gain = f"{100 * (r['tflops'] / prev - 1):+7.1f}%" if prev else f"{'-':>8}"
                lines.append(f"{r['step']:>4} {r['tflops']:>8.1f} {gain}  {r['config']}")
                prev = r["tflops"]
            else:
                lines.append(f"{r['step']:>4} {r['status'].upper():>8} {'':>8}  {r['config']}: {r.get('reason')}")
                prev = None
        base = baselines.get(f"{dtype},{d_head},{seq}")
        if base:
            lines.append(f"     sdpa_flash {base:.1f} TFLOP/s at the same shape")
    return "\n".join(lines)


def format_overhead(o: dict) -> str:
    def us(name: str) -> str:
        item = o.get(name, {})
        if "us_per_call" not in item:
            return f"{name:<18} {item.get('error', 'not measured')}"
        issue = item.get("issue_us_per_call")
        issue_text = f", host issue {issue:.1f} us/call" if issue is not None else ""
        return (f"{name:<18} {item['us_per_call']:8.1f} us/call wall (GPU span {item['gpu_span_us_per_call']:.1f} us/call"
                f"{issue_text})")

    lines = [f"per-call cost, {o['dtype']} {tuple(o['shape'])} (batch, seq, heads, d_head), torch tensors, medians of "
             f"{o.get('rounds', '?')} interleaved rounds ({o.get('calls', '?')} back-to-back calls for the wall time)",
             us("cupyflash_auto"), us("cupyflash_cfg_out"), us("sdpa_flash"), us("bare_launch")]
    ratio = o.get("ratio_cupyflash_auto_over_sdpa")
    if ratio is not None:
        lines.append(f"wall per call, cupyflash(auto) / sdpa_flash = {ratio:.2f}")
    issue = o.get("ratio_cupyflash_issue_over_sdpa_wall")
    if issue is not None:
        per_round = o.get("ratio_per_round")
        spread = f" (rounds {min(per_round):.2f}-{max(per_round):.2f})" if per_round else ""
        lines.append(f"whole host-side cost of cupyflash(auto) / sdpa_flash wall per call = {issue:.2f}{spread}")
    python_side = o.get("ratio_python_side_over_sdpa_wall")
    if python_side is not None:
        per_round = o.get("ratio_python_side_per_round")
        spread = f" (rounds {min(per_round):.2f}-{max(per_round):.2f})" if per_round else ""
        lines.append(f"Python-side overhead of cupyflash(auto) (host cost minus the bare cuLaunchKernel, "
                     f"{o['python_side_us_per_call']:.1f} us) / sdpa_flash wall per call = {python_side:.2f}{spread} "
                     f"(target <= 0.50: {'ok' if python_side <= 0.5 else 'MISS'})")
    return "\n".join(lines)


def write_json(path: str | os.PathLike, data: dict) -> None:
    """Atomic write, so a run killed mid-way leaves the last complete snapshot."""
    write_atomic(path, (json.dumps(data, indent=1, default=str) + "\n").encode("utf-8"))


def plot(records: list[dict], path: str | os.PathLike, title: str) -> str | None:
    """TFLOP/s vs seq length, a line per implementation, a panel per (dtype, d_head). Returns None
    when written, else why not (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib is not importable ({exc})"
    grid = [r for r in records if r["status"] == "ok" and r["impl"] != "cupyflash_tune"]
    panels = list(dict.fromkeys((r["dtype"], r["d_head"]) for r in grid))
    if not panels:
        return "no successful measurements to plot"
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (dtype, d_head) in zip(axes[0], panels):
        for impl in impl_columns(grid):
            pts = sorted((r["seq"], r["tflops"]) for r in grid
                         if r["impl"] == impl and (r["dtype"], r["d_head"]) == (dtype, d_head))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        seqs = sorted({r["seq"] for r in grid if (r["dtype"], r["d_head"]) == (dtype, d_head)})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqs])
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{dtype}, d_head {d_head}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
