#!/usr/bin/env python3
"""Load a `glmcheck export` checkpoint with transformers and compare its logits with a reference.

    /work/scratch/tf-venv/bin/python tools/check_export.py OUTDIR
        [--reference fixtures/tiny/activations/prompt0.safetensors] [--dtype float32|bfloat16]
        [--tol 1e-5] [--json REPORT.json]

What it checks, in order (exit 1 if any fails, 2 if it cannot run):
1. `GlmMoeDsaForCausalLM.from_pretrained(OUTDIR, dtype=…, output_loading_info=True)` loads with no
   missing, unexpected or mismatched keys and no loading warnings (transformers' log is captured).
2. Every parameter and buffer of the loaded model equals the checkpoint's tensors (cast to the model
   dtype), the routed experts through transformers' own fusion: `experts.gate_up_proj[e]` =
   cat(`experts.{e}.gate_proj`, `experts.{e}.up_proj`), `experts.down_proj[e]` = `experts.{e}.down_proj`.
3. The forward (eager attention and experts, as the fixtures were made; no cache) on the reference's
   token ids (`token_ids` metadata, else its `input_ids` tensor) gives logits within --tol rel-L2 of
   the reference's `logits` (transformers' own dump `fixtures/tiny/activations/prompt*.safetensors`,
   or `glmcheck forward … --dump`). Also printed: max |Δ|, KL(ref‖ours) mean/max, top-1 agreement.

The reference for the F32 fixture is the transformers forward of the original checkpoint, so an export
of `tiny-F32.gguf` must match it to float rounding (~1e-6). Needs torch, safetensors and
transformers 5.23 (tools/README.md, "check_export.py").
"""

import argparse
import json
import logging
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("outdir", help="directory written by `glmcheck export`")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument(
        "--reference",
        default=os.path.join(here, "..", "fixtures", "tiny", "activations", "prompt0.safetensors"),
        help="activation dump with `logits` and the token ids (default: the tiny fixture's prompt0)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tol", type=float, default=1e-5, help="largest logits rel-L2 that passes")
    p.add_argument("--json", help="also write the measurements as JSON here")
    p.add_argument(
        "--meta",
        action="store_true",
        help="load no weights (a checkpoint too large for this machine's memory): build the model "
        "from config.json on the meta device and check that the checkpoint's names and shapes, "
        "experts fused as transformers fuses them, are exactly its state_dict's",
    )
    return p.parse_args()


class Captured(logging.Handler):
    """Collects transformers' warnings while the model loads."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load(outdir, dtype):
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    transformers.logging.set_verbosity_warning()
    handler = Captured()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        t0 = time.time()
        model, info = GlmMoeDsaForCausalLM.from_pretrained(
            outdir,
            dtype=dtype,
            output_loading_info=True,
            attn_implementation="eager",
            experts_implementation="eager",
        )
        seconds = time.time() - t0
    finally:
        logger.removeHandler(handler)
    model.eval()
    keys = {k: sorted(map(str, v)) for k, v in info.items() if isinstance(v, (list, set, tuple))}
    return model, keys, handler.messages, seconds


def checkpoint_tensors(outdir):
    from safetensors import safe_open

    with open(os.path.join(outdir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(outdir, shard), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def expected_state(ckpt, state_keys):
    """The loaded model's state_dict as the checkpoint says it must be (experts fused as
    transformers' conversion_mapping does for glm_moe_dsa)."""
    import torch

    want = {}
    for key in state_keys:
        if key in ckpt:
            want[key] = ckpt[key]
            continue
        prefix, _, leaf = key.rpartition(".experts.")
        if leaf not in ("gate_up_proj", "down_proj"):
            continue
        e = 0
        parts = []
        while f"{prefix}.experts.{e}.down_proj.weight" in ckpt:
            p = f"{prefix}.experts.{e}"
            if leaf == "gate_up_proj":
                parts.append(torch.cat([ckpt[f"{p}.gate_proj.weight"], ckpt[f"{p}.up_proj.weight"]], 0))
            else:
                parts.append(ckpt[f"{p}.down_proj.weight"])
            e += 1
        if parts:
            want[key] = torch.stack(parts)
    return want


def compare_weights(model, outdir):
    import torch

    state = model.state_dict()
    ckpt = checkpoint_tensors(outdir)
    want = expected_state(ckpt, state.keys())
    differ = []
    for k, v in state.items():
        w = want.get(k)
        if w is None:
            differ.append(f"{k}: not in the checkpoint")
        elif tuple(w.shape) != tuple(v.shape) or not torch.equal(w.to(v.dtype), v):
            differ.append(f"{k}: {tuple(v.shape)} {v.dtype} differs from the checkpoint's {tuple(w.shape)} {w.dtype}")
    return len(state), differ


