#!/usr/bin/env python3
"""CPU forward time: glmcheck's GLM-5 forward against transformers' GlmMoeDsaForCausalLM, same model
(fixtures/tiny/tiny-F32.gguf, rebuilt into the HF model with the fixture generator's own mapping),
same tokens (the two fixture prompts), same machine, same run.

  - transformers: torch CPU, threads = cores, `model(input_ids, use_cache=False)` under no_grad,
    best of --repeat (after one warm-up); its logits are checked against the fixture's first.
  - glmcheck: `glmcheck forward FILE --tokens IDS --max-new-tokens 0 --bench N --json`
    ("forward_seconds": best of N plain forwards in the process, load excluded).

Writes reports/forward.json and reports/forward.md.

Run (fixture venv of tools/README.md, after `cargo build --release`):
    /root/venvs/fixtures/bin/python tools/bench_forward.py
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "tiny"
sys.path.insert(0, str(ROOT / "tools"))


def hf_model():
    import torch
    from safetensors import safe_open
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    import make_fixtures as mf  # the generator's GGUF → HF mapping, verified when the fixtures were made

    cfg_dict = json.loads((FIX / "config.json").read_text())
    cfg = GlmMoeDsaConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "dtype")})
    model = GlmMoeDsaForCausalLM(cfg).to(torch.float32).eval()
    _, tensors = mf.read_gguf(FIX / "tiny-F32.gguf")
    gg = {t["name"]: t["array"] for t in tensors}
    # The model's own parameter names: gguf_to_hf then builds transformers' fused expert tensors.
    names = list(model.state_dict().keys())
    hf, _ = mf.gguf_to_hf(gg, names)
    missing = [n for n in names if n not in hf]
    if missing:
        sys.exit(f"HF parameters not rebuilt from the GGUF: {missing[:5]}…")
    loaded = {n: torch.from_numpy(np.ascontiguousarray(hf[n])) for n in names}
    model.load_state_dict(loaded, strict=True)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--glmcheck", default=str(ROOT / "target" / "release" / "glmcheck"))
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "reports"))
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors import safe_open

    torch.set_num_threads(os.cpu_count() or 1)
    model = hf_model()
    rows = {}
    for prompt in ("prompt0", "prompt1"):
        path = FIX / "activations" / f"{prompt}.safetensors"
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            ref_logits = f.get_tensor("lm_head").float()
        ids = json.loads(meta["token_ids"])
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x, use_cache=False).logits[0]
            err = float((logits - ref_logits).norm() / ref_logits.norm())
            if err > 1e-4:
                sys.exit(f"{prompt}: the rebuilt HF model's logits differ from the fixture's (rel-L2 {err:.2e})")
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                model(x, use_cache=False)
                best = min(best, time.perf_counter() - t0)
        cmd = [args.glmcheck, "forward", str(FIX / "tiny-F32.gguf"), "--tokens", ",".join(map(str, ids)),
               "--max-new-tokens", "0", "--bench", str(args.repeat), "--json", "-q"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"glmcheck forward failed ({p.returncode}): {p.stderr}")
        g = json.loads(p.stdout)["forward_seconds"]
        rows[prompt] = {"tokens": len(ids), "transformers_seconds": best, "glmcheck_seconds": g,
                        "ratio": best / g, "hf_logits_rel_l2_vs_fixture": err}

    version = subprocess.run([args.glmcheck, "--version"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu, "cores": os.cpu_count()},
        "command": "python tools/bench_forward.py " + " ".join(sys.argv[1:]),
        "glmcheck": version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "results": rows,
    }
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / "forward.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        "# CPU forward: glmcheck vs transformers",
        "",
        f"- date: {report['date']}",
        f"- machine: {cpu}, {os.cpu_count()} cores",
        f"- command: `{report['command']}` (glmcheck release build: `{version}`)",
        f"- transformers {transformers.__version__}, torch {torch.__version__} ({torch.get_num_threads()} threads);"
        f" best of {args.repeat} forwards each, f32, no KV cache, after a warm-up",
        "- model: fixtures/tiny (random-weight GLM-5, hidden 256, 3 layers, 8 experts); the same weights in both"
        " (the HF model is rebuilt from tiny-F32.gguf and its logits checked against the fixture's)",
        "",
        "| prompt | tokens | transformers ms | glmcheck ms | transformers / glmcheck |",
        "|---|---|---|---|---|",
    ]
    for p, r in rows.items():
        lines.append(f"| {p} | {r['tokens']} | {r['transformers_seconds'] * 1e3:.2f} | {r['glmcheck_seconds'] * 1e3:.2f} | {r['ratio']:.2f} |")
    lines += ["", "Load times are excluded on both sides (glmcheck: `--bench` times forwards in the process).", ""]
    (out / "forward.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
