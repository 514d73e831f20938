#!/usr/bin/env bash
# One device call for backward_sm90's launch knobs (lpt, pdl, dq_early), from the repository
# root, with the kernel cache prewarmed here (scripts/prewarm_offdevice.py --sets backward_sm90:all)
# and carried in .out/kcache:
#   1. GPU tests of the family (the launch knobs over the shape matrix, the defaults, GQA,
#      deterministic, autograd);
#   2. scripts/bench_sm90_backward_knobs.py: every knob set beside SDPA cuDNN in interleaved
#      rounds, and the default's preprocess / dK/dV / convert times; it names the winner;
#   3. bench.py --mode backward with cuDNN, cfg=None (the default) and the winner as the
#      backward_sm90 column;
#   4. compute-sanitizer racecheck and synccheck of the knob kernels (--quick shapes).
# Logs and JSON under $OUT (at most 8 files).
set -u
OUT=${OUT:-.out/gpu_knobs}
mkdir -p "$OUT"
export CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-$PWD/.out/kcache} PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
KNOBS="backward_sm90(BF16, 128, 64, 128, 2): dq_tma+dq_mid+lpt+pdl+dq_early"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> "$LOG" 2>&1
t0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_backward_sm90.py \
    -k "launch_knob or default or many_blocks or deterministic or agrees or autograd" > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$? $((SECONDS - t0)) s: $(tail -1 "$OUT/pytest.txt")" | tee -a "$LOG"
t0=$SECONDS
timeout 150 python3 scripts/bench_sm90_backward_knobs.py --rounds "${ROUNDS:-15}" --json "$OUT/knobs.json" \
    --winner-file "$OUT/winner.txt" > "$OUT/knobs.txt" 2>&1
echo "knobs rc=$? $((SECONDS - t0)) s" | tee -a "$LOG"
sed -n '/^dtype causal/,$p' "$OUT/knobs.txt" | tee -a "$LOG"
WINNER=$(cat "$OUT/winner.txt" 2>/dev/null || echo "$KNOBS")
rm -f "$OUT/winner.txt"
t0=$SECONDS
timeout 120 python3 scripts/bench.py --mode backward --d-heads 128 --dtypes bf16,fp16 --seqs 1k,4k,16k --causal both \
    --impls cupyflash,backward_sm90,sdpa_cudnn --sm90-config "$WINNER" --json "$OUT/bench.json" --plot '' \
    > "$OUT/bench.txt" 2>&1
echo "bench rc=$? $((SECONDS - t0)) s (backward_sm90 column: $WINNER)" | tee -a "$LOG"
grep -v "^  " "$OUT/bench.txt" | tail -25 | tee -a "$LOG"
for tool in racecheck synccheck; do
    t0=$SECONDS
    timeout 60 compute-sanitizer --tool $tool python3 scripts/sanitize_check.py --family backward_sm90 --quick \
        --sm90-configs "$KNOBS" > "$OUT/$tool.txt" 2>&1
    echo "$tool rc=$? $((SECONDS - t0)) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize' "$OUT/$tool.txt" | tail -3 | tr '\n' ' ')" | tee -a "$LOG"
done
