#!/usr/bin/env bash
# On the GPU machine: the grouped MoE kernel (cuda/moe_mmq.cu) at GLM-5's real size and on the
# fixtures, in one call: synth a 3-layer Q4_K_M GLM-5 (1 dense + 2 MoE) unless WORK has one, time
# `--matmul q8` and `--matmul dequant` at 16 and 256 tokens (--bench 5 --profile), run tools/device_q8_check.sh (q8 against
# the dequant forward of the same file, f32 and bf16, module by module) and
# tools/device_fixture_check.sh (fixtures: q8 on Q4_K_M and Q8_0 stacks against the CPU dequant).
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set.
# Then the same q8 check on a 2-layer Q8_0 synth (1 dense + 1 MoE).
# Usage: tools/device_moe_grouped.sh GLMCHECK OUTDIR      Env: WORK (default /tmp/gpub), VARIANTS, NS (prompt lengths), CHECKS
set -uo pipefail
bin=$(readlink -f "$1"); out=$2; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
# VARIANTS: "name[:VAR=value[,VAR=value]]" environments to time (default: one, as built), e.g.
# "auto mmq:GLMCHECK_MOE_KERNEL=mmq mmvq:GLMCHECK_MOE_KERNEL=mmvq".
for v in ${VARIANTS:-auto}; do
  name=${v%%:*}; envs=""; [ "$v" = "$name" ] || envs=${v#*:}
  for n in ${NS:-16 256}; do
    ( [ -z "$envs" ] || export ${envs//,/ }; step "q8-$n-$name" 120 "$bin" forward "$model" --tokens "$(seq -s, 1000 $((999 + n)))" \
      --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --bench 5 --profile --json )
  done
done
# The dequant mode (batched expert decode + GEMMs) at the same lengths, bf16.
for n in ${NS:-16 256}; do
  step "dequant-$n" 120 "$bin" forward "$model" --tokens "$(seq -s, 1000 $((999 + n)))" \
    --device cuda --dtype bf16 --matmul dequant --max-new-tokens 0 --bench 5 --profile --json
done
# CHECKS: the same "name[:VAR=value]" list for the q8-vs-dequant check (default: one, as built).
for v in ${CHECKS:-auto}; do
  name=${v%%:*}; envs=""; [ "$v" = "$name" ] || envs=${v#*:}
  ( [ -z "$envs" ] || export ${envs//,/ }
    step "q8check-$name" 300 "$(dirname "$0")/device_q8_check.sh" "$bin" "$out/q8check-$name" "$model" )
done
step fixture 200 "$(dirname "$0")/device_fixture_check.sh" "$bin" "$out/fixture"
# Q8_0 expert stacks (candle's own fused kernel strode wrongly over them): a 2-layer Q8_0 synth.
q8=$work/m-q8_0.gguf
[ -f "$q8" ] || step synth-q8_0 200 "$bin" synth --dims glm5 --layers 2 --qtype q8_0 --out "$q8" --force --json
step q8check-q8_0 200 "$(dirname "$0")/device_q8_check.sh" "$bin" "$out/q8check-q8_0" "$q8"
for n in 16 256; do
  step "q8_0-q8-$n" 120 "$bin" forward "$q8" --tokens "$(seq -s, 1000 $((999 + n)))" --device cuda --dtype bf16 \
    --matmul q8 --max-new-tokens 0 --bench 5 --json
done
