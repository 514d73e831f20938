#!/usr/bin/env bash
# One device call for the backward family: prewarm, GPU tests, compute-sanitizer, benchmark.
#   OUT=/tmp/out bash scripts/gpu_backward_session.sh [BENCH_ARGS...]
# Logs and JSON go to $OUT; the last lines printed are the summaries.
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-backward}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}"
arch=$(python3 -c "from cupyflash.device import device_arch; print(device_arch(0)[0])")
# benchmarked besides the defaults: the single-buffered layout and the pds_smem (2-D warp tiling) ones
D128="backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled|backward_sm80 (BF16, 128, 64, 128, 8): dsplit_1+swizzled+dbuf+pds|backward_sm80 (BF16, 128, 64, 64, 4): dsplit_1+swizzled+dbuf+pds"
D64="backward_sm80 (BF16, 64, 64, 128, 8): dsplit_1+swizzled|backward_sm80 (BF16, 64, 64, 128, 8): dsplit_1+swizzled+dbuf+pds"
CFGS="$D128|$D64"
args=()
while IFS= read -r c; do args+=(--config "$c"); done < <(echo "$CFGS|$(echo "$CFGS" | sed 's/BF16/FP16/g')" | tr '|' '\n')
python3 scripts/prewarm_cache.py --family backward_sm80 --arch "$arch" "${args[@]}" --all-variants --jobs 16 \
    --quiet >"$OUT/prewarm.log" 2>&1
echo "prewarm exit $?: $(tail -n 2 "$OUT/prewarm.log" | head -n 1)"
CUPYFLASH_TEST_FIGURES="$OUT/figures.json" timeout 200 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/test_gpu_backward.py >"$OUT/pytest.log" 2>&1
tests=$?
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | tail -n 30
if [ "$tests" -ne 0 ]; then
    echo "GPU tests failed: skipping sanitizer and benchmark"
    exit 1
fi
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_backward.py \
    --max-shapes 2 >"$OUT/memcheck.log" 2>&1
echo "memcheck exit $?: $(grep -E 'ERROR SUMMARY|sanitize_backward:' "$OUT/memcheck.log" | tr '\n' ' ')"
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_backward.py \
    --d-heads 128 --max-shapes 1 >"$OUT/racecheck.log" 2>&1
echo "racecheck exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_backward:' "$OUT/racecheck.log" | tr '\n' ' ')"
timeout 150 python3 scripts/bench_backward.py --deterministic --warmup 2 --reps 5 --cfgs "$CFGS" \
    --json "$OUT/bench_backward.json" "$@" >"$OUT/bench.log" 2>&1
echo "bench exit $?"
tail -n 28 "$OUT/bench.log"
