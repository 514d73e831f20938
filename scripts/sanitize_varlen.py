"""Small forward_varlen launches for compute-sanitizer (memcheck / racecheck): packed ragged
batches with empty sequences (first, middle and last), sequences shorter and longer than a tile,
seq_q != seq_k per sequence (causal rows that see no key), a batch with no keys at all, GQA/MQA,
d_head 64/128/256, fp16/bf16; each with cfg=None (on sm_90 the Hopper family) and with the
mma.sync family's default config, causal off and on; and each again with 37 tokens past the last
sequence that the kernels zero (zero_tail, as for cupyflash.jax's output buffers).

    python scripts/sanitize_varlen.py                      # plainly first: fills the kernel cache
    compute-sanitizer --tool memcheck python scripts/sanitize_varlen.py
    compute-sanitizer --tool memcheck python scripts/sanitize_check.py --family all --varlen  # the same launches

Each launch writes into a NaN-poisoned out; every sequence's out and lse (heads, total_q) are
checked on the host against a float64 reference (sanitize_common.check: relative L2 <= 2e-2, lse
-inf exactly on rows that see no key); the zeroed tail's out and lse must be exactly 0. CuPy's memory pool is off, so each array is its own
exact-size allocation. Exit 0 when all pass, 1 when any fails, 2 without forward_varlen.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

try:
    import cupyflash  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.config import DType  # noqa: E402
from sanitize_common import Launch, check, reference, run_launches  # noqa: E402

CASES = [  # dtype, d_head, heads, kv_heads, query lengths, key lengths
    (DType.BF16, 128, 4, 4, [0, 77, 1, 130, 0, 64], [0, 77, 1, 130, 0, 64]),  # self-attention, empty ones
    (DType.FP16, 64, 4, 1, [5, 0, 200, 33], [130, 64, 3, 0]),                 # MQA, S_q != S_k, keys-only, queries-only
    (DType.BF16, 256, 4, 2, [257, 0, 129], [257, 0, 129]),                     # GQA, one row past a tile
    (DType.FP16, 128, 2, 2, [3, 0, 2], [0, 0, 0]),                             # no keys at all: out 0, lse -inf
]
FAMILIES = ("auto", "forward_sm80")  # cfg=None (the Hopper family on sm_90), and the mma.sync family's default
TAIL = 37  # tokens past the last sequence in the zero_tail runs


def cu_seqlens(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def launches(rng: np.random.Generator) -> Iterator[Launch]:
    """Each case, causal off and on, with cfg=None and with forward_sm80's default config, so both
    forward families' varlen variants run."""
    for case in CASES:
        for family in FAMILIES:
            for causal in (False, True):
                for tail in (0, TAIL):
                    dt, d, h, hk, lq, lk = case
                    label = (f"{dt.name} d{d} H={h}/{hk} lens_q={lq} lens_k={lk} causal={int(causal)} cfg={family}"
                             + (f" zero_tail={tail}" if tail else ""))
                    yield Launch("varlen", label, functools.partial(_once, case, causal, family, rng, tail))


def _config(family: str, dtype: DType, d_head: int):
    if family == "auto":
        return None
    from cupyflash.families.forward_sm80.config_sets import default_config

    return default_config(dtype, d_head)


def _once(case: tuple, causal: bool, family: str, rng: np.random.Generator, tail: int = 0) -> tuple[bool, str]:
    import cupy as cp

    import cupyflash
    from cupyflash.varlen import _forward_varlen

    dt, d, h, hk, lens_q, lens_k = case
    npdt = dt.numpy_dtype
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    host_q = rng.standard_normal((int(cu_q[-1]) + tail, h, d), dtype=np.float32).astype(npdt)
    host_k, host_v = (rng.standard_normal((int(cu_k[-1]), hk, d), dtype=np.float32).astype(npdt) for _ in range(2))
    q, k, v = (cp.asarray(x) for x in (host_q, host_k, host_v))
    out = cp.asarray(np.full(host_q.shape, np.nan, dtype=npdt))
    args = (q, k, v, cp.asarray(cu_q), cp.asarray(cu_k), max(lens_q), max(lens_k))
    if tail:
        lse = cp.full((h, host_q.shape[0]), np.nan, dtype=cp.float32)
        _forward_varlen(*args, causal, None, True, out, lse, None, _config(family, dt, d), None, False, True)
        got = out
    else:
        got, lse = cupyflash.forward_varlen(*args, causal=causal, return_lse=True, out=out, cfg=_config(family, dt, d))
    cp.cuda.runtime.deviceSynchronize()
    host_out, host_lse = cp.asnumpy(got), cp.asnumpy(lse)
    if host_lse.shape != (h, host_q.shape[0]):
        return False, f"lse has shape {host_lse.shape}, expected {(h, host_q.shape[0])}"
    all_ok, figures = True, []
    if tail:
        end = int(cu_q[-1])
        tail_zero = bool((host_out[end:].astype(np.float32) == 0).all() and (host_lse[:, end:] == 0).all())
        all_ok = tail_zero
        figures.append(f"tail of {tail} zero: {tail_zero}")
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref, ref_lse = reference(host_q[None, sq], host_k[None, sk], host_v[None, sk], causal)
        ok, fig = check(host_out[None, sq], host_lse[None, :, sq], ref, ref_lse)
        all_ok = all_ok and ok
        figures.append(f"[{i}] {fig}")
    return all_ok, "; ".join(figures)


def main() -> int:
    """Thin wrapper: the same launches run by `sanitize_check.py --varlen`."""
    import cupy as cp

    import cupyflash

    if not hasattr(cupyflash, "forward_varlen"):
        print("sanitize_varlen: this cupyflash has no forward_varlen", file=sys.stderr)
        return 2
    cp.cuda.set_allocator(None)
    done = run_launches(launches(np.random.default_rng(0)), lambda line: print(line, flush=True))
    print(f"sanitize_varlen: {done.runs} launches, {done.ok} ok, {len(done.failures)} failed in {done.seconds:.1f} s")
    return 1 if done.failures else 0


if __name__ == "__main__":
    sys.exit(main())
