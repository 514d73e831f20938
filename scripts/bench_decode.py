"""Decode benchmark (issue 10's table): cupyflash.forward_kvcache (contiguous and paged cache)
against PyTorch SDPA (flash and cuDNN backends), FlashAttention-3's flash_mha_with_kvcache (the
flash_attn3_jax wheel, d_head 128, when installed) and the bandwidth limit (K and V bytes at
3.0 TB/s).

    python scripts/bench_decode.py --out docs/bench_decode_h100.json [--dtypes bf16,fp16] [--quick]
    python scripts/bench_decode.py --tune --out tune.json     # sweep the decode tune set instead
    python scripts/bench_decode.py --sweep --rows 0,6 --out sweep.json  # configs x num_splits per row

Timing: CUDA events around each call, all calls of a sample queued behind a GPU spin so the
events measure GPU time only (not Python); median over the samples. Inputs rotate over enough
copies to exceed L2 (50 MB on the H100). FA3 runs under jax.jit on JAX's own stream, so it is
timed with the host clock over batches of calls (block_until_ready at the end of each batch).
Every implementation's output is checked against SDPA's (relative L2) before it is timed.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

COPY_RATE = 3.0e12  # bytes/s, measured device-to-device copy rate of the H100 (ANCHORS.md)
L2_DEFEAT_BYTES = 256 << 20
LOCAL_RUN = 32  # pages per locally shuffled run (Problem.build_pages)

# (d_head, batch, seq_q, keys, causal) rows of issue 10; 32 query heads, 8 KV heads
TABLE_ROWS = [
    (128, 1, 1, 8192, False), (128, 1, 1, 131072, False), (128, 8, 1, 32768, False), (128, 32, 1, 4096, False),
    (128, 64, 1, 8192, False), (128, 16, 4, 8192, True),
    (64, 1, 1, 8192, False), (64, 1, 1, 131072, False), (64, 64, 1, 8192, False),
    (256, 1, 1, 8192, False), (256, 8, 1, 32768, False), (256, 64, 1, 8192, False),
]
N_HEADS, N_KV_HEADS = 32, 8


@dataclass
class Row:
    dtype: str
    d_head: int
    batch: int
    seq_q: int
    keys: int
    causal: bool
    times_us: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.keys * N_KV_HEADS * self.d_head * 2

    @property
    def limit_us(self) -> float:
        return self.kv_bytes / COPY_RATE * 1e6


# ----------------------------------------------------------------------------- timing
def gpu_time_us(torch, call, n_sets: int, samples: int = 30, per_sample: int = 1) -> float:
    """Median GPU time of call(i) from CUDA events, the calls queued behind a GPU spin."""
    for i in range(max(3, n_sets)):
        call(i % n_sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues every call below before the GPU runs them
    for s in range(samples):
        starts[s].record()
        for j in range(per_sample):
            call((s * per_sample + j) % n_sets)
        ends[s].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 / per_sample for a, b in zip(starts, ends))


def host_time_us(call, sync, n_sets: int, batches: int = 7, per_batch: int = 20) -> float:
    for i in range(3):
        sync(call(i % n_sets))
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        r = None
        for j in range(per_batch):
            r = call(j % n_sets)
        sync(r)
        times.append((time.perf_counter() - t0) * 1e6 / per_batch)
    return statistics.median(times)


def rel_l2(torch, out, ref) -> float:
    o, r = out.float(), ref.float()
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


# ----------------------------------------------------------------------------- problems
class Problem:
    def __init__(self, torch, dtype, d, batch, seq_q, keys, causal, page_size=16):
        self.torch = torch
        self.dtype, self.d, self.batch, self.seq_q, self.keys, self.causal = dtype, d, batch, seq_q, keys, causal
        kv_bytes = 2 * batch * keys * N_KV_HEADS * d * 2
        self.n_sets = max(1, min(8, math.ceil(L2_DEFEAT_BYTES / kv_bytes)))
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(0)
        self.q = [torch.randn(batch, seq_q, N_HEADS, d, dtype=dtype, device=dev, generator=g) for _ in range(self.n_sets)]
        self.k = [torch.randn(batch, keys, N_KV_HEADS, d, dtype=dtype, device=dev, generator=g) for _ in range(self.n_sets)]
        self.v = [torch.randn(batch, keys, N_KV_HEADS, d, dtype=dtype, device=dev, generator=g) for _ in range(self.n_sets)]
        self.seqlens = torch.full((batch,), keys, dtype=torch.int32, device=dev)
        self.page_size = page_size
        self.pages = None

    def build_pages(self, order: str = "shuffled"):
        """The same contents in a paged cache (page_size rows a page) whose page table is
        'shuffled' (a random permutation of the whole pool, the benchmark's case), 'local'
        (shuffled within runs of LOCAL_RUN consecutive pages: the same page-table indirection over
        a small address range) or 'identity' (pages in order: the indirection alone)."""
        torch, ps = self.torch, self.page_size
        per_seq = self.keys // ps
        n_pages = self.batch * per_seq
        self.tables, self.k_pages, self.v_pages = [], [], []
        for i in range(self.n_sets):
            if order == "identity":
                perm = torch.arange(n_pages, device="cuda", dtype=torch.int32)
            elif order == "local":
                run = min(LOCAL_RUN, n_pages)
                keys = torch.arange(n_pages, device="cuda") // run * run + torch.rand(n_pages, device="cuda")
                perm = torch.argsort(keys).to(torch.int32)
            elif order == "shuffled":
                perm = torch.randperm(n_pages, device="cuda").to(torch.int32)
            else:
                raise ValueError(f"order: expected shuffled, local or identity, got {order!r}")
            table = perm.view(self.batch, per_seq).contiguous()
            kp = torch.empty(n_pages, ps, N_KV_HEADS, self.d, dtype=self.dtype, device="cuda")
            vp = torch.empty_like(kp)
            kp[perm.long()] = self.k[i].view(n_pages, ps, N_KV_HEADS, self.d)
            vp[perm.long()] = self.v[i].view(n_pages, ps, N_KV_HEADS, self.d)
            self.tables.append(table)
            self.k_pages.append(kp)
            self.v_pages.append(vp)
        self.pages = True

    def drop_pages(self):
        self.tables = self.k_pages = self.v_pages = None
        self.pages = None

    def reference(self, torch):
        F = torch.nn.functional
        q, k, v = (x.transpose(1, 2) for x in (self.q[0], self.k[0], self.v[0]))
        k = k.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        v = v.repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        mask = None
        if self.causal:
            i = torch.arange(self.seq_q, device="cuda")[:, None]
            j = torch.arange(self.keys, device="cuda")[None, :]
            mask = j <= i + self.keys - self.seq_q
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        return out.transpose(1, 2)


# ----------------------------------------------------------------------------- implementations
def cupyflash_call(problem, paged: bool, cfg=None, num_splits=None):
    import cupyflash

    torch = problem.torch
    out = [torch.empty_like(q) for q in problem.q]
    if paged:
        def call(i):
            return cupyflash.forward_kvcache(problem.q[i], problem.k_pages[i], problem.v_pages[i],
                                             cache_seqlens=problem.seqlens, block_table=problem.tables[i],
                                             causal=problem.causal, out=out[i], cfg=cfg, num_splits=num_splits)
    else:
        def call(i):
            return cupyflash.forward_kvcache(problem.q[i], problem.k[i], problem.v[i], cache_seqlens=problem.seqlens,
                                             causal=problem.causal, out=out[i], cfg=cfg, num_splits=num_splits)
    return call


def sdpa_call(problem, backend: str):
    torch = problem.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    qs = [q.transpose(1, 2) for q in problem.q]
    ks = [k.transpose(1, 2) for k in problem.k]
    vs = [v.transpose(1, 2) for v in problem.v]
    if problem.causal:
        raise RuntimeError("SDPA's is_causal is top-left aligned for seq_q < seq_k: not the decode mask")
    b = getattr(SDPBackend, backend)

    def call(i):
        with sdpa_kernel([b]):
            return F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True).transpose(1, 2)
    return call


class FA3:
    def __init__(self):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch
        import jax
        import jax.numpy as jnp
        from flash_attn3_jax import flash_mha_with_kvcache

        self.jax, self.jnp, self.fn = jax, jnp, flash_mha_with_kvcache

    def calls(self, problem, paged: bool, num_splits: int):
        jax = self.jax
        torch = problem.torch
        torch.cuda.synchronize()
        tj = lambda t: jax.dlpack.from_dlpack(t)  # noqa: E731 - zero copy
        qs = [tj(q) for q in problem.q]
        seqlens = tj(problem.seqlens)
        if paged:
            ks, vs, tabs = [tj(k) for k in problem.k_pages], [tj(v) for v in problem.v_pages], [tj(t) for t in problem.tables]
            f = jax.jit(lambda q, k, v, s, t: self.fn(q, k, v, cache_seqlens=s, page_table=t, is_causal=problem.causal,
                                                       num_splits=num_splits))
            return (lambda i: f(qs[i], ks[i], vs[i], seqlens, tabs[i])), (lambda r: r.block_until_ready())
        ks, vs = [tj(k) for k in problem.k], [tj(v) for v in problem.v]
        f = jax.jit(lambda q, k, v, s: self.fn(q, k, v, cache_seqlens=s, is_causal=problem.causal, num_splits=num_splits))
        return (lambda i: f(qs[i], ks[i], vs[i], seqlens)), (lambda r: r.block_until_ready())

    def to_torch(self, torch, x):
        return torch.from_dlpack(x)


# ----------------------------------------------------------------------------- runs
def bench_row(torch, row: Row, fa3, quick: bool, log) -> None:
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[row.dtype]
    p = Problem(torch, dt, row.d_head, row.batch, row.seq_q, row.keys, row.causal)
    ref = p.reference(torch) if row.kv_bytes < (3 << 30) // 4 * 1 else None
    samples = 15 if quick else 40

    def run(name, call, timer="gpu", sync=None):
        try:
            out = call(0)
            torch.cuda.synchronize()
            if ref is not None:
                o = fa3.to_torch(torch, out) if timer == "host" else out
                row.errors[name] = rel_l2(torch, o, ref)
            if timer == "gpu":
                row.times_us[name] = gpu_time_us(torch, call, p.n_sets, samples)
            else:
                row.times_us[name] = host_time_us(call, sync, p.n_sets)
        except Exception as exc:  # a peer that cannot run this row: recorded, not fatal
            row.notes[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        log(f"  {name}: {row.times_us.get(name, '-')} us err {row.errors.get(name, '-')} {row.notes.get(name, '')}")

    run("cupyflash", cupyflash_call(p, False))
    p.build_pages()
    run("cupyflash_paged16", cupyflash_call(p, True))
    if not row.causal:
        run("sdpa_flash", sdpa_call(p, "FLASH_ATTENTION"))
        run("sdpa_cudnn", sdpa_call(p, "CUDNN_ATTENTION"))
    if fa3 is not None and row.d_head == 128 and row.dtype == "bf16":
        for paged, splits in ((False, (1, 4, 16, 32)), (True, (1, 4, 16))):
            best = None
            for s in ((1, 16) if quick else splits):
                name = f"fa3{'_paged16' if paged else ''}_s{s}"
                call, sync = fa3.calls(p, paged, s)
                run(name, call, timer="host", sync=sync)
                t = row.times_us.get(name)
                if t is not None and (best is None or t < best[0]):
                    best = (t, s)
            if best:
                key = "fa3_paged16" if paged else "fa3"
                row.times_us[key] = best[0]
                row.notes[key] = f"best num_splits={best[1]} (host clock)"
    p.drop_pages()


def tune(torch, rows, configs_for, log) -> list[dict]:
    """Time every config of the decode tune set (matching d_head) on `rows`, contiguous and paged."""
    from cupyflash.device import device_arch
    from cupyflash.prewarm import prewarm

    wanted = sorted({c for dtype, d, *_ in rows for c in configs_for(dtype, d)})
    variants = sorted({(causal, paged) for *_, causal in rows for paged in (False, True)})
    report = prewarm(wanted, [device_arch(torch.cuda.current_device())[0]], variants=variants,
                     jobs=os.cpu_count(), progress=None)
    log(f"prewarmed {len(report.results)} modules, {len(report.failed)} failed")
    results = []
    for dtype, d, batch, seq_q, keys, causal in rows:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        p = Problem(torch, dt, d, batch, seq_q, keys, causal)
        p.build_pages()
        for cfg in configs_for(dtype, d):
            entry = {"config": cfg.short_form(), "d_head": d, "batch": batch, "seq_q": seq_q, "keys": keys}
            for paged in (False, True):
                try:
                    entry["paged" if paged else "contig"] = gpu_time_us(torch, cupyflash_call(p, paged, cfg), p.n_sets, 15)
                except Exception as exc:
                    entry["error"] = str(exc)[:200]
            log(json.dumps(entry))
            results.append(entry)
        del p
        torch.cuda.empty_cache()
    return results


def overhead_us(torch) -> dict:
    """Host cost of one forward_kvcache call with a cached kernel (bursts queued behind a spin):
    'cupyflash' (contiguous, out given, one split: one launch), then with a paged cache, with
    k_new/v_new (append launch), with return_lse, with 4 splits (combine launch) and with no
    `out` (allocation), and SDPA's for scale."""
    from bench_mode_common import host_cost_us

    import cupyflash

    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    kp, vp = k.view(16, 16, 2, 128), v.view(16, 16, 2, 128)
    table = torch.arange(16, dtype=torch.int32, device="cuda").view(1, 16)
    kn = torch.randn(1, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((1,), 200, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    F = torch.nn.functional
    fk = cupyflash.forward_kvcache
    cases = {
        "cupyflash": lambda: fk(q, k, v, cache_seqlens=lens, out=out, num_splits=1),
        "cupyflash_paged": lambda: fk(q, kp, vp, cache_seqlens=lens, block_table=table, out=out, num_splits=1),
        "cupyflash_k_new": lambda: fk(q, k, v, cache_seqlens=lens, k_new=kn, v_new=kn, out=out, num_splits=1),
        "cupyflash_lse": lambda: fk(q, k, v, cache_seqlens=lens, out=out, num_splits=1, return_lse=True),
        "cupyflash_splits4": lambda: fk(q, k, v, cache_seqlens=lens, out=out, num_splits=4),
        "cupyflash_no_out": lambda: fk(q, k, v, cache_seqlens=lens, num_splits=1),
        "sdpa": lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       enable_gqa=True),
    }
    # The driver's share: the same launches replayed from their plans with nothing else (no
    # signature, pointers, allocation or stream lookup), so cupyflash minus launch_only is the
    # library's own host cost.
    from cupyflash import kvcache_plans

    # (One split only: a split plan's packed workspace pointer is freed after its call.)
    kvcache_plans.clear()
    cases["cupyflash"]()  # validated once: its plan is the table's only one
    (plan,) = kvcache_plans._TABLE.plans.values()
    cases["launch_only"] = functools.partial(plan.run, torch.cuda.current_stream().cuda_stream)
    return host_cost_us(torch, cases)


def profile_calls(torch, n: int = 3000, top: int = 18) -> str:
    """cProfile of `n` fast-path calls (paged cache, k_new, 4 splits, return_lse: every launch
    and allocation), sorted by own time: where the host time of a call goes."""
    import cProfile
    import io
    import pstats

    import cupyflash

    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    kp = torch.randn(16, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(16, dtype=torch.int32, device="cuda").view(1, 16)
    kn = torch.randn(1, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((1,), 200, dtype=torch.int32, device="cuda")

    def call():
        return cupyflash.forward_kvcache(q, kp, kp, cache_seqlens=lens, block_table=table, k_new=kn, v_new=kn,
                                         num_splits=4, return_lse=True)
    call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def sweep(torch, picks, dtypes, log, splits=(None, 8, 16, 32, 64, 128)) -> list[dict]:
    """Time the tune set's configs of each row's (dtype, d_head), contiguous and paged, at each
    split count (None: the library's rule); also the library's own choice (cfg None)."""
    from cupyflash.config import DType
    from cupyflash.families.decode.config_sets import autotune_configs

    results = []
    for dtype in dtypes:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        for d, batch, seq_q, keys, causal in picks:
            p = Problem(torch, dt, d, batch, seq_q, keys, causal)
            p.build_pages()
            configs = [None] + autotune_configs([DType.parse(dtype)], [d])
            for cfg in configs:
                for ns in splits:
                    entry = {"dtype": dtype, "d_head": d, "batch": batch, "seq_q": seq_q, "keys": keys,
                             "config": cfg.short_form() if cfg is not None else "auto", "num_splits": ns}
                    for paged in (False, True):
                        try:
                            entry["paged" if paged else "contig"] = gpu_time_us(
                                torch, cupyflash_call(p, paged, cfg, ns), p.n_sets, 10)
                        except Exception as exc:
                            entry["error"] = str(exc)[:200]
                    log(json.dumps(entry))
                    results.append(entry)
            del p
            torch.cuda.empty_cache()
    return results


def format_table(rows: list[Row]) -> str:
    cols = ["cupyflash", "cupyflash_paged16", "sdpa_flash", "sdpa_cudnn", "fa3", "fa3_paged16"]
    head = "| dtype | d | batch | seq_q | keys | " + " | ".join(cols) + " | limit | cf/best peer | cf % of 3.0 TB/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        peers = [r.times_us[c] for c in ("sdpa_flash", "sdpa_cudnn", "fa3", "fa3_paged16") if c in r.times_us]
        cf = r.times_us.get("cupyflash")
        ratio = f"{cf / min(peers):.2f}" if cf and peers else "-"
        pct = f"{100 * r.limit_us / cf:.0f}%" if cf else "-"
        cells = [f"{r.times_us[c]:.1f}" if c in r.times_us else "-" for c in cols]
        lines.append(f"| {r.dtype} | {r.d_head} | {r.batch} | {r.seq_q}{' causal' if r.causal else ''} | "
                     f"{r.keys // 1024}k | " + " | ".join(cells) + f" | {r.limit_us:.1f} | {ratio} | {pct} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--quick", action="store_true", help="fewer samples and FA3 split counts")
    ap.add_argument("--no-fa3", action="store_true")
    ap.add_argument("--rows", default="", help="comma-separated row indices of the table (default all)")
    ap.add_argument("--tune", action="store_true", help="sweep the decode tune set (bf16) instead")
    ap.add_argument("--sweep", action="store_true", help="time tune-set configs x num_splits on --rows instead")
    ap.add_argument("--splits", default="auto,8,16,32,64,128", help="--sweep: split counts (auto = library rule)")
    ap.add_argument("--overhead", action="store_true", help="only the per-call host overhead lines and a profile")
    args = ap.parse_args(argv)

    import torch

    def log(msg):
        print(msg, flush=True)

    dev = torch.cuda.get_device_name()
    meta = {"gpu": dev, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.tune:
        from cupyflash.families.decode.config_sets import autotune_configs
        from cupyflash.config import DType

        def configs_for(dtype, d):
            return autotune_configs([DType.BF16 if dtype == "bf16" else DType.FP16], [d])

        picks = [TABLE_ROWS[int(i)] for i in args.rows.split(",")] if args.rows else TABLE_ROWS
        rows = [("bf16", d, b, sq, n, c) for d, b, sq, n, c in picks]
        results = tune(torch, rows, configs_for, log)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "tune": results}, f, indent=1)
        return 0

    if args.overhead:
        meta["overhead_us"] = overhead_us(torch)
        log(f"per-call host overhead (us): {json.dumps(meta['overhead_us'], indent=1)}")
        log(profile_calls(torch))
        with open(args.out, "w") as f:
            json.dump({"meta": meta}, f, indent=1)
        return 0

    if args.sweep:
        picks = [TABLE_ROWS[int(i)] for i in args.rows.split(",")] if args.rows else TABLE_ROWS
        splits = tuple(None if s == "auto" else int(s) for s in args.splits.split(","))
        results = sweep(torch, picks, args.dtypes.split(","), log, splits)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "sweep": results}, f, indent=1)
        return 0

    fa3 = None
    if not args.no_fa3:
        try:
            fa3 = FA3()
        except Exception as exc:
            log(f"FA3 unavailable: {exc}")
    picks = [TABLE_ROWS[int(i)] for i in args.rows.split(",")] if args.rows else TABLE_ROWS
    rows = []
    for dtype in args.dtypes.split(","):
        for d, b, sq, n, c in picks:
            row = Row(dtype, d, b, sq, n, c)
            log(f"{dtype} d{d} batch {b} seq_q {sq} keys {n} causal {c}")
            bench_row(torch, row, fa3, args.quick, log)
            rows.append(row)
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": [r.__dict__ | {"limit_us": r.limit_us} for r in rows]}, f, indent=1)
    meta["overhead_us"] = overhead_us(torch)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": [r.__dict__ | {"limit_us": r.limit_us} for r in rows]}, f, indent=1)
    log(f"per-call host overhead (us): {meta['overhead_us']}")
    log(f"{dev}, {meta['date']}; times in microseconds (CUDA-event medians; FA3 host clock)")
    log(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
