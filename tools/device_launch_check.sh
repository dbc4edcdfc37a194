#!/usr/bin/env bash
# On the GPU machine: the host-side and small-kernel cost of the short q8 forward, checked and timed
# in one call. Two changes, each with a switch back to the old behaviour: cudarc's per-allocation
# events off (GLMCHECK_EVENT_TRACKING=on keeps them) and q8's activations quantized straight from
# bf16 (GLMCHECK_Q8_INPUT=f32 casts them to f32 first, as before: the same Q8_1 blocks).
#  1. the CUDA unit tests of the quantizer and the int8 kernel (tools/build-cuda.sh --tests);
#  2. a 3-layer Q4_K_M GLM-5 synth (WORK keeps one): the q8 forward at 16 and 256 tokens against the
#     same forward with the f32 cast (must be identical: max |diff| 0 in every module), and the
#     16-token forward against the forward on llama.cpp's kernels only (GLMCHECK_Q8_EXPERTS=mmq,
#     GLMCHECK_Q8_DENSE=candle);
#  3. --bench 5 at 16 tokens, four settings interleaved, ROUNDS rounds (old: events on and the f32
#     cast, the previous commit's forward; f32: events off, the f32 cast; new: both changes;
#     narrow: both and GLMCHECK_Q8_DENSE=narrow), then old and new at 256 tokens twice;
#  4. ncu: every kernel of one forward with both changes at 16 and at 256 tokens (the census).
# Usage: tools/device_launch_check.sh GLMCHECK TESTBIN OUTDIR   Env: WORK (default /tmp/gpub), ROUNDS (4)
# Packs OUTDIR into $OUT/x.tar.xz when OUT is set.
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
step unit 120 "$tests" --test-threads 1 --nocapture the_bf16_quantizer the_int8_ split_k
[ -f "$model" ] || step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
t16=$(seq -s, 1000 1015); t256=$(seq -s, 1000 1255); d=$work/dumps; mkdir -p "$d"
q8=(forward "$model" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json)
for n in 16 256; do
  toks=$t16; [ "$n" = 256 ] && toks=$t256
  GLMCHECK_Q8_INPUT=f32 step "f32-dump-$n" 120 "$bin" "${q8[@]}" --tokens "$toks" --dump "$d/f32-$n.safetensors"
  step "new-vs-f32-$n" 120 "$bin" "${q8[@]}" --tokens "$toks" --reference "$d/f32-$n.safetensors"
done
GLMCHECK_Q8_EXPERTS=mmq GLMCHECK_Q8_DENSE=candle step mmq-dump-16 120 "$bin" "${q8[@]}" --tokens "$t16" \
  --dump "$d/mmq-16.safetensors"
step new-vs-mmq-16 120 "$bin" "${q8[@]}" --tokens "$t16" --reference "$d/mmq-16.safetensors"
rm -rf "$d"
variant() { # NAME → the environment of that setting
  case $1 in
    old) echo GLMCHECK_EVENT_TRACKING=on GLMCHECK_Q8_INPUT=f32 ;;
    f32) echo GLMCHECK_Q8_INPUT=f32 ;;
    new) echo GLMCHECK_UNUSED=1 ;;
    narrow) echo GLMCHECK_Q8_DENSE=narrow ;;
  esac
}
for r in $(seq 1 "${ROUNDS:-4}"); do
  for v in old f32 new narrow; do
    # shellcheck disable=SC2046
    (export $(variant "$v"); step "$v-16-r$r" 120 "$bin" "${q8[@]}" --tokens "$t16" --bench 5)
  done
done
for r in 1 2; do
  for v in old new; do
    # shellcheck disable=SC2046
    (export $(variant "$v"); step "$v-256-r$r" 120 "$bin" "${q8[@]}" --tokens "$t256" --bench 5)
  done
done
for n in 16 256; do
  toks=$t16; [ "$n" = 256 ] && toks=$t256
  step "census-new-$n" 180 "$ncu" --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
    "$bin" "${q8[@]}" --tokens "$toks" --bench 1
done
