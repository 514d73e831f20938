"""What the compute-sanitizer scripts share: a Launch (one kernel call and its check), the runner
that prints one line per launch and a summary, and the float64 host reference of attention with
its log-sum-exp plus the loose check of scripts/sanitize_check.py.

The checks are loose on purpose (the pytest matrices are the accuracy tests): they exist so that a
kernel that reads or writes the wrong place, or leaves elements unwritten, fails under the
sanitizer as well as in its report. Nothing here imports CuPy; the launches do, when run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

__all__ = ["Launch", "Summary", "run_launches", "reference", "check", "rel_l2", "REL_L2_BOUND", "LSE_BOUND"]

REL_L2_BOUND = 2e-2
LSE_BOUND = 1e-2


@dataclass(frozen=True)
class Launch:
    """One kernel call: `run()` launches it, synchronises, checks, and returns (ok, figures)."""

    family: str
    label: str
    run: Callable[[], tuple[bool, str]]


@dataclass
class Summary:
    runs: int = 0
    failures: list[str] | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.failures = [] if self.failures is None else self.failures

    @property
    def ok(self) -> int:
        return self.runs - len(self.failures)


def run_launches(launches: Iterable[Launch], print_fn: Callable[[str], None] = print) -> Summary:
    """Run each launch once, printing `ok  ` / `FAIL` with its family, label and figures. A launch
    that raises (a launch error under memcheck, a refused argument) is a failure, not a crash."""
    summary = Summary()
    t0 = time.perf_counter()
    for launch in launches:
        summary.runs += 1
        try:
            ok, figures = launch.run()
        except Exception as exc:
            ok, figures = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print_fn(f"{'ok  ' if ok else 'FAIL'} [{launch.family}] {launch.label}: {figures}")
        if not ok:
            summary.failures.append(f"[{launch.family}] {launch.label}")
    summary.seconds = time.perf_counter() - t0
    return summary


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 (out (B, S_q, H, D), lse (B, H, S_q)); GQA by k/v head h // group; bottom-right
    causal; rows with no visible key (causal, or S_k = 0): out 0, lse -inf."""
    batch, seq_q, n_heads, d = q.shape
    seq_k, n_kv = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    out = np.zeros((batch, seq_q, n_heads, d))
    lse = np.full((batch, n_heads, seq_q), -np.inf)
    hidden = np.arange(seq_k)[None, :] > np.arange(seq_q)[:, None] + (seq_k - seq_q)
    for b in range(batch):
        for h in range(n_heads):
            s = q[b, :, h] @ k[b, :, h // group].T / np.sqrt(d)
            if causal:
                s = np.where(hidden, -np.inf, s)
            m = s.max(axis=1, keepdims=True, initial=-np.inf)
            m = np.where(np.isfinite(m), m, 0.0)
            e = np.exp(s - m)
            total = e.sum(axis=1, keepdims=True)
            seen = total[:, 0] > 0
            out[b, seen, h] = (e[seen] / total[seen]) @ v[b, :, h // group]
            lse[b, h, seen] = (m + np.log(np.where(total > 0, total, 1.0)))[seen, 0]
    return out, lse


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    got = got.astype(np.float64)
    den = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / den if den > 0 else float(np.linalg.norm(got))


def check(out: np.ndarray, lse: np.ndarray, ref: np.ndarray, ref_lse: np.ndarray) -> tuple[bool, str]:
    """Output finite and within REL_L2_BOUND (an all-zero reference: the output must be 0 too);
    lse -inf exactly on rows that see no key, finite elsewhere and within LSE_BOUND."""
    out = out.astype(np.float64)
    if not np.isfinite(out).all():
        return False, f"{int((~np.isfinite(out)).sum())} non-finite output elements"
    rel = rel_l2(out, ref)
    masked = np.isneginf(ref_lse)
    if np.isnan(lse).any():
        return False, f"{int(np.isnan(lse).sum())} NaN lse entries (unwritten?)"
    if not np.isneginf(lse[masked]).all():
        return False, "lse of a row that sees no key is not -inf"
    if not np.isfinite(lse[~masked]).all():
        return False, "lse not finite where the reference is"
    lse_err = float(np.abs(lse[~masked] - ref_lse[~masked]).max()) if (~masked).any() else 0.0
    ok = rel <= REL_L2_BOUND and lse_err <= LSE_BOUND
    return ok, f"rel_l2 {rel:.2e} lse_err {lse_err:.1e}"
