#!/usr/bin/env bash
# One device call for a backward_sm80 config sweep: compile the candidates, time them beside SDPA
# flash (scripts/bench_backward.py --cfgs), write the fastest correct one per point into the shipped
# H100 table (scripts/backward_table_from_bench.py), run the GPU tests on it, then the issue's
# table (bench.py --mode backward) on cfg=None, i.e. on that table.
#   OUT=/tmp/out CFGS='short form|short form' bash scripts/gpu_backward_sweep.sh
# Environment: CFGS ('|'-separated bf16 short forms; each is timed in both dtypes at its d_head, on
# the non-causal points), CFGS_CAUSAL (the same for the causal points; default CFGS), SEQS (default
# 1024,2048,4096,8192,16384), REPS (default 5), TESTS (pytest -k expression, '' to skip).
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-sweep}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}"
SEQS="${SEQS:-1024,2048,4096,8192,16384}"
REPS="${REPS:-5}"
TESTS="${TESTS-double_buffered_and_pds_variants or default_config_shapes}"
t0=$SECONDS
arch=$(python3 -c "from cupyflash.device import device_arch; print(device_arch(0)[0])")
cfg_args=()
while IFS= read -r c; do [ -n "$c" ] && cfg_args+=(--config "$c"); done < <(python3 - "${CFGS:-}|${CFGS_CAUSAL:-}" <<'PY'
import sys
from cupyflash.config import DType
from cupyflash.families.backward_sm80.config import BackwardKernelConfig
for text in dict.fromkeys(filter(None, (t.strip() for t in sys.argv[1].split("|")))):
    for dt in DType:
        print(BackwardKernelConfig.parse(text).replace(dtype=dt).short_form())
PY
)
python3 scripts/prewarm_cache.py --family backward_sm80 "${cfg_args[@]}" --arch "$arch" --causal --jobs 16 \
    --quiet >"$OUT/prewarm.log" 2>&1
echo "prewarm exit $? ($((SECONDS - t0)) s): $(tail -n 2 /tmp/cupyflash-sweep-prewarm.log | head -n 1)"
for causal in no yes; do
    cfgs="${CFGS:-}"
    [ "$causal" = yes ] && cfgs="${CFGS_CAUSAL-${CFGS:-}}"
    timeout 90 python3 scripts/bench_backward.py --json "$OUT/sweep_causal_$causal.json" --cfgs "$cfgs" \
        --peers sdpa_flash --causal "$causal" --seqs "$SEQS" --warmup 2 --reps "$REPS" >"$OUT/sweep_causal_$causal.log" 2>&1
    echo "sweep causal=$causal exit $? ($((SECONDS - t0)) s)"
done
python3 scripts/backward_table_from_bench.py "$OUT"/sweep_causal_no.json "$OUT"/sweep_causal_yes.json \
    >"$OUT/pick.log" 2>&1
# one file per kind comes back from a device call (the call returns a limited number of files)
cat "$OUT"/sweep_causal_no.log "$OUT"/sweep_causal_yes.log >"$OUT/sweep.log" && rm "$OUT"/sweep_causal_*.log
python3 -c "import json, sys; json.dump([json.load(open(f)) for f in sys.argv[2:]], open(sys.argv[1], 'w'))" \
    "$OUT/sweeps.json" "$OUT"/sweep_causal_no.json "$OUT"/sweep_causal_yes.json && rm "$OUT"/sweep_causal_*.json
echo "pick exit $? ($((SECONDS - t0)) s): $(wc -l <"$OUT/pick.log") entries changed"
cp cupyflash/tuning/default_h100.backward_sm80.json "$OUT/"
if [ -n "$TESTS" ]; then
    timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu_backward.py -k "$TESTS" \
        >"$OUT/pytest.log" 2>&1
    echo "tests exit $? ($((SECONDS - t0)) s): $(tail -n 1 "$OUT/pytest.log")"
    grep -E "^FAILED|^ERROR" "$OUT/pytest.log" | head -n 10
fi
k_seqs=$(echo "$SEQS" | sed 's/16384/16k/;s/8192/8k/;s/4096/4k/;s/2048/2k/;s/1024/1k/')
timeout 120 python3 scripts/bench.py --mode backward --seqs "$k_seqs" --warmup 2 --reps "$REPS" \
    --json "$OUT/bench_mode_backward.json" --plot '' >"$OUT/bench_mode.log" 2>&1
echo "bench.py --mode backward exit $? ($((SECONDS - t0)) s)"
tail -n 48 "$OUT/bench_mode.log"
