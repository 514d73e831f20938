#!/usr/bin/env bash
# One device call for issue 11's d_head 64 / 256 rows (run from the repo root; this tree's
# cupyflash is used, kernels from the prewarmed $CUPYFLASH_CACHE_DIR, default .out/kcache):
#   1. GPU tests of the new knobs (tests/test_gpu_forward_sm90_knobs.py: oreg, lazy, B_c 192)
#   2. scripts/probe_sm90_d64_256.py: per grid point the table's pick, its lazy twin and the fixed
#      candidates beside SDPA cuDNN, interleaved rounds
#   3. compute-sanitizer memcheck (ragged shapes), racecheck and synccheck (many tiles per
#      persistent CTA) on the new code paths
#   4. bench.py with cfg=None (the shipped table) at d64/d256 beside SDPA flash and cuDNN, the
#      README's rows (non-causal; d64 causal too)
# STEPS picks the steps (default "tests probe sanitize bench"); PROBE_ARGS are the probe's options.
# Each step runs under a timeout inside a whole-call deadline; results are packed into
# $OUT/results.tgz after every step and a short summary is printed last.
set -uo pipefail
OUT="${OUT:-/tmp/cupyflash-gpu}"
R="${WORK:-/tmp/cupyflash-d64-256}/r"  # logs here; only results.tgz goes to $OUT (a call returns few files)
mkdir -p "$R" "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
export CUPYFLASH_CACHE_DIR="${CUPYFLASH_CACHE_DIR:-$PWD/.out/kcache}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$R/gpu.txt" 2>&1
t0=$(date +%s)
deadline=$(( t0 + ${DEADLINE:-215} ))
stamp() {
    echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$R/steps.txt"
    tar -czf "$OUT/results.tgz" -C "$(dirname "$R")" r
}
limit() {
    local left=$(( deadline - $(date +%s) ))
    [ "$left" -lt 1 ] && left=1
    echo $(( $1 < left ? $1 : left ))
}

STEPS="${STEPS:-tests probe sanitize bench}"
has() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if has tests; then
timeout "$(limit 50)" python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_forward_sm90_knobs.py >"$R/pytest.log" 2>&1
stamp "pytest rc=$?: $(tail -n 1 "$R/pytest.log")"
fi

if has probe; then
# shellcheck disable=SC2086
timeout "$(limit 110)" python3 scripts/probe_sm90_d64_256.py --json "$R/probe.json" ${PROBE_ARGS:-} >"$R/probe.log" 2>&1
stamp "probe rc=$?"
fi

if has sanitize; then
SAN="forward_sm90(BF16, 256, 128, 80, 2): tma+ws+pingpong+overlap+persistent+oreg+lazy|forward_sm90(BF16, 64, 192, 128, 2): tma+ws+pingpong+overlap+persistent+qbuf2+oreg+lazy"
timeout "$(limit 25)" compute-sanitizer --tool memcheck python3 scripts/sanitize_sm90.py \
    --configs "$SAN|forward_sm90(BF16, 64, 128, 192, 2): tma+ws+pingpong+overlap+lazy" >"$R/memcheck.log" 2>&1
stamp "memcheck rc=$?: $(grep -E 'ERROR SUMMARY|sanitize_sm90:' "$R/memcheck.log" | tr '\n' ' ')"
timeout "$(limit 25)" compute-sanitizer --tool racecheck python3 scripts/sanitize_sm90.py --multi-tile --configs "$SAN" \
    >"$R/racecheck.log" 2>&1
stamp "racecheck rc=$?: $(grep -E 'HAZARD|RACECHECK SUMMARY|sanitize_sm90:' "$R/racecheck.log" | tail -n 3 | tr '\n' ' ')"
timeout "$(limit 20)" compute-sanitizer --tool synccheck python3 scripts/sanitize_sm90.py --multi-tile --configs "$SAN" \
    >"$R/synccheck.log" 2>&1
stamp "synccheck rc=$?: $(grep -E 'ERROR SUMMARY|sanitize_sm90:' "$R/synccheck.log" | tr '\n' ' ')"
fi

if has bench; then
timeout "$(limit 45)" python3 scripts/bench.py --no-overhead --iters 20 --warmup 5 --d-heads 64,256 --dtypes bf16,fp16 \
    --seqs 2k,4k,16k --peers sdpa_flash,sdpa_cudnn --plot '' --json "$R/bench_d64_256.json" >"$R/bench_d64_256.log" 2>&1
stamp "bench d64/d256 rc=$?"
timeout "$(limit 35)" python3 scripts/bench.py --no-overhead --iters 20 --warmup 5 --causal --d-heads 64 --dtypes bf16,fp16 \
    --seqs 2k,4k,16k --peers sdpa_flash,sdpa_cudnn --plot '' --json "$R/bench_d64_causal.json" >"$R/bench_d64_causal.log" 2>&1
stamp "bench d64 causal rc=$?"
fi

stamp "done"
[ -f "$R/pytest.log" ] && tail -n 5 "$R/pytest.log"
[ -f "$R/probe.log" ] && grep -E "^best |FAIL" "$R/probe.log" | head -n 80
for f in "$R"/bench_*.log; do [ -f "$f" ] && grep -E "cupyflash |sdpa_cudnn|sdpa_flash|REFUSED|ERROR" "$f" | tail -n 40; done
