#!/usr/bin/env bash
# One device call for the backward family: prewarm, GPU tests, compute-sanitizer, autotune (the
# shipped H100 table), benchmark against the peers.
#   OUT=/tmp/out bash scripts/gpu_backward_session.sh
# Environment: STAGES (default "tests,sanitize,autotune,bench"), SANITIZE_CFGS ('|'-separated short
# forms checked by memcheck and racecheck), PREWARM_CFGS (compile only these, all variants, instead
# of the tuning set), PREWARM_FORWARD_CFGS (forward configs to compile too), SANITIZE_DHEADS (whose bf16 defaults they check too;
# default 64,128 and 128), BENCH_ARGS (extra arguments of
# scripts/bench_backward.py), BENCH_CFGS (its --cfgs), TUNE_ARGS (extra arguments of `cupyflash autotune`), WHEELS (a
# directory of wheels to install into /tmp/site first, e.g. the FlashAttention-3 one).
# Logs, the tuning table and the benchmark JSON go to $OUT; the last lines printed are summaries.
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-backward}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STAGES="${STAGES:-tests,sanitize,autotune,bench}"
if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl >/tmp/cupyflash-wheels.log 2>&1
    echo "wheels exit $?"
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
has() { case ",$STAGES," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
t0=$SECONDS
arch=$(python3 -c "from cupyflash.device import device_arch; print(device_arch(0)[0])")
prewarm=(--set tune)  # PREWARM_CFGS ('|'-separated short forms) narrows it to the configs a stage uses
if [ -n "${PREWARM_CFGS:-}" ]; then
    prewarm=()
    while IFS= read -r c; do [ -n "$c" ] && prewarm+=(--config "$c"); done < <(echo "$PREWARM_CFGS" | tr '|' '\n')
fi
python3 scripts/prewarm_cache.py --family backward_sm80 "${prewarm[@]}" --arch "$arch" --all-variants --jobs 16 \
    --quiet >/tmp/cupyflash-prewarm.log 2>&1
echo "prewarm exit $? ($((SECONDS - t0)) s): $(tail -n 2 /tmp/cupyflash-prewarm.log | head -n 1)"
if [ -n "${PREWARM_FORWARD_CFGS:-}" ]; then  # the forward configs a stage runs (out and lse of the bench)
    fwd=()
    while IFS= read -r c; do [ -n "$c" ] && fwd+=(--config "$c"); done < <(echo "$PREWARM_FORWARD_CFGS" | tr '|' '\n')
    python3 scripts/prewarm_cache.py "${fwd[@]}" --arch "$arch" --causal --jobs 16 --quiet >/tmp/cupyflash-prewarm-fwd.log 2>&1
    echo "prewarm forward exit $? ($((SECONDS - t0)) s)"
fi
if has tests; then
    timeout 200 python3 -m pytest -q -rs -p no:cacheprovider \
        tests/test_gpu_backward.py >"$OUT/pytest.log" 2>&1
    tests=$?
    echo "tests ($((SECONDS - t0)) s):"
    grep -E "passed|failed|^FAILED|^ERROR" "$OUT/pytest.log" | tail -n 30
    # on failure the later stages still run: autotune drops wrong candidates, the benchmark
    # reports each config's difference from SDPA flash
    [ "$tests" -ne 0 ] && echo "GPU TESTS FAILED"
fi
if has sanitize; then
    cfgs="${SANITIZE_CFGS:-}"
    timeout 100 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitize_backward.py \
        --d-heads "${SANITIZE_DHEADS-64,128}" --max-shapes 2 --configs "$cfgs" >"$OUT/memcheck.log" 2>&1
    echo "memcheck exit $? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY|sanitize_backward:' "$OUT/memcheck.log" | tr '\n' ' ')"
    timeout 100 compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitize_backward.py \
        --d-heads "${SANITIZE_DHEADS-128}" --max-shapes 1 --configs "$cfgs" >"$OUT/racecheck.log" 2>&1
    echo "racecheck exit $? ($((SECONDS - t0)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_backward:' "$OUT/racecheck.log" | tr '\n' ' ')"
fi
if has autotune; then
    for causal in "" "--causal"; do
        # shellcheck disable=SC2086
        timeout 150 python3 -m cupyflash autotune --family backward_sm80 --dtypes bf16,fp16 --d-heads 64,128 \
            --seqs 1024,2048,4096,8192,16384 --write-default $causal ${TUNE_ARGS:-} \
            >"$OUT/autotune${causal:+_causal}.log" 2>&1
        echo "autotune ${causal:-non-causal} exit $? ($((SECONDS - t0)) s)"
        grep -E "^(BF16|FP16) " "$OUT/autotune${causal:+_causal}.log" | tail -n 20
    done
    cp cupyflash/tuning/default_h100.backward_sm80.json "$OUT/" 2>/dev/null
fi
if has bench; then
    # shellcheck disable=SC2086
    timeout 200 python3 scripts/bench_backward.py --json "$OUT/bench_backward.json" --cfgs "${BENCH_CFGS:-}" \
        ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
    echo "bench exit $? ($((SECONDS - t0)) s)"
    tail -n 27 "$OUT/bench.log"
fi
