#!/usr/bin/env python3
"""reports/gpu-dequant-<name>.{md,json} from one `glmcheck dequant FILE --device cuda --repeat 5 --json`
run on the GPU machine: per tensor above 5e7 elements and per type, decode GB/s ((quantized in +
f32 out) / best time) against a device copy of the decoded tensor in the same run ((read + write) /
best time). Usage: tools/device_dequant_summary.py DEQUANT.json GPU.csv NAME COMMIT "MODEL COMMAND"
"""
import datetime, json, sys

dq, gpu_csv, name, commit, model = sys.argv[1:6]
d = json.load(open(dq))
gpu = open(gpu_csv).read().splitlines()[1].split(",")[0]
big = [t for t in d["tensors"] if t["error"] is None and t["elements"] > 5e7]
r = {"date": datetime.date.today().isoformat(), "gpu": gpu, "commit": commit, "model": model,
     "command": "glmcheck dequant FILE --device cuda --repeat 5 --json", "types": d["types"],
     "tensors": [{k: t[k] for k in ("name", "dtype", "elements", "gbps", "copy_gbps", "seconds")} for t in big]}
json.dump(r, open(f"reports/gpu-dequant-{name}.json", "w"), indent=2)
lines = [f"# GPU dequantization of large tensors ({r['date']})", "",
         f"{gpu}, commit `{commit}`. Model: `{model}`. Command: `{r['command']}` "
         f"(produced by `tools/device_dequant_summary.py`). Decode GB/s = (quantized bytes in + f32 bytes out) / best "
         "of 5; copy GB/s = a device copy of the decoded tensor in the same run, (read + write) / best of 5. "
         "Tensors above 2^30 elements are decoded in parts (candle's kernels index with 32-bit ints). Since ac13232 "
         "Q4_0, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K are decoded by glmcheck's kernel (`gguf/cuda_decode.rs`, the same "
         "values as candle's bit for bit), other types by candle's.", "",
         "| tensor | type | elements | decode GB/s | copy GB/s | decode / copy |", "|---|---|---|---|---|---|"]
for t in big:
    lines.append(f"| {t['name']} | {t['dtype']} | {t['elements']:,} | {t['gbps']:.0f} | {t['copy_gbps']:.0f} | "
                 f"{100 * t['gbps'] / t['copy_gbps']:.0f} % |")
lines += ["", "Per type (all tensors of the type, time-weighted):", ""]
for t in d["types"]:
    lines.append(f"- {t['dtype']}: {t['tensors']} tensors, decode {t['gbps']:.0f} GB/s against copy "
                 f"{t['copy_gbps']:.0f} GB/s ({100 * t['gbps'] / t['copy_gbps']:.0f} %)")
open(f"reports/gpu-dequant-{name}.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines[-3:]))
