#!/usr/bin/env bash
# Runs the three cargo-fuzz targets side by side in libFuzzer fork mode, then minimizes each grown
# corpus with -merge=1 and packs logs, minimized corpora and any crash/timeout/OOM inputs into OUT.
#
#   tools/fuzz_run.sh BIN_DIR SECONDS OUT [FORKS_GGUF FORKS_DUMP FORKS_TOKENIZER]
#
# A target given 0 forks is skipped. BIN_DIR holds the built targets (gguf_reader, safetensors_dump, tokenizer: copies of
# fuzz/target/x86_64-unknown-linux-gnu/release/<target>, debug info stripped is fine). Each target
# starts from fuzz/corpus/<target> (run from the repository root). Executions are libFuzzer's own
# totals (the last "#N" line of each log); reports/fuzz.md records them.
set -euo pipefail
bin=$1 secs=$2 out=$3
forks=("${4:-6}" "${5:-3}" "${6:-7}")
targets=(gguf_reader safetensors_dump tokenizer)
work=$(mktemp -d)
mkdir -p "$out"
nproc; grep -m1 'model name' /proc/cpuinfo || true
for i in 0 1 2; do
  t=${targets[$i]}
  [ "${forks[$i]}" = 0 ] && continue
  mkdir -p "$work/$t/corpus" "$work/$t/artifacts"
  cp fuzz/corpus/"$t"/* "$work/$t/corpus/"
  if [ -d fuzz/regressions/"$t" ]; then cp fuzz/regressions/"$t"/* "$work/$t/corpus/"; fi
  (cd "$work/$t" && "$bin/$t" -fork="${forks[$i]}" -max_total_time="$secs" \
      -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 \
      -detect_leaks=0 -rss_limit_mb=2048 -timeout=10 -artifact_prefix=artifacts/ corpus \
      >"$out/$t.log" 2>&1; echo "exit $?" >>"$out/$t.log") &
done
wait
ran=()
for t in "${targets[@]}"; do
  [ -d "$work/$t" ] || continue
  ran+=("$t")
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
