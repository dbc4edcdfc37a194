#!/usr/bin/env bash
# The CPU forward at GLM-5's real dimensions on this machine: a 2-layer synth model (1 dense + 1 MoE,
# ~8 GB Q4_K_M), 16 tokens, f32, --matmul dequant, with the peak anonymous RSS (the GGUF's mapped
# pages aside) and the peak RSS (mapped pages included). Writes reports/cpu-glm5.{md,json}.
# Usage: tools/cpu_glm5_memory.sh [MODEL [GPU_DIR]]   (MODEL: an existing `synth --dims glm5 --layers 2
#        --dense 1` file; default: written to /tmp/glm5-2l.gguf first, ~4 min on 2 cores. GPU_DIR: the
#        unpacked results of `tools/device_cpu_gpu_check.sh run`, the GPU forward of the same file
#        against this machine's dump, added to the report)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/glmcheck
[ -x "$bin" ] || cargo build --release --quiet
model=${1:-/tmp/glm5-2l.gguf}
[ -f "$model" ] || "$bin" synth --dims glm5 --layers 2 --dense 1 --qtype q4_k_m --out "$model" -q
toks=$(seq -s, 1000 1015)
log=$(mktemp); out=$(mktemp)
start=$(date +%s.%N)
GLMCHECK_PEAK_RSS=1 "$bin" forward "$model" --tokens "$toks" --max-new-tokens 0 --json > "$out" 2> "$log"
end=$(date +%s.%N)
python3 - "$model" "$log" "$out" "$start" "$end" "$(git rev-parse --short HEAD)" "$(nproc)" "$(free -g | awk '/Mem:/{print $2}')" "${2:-}" <<'PY'
import json, os, re, sys, datetime
model, log, out, start, end, commit, cores, mem, gpu = sys.argv[1:]
err = open(log).read()
rss = int(re.search(r"peak RSS (\d+) KiB", err).group(1))
anon = int(re.search(r"peak anonymous RSS (\d+) KiB", err).group(1))
fwd = json.load(open(out))
r = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": f"{cores} cores, {mem} GB RAM",
     "command": f"GLMCHECK_PEAK_RSS=1 glmcheck forward {os.path.basename(model)} --tokens 1000..1015 --max-new-tokens 0",
     "model_bytes": os.path.getsize(model), "seconds": float(end) - float(start),
     "peak_anon_gb": anon * 1024 / 1e9, "peak_rss_gb": rss * 1024 / 1e9,
     "top1": fwd["top"][0]["id"] if fwd.get("top") else None}
gpu_md = "The GPU forward of the same file: not run (no GPU_DIR given).\n"
if gpu:
    g = json.load(open(os.path.join(gpu, "gpu2l-f32-vs-cpu.json")))
    sha = lambda f: open(os.path.join(gpu, f)).read().split()[0]
    mods = [m for m in g["modules"] if m.get("rel_l2") is not None]
    worst = max(mods, key=lambda m: m["rel_l2"])
    gpu_name = open(os.path.join(gpu, "gpu.csv")).read().splitlines()[1].split(",")[0]
    r["gpu"] = {"device": gpu_name, "verdict": g["verdict"], "sha256_cpu": sha("sha-cpu.txt"),
                "sha256_gpu": sha("sha-gpu.txt"), "modules": len(mods), "worst_module": worst["name"],
                "worst_rel_l2": worst["rel_l2"], "logits_kl_mean": g["logits"]["kl_mean"],
                "logits_kl_max": g["logits"]["kl_max"], "top1_agree": g["logits"]["top1_agree"],
                "command": "tools/device_cpu_gpu_check.sh run (forward --device cuda, f32, --reference the CPU dump)"}
    same = "the same file" if r["gpu"]["sha256_cpu"] == r["gpu"]["sha256_gpu"] else "DIFFERENT files"
    gpu_md = (f"## Against the GPU forward of the same file\n\nThe {gpu_name} wrote the file again with the same `synth` "
              f"command: sha256 `{r['gpu']['sha256_gpu'][:16]}…` there, `{r['gpu']['sha256_cpu'][:16]}…` here ({same}). "
              f"`glmcheck forward --device cuda` (f32, `--matmul dequant`) against this machine's dump of the same 16 tokens: "
              f"**{g['verdict']}**, {len(mods)} modules, worst `{worst['name']}` rel-L2 {worst['rel_l2']:.2e}; logits KL mean "
              f"{g['logits']['kl_mean']:.1e}, max {g['logits']['kl_max']:.1e}, top-1 agreement {g['logits']['top1_agree']:.2f}. "
              f"Produced by `tools/device_cpu_gpu_check.sh` (prepare here, run there).\n")
json.dump(r, open("reports/cpu-glm5.json", "w"), indent=2)
open("reports/cpu-glm5.md", "w").write(f"""# The CPU forward at GLM-5's real dimensions ({r['date']})

Machine: {r['machine']}. Commit {commit}. Produced by `tools/cpu_glm5_memory.sh`.

Model: `glmcheck synth --dims glm5 --layers 2 --dense 1 --qtype q4_k_m` ({r['model_bytes']/1e9:.2f} GB: 1 dense + 1 MoE
layer with 256 experts, GLM-5's names and shapes, random weights). Command: `{r['command']}` (f32, `--matmul dequant`).

| wall s (load included) | peak anonymous RSS GB | peak RSS GB (mapped GGUF pages included) |
|---|---|---|
| {r['seconds']:.1f} | {r['peak_anon_gb']:.2f} | {r['peak_rss_gb']:.2f} |

The quantized weights stay in the GGUF's mapping and are decoded when used (row chunks of at most
256 MiB of f32; experts one at a time), so the process holds no anonymous copy of the blocks. The
peak anonymous RSS is sampled every 5 ms by glmcheck itself (`GLMCHECK_PEAK_RSS=1`); the kernel's
own peak (`VmHWM`) counts the mapped pages too.

{gpu_md}""")
print(json.dumps(r))
PY
rm -f "$log" "$out"
