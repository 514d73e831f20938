#!/usr/bin/env bash
# One device call for the Hopper backward family (backward_sm90): prewarm, a smoke run (wrong or
# hung kernels show here; the GPU tests still run, for their per-case figures), the GPU tests, the
# autograd paths (torch, JAX), the benchmark (bench.py --mode backward: cupyflash's pick,
# backward_sm80, backward_sm90, SDPA flash/cuDNN, FA3) and compute-sanitizer. At most 8 files
# under $OUT (the device returns no more). Each stage has its own timeout.
#   OUT=/tmp/out bash scripts/gpu_backward_sm90_session.sh
# Environment: STAGES (default "smoke,tests,autograd,bench,memcheck"; also racecheck, synccheck),
# BENCH_ARGS (bench.py --mode backward arguments; default bf16 d128, S 1k..16k, causal both),
# BENCH_ARGS_2, BENCH_ARGS_3 (more bench runs, e.g. d_head 64 against cuDNN: bench2.json, bench3.json;
# a --sm90-config short form must be written without spaces), FIGURES=1 (the tests' figures.json),
# BENCH_TIMEOUT (s per run, default 150), TESTS_TIMEOUT (s, default 180), SAN_TIMEOUT (s per tool, default 100), TESTS_K (pytest -k expression for test_gpu_backward_sm90.py).
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-backward-sm90}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}"
CFGS="backward_sm90(BF16, 128, 64, 128, 2)|backward_sm90(BF16, 64, 64, 128, 2)|backward_sm90(FP16, 128, 64, 64, 2)"
STAGES="${STAGES:-smoke,tests,autograd,bench,memcheck}"
BENCH_ARGS="${BENCH_ARGS:---dtypes bf16 --d-heads 128 --seqs 1k,2k,4k,8k,16k --causal both}"
has() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
t0=$SECONDS
{
    timeout 120 python3 -m cupyflash prewarm --family backward_sm90 --set defaults --arch sm_90a --all-variants \
        --jobs 16 --quiet
    timeout 120 python3 -m cupyflash prewarm --family backward_sm90 --set all --arch sm_90a --jobs 16 --quiet
    timeout 60 python3 -m cupyflash prewarm --arch sm_90a --all-variants --jobs 16 --quiet \
        --config "backward_sm90(BF16, 128, 64, 128, 2): dq_bulk" --config "backward_sm90(FP16, 128, 64, 128, 2): dq_bulk"
} >"$OUT/prewarm.log" 2>&1
echo "prewarm exit $? ($((SECONDS - t0)) s)"; grep -E "compiled|failed|warning" "$OUT/prewarm.log" | head -n 6
smoke_ok=1 bulk_ok=1
if has smoke; then
    timeout 45 python3 scripts/sanitize_backward.py --d-heads "" --configs "$CFGS" >"$OUT/smoke.log" 2>&1
    rc=$?
    echo "smoke exit $rc ($((SECONDS - t0)) s)"; grep "^FAIL" "$OUT/smoke.log" | head -n 24; tail -n 3 "$OUT/smoke.log"
    [ "$rc" -eq 124 ] && { echo "SMOKE TIMED OUT (a hang?): stopping"; exit 1; }
    [ "$rc" -ne 0 ] && smoke_ok=0
    timeout 30 python3 scripts/sanitize_backward.py --d-heads "" --configs "backward_sm90(BF16, 128, 64, 128, 2): dq_bulk" \
        >>"$OUT/smoke.log" 2>&1
    rc=$?
    echo "dq_bulk smoke exit $rc ($((SECONDS - t0)) s)"; grep "^FAIL" "$OUT/smoke.log" | head -n 12; tail -n 1 "$OUT/smoke.log"
    if [ "$rc" -ne 0 ]; then
        bulk_ok=0; BENCH_ARGS_2=""; TESTS_K="${TESTS_K:-not bulk}"; echo "DQ_BULK FAILED: left out of the later stages"
    fi
fi
if has tests; then
    CUPYFLASH_TEST_FIGURES="${FIGURES:+$OUT/figures.json}" timeout "${TESTS_TIMEOUT:-180}" python3 -m pytest -q -rs -p no:cacheprovider \
        ${TESTS_K:+-k "$TESTS_K"} tests/test_gpu_backward_sm90.py >"$OUT/pytest.log" 2>&1
    echo "tests exit $? ($((SECONDS - t0)) s):"
    grep -E "passed|failed|^FAILED|^ERROR|^E  .*(rel|max|assert)" "$OUT/pytest.log" | head -n 40
fi
[ "$smoke_ok" -eq 0 ] && { echo "SMOKE FAILED: no autograd, bench or sanitizer stages"; STAGES="memcheck"; }
if has autograd; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_jax_ops.py -k "gpu and grad" >"$OUT/autograd.log" 2>&1
    echo "jax grad tests exit $? ($((SECONDS - t0)) s): $(tail -n 1 "$OUT/autograd.log")"
fi
if has bench; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        ../../.whl/*.whl >/dev/null 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    for run in 1 2 3; do
        args="$BENCH_ARGS"; json="$OUT/bench.json"
        [ "$run" -eq 2 ] && { args="${BENCH_ARGS_2:-}"; json="$OUT/bench2.json"; }
        [ "$run" -eq 3 ] && { args="${BENCH_ARGS_3:-}"; json="$OUT/bench3.json"; }
        [ -z "$args" ] && continue
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-150}" python3 scripts/bench.py --mode backward $args --json "$json" \
            --plot '' >>"$OUT/bench.log" 2>&1
        echo "bench $run exit $? ($((SECONDS - t0)) s)"
    done
    python3 - "$OUT"/bench*.json <<'EOF'
import json, sys
sys.path.insert(0, "scripts")
import bench_mode_backward as m
for path in sys.argv[1:]:
    print(m.format_report(json.load(open(path))["records"]))
EOF
fi
for tool in memcheck racecheck synccheck; do
    has $tool || continue
    # shellcheck disable=SC2046
    timeout "${SAN_TIMEOUT:-100}" compute-sanitizer --tool $tool --error-exitcode 1 python3 scripts/sanitize_check.py \
        --family backward_sm90 --quick $([ "$bulk_ok" -eq 0 ] && echo --no-dq-bulk) >>"$OUT/sanitize.log" 2>&1
    echo "$tool exit $? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_check:' "$OUT/sanitize.log" | tail -n 2 | tr '\n' ' ')"
done
