#!/usr/bin/env bash
# On the GPU machine, one call (~8-9 min on a fresh H200): choose between environment variants of
# ONE glmcheck binary, then time the winner against transformers in the same call.
#  1. tools/device_variants.sh GLMCHECK TESTBIN OUTDIR/v VARIANT… (its tests, every variant against
#     the first one's 256-token dump, ROUNDS interleaved --bench 5 rounds, an ncu census), steps
#     started until DECIDE_S (300) s (a fresh machine's synth takes ~105 s of it; at 255, build Z's
#     three variants left the census no time);
#  2. tools/device_pick_variant.py OUTDIR/v: the fastest variant within tolerance of the first, with
#     every round run and the unit step passed, else the first (chosen.txt: its environment and why);
#  3. tools/device_gpu_bench.sh phase Q with GLMCHECK under that environment (its 3-layer synth reused
#     from step 1): glmcheck's --bench 5 forwards of both modes at 16 and 256 tokens, the HF export,
#     transformers 5.23's timings (the wheels under PEERS, default target-cuda/bin), the module
#     agreement at 16 tokens; for at most PAIR_S (270) s.
# Usage: tools/device_decide_and_pair.sh GLMCHECK TESTBIN OUTDIR 'NAME:ENV…' ['NAME:…' …]
#   e.g. … /tmp/glmcheck /tmp/glmcheck-tests /tmp/d 'base:' 'runsb:GLMCHECK_DEQUANT_EXPERTS=runsb'
# Env: GLMCHECK_COMMIT, TEST_FILTERS, ROUNDS (2), UNIT_LIMIT (80), DECIDE_S, PAIR_S, PEERS, PAIR_ENV
# (VAR=V pairs added to the pair's environment only); NCU_KERNEL,
# NCU_VARIANT, NCU_LAUNCHES, SEQS and CENSUS pass through to device_variants.sh (raise DECIDE_S for
# them). A variant 'NAME:GLMCHECK_VARIANT_MATMUL=q8' runs another --matmul mode beside the
# others (its tolerance against the first's dump, its rounds, its census); it is never picked.
# OUT set: the variants packed into $OUT/x.tar.xz, the pair into $OUT/q.tar.xz, $OUT/chosen.txt.
# Figures: tools/device_variants_summary.py on x's dir, tools/device_gpu_summary.py on q's
# (reports/gpu-moe.md build Y has the checkout and carry this needs: `tools/device-trim.sh out all`).
set -uo pipefail
[ $# -ge 4 ] || { echo "usage: $0 GLMCHECK TESTBIN OUTDIR 'NAME:ENV…' ['NAME:…' …]" >&2; exit 2; }
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; shift 3
mkdir -p "$out"; out=$(readlink -f "$out")
here=$(dirname "$0")
work=${GPU_BENCH_WORK:-/tmp/gpub}
# 1. the variants (device_variants.sh packs OUTDIR/v into $OUT/x.tar.xz itself)
DEADLINE=${DECIDE_S:-300} ROUNDS=${ROUNDS:-2} UNIT_LIMIT=${UNIT_LIMIT:-80} LAYERS=3 \
  "$here/device_variants.sh" "$bin" "$tests" "$out/v" "$@"
echo "variants rc=$?" > "$out/rc.txt"
# 2. the pick
env_line=$(python3 "$here/device_pick_variant.py" "$out/v" 2> "$out/chosen.txt")
echo "env: [$env_line]" >> "$out/chosen.txt"
# shellcheck disable=SC2016
printf '#!/bin/sh\nexec env %s %s %s "$@"\n' "$env_line" "${PAIR_ENV:-}" "$bin" > "$out/glmcheck-chosen"
echo "pair env: [$env_line ${PAIR_ENV:-}]" >> "$out/chosen.txt"
[ -n "${OUT:-}" ] && cp "$out/chosen.txt" "$OUT/chosen.txt"
chmod +x "$out/glmcheck-chosen"
# 3. the pair, on the variants' synth
[ -f "$work/m.gguf" ] || { echo "no synth at $work/m.gguf: no pair" >> "$out/rc.txt"; exit 1; }
GPU_BENCH_MODEL=$work/m.gguf GPU_BENCH_DEADLINE=${PAIR_S:-270} PACK=${OUT:+$OUT/q.tar.xz} \
  "$here/device_gpu_bench.sh" "$out/glmcheck-chosen" "$out/q" Q
echo "pair rc=$?" >> "$out/rc.txt"
cat "$out/rc.txt"
