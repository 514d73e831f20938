#!/bin/bash
# Issues 11 and 12's runs of record, in three device calls of about 8, 8 and 4 minutes:
#   forward   the Hopper forward at d_head 128 beside SDPA flash, cuDNN and FA3 (non-causal and
#             causal), d_head 64/256 beside cuDNN, the GQA and seq_q != seq_k rows, and the SM clock
#             and board power of the d_head 128 pick and cuDNN (is the GPU at its power cap?)
#   backward  the backward table (d_head 64/128, both masks; cfg=None, backward_sm80 and the peers:
#             SDPA flash and cuDNN, FA3 at d_head 128) and the framework front ends' per-call cost
#   hdims     the backward rows at d_head 96 and 256 (cfg=None beside SDPA flash and cuDNN, both masks)
# The timings are sustained (--sustain 0.5: the GPU at its power cap, as in a training loop).
#
# Before the call (this machine has no GPU; device time is scarce):
#   python scripts/prewarm_offdevice.py --expect-nvrtc 13.0 --cache-dir DIR   # all tables' picks
#   the FA3 wheel (flash-attn3-jax) and einops in an ignored .whl/ folder, carried with the call
# On the device (repo root):  CUPYFLASH_CACHE_DIR=DIR bash scripts/gpu_record_h100.sh forward|backward|hdims|all
# Writes the bench JSONs and logs under $RECORD_DIR (default ./record), prints the tables last
# and, where the device tool's $OUT is set, packs the folder into $OUT/record_PART.tgz (the tool
# returns only a few files per call).
set -u
PART=${1:-all}
case "$PART" in forward|backward|hdims|all) ;; *) echo "usage: $0 forward|backward|hdims|all" >&2; exit 2 ;; esac
DIR=${RECORD_DIR:-record}; mkdir -p "$DIR"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -q . 2>&1 | tail -2
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fa3_site .whl/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/fa3_site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$DIR/gpu.txt"
B="python3 scripts/bench.py --no-overhead --iters 30 --sustain 0.5 --rounds 2 --dtypes bf16,fp16"
BW="python3 scripts/bench.py --mode backward --dtypes bf16,fp16 --seqs 1k,4k,16k --rounds 3 --reps 10 --sustain 0.5"
NAMES=()
run() {  # name, time limit, command...
  local name=$1 limit=$2; shift 2
  NAMES+=("$name")
  timeout "$limit" "$@" > "$DIR/$name.log" 2>&1; echo "$name rc=$?"
}
if [ "$PART" = forward ] || [ "$PART" = all ]; then
  run fwd_d128 150 $B --d-heads 128 --peers sdpa_flash,sdpa_cudnn,fa3 --json "$DIR/fwd_d128.json"
  run fwd_d128_causal 130 $B --d-heads 128 --peers sdpa_flash,sdpa_cudnn,fa3 --causal --seqs 1k,2k,4k,8k,16k \
    --json "$DIR/fwd_d128_causal.json"
  run fwd_d64_256 120 $B --d-heads 64,256 --peers sdpa_cudnn --seqs 2k,4k,16k --json "$DIR/fwd_d64_256.json"
  run fwd_d64_256_causal 120 $B --d-heads 64,256 --peers sdpa_cudnn --causal --seqs 2k,4k,16k \
    --json "$DIR/fwd_d64_256_causal.json"
  run fwd_gqa 60 $B --d-heads 128 --peers sdpa_cudnn,fa3 --gqa 4 --seqs 1k,4k,16k --json "$DIR/fwd_gqa.json"
  run fwd_seqk 60 $B --d-heads 128 --peers sdpa_cudnn --seq-k-factor 2 --seqs 1k,4k --json "$DIR/fwd_seqk.json"
  PICK=$(python3 -c "from cupyflash.tuning import tuned_config; from cupyflash.config import DType
print(tuned_config(DType.BF16, 128, 4096, 4096, 0, False, 'forward_sm90'))")
  run clocks 90 python3 scripts/probe_sm90_power.py clocks --cudnn --seqs 4k,16k "$PICK"
fi
if [ "$PART" = backward ] || [ "$PART" = all ]; then
  run bwd_d128 240 $BW --d-heads 128 --causal both --json "$DIR/bwd_d128.json"
  run bwd_d64 150 $BW --d-heads 64 --causal both --impls cupyflash,backward_sm80,sdpa_flash,sdpa_cudnn \
    --json "$DIR/bwd_d64.json"
  run frameworks 150 python3 scripts/bench_frameworks.py --rounds 5 --json "$DIR/frameworks.json"
fi
if [ "$PART" = hdims ] || [ "$PART" = all ]; then
  run bwd_d96_256 220 $BW --d-heads 96,256 --causal both --impls cupyflash,sdpa_flash,sdpa_cudnn \
    --json "$DIR/bwd_d96_256.json"
fi
for f in "${NAMES[@]}"; do
  echo "== $f"; grep -v '^{' "$DIR/$f.log" | tail -30
done
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  tar czf "$OUT/record_$PART.tgz" --exclude='*.png' -C "$DIR" . && echo "packed: $OUT/record_$PART.tgz"
fi
