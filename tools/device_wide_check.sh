#!/usr/bin/env bash
# On the GPU machine, one call (~5 min on an H100): a kernel change (NEW) against the build or the
# route before it (OLD, possibly the same binary with OLD_ENV), with a same-run pair against
# transformers:
#  0. NEW's CUDA unit tests matching TEST_FILTERS (at most 75 s);
#  1. tools/device_gpu_bench.sh phase Q with NEW (synth, glmcheck's --bench 5 forwards of both modes
#     at 16 and 256 tokens, the HF export, transformers' timings, the module agreement at 16 tokens)
#     into OUTDIR/q;
#  2. at 256 tokens, --matmul MODE (q8 unless MODE=dequant): OLD's dump and NEW's forward against it (within q8's tolerance; not bit for
#     bit when a matmul moves between kernels that sum k in another order), then ROUNDS interleaved
#     --bench 5 rounds of each (old-256-rR, new-256-rR);
#  3. ncu census (every kernel's time, grid, registers) of one 256-token forward of NEW and of OLD,
#     and of NEW with CENSUS_ENV set (census-env-256; e.g. GLMCHECK_Q8_DENSE=wide), with what time
#     is left.
#  4. with NCU_KERNEL set (a kernel-name regex): ncu --set full --print-details all on NEW's first
#     NCU_LAUNCHES (3) launches of it at 256 tokens (ncu-new-256.json: throughput, occupancy, stall
#     reasons), e.g. NCU_KERNEL=glmcheck_dqmma.
# NEW_ENV (e.g. GLMCHECK_Q8_DENSE=wide) is set for every NEW run, OLD_ENV (e.g.
# GLMCHECK_DEQUANT_EXPERTS=smem) for every OLD run (through wrappers).
# Usage: tools/device_wide_check.sh OLD_GLMCHECK NEW_GLMCHECK NEW_TESTBIN OUTDIR
# Env: TEST_FILTERS (set it: the whole test binary does not fit the 75 s), ROUNDS (2), DEADLINE (s from start, 570), MODE, NEW_ENV, OLD_ENV, CENSUS_ENV, NCU_KERNEL, NCU_LAUNCHES, PAIR (1; 0 skips
# step 1 but the synth: ~3 min less), GLMCHECK_COMMIT,
# GPU_BENCH_* as device_gpu_bench.sh takes them (peers under target-cuda/bin). OUT set: packs OUTDIR
# into $OUT/x.tar.xz (keep OUTDIR outside $OUT). Figures: tools/device_gpu_summary.py OUTDIR/q (the
# pair) and tools/device_ab_summary.py OUTDIR (the rest).
set -uo pipefail
oldbin=$(readlink -f "$1"); newbin=$(readlink -f "$2"); tests=$(readlink -f "$3"); out=$4
mkdir -p "$out"; out=$(readlink -f "$out")
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
work=${GPU_BENCH_WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
# NEW with NEW_ENV and OLD with OLD_ENV, each as one executable
new=$out/glmcheck-new old=$out/glmcheck-old
printf '#!/bin/sh\nexec env %s %s "$@"\n' "${NEW_ENV:-}" "$newbin" > "$new"; chmod +x "$new"
printf '#!/bin/sh\nexec env %s %s "$@"\n' "${OLD_ENV:-}" "$oldbin" > "$old"; chmod +x "$old"

# 0. unit tests
# shellcheck disable=SC2086
step unit 75 "$tests" --test-threads 1 --nocapture ${TEST_FILTERS:-}
# 1. the same-run pair (leaves ~2 min for the rest); PAIR=0: only the synth
if [ "${PAIR:-1}" = 1 ]; then
  PACK=/dev/null GPU_BENCH_DEADLINE=$(($(left) - 120)) "$(dirname "$0")/device_gpu_bench.sh" "$new" "$out/q" Q \
    > "$out/q.log" 2>&1
elif [ ! -f "$model" ]; then
  step synth 200 "$newbin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
fi
# 2. OLD against NEW at 256 tokens
t256=$(seq -s, 1000 1255)
fwd=(forward "$model" --device cuda --dtype bf16 --matmul "${MODE:-q8}" --max-new-tokens 0 --json --tokens "$t256")
if [ -f "$model" ]; then
  step old-dump-256 60 "$old" "${fwd[@]}" --dump "$work/old-256.safetensors"
  step new-vs-old-256 60 "$new" "${fwd[@]}" --reference "$work/old-256.safetensors"
  rm -f "$work/old-256.safetensors"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    step "old-256-r$r" 60 "$old" "${fwd[@]}" --bench 5
    step "new-256-r$r" 60 "$new" "${fwd[@]}" --bench 5
  done
  # 3. census (each runs a captured forward and the timed one)
  step census-new-256 60 "$ncu" "${census[@]}" "$new" "${fwd[@]}" --bench 1
  step census-old-256 60 "$ncu" "${census[@]}" "$old" "${fwd[@]}" --bench 1
  if [ -n "${CENSUS_ENV:-}" ]; then
    # shellcheck disable=SC2086
    step census-env-256 60 env $CENSUS_ENV "$ncu" "${census[@]}" "$new" "${fwd[@]}" --bench 1
  fi
  # 4. NCU_KERNEL (a regex of kernel names, e.g. glmcheck_dqmma): Nsight Compute's full sections,
  # stall reasons included, on NEW's first NCU_LAUNCHES (3) launches of it in a 256-token forward
  if [ -n "${NCU_KERNEL:-}" ]; then
    step ncu-new-256 120 "$ncu" --kernel-name "regex:$NCU_KERNEL" --launch-count "${NCU_LAUNCHES:-3}" --set full \
      --print-details all --clock-control none "$new" "${fwd[@]}"
  fi
fi
# a failed or skipped step makes the call's exit status say so (the results are packed either way)
if grep -v ' rc=0 ' "$out/rc.txt" | grep -q .; then
  echo "steps that did not end rc=0:" >&2; grep -v ' rc=0 ' "$out/rc.txt" >&2; exit 1
fi
