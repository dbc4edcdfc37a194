#!/usr/bin/env python3
"""reports/behaviour-gpu.{md,json} from the result dir of tools/device_gpu_bench.sh A plus
tools/device_fault_check.sh (the same dir): per injected behaviour fault, the first divergence,
the signature named (fault, layer, evidence) and the logits' KL; and the two unfaulted runs against
transformers (both matmul modes). Usage: tools/device_fault_summary.py RESULT_DIR [COMMIT]
(COMMIT: the commit the binary was built from, when the device copy's git HEAD is not it; pass
GLMCHECK_COMMIT to device_gpu_bench.sh to record it there instead)"""
import datetime, glob, json, os, sys

d = sys.argv[1]
def load(name):
    with open(os.path.join(d, name)) as f:
        return json.load(f)
env = open(os.path.join(d, "env.txt")).read()
commit = sys.argv[2] if len(sys.argv) > 2 else next(
    (l.split("=", 1)[1] for l in env.splitlines() if l.startswith("commit=")), "unknown")
gpu = open(os.path.join(d, "gpu.csv")).read().splitlines()[1].split(",")[0]
def row(j):
    fd = j.get("first_divergence") or {}
    sig = fd.get("signature") or {}
    lg = j.get("logits") or {}
    mods = [m for m in j.get("modules", []) if m.get("rel_l2") is not None]
    worst = max(mods, key=lambda m: m["rel_l2"]) if mods else {}
    return {"verdict": j["verdict"], "first_divergence": fd.get("module"), "layer": fd.get("layer"),
            "signature": sig.get("fault"), "signature_layer": sig.get("layer"),
            "evidence": sig.get("evidence"), "kl_mean": lg.get("kl_mean"), "kl_max": lg.get("kl_max"),
            "top1_agree": lg.get("top1_agree"), "worst_module": worst.get("name"),
            "worst_rel_l2": worst.get("rel_l2")}
faults = {}
for f in sorted(glob.glob(os.path.join(d, "fault-*.json"))):
    name = os.path.basename(f)[len("fault-"):-len(".json")]
    faults[name] = row(json.load(open(f)))
clean = {m: row(load(f"cuda-bf16-{m}-16-vs-hf.json")) for m in ("dequant", "q8")}
r = {"date": datetime.date.today().isoformat(), "gpu": gpu, "commit": commit,
     "model": "glmcheck synth --dims glm5 --layers 3 --qtype q4_k_m (1 dense + 2 MoE, random weights)",
     "command": "tools/device_gpu_bench.sh GLMCHECK OUT A; tools/device_fault_check.sh GLMCHECK OUT",
     "tokens": "1000..1015", "faults": faults, "clean_vs_transformers": clean}
json.dump(r, open("reports/behaviour-gpu.json", "w"), indent=2)
lines = [f"# Behaviour faults at GLM-5's real dimensions, on the GPU ({r['date']})", "",
         f"{gpu}, commit `{commit}`. Model: `{r['model'].split(' (')[0]}` (1 dense + 2 MoE layers, "
         "GLM-5's shapes, random weights). 16 tokens, bf16, `--matmul dequant`. Produced by "
         "`tools/device_fault_summary.py` from `tools/device_gpu_bench.sh … A` + `tools/device_fault_check.sh`.", "",
         "Each fault is injected with `forward --fault NAME@LAYER` and compared with the unfaulted forward of the same model.", "",
         "| fault | verdict | first divergence | signature named | logits KL mean / max | top-1 |", "|---|---|---|---|---|---|"]
for n, x in faults.items():
    lines.append(f"| `{n}` | {x['verdict']} | {x['first_divergence']} | {x['signature']} @ layer {x['signature_layer']} | "
                 f"{x['kl_mean']:.2e} / {x['kl_max']:.2e} | {x['top1_agree']:.2f} |")
lines += ["", "Evidence, as glmcheck words it:", ""]
lines += [f"- `{n}`: {x['evidence']}" for n, x in faults.items()]
lines += ["", "The unfaulted forward against transformers 5.23 (bf16, same weights via `export`), same run:", ""]
for m, x in clean.items():
    lines.append(f"- `--matmul {m}`: {x['verdict']}; worst `{x['worst_module']}` rel-L2 {x['worst_rel_l2']:.2e}; "
                 f"logits KL mean {x['kl_mean']:.2e}, max {x['kl_max']:.2e}; top-1 {x['top1_agree']:.2f}; no signature named.")
lines += ["", "`indexer-rope-neox` leaves the logits identical here (KL 0): 16 tokens are fewer than index_topk (2048), "
          "so the indexer's wrong top-k still selects every key; its q/k diverge and are named all the same."]
open("reports/behaviour-gpu.md", "w").write("\n".join(lines) + "\n")
print(json.dumps(r)[:400])
