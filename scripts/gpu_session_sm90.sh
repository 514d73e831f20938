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
python3 - <<'PY' > "$OUT/prewarm.txt" 2>&1
from cupyflash.families.forward_sm90.launch import prewarm_sm90
from cupyflash.families.forward_sm90.config_sets import get_kernel_configs
cfgs = sorted(set(get_kernel_configs("prog_all")) | set(get_kernel_configs("defaults")))
for r in prewarm_sm90(cfgs): print(r)
PY
timeout ${PLAIN_TIMEOUT:-90} python3 scripts/sanitize_sm90.py > "$OUT/sanitize_plain.txt" 2>&1; rc=$?
echo "sanitize plain rc=$rc"
if [ $rc -ne 0 ]; then tail -40 "$OUT/sanitize_plain.txt"; exit 1; fi  # wrong or hung: nothing else is worth the time
tail -2 "$OUT/sanitize_plain.txt"
timeout ${BENCH_TIMEOUT:-200} python3 scripts/bench_hopper.py --json "$OUT/bench.json" "$@" > "$OUT/bench.txt" 2>&1; echo "bench rc=$?"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x tests/test_gpu_forward_sm90.py > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$?"
tail -5 "$OUT/pytest.txt"
for tool in memcheck racecheck synccheck; do
  timeout ${SANITIZER_TIMEOUT:-60} compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_sm90.py --quick > "$OUT/sanitizer_$tool.txt" 2>&1
  echo "$tool rc=$?"; tail -2 "$OUT/sanitizer_$tool.txt"
done
python3 -c "
from cupyflash.config import DType
from cupyflash.families.forward_sm90.config_sets import default_config
from cupyflash.families.forward_sm90.launch import compile_sm90
open('$OUT/default_bf16_d128.cubin', 'wb').write(compile_sm90(default_config(DType.BF16, 128)).module.binary)"
echo "HGMMA in SASS: $(cuobjdump -sass "$OUT/default_bf16_d128.cubin" 2>&1 | grep -c HGMMA)"
grep -v '^{' "$OUT/bench.txt" | tail -40
