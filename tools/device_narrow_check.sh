#!/usr/bin/env bash
# On the GPU machine: q8's dense matmuls with split-K on narrow grids only (GLMCHECK_Q8_DENSE=narrow)
# against the default, every-grid split-K and candle's kernels, in one call.
#  1. a 3-layer Q4_K_M GLM-5 synth (WORK keeps one): the 16-token q8 forward with narrow split-K
#     against the same forward on llama.cpp's kernels only (GLMCHECK_Q8_EXPERTS=mmq,
#     GLMCHECK_Q8_DENSE=candle);
#  2. --bench 5 at 16 tokens, the four settings interleaved, ROUNDS rounds (the machine's
#     run-to-run spread is of the size of the differences measured), then 9 and 12 tokens once.
# Usage: tools/device_narrow_check.sh GLMCHECK OUTDIR   Env: WORK (default /tmp/gpub), ROUNDS (4)
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set.
set -uo pipefail
bin=$(readlink -f "$1"); out=$2; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
t16=$(seq -s, 1000 1015); d=$work/dumps; mkdir -p "$d"
GLMCHECK_Q8_EXPERTS=mmq GLMCHECK_Q8_DENSE=candle step mmq-dump-16 120 "$bin" forward "$model" --tokens "$t16" \
  --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json --dump "$d/mmq-16.safetensors"
GLMCHECK_Q8_DENSE=narrow step narrow-vs-mmq-16 120 "$bin" forward "$model" --tokens "$t16" --device cuda \
  --dtype bf16 --matmul q8 --max-new-tokens 0 --json --reference "$d/mmq-16.safetensors"
rm -rf "$d"
for r in $(seq 1 "${ROUNDS:-4}"); do
  for n in 16 9 12; do
    [ "$n" != 16 ] && [ "$r" != 1 ] && continue
    toks=$(seq -s, 1000 $((999 + n)))
    fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --bench 5 --json)
    for v in default narrow splitk candle; do
      if [ "$v" = default ]; then step "$v-$n-r$r" 120 "${fwd[@]}"; else GLMCHECK_Q8_DENSE=$v step "$v-$n-r$r" 120 "${fwd[@]}"; fi
    done
  done
done
