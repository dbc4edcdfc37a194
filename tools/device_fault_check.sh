#!/usr/bin/env bash
# On the H200, after `tools/device_gpu_bench.sh GLMCHECK OUTDIR A` (which synthesizes the 3-layer
# GLM-5-sized model into /tmp/gpub/m.gguf and checks both matmul modes against transformers):
# behaviour faults injected at real size, bf16 on the GPU, each compared with the unfaulted forward
# of the same model; the signature named and its layer are the check.
# Usage: tools/device_fault_check.sh GLMCHECK OUTDIR [MODEL]   (then tools/device_fault_summary.py OUTDIR)
set -uo pipefail
bin=$1; out=$2; model=${3:-/tmp/gpub/m.gguf}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
T=$(seq -s, 1000 1015)
for f in router-softmax@1 mla-scale-latent@2 indexer-rope-neox@2 router-no-bias@2; do
  timeout 50 "$bin" forward "$model" --tokens "$T" --device cuda --dtype bf16 --max-new-tokens 0 \
    --fault "$f" --json > "$out/fault-$f.json" 2> "$out/fault-$f.log"
  echo "$f rc=$?" >> "$out/fault-rc.txt"
done
