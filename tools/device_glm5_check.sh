#!/usr/bin/env bash
# On the GPU machine: GLM-5 at its real dimensions. Writes a 3-layer (1 dense + 2 MoE) random-weight
# Q4_K_M GGUF with `glmcheck synth`, times the CUDA forward (weights resident, routed experts kept
# as the GGUF's blocks and dequantized when used) at 16 and 256 tokens in f32 and bf16 (best of 5,
# `--bench 5`), and compares the CPU f32 forward module by module with the CUDA f32 forward's dump.
# Usage: tools/device_glm5_check.sh GLMCHECK OUTDIR   (results: OUTDIR/*.json, *.log, times.txt)
set -uo pipefail
bin=$1; out=$2; mkdir -p "$out"
work=${GLM5_WORK:-/tmp/glm5}; mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
model=$work/glm5-3l-q4km.gguf
t16=$(seq -s, 1000 1015); t256=$(seq -s, 1000 1255)
stamp() { echo "$(date +%s.%N) $*" >> "$out/times.txt"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
stamp synth-start
GLMCHECK_PEAK_RSS=1 timeout 200 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json \
  > "$out/synth.json" 2> "$out/synth.log"
stamp synth-end
run() { # name device dtype tokens extra...
  local name=$1 dev=$2 dt=$3 toks=$4; shift 4
  stamp "$name-start"
  GLMCHECK_PEAK_RSS=1 timeout 150 "$bin" forward "$model" --tokens "$toks" --device "$dev" --dtype "$dt" \
    --max-new-tokens 0 --json "$@" > "$out/$name.json" 2> "$out/$name.log"
  echo "$name rc=$?" >> "$out/times.txt"
  stamp "$name-end"
}
run cuda-f32-16 cuda f32 "$t16" --bench 5 --dump "$work/cuda-f32-16.safetensors"
run cuda-bf16-16 cuda bf16 "$t16" --bench 5
run cuda-bf16-256 cuda bf16 "$t256" --bench 5
run cuda-f32-256 cuda f32 "$t256" --bench 5
run cpu-f32-16-vs-cuda cpu f32 "$t16" --bench 1 --reference "$work/cuda-f32-16.safetensors"
ls -la "$work" >> "$out/times.txt"
