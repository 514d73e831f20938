"""Gradient accuracy against float64 at the training check's shapes (torch, GPU).

The training check (scripts/train_check.py) compares whole bf16 training runs, which are chaotic:
one trajectory cannot tell a different rounding order from a biased gradient. This script looks
at the gradients themselves, against float64, for every implementation the check trains with:

1. Attention alone, (batch 16, seq 256, heads, d_head) causal, bf16 inputs drawn at two logit
   scales: each implementation's out, dq, dk, dv against float64 math on the same bf16 inputs.
   Printed per tensor: the relative L2 error |g - r| / |r| and the bias (g - r).r / r.r, the
   component of the error along the exact gradient (a scale error shows there; rounding noise
   averages to ~0).
2. The whole model (train_check's GPT) at its initial weights and at the weights after --steps
   steps of training with SDPA math: the gradient of one held-out batch's loss under bf16
   autocast, per implementation, against the same model run in float64 without autocast.
   Printed: relative L2 error and bias of the whole gradient and of the attention weights (qkv_w).

Implementations: cupyflash (the library's choice: backward_sm90 on Hopper at d_head 128),
cupyflash_sm80 (the backward forced to backward_sm80), SDPA flash, SDPA cuDNN, SDPA math.

    python scripts/grad_accuracy.py [--heads 2] [--steps 300] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_check as tc  # noqa: E402  (the model, data and training loop of the check)

SCALES = (1.0, 3.0)  # std of q and k entries: logits of std ~1 and ~9 (peaked rows)


@contextlib.contextmanager
def backward_family(name: str) -> Iterator[None]:
    """cupyflash's backward forced to backward_sm80 ('sm80') or left to the library ('auto')."""
    import cupyflash.backward_api as bapi
    import cupyflash.backward_plans as plans

    saved = bapi.hopper_reason
    if name == "sm80":
        bapi.hopper_reason = lambda *args: "forced to backward_sm80 by grad_accuracy.py"
    plans.clear()  # a replayed plan keeps the family chosen on its first call
    try:
        yield
    finally:
        bapi.hopper_reason = saved
        plans.clear()


def implementations() -> dict[str, tuple[Callable[..., Any], str]]:
    """name -> (attend(q, k, v) on (batch, seq, heads, d) tensors, causal; backward family)."""
    impls = tc.torch_attention_impls()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)

    return {"cupyflash": (impls["cupyflash"], "auto"), "cupyflash_sm80": (impls["cupyflash"], "sm80"),
            "sdpa_flash": (impls["sdpa_flash"], "auto"), "sdpa_cudnn": (cudnn, "auto"),
            "sdpa_math": (impls["sdpa_math"], "auto")}


def errors(g: Any, r: Any) -> dict[str, float]:
    """Relative L2 error of g against r and the bias (g - r).r / r.r (float64)."""
    g, r = g.detach().double().flatten(), r.detach().double().flatten()
    rr = float(r @ r)
    return {"rel_l2": float((g - r).norm()) / max(rr, 1e-300) ** 0.5, "bias": float((g - r) @ r) / max(rr, 1e-300)}


def reference_attention(q: Any, k: Any, v: Any) -> Any:
    import torch

    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)


def attention_part(impls: dict[str, tuple[Callable[..., Any], str]], heads: int) -> dict[str, Any]:
    import torch

    d = tc.D_MODEL // heads
    out: dict[str, Any] = {}
    for scale in SCALES:
        gen = torch.Generator(device="cuda").manual_seed(1234)
        shape = (tc.BATCH, tc.SEQ, heads, d)
        q, k = (torch.randn(shape, device="cuda", generator=gen) * scale for _ in range(2))
        v, do = (torch.randn(shape, device="cuda", generator=gen) for _ in range(2))
        q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out = reference_attention(*leaves)
        ref_grads = torch.autograd.grad(ref_out, leaves, do.double())
        for name, (attend, family) in impls.items():
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            with backward_family(family):
                o = attend(*inputs)
                grads = torch.autograd.grad(o, inputs, do)
            row = {"out": errors(o, ref_out)}
            row.update({n: errors(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
            out[f"scale {scale:g} {name}"] = row
            print(f"[attention d{d} scale {scale:g}] {name:15s} " + "  ".join(
                f"{n} {e['rel_l2']:.2e} ({e['bias']:+.1e})" for n, e in row.items()), flush=True)
    return out


def model_gradient(params0: dict[str, np.ndarray], attend: Callable[..., Any], x: Any, y: Any,
                   dtype: Any, autocast: bool) -> tuple[float, dict[str, Any]]:
    import torch

    params = {k: torch.tensor(v, device="cuda", dtype=dtype, requires_grad=True) for k, v in params0.items()}
    # the training check's own loss: bf16 autocast, or without it every op in `dtype`
    loss = tc.torch_loss_fn(params, attend, "cuda", autocast=autocast)(x, y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss), dict(zip(params, grads))


def model_part(impls: dict[str, tuple[Callable[..., Any], str]], steps: int) -> dict[str, Any]:
    import torch

    tokens, vocab = tc.make_corpus()
    params0 = tc.init_params(len(vocab))
    starts = tc.batch_starts(len(tokens), steps)
    eval_starts = tc.batch_starts(len(tokens), 1, seed=99)[0]
    trained = tc.train_torch("sdpa_math", impls["sdpa_math"][0], params0, tokens, starts, eval_starts,
                             keep_params=True)["params"]
    x, y = (torch.from_numpy(a).long().cuda() for a in tc.gather(tokens, eval_starts))
    out: dict[str, Any] = {}
    for label, weights in (("initial", params0), (f"after {steps} steps", trained)):
        ref_loss, ref = model_gradient(weights, reference_attention, x, y, torch.float64, autocast=False)
        ref_all = torch.cat([g.flatten() for g in ref.values()])
        ref_qkv = torch.cat([g.flatten() for n, g in ref.items() if n.endswith("qkv_w")])
        for name, (attend, family) in impls.items():
            with backward_family(family):
                loss, grads = model_gradient(weights, attend, x, y, torch.float32, autocast=True)
            row = {"loss": loss, "ref_loss": ref_loss,
                   "all": errors(torch.cat([g.flatten() for g in grads.values()]), ref_all),
                   "qkv_w": errors(torch.cat([g.flatten() for n, g in grads.items() if n.endswith("qkv_w")]), ref_qkv)}
            out[f"{label} {name}"] = row
            print(f"[model, {label}] {name:15s} loss {loss:.5f} (float64 {ref_loss:.5f})  "
                  f"grad {row['all']['rel_l2']:.3e} ({row['all']['bias']:+.2e})  "
                  f"qkv_w {row['qkv_w']['rel_l2']:.3e} ({row['qkv_w']['bias']:+.2e})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=2, help="heads of the d_model 256 model (2: d_head 128)")
    ap.add_argument("--steps", type=int, default=300, help="training steps before the second model probe")
    ap.add_argument("--json", help="write the figures here (default $OUT/grad_accuracy.json when $OUT is set)")
    args = ap.parse_args(argv)
    if args.heads <= 0 or tc.D_MODEL % args.heads:
        raise SystemExit(f"--heads: must divide d_model {tc.D_MODEL}, got {args.heads}")
    tc.N_HEAD = args.heads
    impls = implementations()
    result = {"heads": args.heads, "d_head": tc.D_MODEL // args.heads, "steps": args.steps,
              "attention": attention_part(impls, args.heads), "model": model_part(impls, args.steps)}
    path = args.json or (os.environ.get("OUT") and str(Path(os.environ["OUT"]) / "grad_accuracy.json"))
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
