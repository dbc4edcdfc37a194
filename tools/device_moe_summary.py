#!/usr/bin/env python3
"""Summarise tools/device_moe_grouped.sh result dirs into reports/gpu-moe.{md,json}.

Usage: tools/device_moe_summary.py [--append] OUT_STEM LABEL=DIR [LABEL=DIR ...]
Each DIR holds q8-N[-VARIANT].json (--bench --profile; VARIANT: an environment of VARIANTS),
dequant-N.json, q8_0-q8-*.json, q8check[-VARIANT]*/ and fixture/ as the script writes them, or
tools/device_tiled_check.sh's q8-N.json, batched-N.json (dequant, decode-then-GEMM experts) and
tiled-N.json (dequant, the tiled kernel), or tools/device_q8_int8_check.sh's q8-N.json (q8, the int8
expert kernel where it applies), mmq-N.json (q8, llama.cpp's MMQ experts) and int8-vs-mmq-N.json; LABEL
names the build (a commit or a described variant). --append keeps the runs already in
OUT_STEM.json; the markdown's hand-written "## Reading these runs" section is kept.
"""
import json
import pathlib
import sys


def load(p):
    try:
        return json.loads(pathlib.Path(p).read_text())
    except (OSError, ValueError):
        return None


def bench(d, name):
    j = load(d / f"{name}.json")
    if not j or "bench" not in j:
        return None
    b = j["bench"]
    experts = sum(r["ms"] for r in b.get("profile") or [] if r["module"].endswith("mlp.experts"))
    return {"best_ms": b["best_ms"], "median_ms": b["median_ms"],
            "experts_profiled_ms": experts if b.get("profile") else None}


def check(d, sub, name):
    j = load(d / sub / f"{name}.json")
    if not j:
        return None
    lg = j.get("logits") or {}
    return {"verdict": j.get("verdict"), "kl_mean": lg.get("kl_mean"), "kl_max": lg.get("kl_max"),
            "top1": lg.get("top1_agree_count"), "positions": lg.get("positions"),
            "excluded": [len(e["positions"]) for e in (j.get("comparison") or {}).get("exclusions", [])]}


def same_file(d, n):
    """int8-vs-mmq-N.json: the int8 q8 forward against the MMQ q8 forward's dump, worst module."""
    j = load(d / f"int8-vs-mmq-{n}.json")
    if not j:
        return None
    mods = [m for m in j.get("modules") or [] if m.get("rel_l2") is not None]
    worst = max(mods, key=lambda m: m["rel_l2"], default=None)
    lg = j.get("logits") or {}
    return {"verdict": j.get("verdict"), "worst": worst and worst["name"],
            "worst_rel_l2": worst and worst["rel_l2"], "kl_max": lg.get("kl_max")}


def variants(d, prefix):
    """The variant suffixes of DIR's `{prefix}-16[-V].json` files ("" for the plain name)."""
    out = []
    for p in sorted(d.glob(f"{prefix}-16*.json")):
        v = p.stem[len(f"{prefix}-16"):].lstrip("-")
        out.append(v)
    return sorted(out, key=lambda v: (v != "", v)) or [""]


