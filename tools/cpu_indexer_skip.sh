#!/usr/bin/env bash
# Here, on the CPU: what skipping the DSA indexer saves where its top-k is every key (prompts up to
# index_topk, 2048 for GLM-5) and nothing reads it, on GLM-5's real dimensions. The same binary and
# file, the default (skip) against GLMCHECK_INDEXER=always (transformers' work), ROUNDS interleaved
# runs of `forward --bench N` each; the last position's top-5 (ids and probabilities, printed to 17
# digits) of both must be equal (the unit test has the whole logits bit for bit on the tiny model).
# Usage: tools/cpu_indexer_skip.sh GLMCHECK MODEL.gguf OUTDIR   (MODEL: e.g. `glmcheck synth --dims
#   glm5 --layers 2 --dense 1 --qtype q4_k_m`, the file of reports/cpu-glm5.md)
# Env: ROUNDS (2), BENCH (3), TOKENS (16), START (1000: the first token id). Writes OUTDIR/*.json; the summary: OUTDIR/summary.json.
set -euo pipefail
bin=$(readlink -f "$1"); model=$(readlink -f "$2"); out=$3; mkdir -p "$out"
rounds=${ROUNDS:-2}; n=${BENCH:-3}; t=${TOKENS:-16}
start=${START:-1000}; toks=$(seq -s, "$start" $((start + t - 1)))
run() { # NAME ENV…: forward --bench into OUTDIR/NAME.json
  local name=$1; shift
  env "$@" "$bin" forward "$model" --tokens "$toks" --max-new-tokens 0 --bench "$n" --json > "$out/$name.json"
}
for r in $(seq 1 "$rounds"); do
  run "skip-r$r" GLMCHECK_INDEXER=
  run "always-r$r" GLMCHECK_INDEXER=always
done
python3 - "$out" "$rounds" <<'PY'
import json, sys, os
out, rounds = sys.argv[1], int(sys.argv[2])
def bench(name):
    with open(os.path.join(out, f"{name}.json")) as f:
        b = json.load(f)["bench"]
    return b["best_ms"], b["median_ms"]
s = {v: [bench(f"{v}-r{r}") for r in range(1, rounds + 1)] for v in ("skip", "always")}
def top(name):
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)["top"]
tops = [top(f"{v}-r{r}") for v in ("skip", "always") for r in range(1, rounds + 1)]
summary = {
    "best_ms": {v: [round(b, 1) for b, _ in x] for v, x in s.items()},
    "median_ms": {v: [round(m, 1) for _, m in x] for v, x in s.items()},
    "same_top5": all(t == tops[0] for t in tops),
    "top5": tops[0],
}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
PY
