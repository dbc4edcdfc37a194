#!/usr/bin/env bash
# On the GPU machine: glmcheck's CUDA expert kernels on a real-size GLM-5 file whose blocks
# llama.cpp's own quantizer wrote (not glmcheck's synth), in one call.
#  1. llama-quantize: reused from tools/device_gpu_bench.sh's build under WORK (it builds the target
#     too), else built here CPU-only from PEERS/llama.cpp.tar.xz (~1 min on 16 cores);
#  2. glmcheck synth --dims glm5 --layers 2 --qtype q8_0 (1 dense + 1 MoE), then
#     llama-quantize --allow-requantize to Q4_K_M: llama.cpp's type mix and its Q4_K/Q6_K/... blocks;
#  3. dequant mode: the tiled expert kernel's forward against the decode-then-GEMM forward
#     (GLMCHECK_DEQUANT_EXPERTS=batched GLMCHECK_DENSE=decode: every weight decoded whole, candle's
#     decoders for the experts, then cuBLAS) of that file, module by module, 16 and 256 tokens — at
#     16 tokens the tiled forward's dense matmuls take the grouped kernel too (moe_cuda::dense_tiled);
#  4. q8 mode: the int8 expert kernel's forward against llama.cpp's MMQ (GLMCHECK_Q8_EXPERTS=mmq);
#  5. --bench 5 at 16 and 256 tokens, both modes.
# Usage: tools/device_llama_quantized_check.sh GLMCHECK OUTDIR   Env: WORK (default /tmp/gpub), PEERS
# Packs OUTDIR into $OUT/$PACK_NAME.tar.xz (default x) when OUT is set: after another script of the
# same call, set PACK_NAME=lq (say) so that neither archive replaces the other.
set -uo pipefail
bin=$(readlink -f "$1"); out=$2; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; peers=$(readlink -f "${PEERS:-target-cuda/bin}")
. "$(dirname "$0")/device_common.sh"
lq=$work/llama/build/bin/llama-quantize
if [ ! -x "$lq" ]; then
  lq=$work/lq/build/bin/llama-quantize
  mkdir -p "$work/lq" && tar -xJf "$peers/llama.cpp.tar.xz" -C "$work/lq"
  step lq-cmake 120 cmake -S "$work/lq/llama.cpp" -B "$work/lq/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CCACHE=OFF
  step lq-build 300 cmake --build "$work/lq/build" --target llama-quantize -j 16
fi
q8=$work/q8_0-2.gguf; model=$work/llama-q4_k_m-2.gguf
# The q8_0 synth and its requantization need ~20 GB. After tools/device_gpu_bench.sh on the same warm
# machine the work dir holds its HF export (~45 GB of a 64 GB disk; remade by the next pair, which
# exports again without its .done marker): removed when the disk would not hold both files.
need=$((20 * 1000 * 1000 * 1000)); avail=$(df --output=avail -B1 "$work" | tail -1)
if [ ! -f "$model" ] && [ "$avail" -lt "$need" ] && [ -d "$work/hf" ]; then
  echo "work fs avail $avail B < $need B: removing the HF export $work/hf" >> "$out/rc.txt"
  rm -rf "$work/hf"
fi
[ -f "$q8" ] || step synth 200 "$bin" synth --dims glm5 --layers 2 --qtype q8_0 --out "$q8" --force --json
[ -f "$model" ] || step quantize 300 "$lq" --allow-requantize "$q8" "$model" Q4_K_M
step inspect 60 "$bin" inspect "$model" --json
d=$work/dumps; mkdir -p "$d"; t16=$(seq -s, 1000 1015)
GLMCHECK_DEQUANT_EXPERTS=batched GLMCHECK_DENSE=decode step batched-dump 120 "$bin" forward "$model" --tokens "$t16" --device cuda \
  --dtype bf16 --matmul dequant --max-new-tokens 0 --json --dump "$d/batched.safetensors"
step tiled-vs-batched 120 "$bin" forward "$model" --tokens "$t16" --device cuda --dtype bf16 --matmul dequant \
  --max-new-tokens 0 --json --reference "$d/batched.safetensors"
t256=$(seq -s, 1000 1255)
GLMCHECK_DEQUANT_EXPERTS=batched GLMCHECK_DENSE=decode step batched-dump-256 120 "$bin" forward "$model" --tokens "$t256" --device cuda \
  --dtype bf16 --matmul dequant --max-new-tokens 0 --json --dump "$d/batched-256.safetensors"
step tiled-vs-batched-256 120 "$bin" forward "$model" --tokens "$t256" --device cuda --dtype bf16 --matmul dequant \
  --max-new-tokens 0 --json --reference "$d/batched-256.safetensors"
GLMCHECK_Q8_EXPERTS=mmq step mmq-dump 120 "$bin" forward "$model" --tokens "$t16" --device cuda --dtype bf16 \
  --matmul q8 --max-new-tokens 0 --json --dump "$d/mmq.safetensors"
step int8-vs-mmq 120 "$bin" forward "$model" --tokens "$t16" --device cuda --dtype bf16 --matmul q8 \
  --max-new-tokens 0 --json --reference "$d/mmq.safetensors"
rm -rf "$d"
for n in 16 256; do
  toks=$(seq -s, 1000 $((999 + n)))
  for mode in q8 dequant; do
    step "$mode-$n" 120 "$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul "$mode" \
      --max-new-tokens 0 --bench 5 --profile --json
  done
done
