#!/usr/bin/env bash
# On the GPU machine: split-K on the int8 kernel for q8's dense matmuls (GLMCHECK_Q8_DENSE=splitk),
# checked and timed in one call.
#  1. the CUDA unit tests of the int8 kernel (tools/build-cuda.sh --tests): split-K against candle's
#     own quantized matmul, the dense route, the expert kernel against MMQ;
#  2. a 3-layer Q4_K_M GLM-5 synth (WORK keeps one): the 16-token q8 forward with split-K against the
#     same forward on llama.cpp's kernels only (GLMCHECK_Q8_EXPERTS=mmq, GLMCHECK_Q8_DENSE=candle);
#  3. --bench 5 at 9, 12 and 16 tokens: default, splitk, candle;
#  4. ncu: every kernel of a --bench 1 forward at 16 tokens, default and splitk.
# Usage: tools/device_splitk_check.sh GLMCHECK TESTBIN OUTDIR   Env: WORK (default /tmp/gpub)
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set.
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
step unit 120 "$tests" --test-threads 1 --nocapture the_int8_ split_k
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
t16=$(seq -s, 1000 1015); d=$work/dumps; mkdir -p "$d"
GLMCHECK_Q8_EXPERTS=mmq GLMCHECK_Q8_DENSE=candle step mmq-dump-16 120 "$bin" forward "$model" --tokens "$t16" \
  --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json --dump "$d/mmq-16.safetensors"
GLMCHECK_Q8_DENSE=splitk step splitk-vs-mmq-16 120 "$bin" forward "$model" --tokens "$t16" --device cuda \
  --dtype bf16 --matmul q8 --max-new-tokens 0 --json --reference "$d/mmq-16.safetensors"
rm -rf "$d"
for n in 9 12 16; do
  toks=$(seq -s, 1000 $((999 + n)))
  fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --bench 5 --json)
  step "q8-$n" 120 "${fwd[@]}"
  GLMCHECK_Q8_DENSE=splitk step "splitk-$n" 120 "${fwd[@]}"
  GLMCHECK_Q8_DENSE=candle step "candle-$n" 120 "${fwd[@]}"
done
fwd=("$bin" forward "$model" --tokens "$t16" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --bench 1 --json)
step census-default-16 120 "$ncu" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none "${fwd[@]}"
GLMCHECK_Q8_DENSE=splitk step census-splitk-16 120 "$ncu" --metrics gpu__time_duration.sum --csv --print-units base \
  --clock-control none "${fwd[@]}"
