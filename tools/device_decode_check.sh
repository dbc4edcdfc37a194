#!/usr/bin/env bash
# On the GPU machine: glmcheck's whole-tensor CUDA decoder (cuda/dequant_gemm.cu, glmcheck_decode_whole)
# checked and timed in one call.
#  1. the library's CUDA unit tests (tools/build-cuda.sh --tests): the decoder against candle's own
#     decode bit for bit (six types, f32/f16/bf16), and the tiled expert kernel;
#  2. `glmcheck dequant --device cuda --repeat 5` on a 2-layer Q8_0 and a 3-layer Q4_K_M GLM-5 synth
#     (decode GB/s against a device copy of the decoded tensor, same run): tools/device_dequant_summary.py;
#  3. the dequant forward's time (bf16, --bench 5 --profile) at 16 and 256 tokens on the Q4_K_M synth.
# Usage: tools/device_decode_check.sh GLMCHECK TESTBIN OUTDIR   (packs OUTDIR into $OUT/x.tar.xz)
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"
. "$(dirname "$0")/device_common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.csv" 2>&1
step unit 180 "$tests" --test-threads 1 --nocapture moe_cuda
step synth-q8_0 200 "$bin" synth --dims glm5 --layers 2 --dense 1 --qtype q8_0 --out "$work/q8.gguf" --force --json
step dequant-q8_0 120 "$bin" dequant "$work/q8.gguf" --device cuda --repeat 5 --json
rm -f "$work/q8.gguf"
step synth-q4_k_m 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$work/m.gguf" --force --json
step dequant-q4_k_m 120 "$bin" dequant "$work/m.gguf" --device cuda --repeat 5 --json
for n in 16 256; do
  step "tiled-$n" 120 "$bin" forward "$work/m.gguf" --tokens "$(seq -s, 1000 $((999 + n)))" --device cuda \
    --dtype bf16 --matmul dequant --max-new-tokens 0 --bench 5 --profile --json
done
