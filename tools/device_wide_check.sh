#!/usr/bin/env bash
# On the GPU machine, one call (~9 min on an H200): q8's wide dense route (`GLMCHECK_Q8_DENSE=wide`:
# dense matmuls past 16 tokens on glmcheck's int8 kernel, tiles up to 128 tokens) in a same-run pair
# against transformers, and against the default route (candle's stream-k MMQ) at 256 tokens.
#  0. the CUDA unit tests matching TEST_FILTERS (at most 75 s);
#  1. tools/device_gpu_bench.sh phase Q with GLMCHECK = a wrapper that sets GLMCHECK_Q8_DENSE=wide
#     (synth, glmcheck's --bench 5 forwards of both modes at 16 and 256 tokens, the HF export,
#     transformers' timings and the module agreement at 16 tokens) into OUTDIR/q: 16 tokens and
#     dequant mode run as without the wrapper (the route starts at 17 tokens);
#  2. at 256 tokens, q8: the default route's dump and the wide route's forward against it
#     (tolerance: within q8's, not bit for bit: stream-k sums k in another order), then ROUNDS
#     interleaved --bench 5 rounds of each (default-256-rR, wide-256-rR);
#  3. ncu census (every kernel's time, grid, registers) of one 256-token forward of each, with
#     what time is left.
# Usage: tools/device_wide_check.sh GLMCHECK TESTBIN OUTDIR
# Env: TEST_FILTERS, ROUNDS (2), DEADLINE (s from start, 570), GLMCHECK_COMMIT, GPU_BENCH_* as
# device_gpu_bench.sh takes them (peers under target-cuda/bin). OUT set: packs OUTDIR into
# $OUT/x.tar.xz (keep OUTDIR outside $OUT). Figures: tools/device_gpu_summary.py OUTDIR/q (the pair)
# and tools/device_ab_summary.py OUTDIR (the rest: old = default route, new = wide).
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3
mkdir -p "$out"; out=$(readlink -f "$out")
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
work=${GPU_BENCH_WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
# device_common's step with the limit capped by what is left of the call
step() {
  local name=$1 max=$2; shift 2; local l; l=$(left); [ "$max" -gt "$l" ] && max=$l
  if [ "$max" -lt 5 ]; then echo "$name skipped (deadline)" >> "$out/rc.txt"; return 99; fi
  local t0; t0=$(date +%s.%N)
  timeout "$max" "$@" > "$out/$name.json" 2> "$out/$name.log"
  local rc=$?; echo "$name rc=$rc $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> "$out/rc.txt"
}
wide=$out/glmcheck-wide
printf '#!/bin/sh\nGLMCHECK_Q8_DENSE=wide exec %s "$@"\n' "$bin" > "$wide"; chmod +x "$wide"

# 0. unit tests
# shellcheck disable=SC2086
step unit 75 "$tests" --test-threads 1 --nocapture ${TEST_FILTERS:-}
# 1. the same-run pair, the wide route in q8 mode (leaves ~2 min for the rest)
PACK=/dev/null GPU_BENCH_DEADLINE=$(($(left) - 120)) "$(dirname "$0")/device_gpu_bench.sh" "$wide" "$out/q" Q \
  > "$out/q.log" 2>&1
# 2. default against wide at 256 tokens
t256=$(seq -s, 1000 1255)
fwd=(forward "$model" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json --tokens "$t256")
if [ -f "$model" ]; then
  step old-dump-256 60 "$bin" "${fwd[@]}" --dump "$work/default-256.safetensors"
  step new-vs-old-256 60 "$wide" "${fwd[@]}" --reference "$work/default-256.safetensors"
  rm -f "$work/default-256.safetensors"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    step "old-256-r$r" 60 "$bin" "${fwd[@]}" --bench 5
    step "new-256-r$r" 60 "$wide" "${fwd[@]}" --bench 5
  done
  # 3. census (the census runs a captured forward and the timed one)
  ncu=$(command -v ncu || echo /usr/local/cuda-13.0/bin/ncu)
  census=(--metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread --csv --print-units base
    --clock-control none)
  step census-new-256 60 "$ncu" "${census[@]}" "$wide" "${fwd[@]}" --bench 1
  step census-old-256 60 "$ncu" "${census[@]}" "$bin" "${fwd[@]}" --bench 1
fi
