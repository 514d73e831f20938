#!/usr/bin/env python
"""Benchmark the Hopper forward family (forward_sm90) against its peers on SPEC §6's grid.

    python scripts/bench_hopper.py --json results.json
    python scripts/bench_hopper.py --json r.json --seqs 512,4096 --dtypes bf16 --causal both --prog

Grid: batch*seq = 16384, heads*d_head = 2048, seq in 512..16k. Per point, on the same torch
inputs (rotated to defeat L2): forward_sm90 (the family default, and with --prog every
progression config), the mma.sync `cupyflash.forward` (library pick), PyTorch SDPA with the
FLASH_ATTENTION and CUDNN_ATTENTION backends, and FlashAttention-3 (`flash_attn3_jax.flash_mha`,
d_head 128 only) when importable. Every result is checked (relative L2 against a float64
reference on spot rows) before it is timed. Times: medians of CUDA-event timings after warm-up
(FA3 runs on JAX's stream: host clock over batches of calls, as for JAX elsewhere).
TFLOP/s = 4*B*H*S*S*D / t (half when causal). Writes every figure to the JSON path; prints a
short table last.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_impls import (CupyflashImpl, Impl, SdpaImpl, Skip, make_problem, rel_l2_error,  # noqa: E402
                         time_host)
from cupyflash.benchmarking import grid_shape, parse_dtypes  # noqa: E402
from cupyflash.config import DType  # noqa: E402
from cupyflash.families.forward_sm90.config import HopperForwardKernelConfig  # noqa: E402
from cupyflash.families.forward_sm90.config_sets import (KERNEL_SET_KEYS, default_config,  # noqa: E402
                                                          get_kernel_configs, progression_configs)

REL_L2_LIMIT = {DType.BF16: 2e-2, DType.FP16: 5e-3}


class Sm90Impl(Impl):
    """forward_sm90 launched from pre-validated plans (the fast path `forward` would take):
    one plan, parameter buffer and output per input set, so the timing is the kernel's."""

    def __init__(self, cfg: HopperForwardKernelConfig | None, name: str) -> None:
        self.cfg = cfg
        self.name = name

    def prepare(self, problem) -> None:
        import torch

        from cupyflash.families.forward_sm90 import launch as L
        from cupyflash.interop import as_view, resolve_stream

        super().prepare(problem)
        cfg = self.cfg or default_config(problem.dtype, problem.shape.d_head, problem.causal)
        self.launches = []
        for q, k, v in problem.sets:
            out = torch.empty_like(q)
            qv, kv, vv, ov = (as_view(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
            plan = L.plan_sm90(cfg, qv, kv, vv, ov, problem.scale, problem.causal)
            kernel = L.get_kernel(plan.cfg, plan.base.device, plan.base.causal)
            params = L.pack_sm90(plan, qv, kv, vv, ov.ptr, 0)
            self.launches.append((kernel, plan.grid, cfg.n_threads, cfg.smem_bytes(), params, out))
        self.stream = lambda: resolve_stream(None, as_view(problem.sets[0][0], "q"))
        self.cfg_used = cfg

    def run(self, i: int) -> Any:
        kernel, grid, block, smem, params, out = self.launches[i]
        kernel.launch(grid, block, smem, self.stream(), params)
        return out

    def check(self, torch) -> float:
        out = self.launches[0][5]
        out.fill_(math.nan)
        return rel_l2_error(torch, self.problem, self.run(0))


class Fa3Impl(Impl):
    """flash_attn3_jax.flash_mha under jax.jit on zero-copy DLPack views (d_head 128 wheel)."""

    timing_method = "host clock, batches of calls"

    def __init__(self) -> None:
        self.name = "fa3"
        try:
            import jax
            import flash_attn3_jax
        except Exception as exc:  # not installed: a peer we skip
            raise Skip(f"flash_attn3_jax not importable ({type(exc).__name__}: {exc})") from None
        self.jax, self.mha = jax, flash_attn3_jax.flash_mha

    def prepare(self, problem) -> None:
        import torch

        if problem.shape.d_head != 128:
            raise Skip("the FA3 wheel is built for d_head 128 only")
        super().prepare(problem)
        torch.cuda.synchronize()
        self._sets = [tuple(self.jax.dlpack.from_dlpack(t) for t in s) for s in problem.sets]
        kwargs = {"is_causal": problem.causal}
        if "softmax_scale" in inspect.signature(self.mha).parameters:
            kwargs["softmax_scale"] = problem.scale
        self._fn = self.jax.jit(functools.partial(self.mha, **kwargs))

    def run(self, i: int) -> Any:
        return self._fn(*self._sets[i])

    def check(self, torch) -> float:
        out = self.run(0).astype(self.jax.numpy.float32)
        out.block_until_ready()
        return rel_l2_error(torch, self.problem, torch.from_dlpack(out))

    def time(self, torch, warmup: int, iters: int):
        return time_host(self.run, lambda x: x.block_until_ready(), len(self._sets), warmup, max(5, iters // 4))


def extra_configs(text: str) -> list[HopperForwardKernelConfig]:
    """--configs: a config-set key of the family ('tune', 'prog_all', ...) or short forms joined by ';'."""
    if not text:
        return []
    if text in KERNEL_SET_KEYS:
        return get_kernel_configs(text)
    return [HopperForwardKernelConfig.parse(t) for t in text.split(";") if t.strip()]


def make_impls(torch, args) -> list:
    impls: list = [Sm90Impl(None, "sm90")]
    if args.prog:
        for i, cfg in enumerate(progression_configs(), 1):
            impls.append(Sm90Impl(cfg, f"sm90_p{i}"))
    for cfg in extra_configs(args.configs):
        impls.append(Sm90Impl(cfg, str(cfg).replace("forward_sm90", "")))
    factories = {"cupyflash": lambda: CupyflashImpl(None, "cupyflash"),
                 "sdpa_flash": lambda: SdpaImpl(torch, "FLASH_ATTENTION", "sdpa_flash"),
                 "sdpa_cudnn": lambda: SdpaImpl(torch, "CUDNN_ATTENTION", "sdpa_cudnn"),
                 "fa3": Fa3Impl}
    for name in args.peers.split(","):
        if not name:
            continue
        try:
            impls.append(factories[name]())
        except Skip as exc:
            print(f"skip {name}: {exc}", flush=True)
    return impls


def call_overhead(torch, n_calls: int = 2000) -> dict:
    """Host microseconds per call on a tiny problem (1x128x8x128 bf16): forward_sm90 (full
    validation, cached TMA descriptors) and cupyflash.forward (its per-signature fast path)."""
    import cupyflash
    from cupyflash.families.forward_sm90 import forward_sm90

    q, k, v = (torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for name, call in (("forward_sm90", lambda: forward_sm90(None, q, k, v)),
                       ("cupyflash.forward", lambda: cupyflash.forward(None, q, k, v))):
        for _ in range(200):
            call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n_calls):
            call()
        out[name] = (time.perf_counter() - t0) / n_calls * 1e6
        torch.cuda.synchronize()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="path of the JSON results")
    parser.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--d-heads", default="128")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--prog", action="store_true", help="also time every progression config (bf16 d128)")
    parser.add_argument("--configs", default="", help="more forward_sm90 configs: a set key (tune, ...) "
                        "or short forms joined by ';' (each timed where its dtype and d_head match)")
    parser.add_argument("--peers", default="cupyflash,sdpa_flash,sdpa_cudnn,fa3")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--overhead", action="store_true", help="also time host microseconds per call (tiny problem)")
    args = parser.parse_args(argv)
    import torch

    dtypes = parse_dtypes(args.dtypes)
    seqs = [int(s) for s in args.seqs.split(",")]
    d_heads = [int(d) for d in args.d_heads.split(",")]
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    impls = make_impls(torch, args)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for dtype in dtypes:
        for d in d_heads:
            for causal in causals:
                for seq in seqs:
                    shape = grid_shape(seq, d)
                    problem = make_problem(torch, dtype, shape, causal, l2)
                    for impl in impls:
                        if impl.name.startswith("sm90_p") and not (dtype is DType.BF16 and d == 128):
                            continue
                        fixed = getattr(impl, "cfg", None)
                        if isinstance(fixed, HopperForwardKernelConfig) and (fixed.dtype, fixed.d_head) != (dtype, d):
                            continue
                        row = {"impl": impl.name, "dtype": dtype.name, "d_head": d, "causal": causal, "seq": seq,
                               "batch": shape.batch, "heads": shape.heads}
                        try:
                            impl.prepare(problem)
                            with impl.context():
                                err = impl.check(torch)
                                row["rel_l2"] = err
                                if not err <= REL_L2_LIMIT[dtype]:
                                    raise RuntimeError(f"wrong result: rel L2 {err:.3g}")
                                timing = impl.time(torch, args.warmup, args.iters)
                            row.update(timing.to_dict(), tflops=timing.tflops(problem.flops),
                                       timing=impl.timing_method)
                            if isinstance(impl, Sm90Impl):
                                row["config"] = str(impl.cfg_used)
                        except Skip as exc:
                            row["skipped"] = str(exc)
                        except Exception as exc:  # one failing peer must not end the run
                            row["error"] = f"{type(exc).__name__}: {exc}"
                            traceback.print_exc()
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    del problem
                    torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.overhead:
        meta["call_overhead_us"] = call_overhead(torch)
        print("call overhead (us/call):", json.dumps(meta["call_overhead_us"]))
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(format_table(rows, [i.name for i in impls]))
    print(f"{meta['gpu']}, {meta['date']}; TFLOP/s; sm90 = the family default for each (dtype, d_head, "
          "causal) (its config is in the JSON rows); " + ", ".join(
              f"{i.name}={i.cfg}" for i in impls if isinstance(i, Sm90Impl) and i.cfg is not None))
    return 0


def format_table(rows: list[dict], names: list[str]) -> str:
    """One line per (dtype, d, causal, seq): TFLOP/s per implementation ('-' skipped, 'ERR')."""
    keys = sorted({(r["dtype"], r["d_head"], r["causal"], r["seq"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    lines = ["| dtype | d | causal | S | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for key in keys:
        cells = []
        for name in names:
            match = [r for r in rows if (r["dtype"], r["d_head"], r["causal"], r["seq"]) == key and r["impl"] == name]
            if not match:
                cells.append(" ")
            elif "tflops" in match[0]:
                cells.append(f"{match[0]['tflops']:.0f}")
            else:
                cells.append("ERR" if "error" in match[0] else "-")
        dt, d, causal, seq = key
        lines.append(f"| {dt} | {d} | {'yes' if causal else 'no'} | {seq} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
