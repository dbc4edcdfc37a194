#!/usr/bin/env bash
# On the GPU machine: q8 mode's int8 expert kernel with fewer instructions per 256-value step (the
# staging copies' addresses hoisted out of the k loop, a step's row scales one row half per thread,
# the MMAs accumulating onto the float-conversion constant), against the build before it (OLD), in
# one call:
#  1. the CUDA unit tests of the int8 kernel, split-K and the bf16 quantizer (NEW's test binary);
#  2. a 3-layer Q4_K_M GLM-5 synth (WORK keeps one): NEW's q8 forward at 16 and 256 tokens against
#     OLD's dump (the arithmetic did not change: max |diff| must be 0 in every module);
#  3. --bench 5, OLD and NEW interleaved: ROUNDS rounds at 16 tokens, then at 256;
#  4. ncu: every kernel of one NEW forward at 16 and at 256 tokens (the census, per launch, in order),
#     OLD's expert launches at 256 tokens, and the speed-of-light, occupancy and launch sections of
#     one NEW and one OLD expert launch at 256 tokens.
# Usage: tools/device_int8_diet_check.sh OLD_GLMCHECK NEW_GLMCHECK NEW_TESTBIN OUTDIR
# Env: WORK (default /tmp/gpub), ROUNDS (4). Packs OUTDIR into $OUT/x.tar.xz when OUT is set.
set -uo pipefail
old=$(readlink -f "$1"); new=$(readlink -f "$2"); tests=$(readlink -f "$3"); out=$4
mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
step unit 150 "$tests" --test-threads 1 --nocapture the_bf16_quantizer the_int8_ split_k
[ -f "$model" ] || step synth 220 "$new" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
q8=(forward "$model" --device cuda --dtype bf16 --matmul q8 --max-new-tokens 0 --json)
ab_forwards "$old" "$new" "${ROUNDS:-4}" "${q8[@]}"
t16=$(seq -s, 1000 1015); t256=$(seq -s, 1000 1255)
for n in 16 256; do
  toks=$t16; [ "$n" = 256 ] && toks=$t256
  step "census-new-$n" 180 "$ncu" "${census[@]}" "$new" "${q8[@]}" --tokens "$toks" --bench 1
done
step census-old-experts-256 120 "$ncu" "${census[@]}" -k regex:glmcheck_q8mm "$old" "${q8[@]}" --tokens "$t256" \
  --bench 1
for v in old new; do
  bin=$old; [ "$v" = new ] && bin=$new
  step "sections-$v-256" 120 "$ncu" --csv --print-units base -k regex:glmcheck_q8mm --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    "$bin" "${q8[@]}" --tokens "$t256" --bench 1
done
