#!/usr/bin/env python3
"""Summarise a tools/device_kernel_profile.sh result dir into reports/gpu-kernels.{md,json}.

Usage: tools/device_kernel_summary.py DIR [--date D] [--out-dir reports]
DIR holds bench-MODE-N.json (`forward --bench 5`: the wall time) and ncu-MODE-N.json (Nsight Compute's
CSV of gpu__time_duration for every kernel of one plain forward, glmcheck's JSON after it). The
plain forward (no --bench) also captures every module for its report, so its kernels include the
captures' own work (casts to f32, the per-expert gathers): the table splits them out by kind.
"""
import argparse
import collections
import csv
import json
import pathlib
import re

# Kernel kinds by name, first match wins.
KINDS = [
    ("routed experts", r"glmcheck_mmq_moe|glmcheck_q8mm|glmcheck_dqmm|dequantize_block|glmcheck_dequant"),
    ("quantized matmul (MMQ/MMVQ, Q8_1 quantize)", r"mul_mat_q|mul_mat_vec|quantize_mmq|quantize_q8_1|stream_k_fixup"),
    ("cuBLAS GEMM", r"nvjet|xmma|cutlass|gemv|gemm|splitKreduce"),
    ("dtype casts", r"^cast_"),
    ("copies (contiguous, cat)", r"^ucopy|^copy2d"),
    ("gathers and scatters", r"^is_|^ia_|^s_|^gather|^get_rows|^where"),
    ("norms, softmax, sort", r"rmsnorm|layernorm|softmax|asort|fast_sum|sum_"),
    ("elementwise", r"^b[a-z]+_|^u[a-z]+_|^affine|^const_set|silu|relu"),
]


def kernels(path):
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.startswith('"')]
    out = []
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            name = re.sub(r"\(.*", "", row["Kernel Name"]).replace("void ", "").strip()
            out.append((name, float(row["Metric Value"].replace(",", "")) / 1e6))
    return out


def kind(name):
    base = re.sub(r"^.*::", "", name)
    return next((k for k, pat in KINDS if re.search(pat, base)), "other")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--date", default=None)
    ap.add_argument("--out-dir", default="reports")
    a = ap.parse_args()
    d = pathlib.Path(a.dir)
    commit = (d / "commit.txt").read_text().strip() if (d / "commit.txt").exists() else "unknown"
    gpu = (d / "gpu.txt").read_text().strip() if (d / "gpu.txt").exists() else "unknown GPU"
    runs = []
    for p in sorted(d.glob("ncu-*-*.json")):
        m = re.fullmatch(r"ncu-(\w+)-(\d+)", p.stem)
        if not m:
            continue
        mode, n = m.group(1), int(m.group(2))
        ks = kernels(p)
        if not ks:
            continue
        bench = json.loads((d / f"bench-{mode}-{n}.json").read_text()).get("bench") or {}
        by_kind = collections.defaultdict(lambda: [0, 0.0])
        by_name = collections.defaultdict(lambda: [0, 0.0])
        for name, ms in ks:
            by_kind[kind(name)][0] += 1
            by_kind[kind(name)][1] += ms
            by_name[name][0] += 1
            by_name[name][1] += ms
        runs.append({
            "matmul": mode, "tokens": n, "kernels": len(ks), "kernel_ms": sum(ms for _, ms in ks),
            "bench_best_ms": bench.get("best_ms"),
            "by_kind": {k: {"launches": c, "ms": t} for k, (c, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "top": [{"kernel": k, "launches": c, "ms": t}
                    for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]],
        })
    runs.sort(key=lambda r: (r["matmul"] != "q8", r["tokens"]))
    command = ("tools/device_kernel_profile.sh GLMCHECK OUTDIR (synth --dims glm5 --layers 3 --qtype q4_k_m; "
               "forward --device cuda --dtype bf16 --matmul q8|dequant --max-new-tokens 0 --bench 5; the same "
               "forward once under ncu --metrics gpu__time_duration.sum --clock-control none)")
    out = pathlib.Path(a.out_dir)
    (out / "gpu-kernels.json").write_text(json.dumps(
        {"gpu": gpu, "date": a.date, "commit": commit, "command": command, "runs": runs}, indent=1) + "\n")
    f = lambda x: "—" if x is None else f"{x:.2f}"
    md = [
        "# Where one CUDA forward's GPU time goes, kernel by kernel", "",
        f"Date {a.date}, commit `{commit}`, GPU: {gpu}. Produced by `tools/device_kernel_summary.py` from one "
        "`tools/device_kernel_profile.sh` result dir.", "",
        "Model: `glmcheck synth --dims glm5 --layers 3 --qtype q4_k_m` (1 dense + 2 MoE, GLM-5's shapes), bf16, "
        "tokens 1000..1000+N-1. kernel ms: the sum of Nsight Compute's `gpu__time_duration` over every kernel of ONE "
        "plain `forward` (ncu serializes kernels and flushes caches between them, so each is timed cold and alone; "
        "the sum is not a wall time). That plain forward captures every module for its report: the casts to f32 and "
        "the per-expert gathers of its captures are in the `dtype casts` and `gathers` rows, which a `--bench` "
        "forward (the wall time beside it, NoCapture) does not run.", "",
        f"Command: {command}", "",
    ]
    for r in runs:
        md += [f"## --matmul {r['matmul']}, {r['tokens']} tokens: {r['kernels']} kernels, {f(r['kernel_ms'])} ms "
               f"of kernel time (bench best {f(r['bench_best_ms'])} ms wall)", "",
               "| kind | launches | ms |", "|---|---|---|"]
        md += [f"| {k} | {v['launches']} | {f(v['ms'])} |" for k, v in r["by_kind"].items()]
        md += ["", "| kernel | launches | ms |", "|---|---|---|"]
        md += [f"| `{t['kernel']}` | {t['launches']} | {f(t['ms'])} |" for t in r["top"]]
        md.append("")
    text = "\n".join(md)
    path = out / "gpu-kernels.md"
    kept = path.read_text().split("\n## Reading these runs", 1) if path.exists() else []
    if len(kept) == 2:
        text += "\n## Reading these runs" + kept[1]
    path.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
