"""Autotuning: time every candidate config of a kernel family per (dtype, d_head, seq bucket) on
this GPU, keep the fastest correct one in a `TuningTable` that `cfg=None` reads (see
cupyflash.tuning).

    python -m cupyflash autotune [--family forward_sm80] [--dtypes bf16,fp16] [--d-heads 64,128]
                                 [--seqs 512,...,16384] [--iters 20] [--table PATH] [--write-default] [--causal]
                                 [--sustain 0.3]

Each bucket is timed on the family's tuning problem (`KernelFamily.tuning_problem`; for the
forward families SPEC §6's grid at that length, batch*seq = 16384, heads*d_head = 2048; with
--causal causally masked, filling the table's causal rows) in buffers the problem allocates. Every candidate is first checked once against a float64 reference (SPEC §5
relative L2 bound) and dropped if wrong. All candidates are timed in two sweeps, in order and then
reversed (`iters`/2 CUDA-event samples each; the mean of the two medians cancels clock drift);
the `finalists` fastest are timed again in FINAL_ROUNDS interleaved rounds of `iters` samples,
and the lowest median of round medians wins (ties: the earlier config in the sorted candidate
order, so the set and its order are deterministic). Then the winner meets the knob twins of the
`twin_finalists` fastest finalists (`KernelFamily.knob_twins`: the same config with launch knobs
the tune set leaves out, such as forward_sm90's `ring`, `oreg`, `xtile`, `wgblocks`), each
checked once, in FINAL_ROUNDS more interleaved rounds; ties keep the winner. With `sustain` S > 0
each timing of those rounds first runs S seconds of back-to-back calls, so the configs that
decide a row are compared at the GPU's power-capped clock (as in training or a long prefill)
instead of the boost clock of a short burst: the shipped H100 table's picks were chosen that
way, and at the cap `lazy` or `oreg` can win rows that burst timing gives to another config
(NOTES.md items 157, 191).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TextIO

from .families import DEFAULT_FAMILY, FAMILIES, KernelFamily, get_family
from .families.base import TuningProblem
from .benchmarking import Timing, grid_shape, parse_dtypes, parse_ints, time_cupy
from .config import SUPPORTED_D_HEADS, DType, KernelConfig
from .progress import ProgressBar
from .tuning import (SEQ_BUCKETS, TuningTable, TuningTableError, clear_caches, default_table_path, device_family,
                     user_table_path)

__all__ = ["autotune", "candidate_configs", "format_table", "build_parser", "run_from_args", "main",
           "DEFAULT_ITERS", "DEFAULT_WARMUP", "DEFAULT_FINALISTS"]

DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
DEFAULT_FINALISTS = 8
FINAL_ROUNDS = 5
# Finalists whose knob twins are timed, fastest first: the best knob combination is not always a
# twin of the fastest plain config (H100, d_head 64 causal 512/1k at the cap: the finals' winner
# was 128x128 x3 or x2 without `lazy`, the best config x2 `lazy` + `oreg`, NOTES.md items 191-192).
DEFAULT_TWIN_FINALISTS = 2


def candidate_configs(dtype: DType, d_head: int, candidates: Iterable[KernelConfig] | None = None,
                      family: str | KernelFamily = DEFAULT_FAMILY) -> list[KernelConfig]:
    """The configs tried for (dtype, d_head): `candidates` (default: the family's autotuning set)
    restricted to that dtype and d_head, deduplicated and sorted, so the order never depends on
    the caller's."""
    pool = get_family(family).tune_candidates(dtype, d_head) if candidates is None else candidates
    return sorted({c for c in pool if c.dtype is dtype and c.d_head == d_head})  # type: ignore[attr-defined]


@dataclass
class _Result:
    cfg: KernelConfig
    index: int                    # position in the candidate order, the tie-breaker
    timing: Timing | None = None
    error: str | None = None
    twin_of: KernelConfig | None = None  # the finalist this knob twin was made from (_knob_round)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _versions() -> dict[str, Any]:
    import cupy

    from . import __version__
    from .compiler import nvrtc_version

    return {"cupyflash": __version__, "cupy": cupy.__version__,
            "nvrtc": ".".join(map(str, nvrtc_version())),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion()}


def _compile_all(configs: Sequence[KernelConfig], device: int, stream: TextIO | None,
                 causal: bool = False) -> dict[str, str]:
    """Compile every candidate into the kernel cache in parallel (NVRTC in worker processes), so the
    timing loop only loads cubins. Returns {short form: error} for the ones that failed."""
    from .families import family_of
    from .prewarm import prewarm

    by_arch: dict[str, list[KernelConfig]] = {}
    for cfg in configs:
        by_arch.setdefault(family_of(cfg).arch_for_device(device), []).append(cfg)
    failed: dict[str, str] = {}
    for arch, cfgs in by_arch.items():
        report = prewarm(cfgs, [arch], progress=stream, causal=(causal,))
        failed.update({r.short_form: (r.error or "compile failed") for r in report.failed})
    return failed


def _tune_bucket(results: list[_Result], checked: dict[KernelConfig, str | None], problem: TuningProblem,
                 iters: int, warmup: int, finalists: int, bar: ProgressBar,
                 twins: Callable[[KernelConfig], list[KernelConfig]] | None = None, sustain: float = 0.0,
                 twin_finalists: int = DEFAULT_TWIN_FINALISTS, heuristic: KernelConfig | None = None
                 ) -> tuple[_Result | None, list[_Result]]:
    """Time every candidate on one bucket's problem; returns (winner, all). `twins(cfg)`: a
    config's knob twins; those of the `twin_finalists` fastest finalists are timed against the
    winner last (None: none). `sustain`: seconds of load before each timing of the final and
    knob rounds (the sweeps only choose the finalists); the `heuristic` config, whose figure the
    table reports beside the winner's, is then timed once more under load unless it was a
    finalist, so the two figures come from the same clock regime."""
    n_sets, flops, label = problem.n_sets, problem.flops, problem.label
    sweep_iters = max(1, iters // 2)  # the first pass is two sweeps (in order, then reversed)
    for r in results:
        known_bad = checked.get(r.cfg) is not None  # reported as failed at an earlier bucket already
        skipped = _check_and_time(r, checked, problem, warmup, sweep_iters)
        item = (f"{label} {r.timing.tflops(flops):6.1f} TFLOP/s {r.cfg}" if r.timing
                else f"{label} FAILED {r.cfg}: {r.error}")
        bar.advance(item, failed=r.timing is None and not known_bad and not skipped)
    # A second sweep in reverse order: drift of the GPU's clocks over the first sweep (tens of
    # seconds) favours whatever was timed in a fast stretch; the mean of the two sweeps cancels
    # linear drift before the finalists are chosen.
    for r in reversed(results):
        if r.timing is None:
            continue
        try:
            again = time_cupy(problem.timed_call(r.cfg), n_sets, warmup, sweep_iters)
        except Exception as exc:
            r.timing, r.error = None, checked.setdefault(r.cfg, f"{type(exc).__name__}: {exc}")
            continue
        r.timing = Timing((r.timing.median_ms + again.median_ms) / 2, min(r.timing.min_ms, again.min_ms),
                          max(r.timing.max_ms, again.max_ms), r.timing.samples + again.samples)
    timed = sorted((r for r in results if r.timing), key=lambda r: (r.timing.median_ms, r.index))
    finals = timed[:max(1, finalists)]
    winner = _final_round(finals, problem, warmup, iters, sustain)
    if winner is not None and twins is not None:
        ranked = sorted((r for r in finals if r.timing), key=lambda r: (r.timing.median_ms, r.index))
        made: dict[KernelConfig, KernelConfig] = {}  # twin -> the finalist it was made from
        timed_already = {r.cfg for r in results}  # a twin that is a candidate has had its chance
        for base in ranked[:max(1, twin_finalists)]:
            for twin in twins(base.cfg):
                if twin not in made and twin not in timed_already:
                    made[twin] = base.cfg
        winner = _knob_round(winner, made, checked, problem, warmup, iters, len(results), sustain)
    if sustain > 0:
        for r in results:
            if r.cfg == heuristic and r.timing is not None and all(r is not f for f in finals):
                _check_and_time(r, checked, problem, warmup, iters, sustain)
    return winner, results


def _check_and_time(r: _Result, checked: dict[KernelConfig, str | None], problem: TuningProblem,
                    warmup: int, iters: int, sustain: float = 0.0) -> bool:
    """Set r.timing (one timing of `iters` samples) or r.error: a config the problem skips, one
    that failed before (`checked` holds each config's check result, so the float64 check runs
    once per config), or one whose check or launch fails now. True when the problem skips it."""
    r.timing, r.error = None, None
    skip = problem.skip_reason(r.cfg)
    if skip is not None:
        r.error = skip
        return True
    if checked.get(r.cfg) is not None:
        r.error = checked[r.cfg]
        return False
    try:
        if r.cfg not in checked:  # a poisoned output against the float64 reference
            checked[r.cfg] = r.error = problem.check(r.cfg)
        if r.error is None:
            r.timing = time_cupy(problem.timed_call(r.cfg), problem.n_sets, warmup, iters, sustain=sustain)
    except Exception as exc:  # one broken config must not end the whole run; it is reported
        r.error = checked[r.cfg] = f"{type(exc).__name__}: {exc}"
    return False


def _knob_round(winner: _Result, twins: dict[KernelConfig, KernelConfig], checked: dict[KernelConfig, str | None],
                problem: TuningProblem, warmup: int, iters: int, first_index: int, sustain: float = 0.0) -> _Result:
    """The winner against knob twins (`twins`: each twin and the finalist it was made from): each
    twin checked once against the reference (a wrong or failing one is reported with the broken
    configs and left out), timed once, then all in `_final_round`'s interleaved rounds. Twins
    rank after every candidate, so ties keep the winner."""
    entrants = [winner]
    for i, cfg in enumerate(twins):
        r = _Result(cfg, first_index + i)
        _check_and_time(r, checked, problem, warmup, max(1, iters // 2))
        if r.timing is not None:
            entrants.append(r)
    if len(entrants) == 1:
        return winner
    best = _final_round(entrants, problem, warmup, iters, sustain) or winner
    if best is not winner:
        best.twin_of = twins[best.cfg]
    return best


def _final_round(finals: list[_Result], problem: TuningProblem, warmup: int, iters: int,
                 sustain: float = 0.0) -> _Result | None:
    """Re-time the fastest candidates in FINAL_ROUNDS interleaved rounds (the order alternates)
    and pick the lowest median of the per-round medians (ties: candidate order); each timing
    after `sustain` seconds of load (time_cupy).

    The GPU's clocks drift by a few percent over seconds; timing each finalist once, one after
    the other, let that drift choose between configs a few percent apart."""
    rounds: dict[int, list[Timing]] = {r.index: [] for r in finals}
    for n in range(FINAL_ROUNDS):
        for r in (finals if n % 2 == 0 else finals[::-1]):
            if r.timing is None:
                continue
            try:
                rounds[r.index].append(time_cupy(problem.timed_call(r.cfg), problem.n_sets, warmup, iters,
                                                 sustain=sustain))
            except Exception as exc:
                r.timing, r.error = None, f"{type(exc).__name__}: {exc}"
    finals = [r for r in finals if r.timing and rounds[r.index]]
    for r in finals:  # the reported figures: the round with the median median
        ordered = sorted(rounds[r.index], key=lambda t: t.median_ms)
        r.timing = ordered[(len(ordered) - 1) // 2]
    if not finals:
        return None
    return min(finals, key=lambda r: (r.timing.median_ms, r.index))


def autotune(dtypes: Iterable[DType | str] = tuple(DType), d_heads: Iterable[int] = SUPPORTED_D_HEADS,
             seq_buckets: Iterable[int] = SEQ_BUCKETS, candidates: Iterable[KernelConfig] | None = None,
             iters: int = DEFAULT_ITERS, progress: bool = True, table_path: str | Path | None = None, *,
             warmup: int = DEFAULT_WARMUP, finalists: int = DEFAULT_FINALISTS, device: int | None = None,
             write_default: bool = False, stream: TextIO | None = None, causal: bool = False,
             family: str | KernelFamily = DEFAULT_FAMILY, knob_twins: bool = True, sustain: float = 0.0,
             twin_finalists: int = DEFAULT_TWIN_FINALISTS) -> TuningTable:
    """Benchmark the candidates of kernel family `family` on the current GPU and store the winners.

    causal=True times causally masked problems and stores the table's causal rows (which
    forward(causal=True) prefers); the non-causal rows are left as they are, and vice versa.
    knob_twins=False skips the knob twins (`KernelFamily.knob_twins`) of the `twin_finalists`
    fastest finalists. sustain > 0 (seconds) loads the GPU that long before each timing of the
    final and knob rounds, so rows are decided at its power-capped clock (see the module
    docstring).

    Writes the table (merged over an existing valid one for this device) to `table_path`
    (default `<cache dir>/tuning/<device slug>.json`), prints it, and returns it. With
    `write_default`, this run's winners alone also go to the package's shipped table for the
    device family (`cupyflash/tuning/default_<family>.json`). Raises RuntimeError without a GPU.
    """
    import cupy

    from .device import require_gpu

    out = stream if stream is not None else sys.stdout
    fam = get_family(family)
    require_gpu()
    dtypes = tuple(DType.parse(d) if isinstance(d, str) else DType(d) for d in dtypes)
    d_heads = tuple(int(d) for d in d_heads)
    buckets = tuple(sorted(set(int(s) for s in seq_buckets)))
    for d in d_heads:
        if d not in SUPPORTED_D_HEADS:
            raise ValueError(f"d_heads: {d} is not supported; expected values from {SUPPORTED_D_HEADS}")
    for s in buckets:
        grid_shape(s, max(d_heads, default=128))  # ValueError for a bucket the grid cannot express
    if iters < 1 or warmup < 0 or finalists < 1:
        raise ValueError(f"iters >= 1, warmup >= 0 and finalists >= 1 expected, got {iters}, {warmup}, {finalists}")
    if isinstance(twin_finalists, bool) or not isinstance(twin_finalists, int) or twin_finalists < 1:
        raise ValueError(f"twin_finalists: expected an int >= 1, got {twin_finalists!r}")
    try:
        sustain = float(sustain)
    except (TypeError, ValueError):
        raise ValueError(f"sustain: expected seconds >= 0, got {sustain!r}") from None
    if not sustain >= 0:  # also refuses NaN
        raise ValueError(f"sustain: expected seconds >= 0, got {sustain}")
    candidates = list(candidates) if candidates is not None else None
    device = cupy.cuda.runtime.getDevice() if device is None else int(device)
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    l2_bytes = int(props.get("l2CacheSize", 0))
    if not fam.supports(int(props.get("major", 9)) * 10 + int(props.get("minor", 0))):
        raise ValueError(f"family: {fam.name} does not run on {name}")
    groups = [(dt, d, candidate_configs(dt, d, candidates, fam)) for dt in dtypes for d in d_heads]
    log = sys.stderr if progress else None

    with cupy.cuda.Device(device):
        failed_compiles = _compile_all([c for _, _, cfgs in groups for c in cfgs], device, log, causal)
        path = Path(table_path) if table_path is not None else user_table_path(name, family=fam.name)
        table = _existing_table(path, name, fam.name)
        run = TuningTable(device=name, family=fam.name)
        total = sum(len(cfgs) for _, _, cfgs in groups) * len(buckets)
        bar = ProgressBar(total, log, label="autotune")
        missing: list[str] = []
        broken: list[str] = []
        meta = {"date": _now(), "versions": _versions(), "iters": iters, "warmup": warmup,
                "finalists": finalists, "twin_finalists": twin_finalists if knob_twins else 0, "sustain": sustain,
                "causal": causal, "family": fam.name,
                "grid": f"batch*seq=16384, heads*d_head=2048, {'causal' if causal else 'non-causal'}, "
                        "seq_q=seq_k=bucket",
                "missing": missing, "broken_configs": broken, "complete": False}
        twins = functools.partial(fam.knob_twins, causal=causal) if knob_twins else None
        for dtype, d_head, cfgs in groups:
            checked: dict[KernelConfig, str | None] = {
                c: f"compile failed: {(failed_compiles[c.short_form()].splitlines() or [''])[0]}"
                for c in cfgs if c.short_form() in failed_compiles}
            results = [_Result(c, i) for i, c in enumerate(cfgs)]
            heuristic = fam.default_config(dtype, d_head)
            for seq in buckets:
                problem = fam.tuning_problem(dtype, d_head, seq, causal, l2_bytes)
                try:
                    winner, results = _tune_bucket(results, checked, problem, iters, warmup, finalists, bar,
                                                   twins, sustain, twin_finalists, heuristic)
                finally:
                    problem.close()
                if winner is None:
                    missing.append(f"{dtype.name},{d_head},{seq}")
                    continue
                flops = problem.flops
                base = next((r for r in results if r.cfg == heuristic and r.timing), None)
                info = {**problem.info,
                        "candidates": len(cfgs), "correct": sum(r.timing is not None for r in results),
                        "heuristic_tflops": round(base.timing.tflops(flops), 2) if base else None}
                if winner.twin_of is not None:  # a knob twin took the row: say from which finalist
                    info["twin_of"] = winner.twin_of.short_form()
                for t in (table, run):
                    t.set(winner.cfg, seq, round(winner.timing.tflops(flops), 2),
                          round(winner.timing.median_ms, 5), causal=causal, **info)
            broken += [f"{cfg}: {err}" for cfg, err in sorted(checked.items()) if err]
            # saved after every group, so a run cut short (time limit) keeps what it measured
            _store(table, run, path, name, meta, write_default)
        bar.finish()

    meta["complete"] = True
    default_path = _store(table, run, path, name, meta, write_default)
    print(format_table(table, f"tuning table for {name} -> {path}"), file=out)
    if default_path is not None:
        print(f"wrote the shipped default table ({len(run)} entries): {default_path}", file=out)
    clear_caches()  # forward(cfg=None) must see the new tables
    if broken:
        print(f"autotune: {len(broken)} config(s) excluded (wrong, failed to compile, or raised):\n  "
              + "\n  ".join(broken), file=sys.stderr)
    if missing:
        print("autotune: no correct candidate for (dtype,d_head,seq) " + " ".join(missing), file=sys.stderr)
    return table


def _store(table: TuningTable, run: TuningTable, path: Path, name: str, meta: dict,
           write_default: bool) -> Path | None:
    """Write the user table (merged) and, with `write_default`, the package's shipped table for the
    device family: its existing entries (so a run split by dtype or d_head adds up) overlaid with
    this run's winners. Returns the shipped table's path, if written."""
    table.meta = run.meta = json.loads(json.dumps(meta))  # a snapshot, not the live lists
    table.save(path)
    clear_caches()
    if not write_default:
        return None
    gpu = device_family(name)
    target = default_table_path(name, run.family)
    shipped = TuningTable(device=None if gpu else name, match=gpu,
                          comment=f"measured by `python -m cupyflash autotune --write-default` on {name}; "
                                  "meta describes the latest run that wrote into it",
                          meta=run.meta, family=run.family)
    previous = _existing_table(target, name, run.family) if target.is_file() else None
    if previous is not None:  # the other models it was measured to serve stay served
        shipped.also_match = previous.also_match
        shipped.fallback_arch = previous.fallback_arch
    for e in (previous.entries() if previous is not None else []) + run.entries():
        shipped.set(e.config, e.seq, e.tflops, e.ms, causal=e.causal, **e.info)
    return shipped.save(target)


def _existing_table(path: Path, name: str, family: str = DEFAULT_FAMILY) -> TuningTable:
    """The table at `path` to merge into, or a new one (with a warning when it is unusable)."""
    if path.is_file():
        try:
            old = TuningTable.load(path)
            if old.matches(name) and old.family == family:
                return TuningTable.from_dict({**old.to_dict(), "device": name})
            print(f"autotune: {path} belongs to {old.device or old.match} ({old.family}); replacing it",
                  file=sys.stderr)
        except (OSError, TuningTableError) as exc:
            print(f"autotune: ignoring unreadable table {path} ({exc}); writing a new one", file=sys.stderr)
    return TuningTable(device=name, family=family)


def format_table(table: TuningTable, title: str = "") -> str:
    """Plain-text table of the winners with the heuristic default's speed for comparison."""
    lines = [title] if title else []
    lines.append(f"{'dtype':<5} {'d_head':>6} {'causal':>6} {'seq':>6} {'TFLOP/s':>8} {'default':>8} {'gain':>6}  config")
    for e in table.entries():
        base = e.info.get("heuristic_tflops")
        gain = f"{e.tflops / base:5.2f}x" if base and e.tflops else "     -"
        lines.append(f"{e.config.dtype.name:<5} {e.config.d_head:>6} {'yes' if e.causal else 'no':>6} {e.seq:>6} "
                     f"{(e.tflops or float('nan')):>8.1f} {(base or float('nan')):>8.1f} {gain:>6}  {e.config}")
    if not len(table):
        lines.append("(no entries)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- command line
def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="cupyflash autotune", description=__doc__.splitlines()[0])
    parser.add_argument("--family", default=DEFAULT_FAMILY,
                        help=f"kernel family to tune: {', '.join(FAMILIES)} (default {DEFAULT_FAMILY})")
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16,fp16 (default both)")
    parser.add_argument("--d-heads", default=",".join(map(str, SUPPORTED_D_HEADS)),
                        help="comma-separated head dimensions (default 64,128)")
    parser.add_argument("--seqs", default=",".join(map(str, SEQ_BUCKETS)),
                        help="seq buckets (default 512,...,16384; each must divide 16384 or exceed it)")
    parser.add_argument("--set", dest="config_set", default=None,
                        help="candidate set: a KERNELS key (tune, all, prog_all, 'B_r,B_c'); default: tune")
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS, help="timed calls per candidate")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed calls before timing")
    parser.add_argument("--finalists", type=int, default=DEFAULT_FINALISTS,
                        help=f"fastest candidates re-timed in {FINAL_ROUNDS} interleaved rounds")
    parser.add_argument("--table", default=None,
                        help="table file to write (default: <cache dir>/tuning/<device>.json, which forward reads)")
    parser.add_argument("--write-default", action="store_true",
                        help="also write this run's winners as the package's shipped table for this GPU family")
    parser.add_argument("--device", type=int, default=None, help="CUDA device (default: current)")
    parser.add_argument("--causal", action="store_true",
                        help="tune causally masked problems: the table's causal rows, used by forward(causal=True)")
    parser.add_argument("--no-knob-twins", dest="knob_twins", action="store_false",
                        help="do not time the finalists' knob twins (a config with launch knobs the "
                             "tune set leaves out, e.g. forward_sm90's ring/oreg/xtile/wgblocks)")
    parser.add_argument("--twin-finalists", type=int, default=DEFAULT_TWIN_FINALISTS, metavar="N",
                        help=f"how many of the fastest finalists have their knob twins timed against the "
                             f"winner (default {DEFAULT_TWIN_FINALISTS})")
    parser.add_argument("--sustain", type=float, default=0.0, metavar="S",
                        help="seconds of back-to-back calls before each timing of the final and knob rounds, "
                             "so rows are decided at the GPU's power-capped clock (training, long prefill) "
                             "rather than in a short burst; the H100 table's probes used 0.3 (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """0 on success, 1 when some bucket had no correct candidate, 2 for bad arguments or no GPU."""
    try:
        dtypes = parse_dtypes(args.dtypes)
        d_heads = parse_ints(args.d_heads, "--d-heads")
        seqs = parse_ints(args.seqs, "--seqs")
        family = get_family(args.family)
        candidates = family.config_set(args.config_set) if args.config_set else None
    except ValueError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    from .device import has_gpu

    if not has_gpu():
        print("autotune: no CUDA GPU found: autotuning times kernels on the GPU it tunes for, so nothing "
              "was run. cfg=None uses the shipped table or the family's default config meanwhile.",
              file=sys.stderr)
        return 2
    try:
        table = autotune(dtypes, d_heads, seqs, candidates, iters=args.iters, progress=not args.quiet,
                         table_path=args.table, warmup=args.warmup, finalists=args.finalists,
                         device=args.device, write_default=args.write_default, causal=args.causal,
                         family=family, knob_twins=args.knob_twins, sustain=args.sustain,
                         twin_finalists=args.twin_finalists)
    except ValueError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    return 1 if table.meta.get("missing") else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))
