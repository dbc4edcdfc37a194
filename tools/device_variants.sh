#!/usr/bin/env bash
# On the GPU machine, one call: several settings of ONE glmcheck binary (environment variants) on
# the same forward of the 3-layer real-size synth (or LAYERS), for a choice between routes that are
# all built in (e.g. GLMCHECK_DEQUANT_EXPERTS=one against the default tile runs, GLMCHECK_FUSED=off):
#  0. TESTBIN's tests matching TEST_FILTERS (at most 90 s; skipped when TEST_FILTERS is unset);
#  1. the synth (`synth --dims glm5 --layers ${LAYERS:-3} --qtype q4_k_m`; LAYERS=2: one MoE layer, ~half
#     the time) unless $GPU_BENCH_WORK/m.gguf (m-<LAYERS>l.gguf) exists;
#  2. at 256 tokens, --matmul MODE (dequant unless MODE=q8): the FIRST variant's dump, and every
#     other variant's forward against it (`--reference`: per-module rel-L2, max |diff|);
#  3. ROUNDS (2) interleaved `--bench 5` rounds of every variant at 256 tokens (and at 16 with
#     SEQS="16 256");
#  3b. with PROFILE=1: one `--bench 3 --profile` per variant and length (profile-<len>-<name>.json:
#     the synchronized per-module split and the unsynchronized timeline, where the GPU waited on
#     the host and a bound on its idle time);
#  4. an ncu census (every kernel's time, grid, registers) of every variant's 256-token forward (or
#     of those named in CENSUS, e.g. CENSUS="base fast");
#  5. with NCU_KERNEL (a kernel-name regex): ncu --set full on variant NCU_VARIANT's (the last)
#     first NCU_LAUNCHES (3) launches of it.
# Steps stop being started DEADLINE (570) s after the start.
# Usage: tools/device_variants.sh GLMCHECK TESTBIN OUTDIR 'NAME:ENV=V ENV=V' ['NAME:…' …]
#   a variant is a name, a colon and the environment it runs with (empty: the defaults;
#   GLMCHECK_VARIANT_MATMUL=M runs it with --matmul M instead of the script's mode), e.g.
#   tools/device_variants.sh bin/glmcheck bin/tests /tmp/v 'base:' 'one:GLMCHECK_DEQUANT_EXPERTS=one'
# OUT set: OUTDIR packed into $OUT/x.tar.xz. Figures: tools/device_variants_summary.py OUTDIR.
set -uo pipefail
bin=$(readlink -f "$1"); tests=$(readlink -f "$2"); out=$3; shift 3
[ $# -ge 1 ] || { echo "no variants" >&2; exit 2; }
mkdir -p "$out"; out=$(readlink -f "$out")
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
work=${GPU_BENCH_WORK:-/tmp/gpub}; mkdir -p "$work"; model=$work/m.gguf
# another layer count is another file: the 3-layer m.gguf is what the other device scripts reuse
[ "${LAYERS:-3}" = 3 ] || model=$work/m-${LAYERS}l.gguf
. "$(dirname "$0")/device_common.sh"
# one executable per variant (its environment set), names in order
names=()
for v in "$@"; do
  case "$v" in
    [A-Za-z0-9]*:*) ;;
    *) echo "variant '$v': NAME:ENV (a name of letters, digits, '-' or '_', a colon, then VAR=V pairs or nothing)" >&2; exit 2 ;;
  esac
  name=${v%%:*}; env=${v#*:}
  # GLMCHECK_VARIANT_MATMUL=M (not passed on): the wrapper puts M after every --matmul of its arguments
  vm=$(printf '%s\n' $env | sed -n 's/^GLMCHECK_VARIANT_MATMUL=//p'); env=$(printf '%s\n' $env | grep -v '^GLMCHECK_VARIANT_MATMUL=' | tr '\n' ' ')
  {
    echo '#!/bin/sh'
    if [ -n "$vm" ]; then
      echo "p=; for a; do shift; if [ \"\$p\" = --matmul ]; then set -- \"\$@\" $vm; else set -- \"\$@\" \"\$a\"; fi; p=\$a; done"
    fi
    printf 'exec env %s %s "$@"\n' "$env" "$bin"
  } > "$out/glmcheck-$name"; chmod +x "$out/glmcheck-$name"
  echo "$name: ${v#*:}" >> "$out/variants.txt"; names+=("$name")
done

# 0. unit tests
if [ -n "${TEST_FILTERS:-}" ]; then
  # shellcheck disable=SC2086
  step unit "${UNIT_LIMIT:-90}" "$tests" --test-threads 1 --nocapture $TEST_FILTERS
fi
# 1. the model
[ -f "$model" ] || step synth 200 "$bin" synth --dims glm5 --layers "${LAYERS:-3}" --qtype q4_k_m --out "$model" --force --json
[ -f "$model" ] || { echo "no model" >&2; exit 1; }
fwd() { echo forward "$model" --device cuda --dtype bf16 --matmul "${MODE:-dequant}" --max-new-tokens 0 --json --tokens "$(seq -s, 1000 $((999 + $1)))"; }
# 2. every variant against the first one's dump
first=${names[0]}
rm -f "$work/first-256.safetensors" # never compare against a dump an earlier call left
# shellcheck disable=SC2046
step "dump-256-$first" 60 "$out/glmcheck-$first" $(fwd 256) --dump "$work/first-256.safetensors"
for n in "${names[@]:1}"; do
  # shellcheck disable=SC2046
  MIN_S=20 step "vs-$first-256-$n" 60 "$out/glmcheck-$n" $(fwd 256) --reference "$work/first-256.safetensors"
done
rm -f "$work/first-256.safetensors"
# 3. interleaved timing rounds
for s in ${SEQS:-256}; do
  for r in $(seq 1 "${ROUNDS:-2}"); do
    for n in "${names[@]}"; do
      # shellcheck disable=SC2046
      MIN_S=8 step "bench-$s-r$r-$n" 60 "$out/glmcheck-$n" $(fwd "$s") --bench 5
    done
  done
done
# 3b. the timelines
if [ -n "${PROFILE:-}" ]; then
  for s in ${SEQS:-256}; do
    for n in "${names[@]}"; do
      # shellcheck disable=SC2046
      MIN_S=10 step "profile-$s-$n" 60 "$out/glmcheck-$n" $(fwd "$s") --bench 3 --profile
    done
  done
fi
# 4. census (of the variants named in CENSUS, default all)
for n in ${CENSUS:-${names[@]}}; do
  # shellcheck disable=SC2046
  MIN_S=25 step "census-256-$n" 75 "$ncu" "${census[@]}" "$out/glmcheck-$n" $(fwd 256) --bench 1
done
# 5. one kernel in full
if [ -n "${NCU_KERNEL:-}" ]; then
  v=${NCU_VARIANT:-${names[-1]}}
  # shellcheck disable=SC2046
  MIN_S=40 step "ncu-256-$v" 120 "$ncu" --kernel-name "regex:$NCU_KERNEL" --launch-count "${NCU_LAUNCHES:-3}" --set full \
    --print-details all --clock-control none "$out/glmcheck-$v" $(fwd 256)
fi
if grep -v ' rc=0 ' "$out/rc.txt" | grep -q .; then
  echo "steps that did not end rc=0:" >&2; grep -v ' rc=0 ' "$out/rc.txt" >&2; exit 1
fi
