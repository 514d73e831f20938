"""bench.py --mode decode: issue 10's decode table in one run, built from scripts/bench_decode.py's
problem, calls and timers (imported, not copied: that script stays the decode family's tuning
tool and keeps working on its own).

    python scripts/bench.py --mode decode [--dtypes bf16,fp16] [--rows 0,1,...] [--d-heads 128]
                            [--samples 40] [--rounds N] [--quick] [--no-fa3] [--json bench_decode.json]
                            [--plot PNG]

Rows: bench_decode.TABLE_ROWS (32 query heads, 8 KV heads; d_head 128, 64, 256; one new query
token per sequence, and 4 causal ones). Columns: cupyflash.forward_kvcache on a contiguous cache
and on a paged cache (page 16, shuffled page table), SDPA flash and SDPA cuDNN (enable_gqa; not
for the causal seq_q > 1 row, whose is_causal is top-left aligned), FlashAttention-3's
flash_mha_with_kvcache at its best num_splits and its paged form (page 16) where the
flash-attn3-jax wheel is installed (d_head 128), and the limit: K and V bytes at 3.0 TB/s.

Each implementation's output is checked once, before it is timed, against a float64 reference
(the first and last sequence, every head; SPEC §5 relative L2 bound); cupyflash's output buffer
is poisoned with NaN for that check. Times: median of --samples CUDA-event timings of calls
queued behind a GPU spin (FA3: host clock over batches of calls), inputs rotated past L2.
--rounds N times the CUDA-event columns of each row N times in alternating order (after each
one's check and first timing) and reports each one's median round: the rows where cupyflash and
cuDNN both stream at the copy rate are decided by fractions of a percent, which one pass at a
time leaves to clock and DRAM drift (FA3's best split is timed once).
Targets (issue 10, printed beside the figures, never a failure): latency <= the fastest peer of
the row; >= 85% of 3.0 TB/s where K/V exceed 64 MiB; paged within 1.05x of contiguous; the
per-call host cost of forward_kvcache <= 15 us (bench_decode.overhead_us; --no-overhead skips it).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any, Callable

import bench_decode as bd
from bench_impls import timed_rounds
from bench_mode_common import (Skip, bar_plot, check_then_time, collect_failures, finish, fmt, format_table, gpu_host,
                               ratio, verdict)
from cupyflash.benchmarking import REL_L2_TOLERANCE, parse_dtypes, parse_ints
from cupyflash.config import DType

COLUMNS = ("cupyflash", "cupyflash_paged16", "sdpa_flash", "sdpa_cudnn", "fa3", "fa3_paged16")
PEERS = ("sdpa_flash", "sdpa_cudnn", "fa3")  # the target's "fastest peer": FA3 contiguous at its best split
BANDWIDTH_TARGET = 0.85
BANDWIDTH_MIN_BYTES = 64 << 20
PAGED_TARGET = 1.05
OVERHEAD_TARGET_US = 15.0
FA3_SPLITS = (1, 4, 16, 32)
FA3_PAGED_SPLITS = (1, 4, 16)
QUICK_SPLITS = (1, 16)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py --mode decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16,fp16")
    p.add_argument("--rows", default="", help="comma-separated indices into bench_decode.TABLE_ROWS (default all)")
    p.add_argument("--d-heads", default="", help="only the rows of these head dims (default all)")
    p.add_argument("--samples", type=int, default=40, help="CUDA-event samples per measurement (median reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="timing rounds of the CUDA-event columns per row, in alternating order (median round)")
    p.add_argument("--quick", action="store_true", help=f"FA3 at num_splits {QUICK_SPLITS} only, 15 samples")
    p.add_argument("--no-fa3", action="store_true", help="leave FlashAttention-3 out")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the per-call host cost of forward_kvcache (bench_decode.overhead_us)")
    p.add_argument("--json", default="bench_decode.json")
    p.add_argument("--plot", default=None, help="PNG (default: the --json path with .png; '' for none)")
    return p


def select_rows(rows_arg: str, d_heads_arg: str) -> list[tuple]:
    """The TABLE_ROWS entries picked by --rows and --d-heads; ValueError naming the option."""
    picks = list(bd.TABLE_ROWS)
    if rows_arg.strip():
        idx = [int(x) if x.strip().isdigit() else -1 for x in rows_arg.split(",") if x.strip()]
        bad = [i for i in idx if not 0 <= i < len(bd.TABLE_ROWS)]
        if bad or not idx:
            raise ValueError(f"--rows: expected indices 0..{len(bd.TABLE_ROWS) - 1}, got {rows_arg!r}")
        picks = [bd.TABLE_ROWS[i] for i in idx]
    if d_heads_arg.strip():
        keep = parse_ints(d_heads_arg, "--d-heads")
        picks = [r for r in picks if r[0] in keep]
        if not picks:
            raise ValueError(f"--d-heads: no table row has d_head in {keep}")
    return picks


def keys_text(keys: int) -> str:
    return f"{keys // 1024}k" if keys >= 1024 and keys % 1024 == 0 else str(keys)


def kv_bytes(d_head: int, batch: int, keys: int) -> int:
    return bd.Row("bf16", d_head, batch, 1, keys, False).kv_bytes  # fp16 and bf16: 2 bytes an element


# ---------------------------------------------------------------------------- check
def reference(torch: Any, p: Any, b: int) -> Any:
    """float64 attention of sequence b of input set 0: (seq_q, n_heads, d_head). GQA without
    repeating K/V: the query heads of a KV group are rows of one product."""
    sq, h, d = p.q[0].shape[1:]
    hk = p.k[0].shape[2]
    group = h // hk
    q = p.q[0][b].double().permute(1, 0, 2).reshape(hk, group * sq, d)  # row r: head g = r // sq, query r % sq
    k = p.k[0][b].double().permute(1, 0, 2)
    v = p.v[0][b].double().permute(1, 0, 2)
    s = (q @ k.transpose(1, 2)) / math.sqrt(d)
    if p.causal:  # bottom-right: query i sees key j iff j <= i + keys - seq_q
        i = (torch.arange(group * sq, device=s.device) % sq)[:, None]
        j = torch.arange(k.shape[1], device=s.device)[None, :]
        s = s.masked_fill(j > i + k.shape[1] - sq, -math.inf)
    out = torch.softmax(s, dim=-1) @ v  # (hk, group*sq, d)
    return out.reshape(h, sq, d).permute(1, 0, 2)


def rel_l2(torch: Any, refs: dict, out: Any) -> float:
    """Relative L2 error of out (batch, seq_q, heads, d) on the reference sequences; inf on NaN/inf."""
    num = den = 0.0
    for b, ref in refs.items():
        got = out[b].double()
        if not bool(torch.isfinite(got).all()):
            return math.inf
        num += float(((got - ref) ** 2).sum())
        den += float((ref ** 2).sum())
    return math.sqrt(num / den) if den > 0 else math.inf


# ---------------------------------------------------------------------------- one row
def measure_row(torch: Any, fa3: Any, fa3_reason: str | None, dtype: str, row: tuple, samples: int,
                splits: tuple[int, ...], paged_splits: tuple[int, ...], rounds: int = 1) -> list[dict]:
    d, batch, seq_q, keys, causal = row
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    p = bd.Problem(torch, tdt, d, batch, seq_q, keys, causal)
    p.build_pages()
    refs = {b: reference(torch, p, b) for b in sorted({0, batch - 1})}
    tol = REL_L2_TOLERANCE[DType.BF16 if dtype == "bf16" else DType.FP16]
    limit_us = kv_bytes(d, batch, keys) / bd.COPY_RATE * 1e6
    point = {"dtype": dtype, "d_head": d, "batch": batch, "seq_q": seq_q, "keys": keys, "causal": causal,
             "kv_bytes": kv_bytes(d, batch, keys), "limit_us": limit_us,
             "point": f"{dtype} d{d} b{batch} q{seq_q}{'c' if causal else ''} k{keys_text(keys)}"}
    records = []
    timers: dict[str, tuple[dict, Callable[[], float]]] = {}  # the CUDA-event columns that measured

    def record(name: str, check: Callable[[], float], time_us: Callable[[], float]) -> dict:
        rec = check_then_time(name, check, time_us, tol)
        torch.cuda.synchronize()
        rec.update(point)
        records.append(rec)
        if rec["status"] == "ok":
            timers[name] = (rec, time_us)
        status = f"{rec['us']:9.1f} us (rel_l2 {rec['rel_l2']:.1e})" if rec["status"] == "ok" else \
            f"{rec['status'].upper()}: {rec['reason']}"
        print(f"  {point['point']:<22} {name:<18} {status}", flush=True)
        return rec

    for name, paged in (("cupyflash", False), ("cupyflash_paged16", True)):
        call = bd.cupyflash_call(p, paged)

        def check(call: Callable = call) -> float:
            call(0).fill_(math.nan)  # the call writes into its own out buffer: poison it, run again
            return rel_l2(torch, refs, call(0))

        record(name, check, lambda call=call: bd.gpu_time_us(torch, call, p.n_sets, samples))

    for name, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        holder: dict[str, Callable] = {}

        def check(backend: str = backend) -> float:
            try:
                holder["call"] = bd.sdpa_call(p, backend)
            except RuntimeError as exc:  # the causal seq_q > 1 row: SDPA's mask is top-left aligned
                raise Skip(str(exc)) from None
            return rel_l2(torch, refs, holder["call"](0))

        # `holder` bound now: --rounds calls the timer again after the loop has moved on
        record(name, check, lambda holder=holder: bd.gpu_time_us(torch, holder["call"], p.n_sets, samples))

    if rounds > 1:
        more = timed_rounds({n: rec["us"] for n, (rec, _) in timers.items()},
                            {n: timer for n, (_, timer) in timers.items()}, rounds)
        for name, (rec, _) in timers.items():
            rec.update(us=statistics.median(more[name]), us_rounds=more[name])
            print(f"  {point['point']:<22} {name:<18} {rec['us']:9.1f} us, median of {rounds} rounds "
                  f"({', '.join(f'{x:.1f}' for x in more[name])})", flush=True)

    for name, paged, tries in (("fa3", False, splits), ("fa3_paged16", True, paged_splits)):
        per_split = []
        for s in tries:
            holder = {}

            def check(paged: bool = paged, s: int = s) -> float:
                if fa3 is None:
                    raise Skip(fa3_reason or "flash_attn3_jax is not available")
                if d != 128:
                    raise Skip(f"the flash-attn3-jax wheel is built for d_head 128, not {d}")
                holder["call"], holder["sync"] = fa3.calls(p, paged, s)
                got = holder["call"](0)
                holder["sync"](got)
                return rel_l2(torch, refs, fa3.to_torch(torch, got))

            rec = check_then_time(f"{name}_s{s}", check,
                                  lambda: bd.host_time_us(holder["call"], holder["sync"], p.n_sets), tol)
            per_split.append(rec)
            if rec["status"] == "skipped":
                break  # the same reason holds for every split count
        ok = [r for r in per_split if r["status"] == "ok"]
        best = min(ok, key=lambda r: r["us"]) if ok else per_split[-1]
        rec = dict(best, impl=name, **point, splits={r["impl"]: r["us"] for r in per_split},
                   num_splits=int(best["impl"].rsplit("_s", 1)[1]) if ok else None)
        if not ok and per_split and per_split[0]["status"] != "skipped":
            rec.update(status=per_split[0]["status"], reason=per_split[0]["reason"])
        records.append(rec)
        status = f"{rec['us']:9.1f} us (num_splits {rec['num_splits']}, host clock)" if ok else \
            f"{rec['status'].upper()}: {rec['reason']}"
        print(f"  {point['point']:<22} {name:<18} {status}", flush=True)
    p.drop_pages()
    return records


# ---------------------------------------------------------------------------- report
def row_summary(records: list[dict]) -> list[dict]:
    """Per (dtype, row): the times of each column, the limit and the three target figures."""
    out = []
    for key in dict.fromkeys((r["dtype"], r["d_head"], r["batch"], r["seq_q"], r["keys"], r["causal"]) for r in records):
        got = {r["impl"]: r for r in records
               if (r["dtype"], r["d_head"], r["batch"], r["seq_q"], r["keys"], r["causal"]) == key}
        us = {c: got[c]["us"] if c in got and got[c]["status"] == "ok" else None for c in COLUMNS}
        some = next(iter(got.values()))
        peers = [us[c] for c in PEERS if us[c] is not None]
        cf = us["cupyflash"]
        big = some["kv_bytes"] > BANDWIDTH_MIN_BYTES
        out.append({"key": key, "us": us, "status": {c: got[c]["status"] if c in got else None for c in COLUMNS},
                    "limit_us": some["limit_us"], "vs_best_peer": ratio(cf, min(peers)) if peers else None,
                    "bandwidth_fraction": some["limit_us"] / cf if cf else None, "bandwidth_target": big,
                    "paged_over_contig": ratio(us["cupyflash_paged16"], cf)})
    return out


def format_report(records: list[dict], meta: dict) -> str:
    header = ["dtype", "d", "batch", "seq_q", "keys"] + list(COLUMNS) + \
        ["limit", "cf/best peer (<=1.00)", "% of 3.0 TB/s (>=85%)", "paged/contig (<=1.05)"]
    rows = []
    for s in row_summary(records):
        dtype, d, batch, seq_q, keys, causal = s["key"]
        cells = [fmt(s["us"][c]) if s["us"][c] is not None else (s["status"][c] or "-").upper() for c in COLUMNS]
        vb = s["vs_best_peer"]
        bw = s["bandwidth_fraction"]
        pc = s["paged_over_contig"]
        rows.append([dtype, str(d), str(batch), f"{seq_q}{' causal' if causal else ''}", keys_text(keys)] + cells +
                    [fmt(s["limit_us"]),
                     f"{fmt(vb, 2)} {verdict(vb, 1.0, at_most=True)}" if vb else "-",
                     (f"{100 * bw:.0f}% " + (verdict(bw, BANDWIDTH_TARGET) if s["bandwidth_target"] else "(<64 MiB)"))
                     if bw else "-",
                     f"{fmt(pc, 2)} {verdict(pc, PAGED_TARGET, at_most=True)}" if pc else "-"])
    notes = list(dict.fromkeys(f"  {r['impl']} {r['point']}: {r['status']}: {r['reason']}"
                               for r in records if r["status"] != "ok"))
    return "\n".join([f"decode: microseconds, {bd.N_HEADS} query heads / {bd.N_KV_HEADS} KV heads; CUDA-event "
                      f"medians (fa3: host clock, best num_splits); limit = K+V bytes / 3.0 TB/s",
                      format_table(header, rows),
                      "targets (issue 10): cupyflash <= the fastest peer (SDPA flash, SDPA cuDNN, FA3 at its best "
                      "num_splits); >= 85% of 3.0 TB/s where K/V exceed 64 MiB; paged page 16 within 1.05x of "
                      "contiguous"] + (["not reported:"] + notes if notes else []))


def plot(summary: list[dict], path: str, title: str) -> str | None:
    """Each column's time over the row's bandwidth limit (1.0 = K and V read once at 3.0 TB/s),
    a group per row: rows from 10 us to 1.5 ms share one linear axis."""
    groups = [f"{k[0]} d{k[1]} b{k[2]} q{k[3]} {keys_text(k[4])}" for k in (s["key"] for s in summary)]
    series = {c: [s["us"][c] / s["limit_us"] if s["us"][c] else None for s in summary] for c in COLUMNS}
    return bar_plot(groups, series, path, "time / bandwidth limit (1.0 = K+V at 3.0 TB/s)", title)


def format_overhead(o: dict) -> str:
    """bench_decode.overhead_us's figures beside issue 10's target (<= 15 us per call): the plain
    call (contiguous cache, out given, one split), then every other case it measured, steady
    (second burst behind the spin), then the first bursts (bench_mode_common.host_cost_us)."""
    if "cupyflash" not in o:
        return f"per-call host cost: not measured ({o.get('error')})"
    others = ", ".join(f"{k.removeprefix('cupyflash_')} {v:.1f}" for k, v in o.items()
                       if k.startswith("cupyflash_") and isinstance(v, (int, float)))
    line = (f"per-call host cost (1x1x8x128 bf16 query, 256-row cache, cached kernel, calls queued behind a GPU "
            f"spin, steady): forward_kvcache {o['cupyflash']:.1f} us "
            f"({verdict(o['cupyflash'], OVERHEAD_TARGET_US, at_most=True)} <= {OVERHEAD_TARGET_US:.0f} us)"
            + (f"; {others} us" if others else "") + _peer_costs(o, "; {} {:.1f} us"))
    first = o.get("first_burst") or {}
    if "cupyflash" in first:
        line += (f"\n  first burst after a synchronize: forward_kvcache {first['cupyflash']:.1f} us"
                 + _peer_costs(first, ", {} {:.1f}"))
    return line


def _peer_costs(o: dict, fmt: str) -> str:
    """SDPA's and the bare launch's figures of `o`, where measured, each through `fmt`."""
    return "".join(fmt.format(label, o[key]) for key, label in (("sdpa", "SDPA"), ("launch_only", "bare launch"))
                   if key in o)


def main(argv: list[str] | None = None, host: Any = None) -> int:
    """Exit codes as bench.py: 0 measured, 1 cupyflash refused or raised, 2 nothing measured."""
    args = build_parser().parse_args(argv)
    try:
        dtypes = [d.name.lower() for d in parse_dtypes(args.dtypes)]
        rows = select_rows(args.rows, args.d_heads)
        if args.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {args.samples}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    except ValueError as exc:
        print(f"bench.py --mode decode: error: {exc}", file=sys.stderr)
        return 2
    host = gpu_host(host)
    if host is None:
        return 2
    import torch

    from bench_report import write_json

    samples = min(args.samples, 15) if args.quick else args.samples
    splits, paged_splits = (QUICK_SPLITS, QUICK_SPLITS) if args.quick else (FA3_SPLITS, FA3_PAGED_SPLITS)
    jax, jax_reason = host._import_jax([] if args.no_fa3 else ["fa3"])
    fa3, fa3_reason = None, "--no-fa3" if args.no_fa3 else jax_reason
    if jax is not None:
        try:
            fa3 = bd.FA3()
        except Exception as exc:  # the wheel is not installed or does not load here
            fa3_reason = f"flash_attn3_jax is not importable ({type(exc).__name__}: {exc})"
    meta = host._meta(torch, jax)
    data: dict[str, Any] = {"mode": "decode", "meta": meta, "args": vars(args), "records": [], "complete": False}
    print(f"bench decode: {meta['gpu']} | {meta['date']} | {len(rows)} rows x {dtypes}", flush=True)
    for dtype in dtypes:
        for row in rows:
            data["records"] += measure_row(torch, fa3, fa3_reason, dtype, row, samples, splits, paged_splits,
                                           args.rounds)
            torch.cuda.empty_cache()  # the row's tensors are gone with measure_row's frame
            write_json(args.json, data)
    if not args.no_overhead:
        try:
            data["overhead_us"] = bd.overhead_us(torch)
        except Exception as exc:  # reported, not fatal
            data["overhead_us"] = {"error": f"{type(exc).__name__}: {exc}"}
    failures = collect_failures(data["records"])
    data.update(complete=True, failures=failures, summary=row_summary(data["records"]))
    write_json(args.json, data)
    print()
    print(f"== {meta['gpu']} | {meta['date']} | " + " | ".join(f"{k} {v}" for k, v in meta["versions"].items() if v))
    print(format_report(data["records"], meta))
    if "overhead_us" in data:
        print(format_overhead(data["overhead_us"]))
    return finish("decode", args.json, args.plot,
                  lambda path: plot(data["summary"], path, f"decode, {meta['gpu']}, {meta['date']}"), failures)
