#!/usr/bin/env bash
# On the GPU machine: where one q8/dequant forward's time goes, kernel by kernel, in one call.
#  1. a 3-layer Q4_K_M GLM-5 synth (1 dense + 2 MoE; WORK keeps one);
#  2. --bench 5 at NS tokens (default 1 16 256), q8 and dequant: the wall time to compare with;
#  3. Nsight Compute (ncu, in the CUDA toolkit; the machine has no nsys) on ONE forward per token
#     count and mode: every kernel's gpu__time_duration, so the sum of kernel times can be set against
#     the wall time (the rest is launch and host work) and each module's kernels counted;
#  4. ncu's detailed sections on the first launches of the kernels named by KERNELS (regex,
#     default: the grouped expert kernels and candle's quantized matmuls) at 256 tokens, q8.
# Usage: tools/device_kernel_profile.sh GLMCHECK OUTDIR   Env: WORK (default /tmp/gpub), NS, MODES
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set. Summarized by tools/device_kernel_summary.py.
set -uo pipefail
bin=$(readlink -f "$1"); out=$2; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
for mode in ${MODES:-q8 dequant}; do
  for n in ${NS:-1 16 256}; do
    toks=$(seq -s, 1000 $((999 + n)))
    fwd=("$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 --matmul "$mode" --max-new-tokens 0)
    step "bench-$mode-$n" 120 "${fwd[@]}" --bench 5 --json
    [ "$n" -ge 16 ] || continue
    step "ncu-$mode-$n" 240 "$ncu" --metrics gpu__time_duration.sum --csv --print-units base \
      --clock-control none "${fwd[@]}" --json
  done
done
toks=$(seq -s, 1000 1255)
step "ncu-detail" 240 "$ncu" --kernel-name "regex:${KERNELS:-glmcheck_mmq_moe|mul_mat_q}" --launch-count "${LAUNCHES:-4}" \
  --set detailed --clock-control none "$bin" forward "$model" --tokens "$toks" --device cuda --dtype bf16 \
  --matmul q8 --max-new-tokens 0 --json
