#!/usr/bin/env bash
# On the GPU machine, one call: a build (NEW) against the build before it (OLD) whose change must
# keep the forward's arithmetic, on a 3-layer Q4_K_M GLM-5 synth (1 dense + 2 MoE layers):
#  1. NEW's CUDA unit tests matching TEST_FILTERS (space-separated names, as the test binary takes);
#  2. NEW's forward (MODE, default q8) at 16 and 256 tokens against OLD's dump of the same tokens:
#     `max_abs` must be 0 in every module when the change keeps the arithmetic;
#  3. --bench 5, OLD and NEW interleaved: ROUNDS rounds at 16 tokens, then at 256;
#  4. ncu census (every kernel's time, grid, registers; one forward captured and one timed) of NEW
#     at 16 and 256 tokens and of OLD at 256.
# Usage: tools/device_ab_check.sh OLD_GLMCHECK NEW_GLMCHECK NEW_TESTBIN OUTDIR
# Env: TEST_FILTERS, MODE (q8|dequant), ROUNDS (3), WORK (/tmp/gpub, keeps the synth between calls).
# Figures: tools/device_ab_summary.py OUTDIR. Packs OUTDIR into $OUT/x.tar.xz when OUT is set: keep
# OUTDIR outside $OUT (the device tool brings back only a few dozen files; the packed one always).
set -uo pipefail
old=$(readlink -f "$1"); new=$(readlink -f "$2"); tests=$(readlink -f "$3"); out=$4
mkdir -p "$out"; out=$(readlink -f "$out")
work=${WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
. "$(dirname "$0")/device_common.sh"
# shellcheck disable=SC2086
step unit 180 "$tests" --test-threads 1 --nocapture ${TEST_FILTERS:-}
[ -f "$model" ] || step synth 220 "$new" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json
fwd=(forward "$model" --device cuda --dtype bf16 --matmul "${MODE:-q8}" --max-new-tokens 0 --json)
ab_forwards "$old" "$new" "${ROUNDS:-3}" "${fwd[@]}"
t16=$(seq -s, 1000 1015); t256=$(seq -s, 1000 1255)
step census-new-16 150 "$ncu" "${census[@]}" "$new" "${fwd[@]}" --tokens "$t16" --bench 1
step census-new-256 150 "$ncu" "${census[@]}" "$new" "${fwd[@]}" --tokens "$t256" --bench 1
step census-old-256 150 "$ncu" "${census[@]}" "$old" "${fwd[@]}" --tokens "$t256" --bench 1
