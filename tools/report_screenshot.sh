#!/usr/bin/env bash
# The HTML report of a kvb-concat fixture run, rendered by headless Chromium (Debian `chromium`):
# writes reports/kvb-concat-report.{png,html}. The fixture's 4 simulated ranks hold kv_b_proj of
# layer 1 rebuilt as all heads' k_nope then all heads' v (glmcheck inject); the forward is
# compared with transformers' own dump (prompt0).
# Usage: tools/report_screenshot.sh   (needs chromium on PATH, or CHROMIUM=/path)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/glmcheck
[ -x "$bin" ] || cargo build --release --quiet
chromium=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
[ -n "$chromium" ] || { echo "no chromium on PATH (apt-get install chromium)" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
"$bin" inject -q --fault kvb-concat --layer 1 --tp 4 --out "$work/ranks" fixtures/tiny/tiny-F32.gguf
P0=294,266,220,17,10,17,30,220,468,478,68,286,262,414,13,278,286,266
"$bin" forward fixtures/tiny/tiny-F32.gguf --tokens "$P0" --max-new-tokens 0 --tp 4 \
  --weights-from "$work/ranks" --reference fixtures/tiny/activations/prompt0.safetensors \
  --report "$work/report/" -q > /dev/null || [ $? -eq 1 ]
"$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,1500 \
  --screenshot="$work/shot.png" "file://$work/report/report.html" > /dev/null 2>&1
cp "$work/shot.png" reports/kvb-concat-report.png
cp "$work/report/report.html" reports/kvb-concat-report.html
ls -la reports/kvb-concat-report.png reports/kvb-concat-report.html
