#!/bin/bash
# Issues 11 and 12's runs of record in one device call (about 8 minutes): the Hopper forward at
# d_head 128 beside cuDNN and FA3 (non-causal and causal), d_head 64/256 beside cuDNN, the GQA and
# seq_q != seq_k rows, the causal d_head 128 backward beside FA3, and the SM clock and board power
# of the d_head 128 pick and cuDNN (is the GPU at its power cap on these rows?). The timings are
# sustained (--sustain 0.5: the GPU at its power cap, as in a training loop).
#
# Before the call (this machine has no GPU; device time is scarce):
#   python scripts/prewarm_offdevice.py --expect-nvrtc 13.0 --cache-dir DIR   # all tables' picks
#   the FA3 wheel (flash-attn3-jax) and einops in an ignored .whl/ folder, carried with the call
# On the device (repo root):  CUPYFLASH_CACHE_DIR=DIR bash scripts/gpu_record_h100.sh
# Writes the bench JSONs and logs under $OUT (default ./out); prints the tables last.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -q . 2>&1 | tail -2
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fa3_site .whl/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/fa3_site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
B="python3 scripts/bench.py --no-overhead --iters 30 --sustain 0.5 --rounds 2 --dtypes bf16,fp16"
run() {  # name, time limit, command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"
}
run fwd_d128 150 $B --d-heads 128 --peers sdpa_flash,sdpa_cudnn,fa3 --json "$OUT/fwd_d128.json"
run fwd_d128_causal 130 $B --d-heads 128 --peers sdpa_flash,sdpa_cudnn,fa3 --causal --seqs 1k,2k,4k,8k,16k \
  --json "$OUT/fwd_d128_causal.json"
run fwd_d64_256 120 $B --d-heads 64,256 --peers sdpa_cudnn --seqs 2k,4k,16k --json "$OUT/fwd_d64_256.json"
run fwd_d64_256_causal 120 $B --d-heads 64,256 --peers sdpa_cudnn --causal --seqs 2k,4k,16k \
  --json "$OUT/fwd_d64_256_causal.json"
run fwd_gqa 60 $B --d-heads 128 --peers sdpa_cudnn,fa3 --gqa 4 --seqs 1k,4k,16k --json "$OUT/fwd_gqa.json"
run fwd_seqk 60 $B --d-heads 128 --peers sdpa_cudnn --seq-k-factor 2 --seqs 1k,4k --json "$OUT/fwd_seqk.json"
run bwd_causal 120 python3 scripts/bench.py --mode backward --d-heads 128 --dtypes bf16,fp16 --seqs 1k,4k,16k \
  --causal yes --impls cupyflash,sdpa_cudnn,fa3 --rounds 3 --reps 10 --sustain 0.5 --json "$OUT/bwd_causal.json"
PICK=$(python3 -c "from cupyflash.tuning import tuned_config; from cupyflash.config import DType
print(tuned_config(DType.BF16, 128, 4096, 4096, 0, False, 'forward_sm90'))")
run clocks 90 python3 scripts/probe_sm90_power.py clocks --cudnn --seqs 4k,16k "$PICK"
for f in fwd_d128 fwd_d128_causal fwd_d64_256 fwd_d64_256_causal fwd_gqa fwd_seqk bwd_causal clocks; do
  echo "== $f"; grep -v '^{' "$OUT/$f.log" | tail -30
done
