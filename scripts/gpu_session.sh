#!/usr/bin/env bash
# One GPU session in a few steps, each well inside a 10-minute command limit:
#   bash scripts/gpu_session.sh test       install, cold prewarm of the test sets, GPU tests, main job
#   bash scripts/gpu_session.sh shapes     the shape matrix (ragged, causal, GQA, LSE, head dims), sanitizer
#   bash scripts/gpu_session.sh autotune   tune every (dtype, d_head, seq bucket), write the default table
#   bash scripts/gpu_session.sh bench      SPEC §6 grid vs. SDPA flash/cuDNN, progression, per-call overhead
#   bash scripts/gpu_session.sh autotune_sm90  the Hopper family's table for d_head 128 (non-causal and
#                                          causal rows), written as the shipped default; D_HEADS=64,256 for more
#   bash scripts/gpu_session.sh inference  varlen and decode GPU tests, their kernels under compute-sanitizer
#                                          (memcheck, racecheck, synccheck)
#   bash scripts/gpu_session.sh inference_bench  decode tuning table (written as the shipped default),
#                                          then bench.py --mode decode and --mode varlen (FA3 if carried)
# Logs and result files go to $OUT (default /tmp/cupyflash-gpu); the last lines are a short summary.
set -uo pipefail
step="${1:?usage: gpu_session.sh test|shapes|autotune|autotune_sm90|bench|inference|inference_bench}"
OUT="${OUT:-/tmp/cupyflash-gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
# Optional peers carried as wheels (.whl/, git-ignored; e.g. flash-attn3-jax for the FA3 column).
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$OUT/install.log" 2>&1 && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m cupyflash info 2>&1 | tee "$OUT/info.log"

case "$step" in
test)
    arch=$(python3 -c "from cupyflash.device import device_arch; print(device_arch(0)[0])")
    # Cold compile of everything the GPU tests use, in parallel, with per-config seconds.
    python3 scripts/prewarm_cache.py --arch "$arch" --set tune --jobs 16 --quiet >"$OUT/prewarm.log" 2>&1
    python3 scripts/prewarm_cache.py --arch "$arch" --set prog_all --jobs 16 --quiet >>"$OUT/prewarm.log" 2>&1
    CUPYFLASH_TEST_FIGURES="$OUT/figures.json" python3 -m pytest -q -rs -p no:cacheprovider tests \
        --deselect tests/test_gpu_shapes.py 2>&1 \
        | tee "$OUT/pytest.log" | tail -n 25
    python3 scripts/run_attention.py --seq 4096 --batch 4 --heads 16 --d-head 128 --dtype bf16 2>&1 | tee "$OUT/main_job.log"
    python3 - "$OUT" <<'PY'
import json, sys, collections
out = sys.argv[1]
figs = json.load(open(f"{out}/figures.json"))
per = collections.defaultdict(lambda: [0, 0.0])
for f in figs:
    if "config" in f:
        key = (f["dtype"], f["d_head"]); per[key][0] += 1; per[key][1] = max(per[key][1], f["rel_l2"])
for (dt, d), (n, worst) in sorted(per.items()):
    print(f"passed configs {dt} d_head={d}: {n}, worst rel L2 {worst:.3g}")
for f in figs:
    if "warm_start" in f: print("warm start:", f["warm_start"])
PY
    grep -E "configs|seconds|compiled" "$OUT/prewarm.log" | tail -n 6
    ;;
shapes)
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_shapes.py 2>&1 | tee "$OUT/shapes.log" | tail -n 25
    python3 scripts/sanitize_check.py >"$OUT/sanitize.log" 2>&1
    for tool in memcheck racecheck; do
        timeout 280 compute-sanitizer --tool "$tool" --error-exitcode 1 python3 scripts/sanitize_check.py \
            >>"$OUT/sanitize.log" 2>&1
        echo "compute-sanitizer $tool: exit $?" | tee -a "$OUT/sanitize.log"
    done
    grep -E "ERROR SUMMARY|summary|launches" "$OUT/sanitize.log" | tail -n 8
    ;;
autotune)
    timeout 580 python3 -m cupyflash autotune --write-default 2>&1 | tee "$OUT/autotune.log" | tail -n 40
    cp cupyflash/tuning/default_h100.json "$OUT/" 2>/dev/null
    ;;
bench)
    timeout 580 python3 scripts/bench.py --d-heads 64,128 --progression --json "$OUT/bench_results.json" 2>&1 \
        | tee "$OUT/bench.log" | tail -n 60
    ;;
autotune_sm90)
    d_heads="${D_HEADS:-128}"
    # The tune set's modules compile in parallel first (sm_90a compiles take 10-20 s each).
    python3 scripts/prewarm_cache.py --family forward_sm90 --set tune --causal --jobs 16 --quiet \
        >"$OUT/prewarm_sm90.log" 2>&1
    for causal in "" "--causal"; do
        timeout 240 python3 -m cupyflash autotune --family forward_sm90 --d-heads "$d_heads" --iters 10 \
            --finalists 3 --write-default $causal 2>&1 | tee -a "$OUT/autotune_sm90.log" | tail -n 16
    done
    cp cupyflash/tuning/default_*.forward_sm90.json "$OUT/" 2>/dev/null
    ;;
inference)
    python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_varlen.py tests/test_gpu_decode.py 2>&1 \
        | tee "$OUT/inference_tests.log" | tail -n 8
    python3 scripts/sanitize_check.py --family varlen,decode --quick >"$OUT/sanitize.log" 2>&1  # fills the cache
    for tool in memcheck racecheck synccheck; do
        timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 1 python3 scripts/sanitize_check.py \
            --family varlen,decode --quick >>"$OUT/sanitize.log" 2>&1
        echo "compute-sanitizer $tool: exit $?" | tee -a "$OUT/sanitize.log"
    done
    grep -E "ERROR SUMMARY|summary" "$OUT/sanitize.log" | tail -n 8
    ;;
inference_bench)
    timeout 150 python3 -m cupyflash autotune --family decode --d-heads 64,128,256 --seqs 8192,131072 --iters 6 \
        --finalists 2 --write-default 2>&1 | tee "$OUT/autotune_decode.log" | tail -n 12
    cp cupyflash/tuning/default_*.decode.json "$OUT/" 2>/dev/null
    timeout 200 python3 scripts/bench.py --mode decode --json "$OUT/bench_decode.json" 2>&1 \
        | tee "$OUT/bench_decode.log" | tail -n 32
    timeout 150 python3 scripts/bench.py --mode varlen --json "$OUT/bench_varlen.json" 2>&1 \
        | tee "$OUT/bench_varlen.log" | tail -n 16
    ;;
*)
    echo "unknown step $step" >&2; exit 2 ;;
esac
