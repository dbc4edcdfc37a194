#!/usr/bin/env bash
# The device tool sends the whole checkout and refuses one over 64 MiB; the tracked fixtures alone
# are ~100 MB. `tools/device-trim.sh out` moves the fixtures a GPU run does not need into
# .git/device-trim/ (never lost with the working tree), `tools/device-trim.sh in` puts them back.
# A GPU run of tools/device_fixture_check.sh needs only tiny-F32, tiny-Q4_K_M, tiny-Q8_0 and prompt0.
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
case "${1:-}" in
  out)
    for p in "${paths[@]}"; do
      [ -e "$p" ] || continue
      mkdir -p "$stash/$(dirname "$p")"
      mv "$p" "$stash/$p"
    done ;;
  in)
    for p in "${paths[@]}"; do
      [ -e "$stash/$p" ] || continue
      mkdir -p "$(dirname "$p")"
      mv "$stash/$p" "$p"
    done
    git status --short -- fixtures fuzz ;;
  *) echo "usage: $0 out|in" >&2; exit 2 ;;
esac
