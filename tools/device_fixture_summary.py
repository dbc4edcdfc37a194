#!/usr/bin/env python3
"""Summarize an OUTDIR of tools/device_fixture_check.sh into reports/gpu-fixtures.{md,json}.

Usage: tools/device_fixture_summary.py OUTDIR COMMIT DATE [REPORTS_DIR [NOTE]]
Reads only the JSON files the check wrote; every number in the report is one of those.
"""
import json
import os
import sys

out, commit, date = sys.argv[1], sys.argv[2], sys.argv[3]
reports = sys.argv[4] if len(sys.argv) > 4 else "reports"
note = sys.argv[5] if len(sys.argv) > 5 else None


def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def worst_float(d):
    rows = [m for m in d.get("modules", []) if m.get("role") == "float" and m.get("rel_l2") is not None]
    return max((m["rel_l2"] for m in rows), default=None)


gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else "?"
runs = []
for q in ("", "-Q4_K_M", "-Q8_0"):
    diff = load("diff-cpu-cuda" + q)
    if not diff:
        continue
    what = "f32" if not q else f"f32, {q[1:]} GGUF (blocks on the GPU, --matmul dequant)"
    runs.append({"run": f"cuda {what} vs cpu (same binary, diff --rel-l2 1e-5)", "verdict": diff.get("verdict"),
                 "max_module_rel_l2": max((m.get("rel_l2") or 0) for m in diff.get("modules", [])),
                 "logits_kl_mean": (diff.get("logits") or {}).get("kl_mean"),
                 "logits_kl_max": (diff.get("logits") or {}).get("kl_max")})
for name, what in [("cuda-ref", "cuda f32 vs transformers f32"), ("cuda-bf16-ref", "cuda bf16 vs transformers f32"),
                   ("cuda-q4-ref", "cuda f32, Q4_K_M GGUF vs transformers f32"), ("cuda-tp8", "cuda f32 tp=8 vs unsharded"),
                   ("cuda-q8-Q4_K_M", "cuda f32 --matmul q8, Q4_K_M GGUF vs the cpu dequant dump (same-gguf bounds)"),
                   ("cuda-q8-Q4_K_M-ref", "cuda f32 --matmul q8, Q4_K_M GGUF vs transformers f32"),
                   ("cuda-q8-Q8_0", "cuda f32 --matmul q8, Q8_0 GGUF vs the cpu dequant dump (same-gguf bounds)"),
                   ("cuda-q8-Q8_0-ref", "cuda f32 --matmul q8, Q8_0 GGUF vs transformers f32")]:
    d = load(name)
    if d is None:
        runs.append({"run": what, "verdict": "failed (no JSON; see the .err file)"})
        continue
    lg = d.get("logits") or {}
    runs.append({"run": what, "verdict": d.get("verdict"), "max_module_rel_l2": worst_float(d),
                 "logits_kl_mean": lg.get("kl_mean"), "logits_kl_max": lg.get("kl_max"),
                 "top1_agree": lg.get("top1_agree"),
                 "first_divergence": (d.get("first_divergence") or {}).get("module")})
bench = {k: (load(k) or {}).get("forward_seconds") for k in ("cuda-bench", "cpu-bench")}
doc = {"gpu": gpu, "date": date, "commit": commit,
       "command": "tools/device_fixture_check.sh BINARY OUTDIR (binary: tools/build-cuda.sh)",
       "model": "fixtures/tiny/tiny-F32.gguf (and tiny-Q4_K_M), prompt0 (18 tokens)",
       "runs": runs,
       "note": note,
       "forward_ms_best_of_20": {k: (v * 1000 if v else None) for k, v in bench.items()}}
os.makedirs(reports, exist_ok=True)
with open(os.path.join(reports, "gpu-fixtures.json"), "w") as f:
    json.dump(doc, f, indent=2)
lines = [f"# CUDA forward on the fixtures ({date})", "",
         f"GPU: {gpu}. Commit {commit}. Command: `{doc['command']}`; summarized by "
         "`tools/device_fixture_summary.py`. Model: the tiny fixture (hidden 256, 3 layers): these "
         "figures check agreement, they say nothing about speed at GLM-5's size.", "",
         "| run | verdict | worst module rel-L2 | logits KL mean | KL max | top-1 | first divergence |",
         "|---|---|---|---|---|---|---|"]
fmt = lambda v: "—" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v))
for r in runs:
    lines.append("| " + " | ".join(fmt(r.get(k)) for k in
                 ("run", "verdict", "max_module_rel_l2", "logits_kl_mean", "logits_kl_max", "top1_agree", "first_divergence")) + " |")
lines += ["", "Best of 20 plain forwards of the 18-token prompt (no capture): "
          + ", ".join(f"{k} {fmt(v)} ms" for k, v in doc["forward_ms_best_of_20"].items())
          + " (the CPU side is the H200 machine's 16 cores)."]
if note:
    lines += ["", note]
with open(os.path.join(reports, "gpu-fixtures.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
