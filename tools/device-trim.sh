#!/usr/bin/env bash
# The device tool sends the whole checkout and refuses one over 64 MiB; the tracked fixtures alone
# are ~100 MB. `tools/device-trim.sh out` moves the fixtures a GPU run does not need into
# .git/device-trim/ (never lost with the working tree), `tools/device-trim.sh in` puts them back.
# A GPU run of tools/device_fixture_check.sh needs only tiny-F32, tiny-Q4_K_M, tiny-Q8_0 and prompt0.
# `tools/device-trim.sh out all` moves those too (and the rest of fixtures/tiny/activations): a checkout
# of ~4 MB, for a call that carries the binaries and the transformers wheels (~41 MB) and runs no
# fixture (tools/device_variants.sh, tools/device_gpu_bench.sh). `in` puts back whatever is stashed.
set -euo pipefail
cd "$(dirname "$0")/.."
stash=.git/device-trim
paths=(
  fixtures/tiny/vllm033-tp8-originals fixtures/tiny/vllm033-tp8-q4km
  fixtures/tiny/vllm033-tp8-replicated-embed fixtures/tiny/vllm033-tp4-faulty
  fixtures/tiny/tiny-BF16.gguf fixtures/tiny/tiny-mtp-Q8_0.gguf fixtures/tiny/tiny-nonextn-Q8_0.gguf
  fixtures/tiny/dequant fixtures/tiny/activations/prompt1.safetensors
  fixtures/tiny/hf_kv_b_proj.safetensors fixtures/split-gguf-py fixtures/foreign fixtures/golden
  fuzz/corpus
)
if [ "${2:-}" = all ]; then
  paths+=(fixtures/tiny/tiny-F32.gguf fixtures/tiny/tiny-Q4_K_M.gguf fixtures/tiny/tiny-Q8_0.gguf)
  for f in fixtures/tiny/activations/*; do paths+=("$f"); done
fi
case "${1:-}" in
  out)
    for p in "${paths[@]}"; do
      [ -e "$p" ] || continue
      mkdir -p "$stash/$(dirname "$p")"
      mv "$p" "$stash/$p"
    done ;;
  in)
    # every file stashed, whichever level moved it
    [ -d "$stash" ] && (cd "$stash" && find . -type f) | while IFS= read -r f; do
      mkdir -p "$(dirname "$f")"
      mv "$stash/$f" "$f"
    done
    [ -d "$stash" ] && find "$stash" -depth -type d -empty -delete
    # a stash lost with its machine (a new checkout of a cut-off session): the fixtures are tracked,
    # so git has them
    git ls-files -z --deleted -- fixtures fuzz | xargs -0 -r git checkout --
    git status --short -- fixtures fuzz ;;
  *) echo "usage: $0 out [all]|in" >&2; exit 2 ;;
esac
