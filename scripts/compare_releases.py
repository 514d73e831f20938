"""Same-run speed comparison of two cupyflash checkouts on the SPEC §6 non-causal grid.

    git worktree add .old_release <commit>          # the previous release, beside this checkout
    python scripts/compare_releases.py --old .old_release [--dtypes bf16,fp16] [--d-heads 64,128]

Each release runs in its own worker process (two packages named cupyflash cannot share one), on
the same seeded inputs, one grid point after the other, each with cfg=None (the release's own
library pick, tuning table included), timed with CUDA events (median). SDPA flash runs in the new
release's worker as the common baseline. Prints a table and the worst new/old ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SEQS = (512, 1024, 2048, 4096, 8192, 16384)

# Runs inside a worker whose sys.path starts with one release's root.
WORKER = r"""
import json, math, sys, torch
import cupyflash
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[1]]
d_head, seq, iters, with_sdpa = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
batch, heads = max(1, 16384 // seq), 2048 // d_head
gen = torch.Generator(device="cuda").manual_seed(seq * 1000 + d_head)
q, k, v = (torch.randn(batch, seq, heads, d_head, generator=gen, device="cuda").to(dtype) for _ in range(3))
flops = 4 * batch * heads * seq * seq * d_head

def median_ms(fn):
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]

out = {"cupyflash": flops / median_ms(lambda: cupyflash.forward(None, q, k, v)) / 1e9}
if with_sdpa:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out["sdpa_flash"] = flops / median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)) / 1e9
print(json.dumps(out))
"""


def run_worker(root: Path, dtype: str, d_head: int, seq: int, iters: int, with_sdpa: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", WORKER, dtype, str(d_head), str(seq), str(iters),
                           "1" if with_sdpa else "0"], env=env, capture_output=True, text=True, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"worker for {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, type=Path, help="root of the previous release's checkout")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--d-heads", default="64,128")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    old = args.old.resolve()
    if not (old / "cupyflash" / "__init__.py").exists():
        print(f"--old: {old} holds no cupyflash package", file=sys.stderr)
        return 2
    rows = []
    print(f"{'dtype':5} {'d':>4} {'seq':>6} {'new':>8} {'old':>8} {'new/old':>8} {'sdpa_flash':>10} {'new/flash':>9}")
    for dtype in args.dtypes.split(","):
        for d_head in (int(x) for x in args.d_heads.split(",")):
            for seq in SEQS:
                new = run_worker(HERE, dtype, d_head, seq, args.iters, with_sdpa=True)
                prev = run_worker(old, dtype, d_head, seq, args.iters, with_sdpa=False)
                row = {"dtype": dtype, "d_head": d_head, "seq": seq, "new": new["cupyflash"], "old": prev["cupyflash"],
                       "sdpa_flash": new["sdpa_flash"]}
                rows.append(row)
                print(f"{dtype:5} {d_head:>4} {seq:>6} {row['new']:8.1f} {row['old']:8.1f} "
                      f"{row['new'] / row['old']:8.3f} {row['sdpa_flash']:10.1f} {row['new'] / row['sdpa_flash']:9.3f}",
                      flush=True)
    worst = min(rows, key=lambda r: r["new"] / r["old"])
    print(f"worst new/old: {worst['new'] / worst['old']:.3f} at {worst['dtype']} d_head {worst['d_head']} S={worst['seq']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
