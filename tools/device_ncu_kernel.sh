#!/usr/bin/env bash
# On the GPU machine: Nsight Compute's full section set on the first launch of each grouped expert
# kernel of a q8 forward at 256 tokens (glmcheck's int8 kernel, then llama.cpp's MMQ with
# GLMCHECK_Q8_EXPERTS=mmq), on a 3-layer Q4_K_M GLM-5 synth (WORK keeps one). Text reports in
# OUTDIR/ncu-int8.json and ncu-mmq.json (ncu's stdout).
# Usage: tools/device_ncu_kernel.sh GLMCHECK OUTDIR   Env: WORK (default /tmp/gpub), N (tokens, 256)
set -uo pipefail
bin=$(readlink -f "$1"); out=$2; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
toks=$(seq -s, 1000 $((999 + ${N:-256})))
fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json)
step ncu-int8 240 "$ncu" --kernel-name regex:glmcheck_q8mm --launch-count "${LAUNCHES:-2}" --set full "${fwd[@]}"
GLMCHECK_Q8_EXPERTS=mmq step ncu-mmq 240 "$ncu" --kernel-name regex:glmcheck_mmq_moe --launch-count 1 --set full "${fwd[@]}"