def main():
    args = sys.argv[1:]
    append = args[:1] == ["--append"]
    args = args[1:] if append else args
    stem = pathlib.Path(args[0])
    old = load(stem.with_suffix(".json")) if append else None
    runs = list((old or {}).get("runs", []))
    for arg in args[1:]:
        label, d = arg.rsplit("=", 1)
        d = pathlib.Path(d)
        gpu = (d / "gpu.txt").read_text().strip() if (d / "gpu.txt").exists() else None
        for i, v in enumerate(variants(d, "q8")):
            sfx = f"-{v}" if v else ""
            once = i == 0  # dequant and Q8_0 runs are not per variant
            sub = f"q8check{sfx}" if (d / f"q8check{sfx}").is_dir() else "q8check"
            runs.append({
                "label": f"{label} [{v}]" if v else label, "gpu": gpu,
                "q4_k_m": {n: bench(d, f"q8-{n}{sfx}") for n in (16, 64, 256)},
                "q4_k_m_dequant": {n: (bench(d, f"dequant-{n}") or bench(d, f"batched-{n}")) if once else None
                                   for n in (16, 256)},
                "q4_k_m_dequant_tiled": {n: bench(d, f"tiled-{n}") if once else None for n in (16, 256)},
                "q4_k_m_mmq": {n: bench(d, f"mmq-{n}") if once else None for n in (16, 256)},
                "int8_vs_mmq": {n: same_file(d, n) if once else None for n in (16, 256)},
                "q8_0": {n: bench(d, f"q8_0-q8-{n}") if once else None for n in (16, 256)},
                "q8_vs_dequant": {f"{m}-{dt}": check(d, s, f"q8-vs-dequant-{dt}")
                                  for m, s in (("q4_k_m", sub), ("q8_0", "q8check-q8_0"))
                                  if once or m == "q4_k_m" for dt in ("f32", "bf16")},
            })
    stem.with_suffix(".json").write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    f = lambda x, p=2: "—" if x is None else f"{x:.{p}f}"
    lines = ["| build | model, mode | tokens | best ms | median ms | experts ms (profiled) |", "|---|---|---|---|---|---|"]
    for r in runs:
        for m, name in (("q4_k_m", "q4_k_m q8"), ("q4_k_m_dequant", "q4_k_m dequant"),
                        ("q4_k_m_dequant_tiled", "q4_k_m dequant, tiled experts"),
                        ("q4_k_m_mmq", "q4_k_m q8, MMQ experts"), ("q8_0", "q8_0 q8")):
            for n, b in (r.get(m) or {}).items():
                if b:
                    lines.append(f"| {r['label']} | {name} | {n} | {f(b['best_ms'])} | {f(b['median_ms'])} | {f(b['experts_profiled_ms'])} |")
    lines += ["", "| build | q8 vs dequant | verdict | KL mean | KL max | top-1 | positions excluded (per MoE layer) |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        for k, c in (r.get("q8_vs_dequant") or {}).items():
            if c:
                lines.append(f"| {r['label']} | {k} | {c['verdict']} | {f(c['kl_mean'], 4)} | {f(c['kl_max'], 4)} | {c['top1']}/{c['positions']} | {c['excluded']} |")
    lines += ["", "| build | int8 q8 vs MMQ q8, tokens | verdict | worst module | its rel-L2 | logits KL max |", "|---|---|---|---|---|---|"]
    for r in runs:
        for n, c in (r.get("int8_vs_mmq") or {}).items():
            if c:
                lines.append(f"| {r['label']} | {n} | {c['verdict']} | {c['worst']} | {f(c['worst_rel_l2'] or 0, 7)} | {f(c['kl_max'], 7)} |")
    gpu = next((r["gpu"] for r in runs if r["gpu"]), "unknown GPU")
    head = [
        "# glmcheck's grouped MoE kernels on the GPU (`--matmul q8` and `--matmul dequant`)", "",
        f"GPU: {gpu}. Produced by `tools/device_moe_summary.py` from `tools/device_moe_grouped.sh` "
        "and `tools/device_tiled_check.sh` result dirs "
        f"({', '.join(r['label'] for r in runs)}).", "",
        "Model: `glmcheck synth --dims glm5 --layers 3 --qtype q4_k_m` (random weights, GLM-5's shapes, 1 dense + 2 MoE, "
        "13.5 GB) and `--layers 2 --qtype q8_0` (1 dense + 1 MoE). `forward --device cuda --dtype bf16 --matmul q8|dequant "
        "--max-new-tokens 0 --bench 5 [--profile]`, tokens 1000..1000+N-1; best and median of 5, load excluded. "
        "A build label's [variant] is the environment of that row (`VARIANTS` of the device script). "
        "experts ms: the `mlp.experts` modules of one `--profile` pass (device synchronized per module).", "",
        "q4_k_m q8 is glmcheck's int8 expert kernel (`cuda/q8_moe.cu`) in builds that have it, llama.cpp's MMQ "
        "(`cuda/moe_mmq.cu`) before; \"MMQ experts\" rows are the same build with `GLMCHECK_Q8_EXPERTS=mmq`.", "",
        "q8 vs dequant: `tools/device_q8_check.sh` (the q8 forward against the `--matmul dequant` dump of the same file, "
        "16 tokens), judged at other-engine bounds.", "",
    ]
    text = "\n".join(head + lines) + "\n"
    md = stem.with_suffix(".md")
    kept = md.read_text().split("\n## Reading these runs", 1) if md.exists() else []
    if len(kept) == 2:
        text += "\n## Reading these runs" + kept[1]
    md.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
