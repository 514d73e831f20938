#!/usr/bin/env python
"""Small launches of every kernel family, sized for compute-sanitizer, each checked on the host.

    python scripts/sanitize_check.py --family all --varlen      # plainly first: fills the kernel cache
    compute-sanitizer --tool memcheck  python scripts/sanitize_check.py --family all --varlen
    compute-sanitizer --tool racecheck python scripts/sanitize_check.py --family decode
    python scripts/sanitize_check.py                             # forward_sm80 alone, as before

--family (comma-separated, run in the order given; or 'all'): forward_sm80 (forward() with one explicit mma.sync config
per head dim: the first config of get_kernel_configs('all') with that d_head; --pick default the
library's default config instead, --pick both the two of them; three shapes: ragged lengths,
S_q < S_k and S_q > S_k so that causal leaves rows with no visible key, MHA / GQA / MQA, all
S <= 300; causal off and on; lse on: 4 x 3 x 2 = 24 launches), forward_sm90 (the Hopper family's
progression configs and the d_head 64/256 defaults on scripts/sanitize_sm90.py's shapes; skipped
with the reason on a GPU that is not compute capability 9.0), decode (forward_kvcache on
scripts/sanitize_decode.py's cases: contiguous and paged caches, lengths 0 and page boundaries,
several splits for the combine kernel, k_new appended), backward_sm80 (scripts/sanitize_backward.py:
default configs of d_head 64 and 128, atomic and deterministic dQ), backward_sm90 (the same launches
on the Hopper backward family's bf16 defaults of d_head 64 and 128 and the d_head 128 one with
dq_bulk and with dq_tma, or the configs --sm90-configs names: its TMA/mbarrier dK/dV kernel,
for synccheck too; skipped with the reason off compute capability 9.0). --varlen adds forward_varlen
on scripts/sanitize_varlen.py's ragged batches, empty sequences included (also as --family varlen).

Inputs and NaN-poisoned outputs are uploaded from the host, results copied back, and float64
references computed on the host. CuPy's memory pool is turned off, so every array is its own
cudaMalloc of exactly its size and memcheck sees any access past it (the pool would hide
accesses that stay inside its larger blocks). Checks are loose (the pytest matrices are the
accuracy tests): output finite, relative L2 error against the reference <= 2e-2 (3e-2 for
gradients); lse -inf exactly on rows that see no key, finite elsewhere and within 1e-2.

Prints one line per launch and a one-line summary; exit 0 when all pass, 1 when any fails, 2
without a GPU or on bad arguments.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

try:
    import cupyflash  # noqa: F401  (an installed or editable cupyflash)
except ImportError:  # a plain checkout: use the package next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupyflash.config import SUPPORTED_D_HEADS, DType  # noqa: E402
from cupyflash.families.forward_sm80.config import FlashForwardKernelConfig  # noqa: E402
from cupyflash.families.forward_sm80.config_sets import default_config, get_kernel_configs  # noqa: E402
from sanitize_common import LSE_BOUND, REL_L2_BOUND, Launch, check, reference, run_launches  # noqa: E402,F401

FAMILIES = ("forward_sm80", "forward_sm90", "decode", "backward_sm80", "backward_sm90")

# (batch, S_q, S_k, n_heads, n_kv_heads)
SHAPES = ((1, 77, 200, 4, 1),    # MQA, S_q < S_k: bottom-right causal offset +123
          (2, 130, 63, 4, 2),    # GQA, S_q > S_k: causal rows 0..66 see no key
          (1, 257, 257, 2, 2))   # MHA, square, one row past a multiple of 64/128


def pick_configs(d_heads, pick: str = "first") -> list[FlashForwardKernelConfig]:
    """Per head dim: the first config of the 'all' set ('first'), the library default for bf16
    ('default': the fully optimised kernel, eager prefetch and all), or both."""
    configs = get_kernel_configs("all")
    picked = []
    for d in d_heads:
        if d not in SUPPORTED_D_HEADS:
            raise ValueError(f"--d-heads: {d} is not supported (expected {SUPPORTED_D_HEADS})")
        if pick in ("first", "both"):
            mine = [c for c in configs if c.d_head == d]
            if not mine:
                raise ValueError(f"no config with d_head {d} in get_kernel_configs('all')")
            picked.append(mine[0])
        if pick in ("default", "both"):
            cfg = default_config(DType.BF16, d)
            if cfg not in picked:
                picked.append(cfg)
    return picked


def forward_sm80_launches(configs: list[FlashForwardKernelConfig], rng: np.random.Generator) -> Iterator[Launch]:
    """forward() with each config on SHAPES, causal off and on, lse on: NaN-poisoned out and lse
    buffers uploaded from the host, the float64 reference computed on the host."""
    for cfg in configs:
        for shape in SHAPES:
            for causal in (False, True):
                batch, seq_q, seq_k, n_heads, n_kv = shape
                label = (f"d{cfg.d_head} {cfg.dtype.name} B={batch} S_q={seq_q} S_k={seq_k} H={n_heads} "
                         f"H_kv={n_kv} causal={int(causal)}")
                yield Launch("forward_sm80", label, functools.partial(_forward_sm80_once, cfg, shape, causal, rng))


def _forward_sm80_once(cfg: FlashForwardKernelConfig, shape: tuple, causal: bool,
                       rng: np.random.Generator) -> tuple[bool, str]:
    import cupy as cp

    import cupyflash

    batch, seq_q, seq_k, n_heads, n_kv = shape
    np_dtype = cfg.dtype.numpy_dtype
    host_q = rng.standard_normal((batch, seq_q, n_heads, cfg.d_head), dtype=np.float32).astype(np_dtype)
    host_k, host_v = (rng.standard_normal((batch, seq_k, n_kv, cfg.d_head), dtype=np.float32).astype(np_dtype)
                      for _ in range(2))
    q, k, v = (cp.asarray(x) for x in (host_q, host_k, host_v))
    out = cp.asarray(np.full(host_q.shape, np.nan, dtype=np_dtype))
    lse = cp.asarray(np.full((batch, n_heads, seq_q), np.nan, dtype=np.float32))
    cupyflash.forward(cfg, q, k, v, out=out, causal=causal, return_lse=True, lse=lse)
    cp.cuda.runtime.deviceSynchronize()
    ref, ref_lse = reference(host_q, host_k, host_v, causal)
    return check(cp.asnumpy(out), cp.asnumpy(lse), ref, ref_lse)


def _device_cc() -> int:
    import cupy as cp

    return int(cp.cuda.Device().compute_capability)


def family_launches(family: str, args: argparse.Namespace, rng: np.random.Generator) -> tuple[list[Launch], str | None]:
    """The launches of one family, or ([], why not) when this GPU cannot run it."""
    if family == "forward_sm80":
        return list(forward_sm80_launches(pick_configs(_d_heads(args.d_heads), args.pick), rng)), None
    if family == "forward_sm90":
        cc = _device_cc()
        if cc // 10 != 9:
            return [], f"the Hopper family needs compute capability 9.0 (this GPU: {cc // 10}.{cc % 10})"
        import sanitize_sm90

        return list(sanitize_sm90.launches(rng, quick=args.quick)), None
    if family == "decode":
        import sanitize_decode

        return list(sanitize_decode.launches(rng)), None
    if family == "backward_sm80":
        import sanitize_backward

        shapes = sanitize_backward.SHAPES[:2] if args.quick else sanitize_backward.SHAPES
        return list(sanitize_backward.launches(sanitize_backward.pick_configs("64,128"), shapes, rng)), None
    if family == "backward_sm90":
        cc = _device_cc()
        if cc != 90:
            return [], f"the Hopper backward family needs compute capability 9.0 (this GPU: {cc // 10}.{cc % 10})"
        import sanitize_backward
        from cupyflash.families.backward_sm90.config_sets import default_config as sm90_default

        shapes = sanitize_backward.SHAPES[:2] if args.quick else sanitize_backward.SHAPES
        if args.sm90_configs:
            from cupyflash.families.backward_sm90.config import HopperBackwardKernelConfig

            configs = [HopperBackwardKernelConfig.parse(t) for t in args.sm90_configs.split("|") if t.strip()]
            return list(sanitize_backward.launches(configs, shapes, rng)), None
        # the defaults (short and long causal calls differ in stages at d_head 128), each run on every shape
        from cupyflash.families.backward_sm90.config_sets import default_configs

        configs = [c for c in default_configs() if c.dtype is DType.BF16]
        d128 = sm90_default(DType.BF16, 128)
        if not args.no_dq_bulk:  # dQ by bulk reductions from shared memory (no launch knob: they need dq_tma)
            configs.append(d128.replace(dq_bulk=True, dq_tma=False, dq_mid=False, nomask=False, lpt=False, pdl=False,
                                        dq_early=False))
        if not d128.dq_tma:  # dQ by a writer warp's TMA tensor reductions
            configs.append(d128.replace(dq_tma=True))
        return list(sanitize_backward.launches(configs, shapes, rng)), None
    if family == "varlen":
        import cupyflash

        if not hasattr(cupyflash, "forward_varlen"):
            return [], "this cupyflash has no forward_varlen"
        import sanitize_varlen

        return list(sanitize_varlen.launches(rng)), None
    raise ValueError(f"--family: unknown family {family!r}")


def _d_heads(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_families(text: str, varlen: bool) -> list[str]:
    """'all' or a comma-separated list of FAMILIES (and 'varlen') -> the families to run, in the
    order given ('all' expands to FAMILIES in place), with 'varlen' appended when --varlen is given;
    ValueError naming --family otherwise."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError("--family: expected a family name or 'all'")
    unknown = sorted(set(names) - set(FAMILIES) - {"all", "varlen"})
    if unknown:
        raise ValueError(f"--family: unknown {unknown}; expected 'all' or from {list(FAMILIES) + ['varlen']}")
    picked = [f for n in names for f in (FAMILIES if n == "all" else (n,))]
    return list(dict.fromkeys(picked + (["varlen"] if varlen else [])))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--family", default="forward_sm80",
                   help=f"comma-separated from {', '.join(FAMILIES)}, varlen, or 'all' (run in the order given; "
                        "default forward_sm80)")
    p.add_argument("--varlen", action="store_true", help="also forward_varlen's shapes (empty sequences included)")
    p.add_argument("--d-heads", default=",".join(map(str, SUPPORTED_D_HEADS)),
                   help=f"forward_sm80: comma-separated head dims (default all: {SUPPORTED_D_HEADS})")
    p.add_argument("--pick", choices=("first", "default", "both"), default="first",
                   help="forward_sm80: which config per head dim (default: the first of the 'all' set)")
    p.add_argument("--quick", action="store_true",
                   help="forward_sm90: 3 configs x 2 shapes; backward_sm80/sm90: the first 2 shapes")
    p.add_argument("--no-dq-bulk", action="store_true", help="backward_sm90: leave out the dq_bulk config")
    p.add_argument("--sm90-configs", default="",
                   help="backward_sm90: '|'-separated short forms to run instead of the defaults (+ dq_bulk, dq_tma)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        families = parse_families(args.family, args.varlen)
        if "forward_sm80" in families:
            pick_configs(_d_heads(args.d_heads), args.pick)
    except ValueError as exc:
        print(f"sanitize_check: error: {exc}", file=sys.stderr)
        return 2

    from cupyflash.device import has_gpu

    if not has_gpu():
        print("sanitize_check: no CUDA GPU found; nothing was run", file=sys.stderr)
        return 2
    import cupy as cp

    cp.cuda.set_allocator(None)  # exact-size cudaMalloc per array: memcheck sees every overrun
    rng = np.random.default_rng(args.seed)
    runs, failures, per_family, skipped, seconds = 0, [], [], [], 0.0
    for family in families:
        launches, why_not = family_launches(family, args, rng)
        if why_not:
            print(f"skip [{family}]: {why_not}", flush=True)
            skipped.append(family)
            continue
        done = run_launches(launches, lambda line: print(line, flush=True))
        runs += done.runs
        failures += done.failures
        seconds += done.seconds
        per_family.append(f"{family} {done.ok}/{done.runs}")
    print(f"sanitize_check: {runs} launches, {runs - len(failures)} ok, {len(failures)} failed "
          f"({'; '.join(per_family) or 'no family ran'}"
          + (f"; skipped: {', '.join(skipped)}" if skipped else "") + f") in {seconds:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