def checkpoint_shapes(outdir):
    from safetensors import safe_open

    with open(os.path.join(outdir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(outdir, shard), framework="pt") as f:
            for k in f.keys():
                out[k] = tuple(f.get_slice(k).get_shape())
    return out


def fused_shapes(ckpt, state_keys):
    """The state_dict shapes the checkpoint gives, experts fused as in `expected_state`."""
    want = {}
    for key in state_keys:
        if key in ckpt:
            want[key] = ckpt[key]
            continue
        prefix, _, leaf = key.rpartition(".experts.")
        n = 0
        while f"{prefix}.experts.{n}.down_proj.weight" in ckpt:
            n += 1
        if n and leaf == "gate_up_proj":
            g, u = ckpt[f"{prefix}.experts.0.gate_proj.weight"], ckpt[f"{prefix}.experts.0.up_proj.weight"]
            want[key] = (n, g[0] + u[0], g[1])
        elif n and leaf == "down_proj":
            want[key] = (n,) + ckpt[f"{prefix}.experts.0.down_proj.weight"]
    return want


def check_meta(outdir):
    """Names and shapes only: the model built from config.json on the meta device."""
    import torch
    from transformers import AutoConfig, GlmMoeDsaForCausalLM

    config = AutoConfig.from_pretrained(outdir)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(config)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ckpt = checkpoint_shapes(outdir)
    want = fused_shapes(ckpt, state.keys())
    used = set()
    for k in state:
        if k in ckpt:
            used.add(k)
        else:
            prefix = k.rpartition(".experts.")[0]
            used.update(c for c in ckpt if c.startswith(prefix + ".experts.") and c.count(".") == k.count(".") + 2)
    differ = [f"{k}: model {s}, checkpoint {want.get(k)}" for k, s in state.items() if want.get(k) != s]
    unused = sorted(set(ckpt) - used)
    print(f"meta: {len(state)} state_dict tensors from config.json, {len(ckpt)} checkpoint tensors; "
          f"{len(differ)} missing or mis-shaped, {len(unused)} unused")
    for d in (differ + unused)[:10]:
        print(f"  {d}")
    ok = not differ and not unused
    print("check_export: " + ("pass" if ok else "FAIL"))
    return 0 if ok else 1


def reference(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        logits = f.get_tensor("logits").float()
        if "token_ids" in meta:
            ids = json.loads(meta["token_ids"])
        else:
            ids = f.get_tensor("input_ids").flatten().tolist()
    return [int(i) for i in ids], logits.reshape(len(ids), -1)


def compare_logits(model, ids, ref):
    import torch

    with torch.no_grad():
        t0 = time.time()
        out = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        seconds = time.time() - t0
    d = out - ref
    rel_l2 = (d.norm() / ref.norm()).item()
    lp_ref = torch.log_softmax(ref.double(), -1)
    lp = torch.log_softmax(out.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return {
        "tokens": len(ids),
        "rel_l2": rel_l2,
        "max_abs": d.abs().max().item(),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agree": int((out.argmax(-1) == ref.argmax(-1)).sum().item()),
        "forward_seconds": seconds,
    }


def main():
    a = parse_args()
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"check_export: {e} (see tools/README.md for the venv)", file=sys.stderr)
        return 2
    if a.meta:
        return check_meta(a.outdir)
    dtype = getattr(torch, a.dtype)
    model, keys, warnings, load_s = load(a.outdir, dtype)
    n_state, differ = compare_weights(model, a.outdir)
    ids, ref = reference(a.reference)
    logits = compare_logits(model, ids, ref)
    bad_keys = {k: v for k, v in keys.items() if v}
    result = {
        "outdir": a.outdir,
        "reference": a.reference,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": a.dtype,
        "load_seconds": load_s,
        "loading_info": keys,
        "loading_warnings": warnings,
        "state_tensors": n_state,
        "weights_differ": differ,
        "logits": logits,
        "tol": a.tol,
    }
    ok = not bad_keys and not warnings and not differ and logits["rel_l2"] <= a.tol
    result["pass"] = ok
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {a.dtype}: "
          f"loaded {a.outdir} in {load_s:.2f} s")
    for k, v in keys.items():
        print(f"  {k}: {len(v)}" + (f" {v[:5]}" if v else ""))
    print(f"  loading warnings: {len(warnings)}" + "".join(f"\n    {w}" for w in warnings[:5]))
    print(f"  {n_state} state_dict tensors, {len(differ)} differ from the checkpoint"
          + "".join(f"\n    {d}" for d in differ[:5]))
    print(f"logits over {logits['tokens']} tokens vs {a.reference}: rel-L2 {logits['rel_l2']:.3e}, "
          f"max |d| {logits['max_abs']:.3e}, KL mean {logits['kl_mean']:.3e} max {logits['kl_max']:.3e}, "
          f"top-1 {logits['top1_agree']}/{logits['tokens']} (forward {logits['forward_seconds']:.3f} s)")
    print("check_export: " + ("pass" if ok else f"FAIL (tol {a.tol:g})"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
