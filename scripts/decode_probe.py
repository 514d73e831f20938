"""Decode probe: named decode configs x split counts on issue 10's table rows, contiguous and paged
(page 16, shuffled), one compact line per (row, config, num_splits). For questions the tune set
cannot ask (several KV heads per CTA, paged-only shapes, split counts off the rule).

    python scripts/decode_probe.py --rows 0,1 --splits auto,8,16,32 [--dtype bf16] [--samples 15] \\
        --configs "default|paged_default|decode (BF16, 128, 16, 16, 8): stages_2+heads_8"

'default' / 'paged_default' stand for the heuristic configs of the row's (dtype, d_head) for a
contiguous / paged cache; 'auto' for the library's own choice (cfg=None). A short form whose
d_head differs from the row's is skipped. Every config is compiled first, in parallel; each
timed call is checked once against SDPA's math backend in float32 (relative L2 <= 2e-2).
Times: CUDA-event medians of calls queued behind a GPU spin (bench_decode.gpu_time_us).

--allocs N builds each row's cache N times, each behind a fresh device allocation of random size
(up to 256 MB): where in DRAM the cache lands moves a config's time by up to 1-2% from one
allocation to the next at the copy rate, more than configs differ there (NOTES.md item 234). With
--peer, the last lines give each (row, config, num_splits) its median ratio to SDPA cuDNN over
the allocations (cuDNN: the mean of its before/after times in the same allocation).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import bench_decode as bd


def resolve(name: str, dtype, d_head: int):
    from cupyflash.families.decode import config_sets
    from cupyflash.families.decode.config import DecodeKernelConfig

    if name == "auto":
        return None
    if name == "default":
        return config_sets.default_config(dtype, d_head)
    if name == "paged_default":
        return config_sets.default_config(dtype, d_head, paged=True)
    cfg = DecodeKernelConfig.parse(name)
    if cfg.d_head != d_head:
        return "skip"
    return cfg.replace(dtype=dtype)


def parse_shape(text: str) -> tuple[int, int, int, int, bool]:
    """'d:batch:seq_q:keys[:causal]' -> a TABLE_ROWS-like row (causal: 1/0, default 0)."""
    parts = [int(x) for x in text.split(":")]
    if len(parts) not in (4, 5):
        raise SystemExit(f"--shapes: {text!r} is not 'd:batch:seq_q:keys[:causal]'")
    return parts[0], parts[1], parts[2], parts[3], bool(parts[4]) if len(parts) == 5 else False


def print_ratios(results: list[dict]) -> None:
    """Per (row, config, num_splits): the median over allocations of its contiguous time over
    SDPA cuDNN's (the mean of cuDNN's before/after times in that allocation), and the range."""
    peer = {}
    for e in results:
        if e["config"].startswith("sdpa_cudnn_"):
            peer.setdefault((e["row"], e["alloc"]), []).append(e["contig"])
    ratios: dict[tuple, list[float]] = {}
    for e in results:
        us, cudnn = e.get("contig"), peer.get((e["row"], e["alloc"]))
        if not e["config"].startswith("sdpa_cudnn_") and isinstance(us, float) and cudnn:
            ratios.setdefault((e["row"], e["config"], e["num_splits"]), []).append(us / statistics.mean(cudnn))
    for (row, name, ns), r in ratios.items():
        print(f"{row:<18} {name[:52]:<52} s={str(ns):<4} /cudnn median {statistics.median(r):.4f} "
              f"over {len(r)} allocations ({min(r):.4f}-{max(r):.4f})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="0,1", help="indices into bench_decode.TABLE_ROWS")
    ap.add_argument("--shapes", default="",
                    help="extra rows 'd:batch:seq_q:keys[:causal]' separated by commas (e.g. 128:33:1:8192), "
                         "after --rows ('--rows \'\'' for these alone)")
    ap.add_argument("--configs", default="auto,default,paged_default", help="'|'-separated config names")
    ap.add_argument("--splits", default="auto", help="comma-separated num_splits ('auto' = the library's rule)")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-paged", action="store_true")
    ap.add_argument("--peer", action="store_true",
                    help="also time SDPA cuDNN on each row, before and after its configs (same run, same sets)")
    ap.add_argument("--page-order", default="shuffled", help="shuffled | local | identity (bench_decode.Problem)")
    ap.add_argument("--allocs", type=int, default=1,
                    help="fresh allocations of each row's cache, each behind a random-size pad (see above)")
    args = ap.parse_args(argv)

    import torch

    from cupyflash.config import DType
    from cupyflash.device import device_arch
    from cupyflash.prewarm import prewarm

    dtype = DType.parse(args.dtype)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = [bd.TABLE_ROWS[int(i)] for i in args.rows.split(",") if i.strip()]
    rows += [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    names = [n.strip() for n in args.configs.split("|") if n.strip()]
    splits = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    wanted = {c for d, *_ in rows for n in names for c in [resolve(n, dtype, d)] if c not in (None, "skip")}
    t0 = time.time()
    report = prewarm(sorted(wanted), [device_arch(torch.cuda.current_device())[0]],
                     variants=sorted({(c, pg) for *_, c in rows for pg in (False, True)}), jobs=os.cpu_count(),
                     progress=None)
    print(f"prewarmed {len(report.results)} modules in {time.time() - t0:.0f} s, "
          f"{sum(not r.ok for r in report.results)} failed", flush=True)
    results = []
    rng = random.Random(0)
    for (d, batch, seq_q, keys, causal), alloc in itertools.product(rows, range(args.allocs)):
        pad = torch.empty(rng.randint(1, 256) << 20, dtype=torch.uint8, device="cuda")  # moves the cache in DRAM
        p = bd.Problem(torch, tdt, d, batch, seq_q, keys, causal)
        if not args.no_paged:
            p.build_pages(args.page_order)
        ref = p.reference(torch) if p.k[0].numel() * 2 * 4 < (2 << 30) else None
        label = f"d{d} b{batch} q{seq_q}{'c' if causal else ''} k{keys}"
        peer = bd.sdpa_call(p, "CUDNN_ATTENTION") if args.peer and not causal else None

        def time_peer(when: str, n_sets: int = p.n_sets) -> None:
            us = round(bd.gpu_time_us(torch, peer, n_sets, args.samples), 2)
            print(f"{label:<18} {'sdpa_cudnn (' + when + ')':<52} contig {us}", flush=True)
            results.append({"row": label, "config": f"sdpa_cudnn_{when}", "contig": us, "alloc": alloc})

        if peer is not None:
            time_peer("before")
        for name in names:
            cfg = resolve(name, dtype, d)
            if cfg == "skip":
                continue
            for ns in splits:
                entry = {"row": label, "config": name, "num_splits": ns, "alloc": alloc}
                for paged in (False,) if args.no_paged else (False, True):
                    tag = "paged" if paged else "contig"
                    try:
                        call = bd.cupyflash_call(p, paged, cfg, ns)
                        if ref is not None:
                            err = bd.rel_l2(torch, call(0), ref)
                            if not err <= 2e-2:
                                raise RuntimeError(f"wrong result: rel_l2 {err:.3g}")
                        entry[tag] = round(bd.gpu_time_us(torch, call, p.n_sets, args.samples), 2)
                    except Exception as exc:  # reported, the probe goes on
                        entry[tag] = f"{type(exc).__name__}: {str(exc)[:120]}"
                c, pg = entry.get("contig"), entry.get("paged")
                ratio = f"{pg / c:.3f}" if isinstance(c, float) and isinstance(pg, float) else "-"
                print(f"{label:<18} {name[:52]:<52} s={str(ns):<4} contig {c}  paged {pg}  ratio {ratio}", flush=True)
                results.append(entry)
        if peer is not None:
            time_peer("after")
        del p, ref, pad
        torch.cuda.empty_cache()
    if args.peer and args.allocs > 1:
        print_ratios(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "page_order": args.page_order,
                       "probe": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
