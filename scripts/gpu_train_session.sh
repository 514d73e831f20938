#!/usr/bin/env bash
# One device call for the framework operators and the training check (issue 12, part 1):
# prewarm, the per-call overhead bench, the 300-step training check, the operator tests, and the
# short training test with the time left.
#   OUT=/tmp/out bash scripts/gpu_train_session.sh [BUDGET_SECONDS]
# Logs and JSON go to $OUT; each stage prints its summary as it ends.
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-train}"
BUDGET="${1:-190}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}"
left() { echo $((BUDGET - SECONDS)); }

# the kernels the tests, the bench and the check launch (cfg=None's picks), compiled in parallel
cat >"$OUT/prewarm_train.py" <<'EOF'
import cupy
from cupyflash.api import resolve_config
from cupyflash.backward_api import _select
from cupyflash.config import DType
from cupyflash.prewarm import prewarm_for_device

if __name__ == "__main__":  # compile workers are spawned: they re-import this file
    dev = cupy.cuda.runtime.getDevice()
    cfgs = set()
    for dt in (DType.BF16, DType.FP16):
        for d in (64, 128):
            for causal in (False, True):
                for s in (77, 128, 200, 256):
                    cfgs.add(resolve_config(None, dt, d, s, s, dev, causal))
                    cfgs.add(_select(dt, d, s, s, dev, causal))
    reports = prewarm_for_device(cfgs, dev, causal=(False, True), jobs=16)
    print("prewarm:", sum(len(r.results) for r in reports), "modules,", sum(len(r.failed) for r in reports), "failed")
EOF
timeout 40 python3 "$OUT/prewarm_train.py" >"$OUT/prewarm.log" 2>&1
echo "prewarm exit $? at ${SECONDS}s: $(tail -n 1 "$OUT/prewarm.log")"

timeout "$(( $(left) < 45 ? $(left) : 45 ))" python3 scripts/bench_frameworks.py --rounds 5 --calls 300 \
    --jax-iters 100 --jax-reps 5 --json "$OUT/bench_frameworks.json" >"$OUT/bench_frameworks.log" 2>&1
echo "bench exit $? at ${SECONDS}s"
tail -n 25 "$OUT/bench_frameworks.log"

timeout "$(( $(left) < 80 ? $(left) : 80 ))" python3 scripts/train_check.py --json "$OUT/train_check.json" \
    >"$OUT/train_check.log" 2>&1
echo "train_check exit $? at ${SECONDS}s"
grep -E "^\[|training check" "$OUT/train_check.log" | grep -v "^\[.*\] loss" | tail -n 14

# GPU tests only (the CPU ones run on every machine); verbose, so a cut-off run still shows each result
timeout "$(left)" python3 -m pytest -v -rs -p no:cacheprovider -m gpu tests/test_torch_ops.py tests/test_jax_ops.py \
    >"$OUT/pytest_ops.log" 2>&1
echo "ops tests exit $? at ${SECONDS}s: $(grep -c PASSED "$OUT/pytest_ops.log") passed"
grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_ops.log" | tail -n 12

if [ "$(left)" -gt 25 ]; then
    timeout "$(left)" python3 -m pytest -q -p no:cacheprovider tests/test_train_check.py -m gpu \
        >"$OUT/pytest_train.log" 2>&1
    echo "train test exit $? at ${SECONDS}s: $(tail -n 1 "$OUT/pytest_train.log")"
fi
