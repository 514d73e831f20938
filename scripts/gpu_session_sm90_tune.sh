#!/usr/bin/env bash
# One device call for the Hopper family's tuning and final table, each step under a timeout so
# the whole stays inside a few minutes (run from the repo root; this tree's cupyflash is used):
#   1. the family's GPU tests (tests/test_gpu_forward_sm90.py)
#   2. autotune forward_sm90 (d_head $D_HEADS, bf16+fp16, non-causal then causal), written as
#      the shipped default table cupyflash/tuning/default_<gpu>.forward_sm90.json; every
#      candidate's figure per bucket goes to candidates.jsonl (scripts/autotune_record.py)
#   3. bench.py: d128 bf16+fp16 non-causal and causal beside FA2, cuDNN and FA3 (when the
#      flash-attn3-jax wheel is in .whl/), d64/d256 beside cuDNN, GQA rows
# Kernels come from $CUPYFLASH_CACHE_DIR (default .out/kcache) when it was prewarmed elsewhere
# (same NVRTC major.minor and sources: the cache key holds no path), else they compile here first.
# Everything lands in $OUT/r and is packed into $OUT/results.tgz; a short summary is printed last.
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-gpu}"
R="$OUT/r"
mkdir -p "$R"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
# a cache prewarmed on another machine travels in .out/kcache (git-ignored)
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-$PWD/.out/kcache}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
d_heads="${D_HEADS:-64,128,256}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >"$R/install.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$R/gpu.txt" 2>&1
t0=$(date +%s)
deadline=$(( t0 + ${DEADLINE:-210} ))  # whole-session budget in seconds: each step gets what is left
stamp() {  # log a step and repack the results, so a session cut short still returns them
    echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$R/steps.txt"
    tar -czf "$OUT/results.tgz" -C "$OUT" r
}
limit() {  # the smaller of a step's own limit and the time left (at least 1 s)
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -lt 1 ] && left=1
    echo $(( $1 < left ? $1 : left ))
}

# The family's GPU tests first: a wrong or hanging kernel shows here, before the tuner times it.
timeout "$(limit "${TEST_TIMEOUT:-80}")" python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_forward_sm90.py >"$R/pytest.log" 2>&1
stamp "pytest rc=$?: $(tail -n 1 "$R/pytest.log")"

tune() {  # d_heads, timeout, extra autotune arguments...
    local heads=$1 limit=$2
    shift 2
    timeout "$(limit "$limit")" python3 scripts/autotune_record.py "$R/candidates.jsonl" --family forward_sm90 --d-heads "$heads" \
        --iters "${TUNE_ITERS:-8}" --finalists 3 --write-default "$@" >>"$R/autotune.log" 2>&1
    stamp "autotune d_head $heads $* rc=$?"
}
bench() {  # name, timeout, bench.py arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$(limit "$limit")" python3 scripts/bench.py --no-overhead --iters "${BENCH_ITERS:-20}" --warmup 5 --json "$R/$name.json" "$@" \
        >"$R/$name.log" 2>&1
    stamp "bench $name rc=$?"
}
# d128 first, tuned then benchmarked beside FA3; then the other head dims (the shipped table
# merges the runs); steps in order of what matters most if time runs out.
tune 128 "${TUNE_TIMEOUT:-50}"
tune 128 "${TUNE_TIMEOUT:-40}" --causal
cp cupyflash/tuning/default_*.forward_sm90.json "$R/" 2>/dev/null

bench bench_h100_sm90 60 --d-heads 128 --dtypes bf16,fp16 --peers sdpa_flash,sdpa_cudnn,fa3
bench bench_h100_sm90_causal 45 --causal --d-heads 128 --dtypes bf16,fp16 --seqs 1k,2k,4k,16k \
    --peers sdpa_flash,sdpa_cudnn,fa3 --plot ''
other=$(echo "$d_heads" | tr ',' '\n' | grep -v '^128$' | paste -sd, -)
if [ -n "$other" ]; then
    tune "$other" "${TUNE_OTHER_TIMEOUT:-70}"
    tune "$other" "${TUNE_OTHER_TIMEOUT:-55}" --causal
fi
cp cupyflash/tuning/default_*.forward_sm90.json "$R/" 2>/dev/null
bench bench_h100_sm90_d64_256 45 --d-heads 64,256 --dtypes bf16,fp16 --seqs 2k,4k,16k \
    --peers sdpa_flash,sdpa_cudnn --plot ''
bench bench_h100_sm90_gqa 35 --gqa 4 --d-heads 128 --dtypes bf16 --seqs 1k,4k,16k \
    --peers sdpa_flash,sdpa_cudnn,fa3 --plot ''

stamp "done"
grep -E "^(BF16|FP16) " "$R/autotune.log" | tail -n 72
for f in "$R"/bench_*.log; do echo "== $(basename "$f")"; grep -v '^{' "$f" | tail -n 30; done
