#!/usr/bin/env bash
# Runs cargo-fuzz targets side by side in libFuzzer fork mode, then minimizes each grown corpus with
# -merge=1 and packs logs, minimized corpora and any crash/timeout/OOM inputs into OUT.
#
#   tools/fuzz_run.sh BIN_DIR SECONDS OUT TARGET:FORKS [TARGET:FORKS ...]
#   e.g. tools/fuzz_run.sh fuzz/bin 535 /tmp/out gguf_reader:12 safetensors_dump:4
#
# BIN_DIR holds the built targets (copies of fuzz/target/x86_64-unknown-linux-gnu/release/<target>,
# debug info stripped is fine). Each target starts from fuzz/corpus/<target> plus
# fuzz/regressions/<target> (run from the repository root). Executions are libFuzzer's own totals
# (the last "#N" line of each log); reports/fuzz.md records them. FUZZ_FLAGS adds libFuzzer flags
# to every fuzzing run (e.g. FUZZ_FLAGS=-max_len=8192).
set -euo pipefail
bin=$1 secs=$2 out=$3
shift 3
work=$(mktemp -d)
mkdir -p "$out"
nproc; grep -m1 'model name' /proc/cpuinfo || true
ran=()
for spec in "$@"; do
  t=${spec%%:*} forks=${spec##*:}
  ran+=("$t")
  mkdir -p "$work/$t/corpus" "$work/$t/artifacts"
  cp fuzz/corpus/"$t"/* "$work/$t/corpus/"
  if [ -d fuzz/regressions/"$t" ]; then cp fuzz/regressions/"$t"/* "$work/$t/corpus/"; fi
  (cd "$work/$t" && "$bin/$t" -fork="$forks" -max_total_time="$secs" \
      -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
      -detect_leaks=0 -rss_limit_mb=2048 -timeout=10 -artifact_prefix=artifacts/ ${FUZZ_FLAGS:-} corpus \
      >"$out/$t.log" 2>&1; echo "exit $?" >>"$out/$t.log") &
done
wait
for t in "${ran[@]}"; do
  mkdir -p "$work/$t/min"
  (cd "$work/$t" && timeout 60 "$bin/$t" -merge=1 -detect_leaks=0 -rss_limit_mb=2048 -timeout=10 \
      min corpus >merge.log 2>&1 || tail -3 merge.log) &
done
wait
for t in "${ran[@]}"; do
  echo "== $t"; grep -E '^#[0-9]+' "$out/$t.log" | tail -1
  echo "findings: $(ls "$work/$t/artifacts" | wc -l)"
  echo "minimized: $(ls "$work/$t/min" | wc -l) of $(ls "$work/$t/corpus" | wc -l)"
done
tar -C "$work" -czf "$out/corpora.tgz" "${ran[@]/%//min}"
tar -C "$work" -czf "$out/artifacts.tgz" "${ran[@]/%//artifacts}"
ls -la "$out"
