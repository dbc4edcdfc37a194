#!/usr/bin/env bash
# On the GPU machine, after tools/device_gpu_bench.sh has left a synth model in its work dir: the
# q8 kernels (candle's MMVQ/MMQ, and glmcheck's grouped MoE kernel cuda/moe_mmq.cu for the expert stacks) against
# the dequant forward of the same file at GLM-5's real size, module by module (f32 and bf16), and
# GPU decode throughput per type (`dequant --device cuda`, tensors above 2^30 elements in parts).
# Usage: tools/device_q8_check.sh GLMCHECK OUTDIR [MODEL]   (MODEL default /tmp/gpub/m.gguf)
set -uo pipefail
bin=$1; out=$2; model=${3:-/tmp/gpub/m.gguf}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t16=$(seq -s, 1000 1015); d=/tmp/q8check; mkdir -p "$d"
run() { local name=$1; shift; timeout 120 "$bin" "$@" > "$out/$name.json" 2> "$out/$name.log"; echo "$name rc=$?" >> "$out/rc.txt"; }
for dt in f32 bf16; do
  run "dequant-$dt" forward "$model" --tokens "$t16" --device cuda --dtype "$dt" --max-new-tokens 0 --json --dump "$d/dequant-$dt.safetensors"
  run "q8-vs-dequant-$dt" forward "$model" --tokens "$t16" --device cuda --dtype "$dt" --matmul q8 --max-new-tokens 0 --json --reference "$d/dequant-$dt.safetensors"
done
run dequant-cuda dequant "$model" --device cuda --repeat 5 --json
rm -rf "$d"
