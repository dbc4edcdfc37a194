#!/usr/bin/env bash
# On the GPU machine: q8 mode's int8 kernel (cuda/q8_moe.cu: the routed experts, and the dense
# matmuls of 9..32 tokens) checked and timed in one call.
#  1. the library's CUDA unit tests (tools/build-cuda.sh --tests): the kernel against llama.cpp's MMQ
#     (cuda/moe_mmq.cu) for Q4_K, Q6_K and Q8_0, tiles of 8, 16 and 32 tokens; the dense route
#     against candle's own quantized matmul;
#  2. a 3-layer Q4_K_M GLM-5 synth (1 dense + 2 MoE; WORK keeps one): the q8 forward with the int8
#     kernel against the q8 forward on llama.cpp's kernels only (GLMCHECK_Q8_EXPERTS=mmq,
#     GLMCHECK_Q8_DENSE=candle) of the same file, module by module, bf16, at 16 and 256 tokens;
#  3. --bench 5 --profile at NS tokens (default 16 256): q8 int8, q8 on llama.cpp's kernels, q8 with
#     the expert tile fixed at 16 (GLMCHECK_Q8_TILE), dequant;
#  4. ncu: the grouped expert kernels at 256 tokens (int8 as chosen, int8 16 wide, MMQ), and every
#     kernel of a --bench 1 forward at 16 and 32 tokens with the int8 dense route as chosen (lm_head),
#     off (GLMCHECK_Q8_DENSE=candle) and on every dense matmul (=all): each one's time on either kernel.
# Usage: tools/device_q8_int8_check.sh GLMCHECK TESTBIN OUTDIR   Env: WORK (default /tmp/gpub), NS
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set. Summarized by tools/device_moe_summary.py.
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
step unit 120 "$tests" --test-threads 1 --nocapture the_int8_
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
d=$work/dumps; mkdir -p "$d"
for n in 16 256; do
  toks=$(seq -s, 1000 $((999 + n)))
  GLMCHECK_Q8_EXPERTS=mmq GLMCHECK_Q8_DENSE=candle step "mmq-dump-$n" 120 "$bin" forward "$model" --tokens "$toks" --device cuda \
    --dtype bf16 --matmul q8 --max-new-tokens 0 --json --dump "$d/mmq-$n.safetensors"
  step "int8-vs-mmq-$n" 120 "$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 \
    --max-new-tokens 0 --json --reference "$d/mmq-$n.safetensors"
  rm -f "$d/mmq-$n.safetensors"
done
for n in ${NS:-16 256}; do
  toks=$(seq -s, 1000 $((999 + n)))
  fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --max-new-tokens 0 --bench 5 --profile --json)
  step "q8-$n" 120 "${fwd[@]}" --matmul q8
  GLMCHECK_Q8_EXPERTS=mmq GLMCHECK_Q8_DENSE=candle step "mmq-$n" 120 "${fwd[@]}" --matmul q8
  GLMCHECK_Q8_TILE=16 step "tile16-$n" 120 "${fwd[@]}" --matmul q8
  step "tiled-$n" 120 "${fwd[@]}" --matmul dequant
done
# 4. the grouped expert kernels' own GPU time at 256 tokens (ncu, clocks as they are): int8 and MMQ.
toks=$(seq -s, 1000 1255)
fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json)
step ncu-int8-256 120 "$ncu" --kernel-name regex:glmcheck_q8mm --metrics gpu__time_duration.sum --csv \
  --print-units base --clock-control none "${fwd[@]}"
GLMCHECK_Q8_TILE=16 step ncu-tile16-256 120 "$ncu" --kernel-name regex:glmcheck_q8mm --metrics gpu__time_duration.sum \
  --csv --print-units base --clock-control none "${fwd[@]}"
GLMCHECK_Q8_EXPERTS=mmq step ncu-mmq-256 120 "$ncu" --kernel-name regex:glmcheck_mmq_moe \
  --metrics gpu__time_duration.sum --csv --print-units base --clock-control none "${fwd[@]}"
for n in 16 32; do
  toks=$(seq -s, 1000 $((999 + n)))
  fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --bench 1 --json)
  step "census-int8-$n" 120 "$ncu" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none "${fwd[@]}"
  for d in candle all; do
    GLMCHECK_Q8_DENSE=$d step "census-$d-$n" 120 "$ncu" --metrics gpu__time_duration.sum --csv --print-units base \
      --clock-control none "${fwd[@]}"
  done
done
