"""Same-run speed comparison of two cupyflash checkouts on the SPEC §6 grid (non-causal, or
causal with --causal).

    git worktree add .old_release <commit>          # the previous release, beside this checkout
    python scripts/compare_releases.py --old .old_release [--dtypes bf16,fp16] [--d-heads 64,128]
                                       [--causal] [--rounds 5] [--iters 30] [--json PATH]

Each release runs in its own long-lived worker process (two packages named cupyflash cannot share
one) with its own empty kernel cache directory (so no user tuning table applies), on the same
seeded inputs, timed the way scripts/bench.py times (the SPEC §6 grid shape, rotated input sets
so that data comes from DRAM, queued CUDA-event pairs; median of `--iters`). Per grid point the
two workers are timed in alternating order for `--rounds` rounds and each figure is the median
over rounds, so a drift of the GPU's clocks during the run hits both releases alike.

Per point four figures separate the kernel from the tuning table:
  new        the new release, cfg=None (its own pick, its own tuning table)
  old        the old release, cfg=None
  new@old    the new kernel running the old release's pick
  old@new    the old kernel running the new release's pick
new/old is what a user sees; new@old/old and new/old@new compare the two kernels on the same
config. SDPA flash and SDPA cuDNN run in the new release's worker as the common baselines.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
SEQS = (512, 1024, 2048, 4096, 8192, 16384)

# A worker: sys.path starts with one release's root; one JSON request per stdin line, one JSON
# answer per stdout line. Requests: {"op": "pick", ...} -> the release's config for cfg=None;
# {"op": "time", "cfg": str | None | "sdpa", ...} -> TFLOP/s.
WORKER = r"""
import json, math, sys, torch
import cupyflash
from cupyflash.api import resolve_config
from cupyflash.benchmarking import rotation_sets
from cupyflash.config import DType
DTYPES = {"bf16": (torch.bfloat16, DType.BF16), "fp16": (torch.float16, DType.FP16)}
L2_BYTES = torch.cuda.get_device_properties(0).L2_cache_size
SLEEP_CYCLES = 10_000_000  # as bench.py: ~5 ms of GPU spin so the host queues ahead of the GPU
inputs = {}

def problem(dtype, d_head, seq):
    # bench.py's inputs: the SPEC grid shape, enough seeded sets that each call finds its data
    # outside L2
    key = (dtype, d_head, seq)
    if key not in inputs:
        inputs.clear()
        torch.cuda.empty_cache()
        batch, heads = max(1, 16384 // seq), 2048 // d_head
        n_sets = rotation_sets(8 * batch * seq * heads * d_head, L2_BYTES)
        gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + d_head)
        sets = [[torch.randn(batch, seq, heads, d_head, generator=gen, device="cuda").to(DTYPES[dtype][0])
                 for _ in range(3)] for _ in range(n_sets)]
        inputs[key] = (sets, 4 * batch * heads * seq * seq * d_head)
    return inputs[key]

def sdpa_backend(name):
    from torch.nn.attention import SDPBackend
    return {"sdpa": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[name]

def median_ms(fn, n_sets, iters):
    # bench.py's time_events: queued event pairs behind a GPU spin, no sync in between
    fn(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    for i in range(5):
        fn(i % n_sets)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(events):
        a.record(); fn((5 + i) % n_sets); b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    return times[len(times) // 2]

for line in sys.stdin:
    req = json.loads(line)
    try:
        sets, flops = problem(req["dtype"], req["d_head"], req["seq"])
        causal = req.get("causal", False)
        if causal:
            flops /= 2
        if req["op"] == "runs":  # can this release run that config (a knob it may not know)?
            try:
                resolve_config(req["cfg"])
                answer = {"ok": True}
            except ValueError:
                answer = {"ok": False}
        elif req["op"] == "pick":
            cfg = resolve_config(None, DTYPES[req["dtype"]][1], req["d_head"], req["seq"], req["seq"], 0, causal)
            answer = {"config": str(cfg)}
        elif req["cfg"] in ("sdpa", "sdpa_cudnn"):
            from torch.nn.attention import sdpa_kernel
            t_sets = [[x.transpose(1, 2) for x in qkv] for qkv in sets]
            sdpa = torch.nn.functional.scaled_dot_product_attention
            with sdpa_kernel(sdpa_backend(req["cfg"])):
                ms = median_ms(lambda i: sdpa(*t_sets[i], is_causal=causal), len(sets), req["iters"])
            answer = {"tflops": flops / ms / 1e9}
        else:
            cfg = req["cfg"]
            ms = median_ms(lambda i: cupyflash.forward(cfg, *sets[i], causal=causal), len(sets), req["iters"])
            answer = {"tflops": flops / ms / 1e9}
    except Exception as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(answer), flush=True)
"""


class Worker:
    """One release's worker process."""

    def __init__(self, root: Path, cache_dir: Path) -> None:
        self.root = root
        # Its own empty cache directory: a user tuning table in the shared one (written by an
        # earlier `cupyflash autotune` on this machine) would override both releases' shipped
        # tables and make their picks the same.
        env = dict(os.environ, PYTHONPATH=str(root), CUPYFLASH_CACHE_DIR=str(cache_dir))
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, cwd=root, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, **request: Any) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.root} exited (code {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"worker for {self.root}: {answer['error']} (request {request})")
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def compare_point(new: Worker, old: Worker, dtype: str, d_head: int, seq: int, rounds: int, iters: int,
                  causal: bool = False) -> dict:
    point = {"dtype": dtype, "d_head": d_head, "seq": seq, "causal": causal}
    new_pick = new.ask(op="pick", **point)["config"]
    old_pick = old.ask(op="pick", **point)["config"]
    runs: dict[str, tuple[Worker, str | None]] = {
        "new": (new, None), "old": (old, None), "new@old": (new, old_pick), "old@new": (old, new_pick),
        "sdpa_flash": (new, "sdpa"), "sdpa_cudnn": (new, "sdpa_cudnn")}
    if not old.ask(op="runs", cfg=new_pick, **point)["ok"]:
        del runs["old@new"]  # the new pick uses a knob the old release does not know
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))  # alternate who goes first
        for name in order:
            worker, cfg = runs[name]
            samples[name].append(worker.ask(op="time", cfg=cfg, iters=iters, **point)["tflops"])
    row: dict[str, Any] = dict(point, new_pick=new_pick, old_pick=old_pick)
    row.update({name: statistics.median(values) for name, values in samples.items()})
    row.setdefault("old@new", None)
    row["samples"] = samples
    return row


