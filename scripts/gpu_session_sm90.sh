#!/bin/bash
# One device session for the Hopper family: install, correctness (plain sanitize script, then
# the GPU tests), compute-sanitizer on small launches, benchmark. Logs under $OUT (default ./out).
# Usage (repo root): bash scripts/gpu_session_sm90.sh [bench args...]
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash_cache}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this tree's cupyflash, kernels_cu and templates
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 scripts/prewarm_sm90.py prog_all defaults > "$OUT/prewarm.txt" 2>&1; tail -1 "$OUT/prewarm.txt"
timeout ${PLAIN_TIMEOUT:-90} python3 scripts/sanitize_sm90.py > "$OUT/sanitize_plain.txt" 2>&1; rc=$?
echo "sanitize plain rc=$rc"
if [ $rc -ne 0 ]; then tail -40 "$OUT/sanitize_plain.txt"; exit 1; fi  # wrong or hung: nothing else is worth the time
tail -2 "$OUT/sanitize_plain.txt"
timeout ${BENCH_TIMEOUT:-200} python3 scripts/bench_hopper.py --json "$OUT/bench.json" "$@" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
# a second benchmark (e.g. other head dims), arguments in $BENCH2
if [ -n "${BENCH2:-}" ]; then timeout ${BENCH2_TIMEOUT:-120} python3 scripts/bench_hopper.py --json "$OUT/bench2.json" $BENCH2 > "$OUT/bench2.txt" 2>&1; echo "bench2 rc=$?"; fi
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x tests/test_gpu_forward_sm90.py > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$?"
tail -5 "$OUT/pytest.txt"
for tool in memcheck racecheck synccheck; do
  timeout ${SANITIZER_TIMEOUT:-60} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_sm90.py --quick > "$OUT/sanitizer_$tool.txt" 2>&1
  echo "$tool rc=$?"; tail -2 "$OUT/sanitizer_$tool.txt"
done
grep -v '^{' "$OUT/bench.txt" | tail -40
[ -f "$OUT/bench2.txt" ] && grep -v '^{' "$OUT/bench2.txt" | tail -20
