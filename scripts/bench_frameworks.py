"""Per-call overhead of the framework front ends on a tiny problem (1x128x8x128 bf16, kernel cached).

PyTorch: cupyflash.torch.attention (the `cupyflash::` operator defined with torch.library.Library),
the same operator called as an OpOverload, the same body registered with torch.library.custom_op,
plain cupyflash.forward, torch.compile(fullgraph=True) of attention, SDPA flash, and a bare
cuLaunchKernel of the same kernel; for training, attention with q requiring a gradient (the lse
variant through autograd), the attention_forward_lse and attention_backward operators, and one
forward + backward through autograd against SDPA flash's; and a small packed ragged batch
(VARLEN_LENGTHS tokens, causal) through cupyflash.torch.attention_varlen, its forward with the lse
and one forward + backward through autograd against SDPA flash on jagged nested tensors. Each is measured
as host issue cost (calls queued behind a GPU spin, so only the host side counts) and as wall time
of back-to-back calls, in interleaved rounds (medians), and as the median over the rounds of each
row's wall time over its SDPA peer's in the same round (per_round_ratio).

JAX: cupyflash.jax.attention against jax.nn.dot_product_attention (cuDNN and XLA), as eager calls
and inside one jitted program (a fori_loop chain x <- attention(x, k, v), and an unrolled chain of
32), with the number of Python callback runs per attention call (below 1 when XLA replays the
launch from a command buffer); for training, one forward + backward per iteration of a jitted
fori_loop (x <- x + 1e-3 grad(sum(attention(x, k, v)))) and in an unrolled chain of 16 such steps
(with the backward callback's runs per step), the backward through each one's VJP, and
the same steps of cupyflash.jax.attention_varlen on the packed batch (fori_loop and unrolled, with
both of its callbacks' runs per step).

    python scripts/bench_frameworks.py [--json out.json]
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch/CuPy
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = (1, 128, 8, 128)  # (batch, seq, heads, d_head)
VARLEN_LENGTHS = (37, 90, 64, 40)  # a small packed batch (231 tokens, 8 heads, d_head 128), causal


def _varlen_offsets() -> list[int]:
    offsets = [0]
    for n in VARLEN_LENGTHS:
        offsets.append(offsets[-1] + n)
    return offsets


# ------------------------------------------------------------------------------------ torch
# The SDPA row each torch row is compared with (the rest: SDPA flash's forward).
SDPA_PEERS = {"cupyflash fwd+bwd (autograd)": "SDPA flash fwd+bwd (autograd)",
              "attention_varlen fwd+bwd (autograd)": "SDPA flash (nested) fwd+bwd (autograd)"}


def per_round_ratio(samples: dict[str, dict[str, list[float]]], name: str, key: str = "wall") -> float | None:
    """Median over the rounds of `name`'s time / its SDPA peer's time in the same round (SDPA_PEERS,
    else "SDPA flash"), or None where the peer was not measured. A host's speed can change between
    rounds (turbo, other tenants): the medians of each row then mix two host states, while the
    ratio within a round compares the two at one speed. None for the training peers themselves."""
    if name in SDPA_PEERS.values():  # a peer itself (of other rows)
        return None
    base = SDPA_PEERS.get(name, "SDPA flash")
    if base not in samples or not samples[name][key]:
        return None
    return statistics.median(a / b for a, b in zip(samples[name][key], samples[base][key]))


def bench_torch(rounds: int, calls: int) -> dict[str, Any]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupyflash
    import cupyflash.torch as cft
    from bench_impls import _issue_us, _wall_us
    from cupyflash import launch_plans

    @torch.library.custom_op("cupyflash_bench::attention_forward", mutates_args=())
    def custom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                         softmax_scale: float | None = None) -> torch.Tensor:
        return cupyflash.forward(None, q, k, v, causal=causal, softmax_scale=softmax_scale)

    @custom_attention.register_fake
    def _(q, k, v, causal=False, softmax_scale=None):
        return q.new_empty(q.shape)

    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    op = torch.ops.cupyflash.attention_forward.default
    flash = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # noqa: E731
    # training: q requiring a gradient (autograd saves the lse), the backward operator on its own,
    # and one forward + backward through autograd, against SDPA flash doing the same
    qg = q.detach().clone().requires_grad_()
    qgt = qt.detach().clone().requires_grad_()
    dout = torch.randn_like(q)
    fwd_out, fwd_lse = cft.attention_forward_lse(q, k, v, False, None)
    bwd = torch.ops.cupyflash.attention_backward.default
    compiled = torch.compile(lambda q, k, v: cft.attention(q, k, v), fullgraph=True)
    # the packed batch: cupyflash's varlen operators, and SDPA flash on jagged nested tensors
    offsets, longest = _varlen_offsets(), max(VARLEN_LENGTHS)
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    packed = [torch.randn((offsets[-1], SHAPE[2], SHAPE[3]), device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    pg = [x.clone().requires_grad_() for x in packed]
    pdout = torch.randn_like(packed[0])
    nested = [torch.nested.nested_tensor_from_jagged(x, offsets=cu.long(), min_seqlen=min(VARLEN_LENGTHS),
                                                     max_seqlen=longest).transpose(1, 2) for x in pg]

    def nested_step() -> None:
        o = sdpa(*nested, is_causal=True).transpose(1, 2).values()
        torch.autograd.grad(o, pg, pdout)
    table: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
        "cupyflash.forward": (lambda: cupyflash.forward(None, q, k, v), contextlib.nullcontext),
        "cupyflash.torch.attention": (lambda: cft.attention(q, k, v), contextlib.nullcontext),
        "torch.ops.cupyflash.attention_forward": (lambda: op(q, k, v), contextlib.nullcontext),
        "custom_op (same body)": (lambda: custom_attention(q, k, v), contextlib.nullcontext),
        "torch.compile(attention), fullgraph": (lambda: compiled(q, k, v), contextlib.nullcontext),
        "SDPA flash": (lambda: sdpa(qt, kt, vt), flash),
        "attention, q.requires_grad (saves lse)": (lambda: cft.attention(qg, k, v), contextlib.nullcontext),
        "attention_forward_lse op": (lambda: cft.attention_forward_lse(q, k, v, False, None), contextlib.nullcontext),
        "attention_backward op": (lambda: bwd(dout, q, k, v, fwd_out, fwd_lse, False, None, False), contextlib.nullcontext),
        "cupyflash fwd+bwd (autograd)": (lambda: cft.attention(qg, k, v).backward(dout), contextlib.nullcontext),
        "SDPA flash fwd+bwd (autograd)": (lambda: sdpa(qgt, kt, vt).backward(dout.transpose(1, 2)), flash),
        "attention_varlen, return_lse": (lambda: cft.attention_varlen(*packed, cu, cu, longest, longest, causal=True,
                                                                      return_lse=True), contextlib.nullcontext),
        "attention_varlen fwd+bwd (autograd)": (lambda: cft.attention_varlen(*pg, cu, cu, longest, longest,
                                                                             causal=True).backward(pdout),
                                                contextlib.nullcontext),
        "SDPA flash (nested) fwd+bwd (autograd)": (nested_step, flash),
    }
    for name, (call, context) in table.items():
        with context():
            for _ in range(200):
                call()
    ref = sdpa(qt, kt, vt).transpose(1, 2)
    err = (cft.attention(q, k, v).float() - ref.float()).abs().max().item()
    plan = launch_plans._TABLE.plans[launch_plans.signature(None, q, k, v, None, None, False)]
    out = torch.empty_like(q)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    plan.store_pointers(*ptrs)
    from cupy_backends.cuda.api.driver import launchKernel

    stream = torch.cuda.current_stream().cuda_stream
    table["bare cuLaunchKernel"] = (lambda: launchKernel(*plan.launch_head, stream, plan.argv_ptr, 0),
                                    contextlib.nullcontext)
    samples = {name: {"issue": [], "wall": [], "gpu": []} for name in table}
    for r in range(rounds):
        for name in (list(table) if r % 2 == 0 else list(reversed(table))):
            call, context = table[name]
            with context():
                samples[name]["issue"].append(_issue_us(torch, call, 5))
                wall, gpu = _wall_us(torch, call, calls)
            samples[name]["wall"].append(wall)
            samples[name]["gpu"].append(gpu)
        # each round as it ends (a run cut short by a time limit keeps what it measured)
        print(f"torch round {r + 1}/{rounds}, wall us: "
              + "; ".join(f"{name} {got['wall'][-1]:.1f}" for name, got in samples.items()), flush=True)
    result = {name: {key: statistics.median(vals) for key, vals in got.items()} | {"samples": got}
              for name, got in samples.items()}
    for name in samples:
        result[name]["wall_vs_sdpa"] = per_round_ratio(samples, name)
    base = samples["cupyflash.forward"]["issue"]
    for name in ("torch.ops.cupyflash.attention_forward", "cupyflash.torch.attention", "custom_op (same body)"):
        result[name]["dispatch_us"] = statistics.median(a - b for a, b in zip(samples[name]["issue"], base))
    result["max_abs_vs_sdpa"] = err
    return result


# ------------------------------------------------------------------------------------ jax
def _timed(run: Callable[[], Any], reps: int) -> float:
    """Median seconds of run() (which blocks until its result is ready)."""
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_jax(iters: int, reps: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import cupyflash.jax as cfj

    # the callbacks look these names up at each run: count the runs
    originals = {name: getattr(cfj, name) for name in ("_launch", "_backward_launch", "_varlen_forward_launch",
                                                       "_varlen_backward_launch")}
    runs = dict.fromkeys(originals, 0)

    def counting(name: str) -> Callable[..., None]:
        def counted(*args: Any) -> None:
            runs[name] += 1
            originals[name](*args)

        return counted

    for name in originals:
        setattr(cfj, name, counting(name))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, SHAPE, jnp.bfloat16) for kk in keys)
    impls: dict[str, Callable[..., Any]] = {"cupyflash.jax.attention": lambda q, k, v: cfj.attention(q, k, v)}
    for impl in ("cudnn", "xla"):
        fn = lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, implementation=impl)  # noqa: E731
        try:
            jax.block_until_ready(jax.jit(fn)(q, k, v))
            impls[f"jax.nn.dot_product_attention ({impl})"] = fn
        except Exception as exc:  # reported, not fatal
            print(f"dot_product_attention({impl}) unavailable: {type(exc).__name__}: {exc}")
    ref = jax.nn.dot_product_attention(q, k, v)
    err = float(jnp.abs(cfj.attention(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32)).max())
    unroll, unroll_grad = 32, 16
    result: dict[str, Any] = {"iters": iters, "unroll": unroll, "unroll_grad": unroll_grad, "max_abs_vs_dpa": err}
    for name, fn in impls.items():
        eager = fn if name.startswith("cupyflash") else jax.jit(fn)
        chain = jax.jit(lambda x, k, v, fn=fn: jax.lax.fori_loop(0, iters, lambda i, x: fn(x, k, v), x))

        def unrolled_body(x, k, v, fn=fn):
            for _ in range(unroll):
                x = fn(x, k, v)
            return x

        unrolled = jax.jit(unrolled_body)

        def grad_step(i, x, k=k, v=v, fn=fn):  # one forward and its backward (jax.grad) per iteration
            g = jax.grad(lambda y: fn(y, k, v).astype(jnp.float32).sum())(x)
            return x + (1e-3 * g).astype(x.dtype)

        grad_chain = jax.jit(lambda x: jax.lax.fori_loop(0, iters, grad_step, x))

        def grad_unrolled_body(x):
            for i in range(unroll_grad):
                x = grad_step(i, x)
            return x

        grad_unrolled = jax.jit(grad_unrolled_body)
        counts = (lambda: (runs["_launch"], runs["_backward_launch"])) if name.startswith("cupyflash") else None
        result[name] = _time_modes((
            ("eager_us", lambda: jax.block_until_ready([eager(q, k, v) for _ in range(iters)]), iters),
            ("fori_loop_us", lambda: chain(q, k, v).block_until_ready(), iters),
            ("unrolled_us", lambda: unrolled(q, k, v).block_until_ready(), unroll),
            ("grad_fori_loop_us", lambda: grad_chain(q).block_until_ready(), iters),
            ("grad_unrolled_us", lambda: grad_unrolled(q).block_until_ready(), unroll_grad)), reps, counts)
    offsets, longest = _varlen_offsets(), max(VARLEN_LENGTHS)
    cu = jnp.asarray(offsets, jnp.int32)
    pq, pk, pv = (jax.random.normal(kk, (offsets[-1], SHAPE[2], SHAPE[3]), jnp.bfloat16) for kk in keys)

    def varlen_step(i, x):
        loss = lambda y: cfj.attention_varlen(y, pk, pv, cu, cu, longest, longest,  # noqa: E731
                                              causal=True).astype(jnp.float32).sum()
        return x + (1e-3 * jax.grad(loss)(x)).astype(x.dtype)

    def varlen_unrolled_body(x):
        for i in range(unroll_grad):
            x = varlen_step(i, x)
        return x

    varlen_chain = jax.jit(lambda x: jax.lax.fori_loop(0, iters, varlen_step, x))
    varlen_unrolled = jax.jit(varlen_unrolled_body)
    result["cupyflash.jax.attention_varlen"] = _time_modes((
        ("grad_fori_loop_us", lambda: varlen_chain(pq).block_until_ready(), iters),
        ("grad_unrolled_us", lambda: varlen_unrolled(pq).block_until_ready(), unroll_grad)), reps,
        lambda: (runs["_varlen_forward_launch"], runs["_varlen_backward_launch"]))
    for name, original in originals.items():
        setattr(cfj, name, original)
    return result


def _time_modes(modes: tuple, reps: int, counts: Callable[[], tuple[int, int]] | None) -> dict[str, float]:
    """{mode: us per call} for (mode, run, calls per run) rows, and with `counts` (() -> the
    forward and backward callbacks' runs so far) the callbacks' Python runs per call (the backward's
    for the grad modes): below 1 where XLA replays them from command buffers."""
    entry: dict[str, float] = {}
    for mode, run, per in modes:
        run()  # compile
        before = counts() if counts else (0, 0)
        entry[mode] = _timed(run, reps) * 1e6 / per
        if counts:
            forward, backward = (now - then for now, then in zip(counts(), before))
            entry[mode.replace("_us", "_callbacks_per_call")] = forward / ((reps + 1) * per)
            if mode.startswith("grad"):
                entry[mode.replace("_us", "_backward_callbacks_per_call")] = backward / ((reps + 1) * per)
    return entry


# ------------------------------------------------------------------------------------ report
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (torch)")
    p.add_argument("--calls", type=int, default=1000, help="back-to-back calls per wall-time sample (torch)")
    p.add_argument("--jax-iters", type=int, default=200, help="calls per JAX timing sample")
    p.add_argument("--jax-reps", type=int, default=7, help="JAX timing samples (median)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--no-jax", action="store_true")
    p.add_argument("--json", help="write all figures here")
    args = p.parse_args(argv)
    data: dict[str, Any] = {"shape": list(SHAPE), "dtype": "bf16"}
    if not args.no_torch:
        import torch

        data["torch_version"] = torch.__version__
        data["device"] = torch.cuda.get_device_name()
        data["torch"] = bench_torch(args.rounds, args.calls)
    if not args.no_jax:
        import jax

        data["jax_version"] = jax.__version__
        data["jax"] = bench_jax(args.jax_iters, args.jax_reps)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    print(f"\nper-call cost, {'x'.join(map(str, SHAPE))} bf16, {data.get('device', '')}")
    if "torch" in data:
        print(f"\nPyTorch {data['torch_version']} (medians of {args.rounds} interleaved rounds; max |diff| vs SDPA "
              f"{data['torch']['max_abs_vs_sdpa']:.3g})")
        print(f"| {'call':40s} | issue us | wall us | wall / SDPA, per round | dispatch over forward, us |")
        print(f"|{'-' * 42}|---------:|--------:|-----------------------:|--------------------------:|")
        for name, fig in data["torch"].items():
            if isinstance(fig, dict):
                extra = f"{fig['dispatch_us']:.1f}" if "dispatch_us" in fig else ""
                ratio = f"{fig['wall_vs_sdpa']:.3f}x" if fig.get("wall_vs_sdpa") is not None else ""
                print(f"| {name:40s} | {fig['issue']:8.1f} | {fig['wall']:7.1f} | {ratio:>22s} | {extra:>25s} |")
    if "jax" in data:
        j = data["jax"]
        print(f"\nJAX {data['jax_version']} (us per attention call; median of {args.jax_reps}; max |diff| vs "
              f"dot_product_attention {j['max_abs_vs_dpa']:.3g})")
        print(f"| {'call':40s} | eager | jit fori_loop ({j['iters']}) | jit unrolled ({j['unroll']}) | "
              f"forward + backward (jax.grad), jit fori_loop | forward + backward, jit unrolled ({j['unroll_grad']}) |")
        print(f"|{'-' * 42}|------:|------------------:|-----------------:|------:|------:|")
        cell = lambda fig, key, width: f"{fig[key]:{width}.1f}" if key in fig else f"{'-':>{width}s}"  # noqa: E731
        for name, fig in j.items():
            if isinstance(fig, dict):
                print(f"| {name:40s} | {cell(fig, 'eager_us', 5)} | {cell(fig, 'fori_loop_us', 17)} | "
                      f"{cell(fig, 'unrolled_us', 16)} | {cell(fig, 'grad_fori_loop_us', 5)} | "
                      f"{cell(fig, 'grad_unrolled_us', 5)} |")
        c = j.get("cupyflash.jax.attention", {})
        if c:
            print("python callback runs per cupyflash call: eager {:.2f}, fori_loop {:.2f}, unrolled {:.2f}".format(
                c["eager_callbacks_per_call"], c["fori_loop_callbacks_per_call"], c["unrolled_callbacks_per_call"]))
            print("python backward callback runs per training step: fori_loop {:.2f}, unrolled {:.2f}".format(
                c["grad_fori_loop_backward_callbacks_per_call"], c["grad_unrolled_backward_callbacks_per_call"]))
        c = j.get("cupyflash.jax.attention_varlen", {})
        if c:
            print("attention_varlen python callback runs per training step (forward / backward): fori_loop "
                  "{:.2f} / {:.2f}, unrolled {:.2f} / {:.2f}".format(
                      c["grad_fori_loop_callbacks_per_call"], c["grad_fori_loop_backward_callbacks_per_call"],
                      c["grad_unrolled_callbacks_per_call"], c["grad_unrolled_backward_callbacks_per_call"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
