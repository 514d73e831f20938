#!/usr/bin/env bash
# First device call for the Hopper backward family (backward_sm90): prewarm, a plain smoke run
# (wrong or hung kernels stop here), the GPU tests, compute-sanitizer, then a benchmark against
# backward_sm80 (cfg=None) and the peers. Logs under $OUT; the last lines printed are summaries.
#   OUT=/tmp/out bash scripts/gpu_backward_sm90_session.sh
# Environment: CFGS ('|'-separated backward_sm90 short forms for the smoke/sanitizer runs and the
# benchmark; default the bf16 d128 and d64 defaults), STAGES (default "smoke,tests,sanitize,bench"),
# BENCH_ARGS (extra arguments of scripts/bench_backward.py).
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-backward-sm90}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}"
CFGS="${CFGS:-backward_sm90(BF16, 128, 64, 128, 2)|backward_sm90(BF16, 64, 64, 128, 2)}"
STAGES="${STAGES:-smoke,tests,sanitize,bench}"
has() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
t0=$SECONDS
python3 scripts/prewarm_cache.py --family backward_sm90 --set all --arch sm_90a --all-variants --jobs 16 --quiet \
    >"$OUT/prewarm.log" 2>&1
echo "prewarm exit $? ($((SECONDS - t0)) s)"
if has smoke; then
    timeout 90 python3 scripts/sanitize_backward.py --d-heads "" --configs "$CFGS" >"$OUT/smoke.log" 2>&1
    rc=$?
    echo "smoke exit $rc ($((SECONDS - t0)) s)"; tail -n 5 "$OUT/smoke.log"
    [ "$rc" -ne 0 ] && { echo "SMOKE FAILED: nothing else is worth the time"; exit 1; }
fi
if has tests; then
    timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_backward_sm90.py >"$OUT/pytest.log" 2>&1
    echo "tests exit $? ($((SECONDS - t0)) s):"
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | tail -n 30
fi
if has sanitize; then
    for tool in memcheck racecheck synccheck; do
        timeout 100 compute-sanitizer --tool $tool --error-exitcode 1 python3 scripts/sanitize_backward.py \
            --d-heads "" --max-shapes 2 --configs "$CFGS" >"$OUT/$tool.log" 2>&1
        echo "$tool exit $? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_backward:' "$OUT/$tool.log" | tr '\n' ' ')"
    done
fi
if has bench; then
    # shellcheck disable=SC2086
    timeout 200 python3 scripts/bench_backward.py --d-heads 128 --dtypes bf16 --json "$OUT/bench_backward_sm90.json" \
        --cfgs "$(echo "$CFGS" | tr '|' '\n' | grep -E '\((BF16|FP16), 128,' | paste -sd '|')" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
    echo "bench exit $? ($((SECONDS - t0)) s)"
    tail -n 20 "$OUT/bench.log"
fi
