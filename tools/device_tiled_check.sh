#!/usr/bin/env bash
# On the GPU machine: dequant mode's tiled expert kernel (cuda/dequant_gemm.cu) checked and timed
# in one call.
#  1. the library's CUDA unit tests (tools/build-cuda.sh --tests): the kernel against candle's
#     decode-then-matmul for Q4_0, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K, bf16 and f16;
#  2. a 3-layer Q4_K_M GLM-5 synth (1 dense + 2 MoE; WORK keeps one): the tiled forward against
#     the decode-then-GEMM forward (GLMCHECK_DEQUANT_EXPERTS=batched) of the same file, module by
#     module, bf16, 16 tokens;
#  3. --bench 5 --profile at NS tokens (default 16 256): dequant tiled, dequant batched, q8.
# Usage: tools/device_tiled_check.sh GLMCHECK TESTBIN OUTDIR   Env: WORK (default /tmp/gpub), NS
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set.
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
step unit 120 "$tests" --test-threads 1 --nocapture the_tiled_dequant_kernel
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
t16=$(seq -s, 1000 1015); d=$work/dumps; mkdir -p "$d"
GLMCHECK_DEQUANT_EXPERTS=batched step batched-dump 120 "$bin" forward "$model" --tokens "$t16" --device cuda \
  --dtype bf16 --max-new-tokens 0 --json --dump "$d/batched.safetensors"
step tiled-vs-batched 120 "$bin" forward "$model" --tokens "$t16" --device cuda --dtype bf16 --max-new-tokens 0 \
  --json --reference "$d/batched.safetensors"
for n in ${NS:-16 256}; do
  toks=$(seq -s, 1000 $((999 + n)))
  step "tiled-$n" 120 "$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul dequant \
    --max-new-tokens 0 --bench 5 --profile --json
  GLMCHECK_DEQUANT_EXPERTS=batched step "batched-$n" 120 "$bin" forward "$model" --tokens "$toks" --device cuda \
    --dtype bf16 --matmul dequant --max-new-tokens 0 --bench 5 --profile --json
  step "q8-$n" 120 "$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 \
    --max-new-tokens 0 --bench 5 --profile --json
done
rm -rf "$d"