def kernel_ratio(row: dict) -> float:
    """The new kernel over the old one on the same configs: the geometric mean over both picks,
    or the old pick alone when the old release cannot run the new one."""
    if row["old@new"] is None:
        return row["new@old"] / row["old"]
    return ((row["new"] / row["old@new"]) * (row["new@old"] / row["old"])) ** 0.5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, type=Path, help="root of the previous release's checkout")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--d-heads", default="64,128")
    p.add_argument("--seqs", default=",".join(map(str, SEQS)))
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per point (median taken)")
    p.add_argument("--iters", type=int, default=30, help="timed launches per round (median taken)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right) attention, FLOPs halved")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    old_root = args.old.resolve()
    if not (old_root / "cupyflash" / "__init__.py").exists():
        print(f"--old: {old_root} holds no cupyflash package", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="cupyflash-compare-"))
    new, old = Worker(HERE, scratch / "new"), Worker(old_root, scratch / "old")
    rows = []
    print(f"{'dtype':5} {'d':>4} {'seq':>6} {'new':>7} {'old':>7} {'new/old':>7} {'new@old':>7} {'old@new':>7} "
          f"{'kernel':>6} {'flash':>7} {'new/fl':>6} {'cudnn':>7} {'new/cu':>6}   picks new | old")
    try:
        for dtype in args.dtypes.split(","):
            for d_head in (int(x) for x in args.d_heads.split(",")):
                for seq in (int(x) for x in args.seqs.split(",")):
                    row = compare_point(new, old, dtype, d_head, seq, args.rounds, args.iters, args.causal)
                    row["kernel_new_over_old"] = kernel_ratio(row)
                    rows.append(row)
                    same = "same pick" if row["new_pick"] == row["old_pick"] else f"{row['new_pick']} | {row['old_pick']}"
                    print(f"{dtype:5} {d_head:>4} {seq:>6} {row['new']:7.1f} {row['old']:7.1f} "
                          f"{row['new'] / row['old']:7.3f} {row['new@old']:7.1f} {row['old@new'] or float('nan'):7.1f} "
                          f"{row['kernel_new_over_old']:6.3f} {row['sdpa_flash']:7.1f} "
                          f"{row['new'] / row['sdpa_flash']:6.3f} {row['sdpa_cudnn']:7.1f} "
                          f"{row['new'] / row['sdpa_cudnn']:6.3f}   {same}", flush=True)
    finally:
        new.close()
        old.close()
        shutil.rmtree(scratch, ignore_errors=True)
    worst = min(rows, key=lambda r: r["new"] / r["old"])
    worst_kernel = min(rows, key=lambda r: r["kernel_new_over_old"])
    print(f"worst new/old: {worst['new'] / worst['old']:.3f} at {worst['dtype']} d_head {worst['d_head']} "
          f"S={worst['seq']}; worst kernel-only new/old: {worst_kernel['kernel_new_over_old']:.3f} at "
          f"{worst_kernel['dtype']} d_head {worst_kernel['d_head']} S={worst_kernel['seq']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "iters": args.iters, "causal": args.causal,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
