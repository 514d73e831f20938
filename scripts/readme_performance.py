"""Rewrite the README's mma.sync family subsection (the `### The mma.sync family` heading up to
`## Repository layout`) from bench JSON files (scripts/bench.py --json); the Hopper and H200
tables above it are written by hand from their own runs and are left alone.

    python scripts/readme_performance.py docs/bench_h100.json docs/bench_h100_causal.json

The first file is the non-causal run (with --progression and the per-call measurement), the second
the causal run; the plot is expected next to the first file as .png. GQA runs (bench.py --gqa G)
saved beside them as <first>_gqa.json and <first>_gqa_causal.json get a table of their own.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
HEADING = ("### The mma.sync family (`forward_sm80`: `cfg=None` on sm_80-sm_89, and on Hopper for layouts TMA "
           "cannot take)")
END = "## Repository layout"


def _seq(s: int) -> str:
    return str(s) if s < 1024 else f"{s // 1024}k"


def grid_rows(data: dict, causal: bool) -> list[str]:
    by: dict[tuple, dict[str, float]] = {}
    for r in data["grid"]:
        if r.get("status") == "ok" and "tflops" in r:
            by.setdefault((r["dtype"], r["d_head"], r["seq"]), {})[r["impl"]] = r["tflops"]
    rows = []
    for (dtype, d_head, seq), v in sorted(by.items()):
        if "cupyflash" in v and "sdpa_flash" in v:
            cudnn = f"{v['sdpa_cudnn']:.0f}" if "sdpa_cudnn" in v else "-"
            rows.append(f"| {dtype} | {d_head} | {'yes' if causal else 'no'} | {_seq(seq)} | {v['cupyflash']:.0f} | "
                        f"{v['sdpa_flash']:.0f} | {cudnn} | {v['cupyflash'] / v['sdpa_flash']:.2f}x |")
    return rows


def section(plain: dict, causal: dict, plot: str, gqa: list[tuple[dict, bool]] = (),
            releases: dict | None = None) -> str:
    meta = plain["meta"]
    ver = meta["versions"]
    o = plain.get("overhead") or {}
    lines = [
        HEADING, "",
        f"Measured on an **{meta['gpu']}** on {meta['date'][:10]} (CUDA driver {ver['cuda_driver'] // 1000}.0, "
        f"NVRTC {ver['nvrtc']}, torch {ver['torch']}, CuPy {ver['cupy']}, cupyflash {ver['cupyflash']}) with "
        "`python scripts/bench.py --d-heads 64,128 --progression` and `python scripts/bench.py --causal "
        "--dtypes bf16,fp16 --d-heads 128 --no-overhead`, all implementations in one process on the same "
        "inputs. TFLOP/s = `4*B*H*S_q*S_k*D / time` (causal: half), median of 50 CUDA-event timings after "
        "warm-up, `batch*seq = 16384`, `heads*d_head = 2048`. cupyflash runs with `cfg=None`, i.e. the "
        "shipped H100 tuning table (`cupyflash/tuning/default_h100.json`, made by `python -m cupyflash "
        "autotune --write-default` and, for its causal rows, `... --d-heads 128 --causal --write-default`). Raw results: `docs/bench_h100.json`, `docs/bench_h100_causal.json`; "
        "`python scripts/readme_performance.py` writes this section from them.", "",
        f"![TFLOP/s vs sequence length]({plot})", "",
        "| dtype | d_head | causal | seq | cupyflash | SDPA flash (FA2) | SDPA cuDNN | cupyflash / FA2 |",
        "|---|---|---|---|---|---|---|---|",
        *grid_rows(plain, False), *grid_rows(causal, True), "",
        "cupyflash's mma.sync kernels beat FlashAttention-2 (the SDPA flash backend, also mma.sync) at every "
        "point of the grid. On Hopper cfg=None runs the forward_sm90 family instead (tables above).", "",
    ]
    if gqa:
        first = next(r for r in gqa[0][0]["grid"] if r.get("kv_heads"))
        lines += [
            f"Grouped-query attention ({first['heads']} query heads sharing {first['kv_heads']} k/v heads, "
            "`bench.py --gqa 8`; SDPA with `enable_gqa=True`), same grid:", "",
            "| dtype | d_head | causal | seq | cupyflash | SDPA flash (FA2) | SDPA cuDNN | cupyflash / FA2 |",
            "|---|---|---|---|---|---|---|---|",
            *(row for data, is_causal in gqa for row in grid_rows(data, is_causal)), "",
        ]
    if "cupyflash_auto" in o and "sdpa_flash" in o:
        a, c, s = o["cupyflash_auto"], o["cupyflash_cfg_out"], o["sdpa_flash"]
        lines += [
            "Per-call cost on a tiny problem (1x128x8x128 bf16, torch tensors, kernel cached; medians of "
            f"{o.get('rounds', 1)} interleaved rounds): `forward(None, q, k, v)` costs {a['issue_us_per_call']:.1f} us "
            f"of host time per call, `forward(cfg, q, k, v, out=out)` {c['issue_us_per_call']:.1f} us, against "
            f"{s['us_per_call']:.1f} us per back-to-back SDPA flash call.",
        ]
        if "python_side_us_per_call" in o:
            lines[-1] += (
                f" A bare `cuLaunchKernel` of the same kernel costs {o['bare_launch']['issue_us_per_call']:.1f} us, "
                f"so the Python-side overhead of `forward(None, ...)` (argument signature, output allocation, "
                f"launch bookkeeping) is {o['python_side_us_per_call']:.1f} us, "
                f"{o['ratio_python_side_over_sdpa_wall']:.2f}x SDPA's per-call time; the whole host cost is "
                f"{o['ratio_cupyflash_issue_over_sdpa_wall']:.2f}x.")
        lines += ["These figures move by up to 2x between runs with the host's load; ratios within one round are "
                  "what the benchmark compares.", ""]
    if releases and releases.get("rows"):
        rows = releases["rows"]
        user = [r["new"] / r["old"] for r in rows]
        kernel = [r["kernel_new_over_old"] for r in rows]
        lines += [
            "Against the previous release (`scripts/compare_releases.py --old <checkout>`: both releases on the "
            f"non-causal grid above, bf16/fp16, d_head 64/128, in one run, {releases.get('rounds', 1)} alternating "
            "rounds per point, `docs/compare_releases_h100.json`): new/old "
            f"{min(user):.3f}-{max(user):.3f} with each release's own tuning table, "
            f"{min(kernel):.3f}-{max(kernel):.3f} (mean {sum(kernel) / len(kernel):.3f}) for the two kernels on the "
            "same configs.", "",
        ]
    prog = sorted((r for r in plain.get("progression", []) if r["dtype"] == "bf16" and r["d_head"] == 128
                   and "tflops" in r), key=lambda r: r["step"])
    if prog:
        lines += ["Progression (bf16, d_head 128, S=4096; each step adds one optimisation, see NOTES.md):", "",
                  "| step | config | TFLOP/s |", "|---|---|---|",
                  *(f"| {r['step']} | `{r['config']}` | {r['tflops']:.0f} |" for r in prog), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    plain_path, causal_path = Path(argv[0]), Path(argv[1])
    plain, causal = json.loads(plain_path.read_text()), json.loads(causal_path.read_text())
    text = README.read_text()
    plot = plain_path.resolve().with_suffix(".png").relative_to(README.parent).as_posix()
    gqa = [(json.loads(path.read_text()), is_causal)
           for path, is_causal in ((plain_path.with_name(plain_path.stem + "_gqa.json"), False),
                                   (plain_path.with_name(plain_path.stem + "_gqa_causal.json"), True))
           if path.exists()]
    releases_path = plain_path.with_name("compare_releases_h100.json")
    releases = json.loads(releases_path.read_text()) if releases_path.exists() else None
    README.write_text(rewrite(text, section(plain, causal, plot, gqa, releases)))
    return 0


def rewrite(text: str, new_section: str) -> str:
    """`text` with the mma.sync subsection (HEADING up to END) replaced by `new_section`; ValueError
    when either marker is missing. Everything else, the Hopper and H200 tables included, is kept."""
    start, end = text.index(HEADING), text.index(END)
    if end < start:
        raise ValueError(f"{END!r} precedes {HEADING!r}")
    return text[:start] + new_section + text[end:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["docs/bench_h100.json", "docs/bench_h100_causal.json"]))
