#!/usr/bin/env python3
"""transformers' GLM-5 forward as the peer of `glmcheck forward`: times it, records GPU memory and the
routing, measures the device's copy bandwidth, and optionally writes a hook dump that
`glmcheck forward --reference` reads. Prints one JSON object (also written to --out).

    PYTHONPATH=/tmp/tf523 python3 tools/hf_bench.py HF_DIR --seq 16,256 --dump hf-16.safetensors

HF_DIR is what `glmcheck export FILE.gguf --hf HF_DIR --dtype bf16` writes (model-*.safetensors, the
index, config.json); it is loaded with `GlmMoeDsaForCausalLM.from_pretrained(HF_DIR, dtype=...,
attn_implementation="sdpa", device_map=DEVICE)`. `--random-from-config CONFIG.json` builds the model
from a config with random weights instead (to exercise the script without an export).

Timing, for each --seq N: tokens 1000..1000+N-1 (as tools/device_glm5_check.sh gives glmcheck;
`--token-start` moves them, `--tokens` gives them outright), batch 1, `use_cache=False`, under
`torch.no_grad()`; --warmup forwards, then --repeat timed ones, each between two
`torch.cuda.synchronize()` (wall clock, perf_counter); median and min in ms. Peak GPU memory is
`torch.cuda.max_memory_allocated()` (the caching allocator's high-water mark; not nvidia-smi's).
Routing: on one forward per N, how many distinct routed experts each MoE layer used (forward hooks on
the routers): an input for the lower bound of the bytes a forward must read.

Copy bandwidth (--copy-gib, default 4; 0 skips it): a device-to-device `dst.copy_(src)` of that many
GiB, one warm-up, best of 5 timed with CUDA events. Reported both ways: `copy_gbps_rw` counts bytes
read + written (2 x size / time: the convention of the issue's "Device copy 4.12 TB/s" and of the
device notes' "4.3 TB/s counting bytes read and written"), `copy_gbps_oneway` counts the size once.

Dump (--dump OUT.safetensors; tokens of the first --seq unless --tokens): one forward with hooks on
every module, written exactly as tools/make_fixtures.py writes fixtures/tiny/activations/prompt*.
safetensors (the port of its `capture_activations`): key = HF module path (`logits` for the root),
`path#n` for the n-th further call of a module, tuple element i > 0 under `path.i`, the router's
`.topk_weights`/`.topk_indices`, the indexer's recomputed `.q`, `.k`, `.head_weights`,
`.index_scores` and the attention's `.query_states`, `.key_states`, `.value_states`, `.k_rot`;
batch dimension dropped (not for `.mlp.gate`/`.mlp.experts`, which already work on flattened
tokens), floats as float32, integers as int64, bools as uint8; `input_ids` and `position_ids`
tensors; metadata `token_ids`, `execution_order`, `call_order`, `transformers`, `torch`, `dtype`,
`attn_implementation`, `experts_implementation`, `batch_dim_dropped`, `int_dtype`,
`add_special_tokens`. glmcheck reads the token ids from `input_ids`/`token_ids`, the order from
`execution_order`, and takes the routed experts' `act_fn#n` rows as slot-major because the
`transformers` key is there. The dump forward switches to the eager experts loop (the only one that
calls `experts.act_fn` once per expert, which the per-expert keys need) and, by default, to eager
attention (as the fixtures; `--dump-attn sdpa` keeps SDPA); both are switched back afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

# Loading a 3-layer real-size model into an 80 GB H100 ran out of memory in transformers' weight
# conversion (gate and up concatenated, 12 GiB at a time) with 30 GiB reserved but unallocated
# (2026-12-07, e9aa729): expandable segments let freed blocks serve the next allocation. Set before
# torch is imported; an explicit setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

DTYPES = {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}


def log(msg: str) -> None:
    print(f"[hf_bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="HF checkpoint directory (glmcheck export --hf)")
    ap.add_argument("--random-from-config", metavar="CONFIG.json",
                    help="random weights from this config instead of a checkpoint")
    ap.add_argument("--seed", type=int, default=0, help="torch seed for --random-from-config")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation for loading and timing (default sdpa)")
    ap.add_argument("--experts", default=None,
                    help="experts_implementation for timing (default: transformers' choice, grouped_mm where it can)")
    ap.add_argument("--seq", default="16,256", help="comma-separated prompt lengths to time")
    ap.add_argument("--token-start", type=int, default=1000, help="ids are token-start..token-start+N-1")
    ap.add_argument("--tokens", help="explicit comma-separated ids for the dump (and timed as their own length)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copy-gib", type=float, default=None,
                    help="device-copy size in GiB (default 4 on CUDA, 0 = skip; on CPU default 0)")
    ap.add_argument("--dump", metavar="OUT.safetensors", help="write the hook dump of one forward")
    ap.add_argument("--dump-attn", default="eager", help="attention implementation for the dump forward")
    ap.add_argument("--expect-version", default="5.23.",
                    help="refuse to run unless transformers.__version__ starts with this ('' = any)")
    ap.add_argument("--out", help="also write the JSON here")
    return ap.parse_args(argv)


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(torch, device, gib: float, reps: int = 5) -> dict:
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    times = []
    if device.type == "cuda":
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    best = min(times)
    ok = bool(torch.equal(dst[:1024], src[:1024]))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": n, "best_s": best, "times_s": times, "copy_gbps_rw": 2 * n / best / 1e9,
            "copy_gbps_oneway": n / best / 1e9, "verified": ok,
            "method": "torch dst.copy_(src) device-to-device, uint8, 1 warm-up, best of %d (CUDA events)" % reps}


def load_model(args, torch, device, dtype):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    kw = {"attn_implementation": args.attn}
    if args.experts:
        kw["experts_implementation"] = args.experts
    t0 = time.perf_counter()
    if args.random_from_config:
        cfg_dict = json.loads(Path(args.random_from_config).read_text())
        cfg_dict = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "dtype", "transformers_version")}
        cfg = GlmMoeDsaConfig(**cfg_dict)
        torch.manual_seed(args.seed)
        model = GlmMoeDsaForCausalLM._from_config(cfg, dtype=dtype, **kw)
        model = model.to(device)
        source = f"random weights from {args.random_from_config} (seed {args.seed})"
        loading_info = {}
    else:
        if not args.model_dir:
            sys.exit("give MODEL_DIR or --random-from-config")
        kw["output_loading_info"] = True
        try:
            model, info = GlmMoeDsaForCausalLM.from_pretrained(args.model_dir, dtype=dtype, device_map=str(device), **kw)
        except ValueError as e:  # device_map needs accelerate; without it load on the host, then move
            if "accelerate" not in str(e):
                raise
            log(f"no device_map ({e}); loading on the host and moving to {device}")
            model, info = GlmMoeDsaForCausalLM.from_pretrained(args.model_dir, dtype=dtype, **kw)
            model = model.to(device)
        # weights the checkpoint did not provide are randomly initialised: say so, loudly
        loading_info = {k: sorted(str(x) for x in v)[:50] for k, v in info.items() if v}
        if loading_info:
            log(f"loading info (missing/unexpected/mismatched): {loading_info}")
        source = args.model_dir
    model.eval()
    sync(torch, device)
    return model, source, time.perf_counter() - t0, loading_info


def experts_impl(model):
    try:
        return model.get_experts_implementation().get("")
    except Exception:  # older API
        return getattr(model.config, "_experts_implementation", None)


def routing_hooks(model, store):
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mm

    hs = []
    for name, mod in model.named_modules():
        if isinstance(mod, mm.GlmMoeDsaTopkRouter):
            def hook(m, a, out, name=name):
                store[name] = int(out[2].unique().numel())
            hs.append(mod.register_forward_hook(hook))
    return hs


def time_forward(args, torch, model, device, ids) -> dict:
    x = torch.tensor([ids], dtype=torch.long, device=device)
    routing: dict[str, int] = {}
    with torch.no_grad():
        hs = routing_hooks(model, routing)
        try:
            model(input_ids=x, use_cache=False)
        finally:
            for h in hs:
                h.remove()
        for _ in range(max(args.warmup - 1, 0)):
            model(input_ids=x, use_cache=False)
        sync(torch, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.repeat):
            sync(torch, device)
            t0 = time.perf_counter()
            out = model(input_ids=x, use_cache=False)
            sync(torch, device)
            times.append(time.perf_counter() - t0)
        logits = out.logits[0].float()
        finite = bool(torch.isfinite(logits).all())
    r = {"seq": len(ids), "token_ids_first_last": [ids[0], ids[-1]],
         "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
         "times_ms": [t * 1e3 for t in times], "logits_finite": finite,
         "argmax_last": int(logits[-1].argmax()),
         "distinct_experts_per_moe_layer": routing}
    if device.type == "cuda":
        r["peak_gpu_bytes_during_forwards"] = torch.cuda.max_memory_allocated(device)
    return r


# ------------------------------------------------------------------------------------------------
# Hook dump: port of tools/make_fixtures.py capture_activations (same keys, shapes, dtypes, metadata),
# with the ids given instead of a tokenizer, tensors on the model's device, values copied to the host.
# ------------------------------------------------------------------------------------------------
def capture(model, ids, device):
    import torch
    from transformers.utils import ModelOutput
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as mm

    store: dict = {}
    order: list[str] = []
    call_order: list[str] = []
    ncalls: dict[str, int] = {}
    notes: list[str] = []
    state = {"enabled": True}

    def put(key, t):
        t = t.detach()
        flat = re.search(r"\.mlp\.(gate|experts)(\.|#|$)", key) is not None
        if not flat and t.ndim >= 2 and t.shape[0] == 1:
            t = t[0]
        if t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
            t = t.to(torch.int64)
        elif t.dtype == torch.bool:
            t = t.to(torch.uint8)
        else:
            t = t.to(torch.float32)
        if key in store:
            raise RuntimeError(f"duplicate activation key {key}")
        store[key] = t.contiguous().cpu().clone()  # own storage: safetensors refuses shared tensors

    names: dict = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), []).append(name)
    shared = {tuple(v) for v in names.values() if len(v) > 1}
    if shared:
        raise RuntimeError(f"modules shared under several names (hooks would be ambiguous): {shared}")

    def pre_hook_for(path):
        def pre(mod, args, kwargs):
            if state["enabled"]:
                call_order.append(path or "logits")
        return pre

    def recompute_indexer(mod, args, kwargs, key):
        hidden_states, q_resid, (cos, sin), attention_mask = args[0], args[1], args[2], args[3]
        B, S, _ = hidden_states.shape
        q = mod.wq_b(q_resid).view(B, S, mod.n_heads, mod.head_dim)
        q_rot, q_pass = torch.split(q, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
        k = mod.k_norm(mod.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [mod.qk_rope_head_dim, mod.head_dim - mod.qk_rope_head_dim], dim=-1)
        q_rot, k_rot = mm.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale
        scores = torch.nn.functional.relu(scores)
        weights = mod.weights_proj(hidden_states.to(mod.weights_proj.weight.dtype)).float() * (mod.n_heads ** -0.5)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        if attention_mask.dtype == torch.bool:
            index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
        else:
            index_scores = index_scores + attention_mask
        put(key + ".q", q)
        put(key + ".k", k)
        put(key + ".head_weights", weights)
        put(key + ".index_scores", index_scores)
        return index_scores

    def recompute_attention(mod, kwargs, key):
        hs = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        B, S = hs.shape[:-1]
        q_resid = mod.q_a_layernorm(mod.q_a_proj(hs))
        q_states = mod.q_b_proj(q_resid).view(B, S, -1, mod.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [mod.qk_nope_head_dim, mod.qk_rope_head_dim], dim=-1)
        ckv = mod.kv_a_proj_with_mqa(hs)
        kv_pass, k_rot = torch.split(ckv, [mod.kv_lora_rank, mod.qk_rope_head_dim], dim=-1)
        k_pass = mod.kv_a_layernorm(kv_pass).view(B, 1, S, mod.kv_lora_rank)
        k_rot = k_rot.view(B, 1, S, mod.qk_rope_head_dim)
        q_rot, k_rot = mm.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states, value_states = mod.expand_kv(k_pass, k_rot)
        put(key + ".query_states", query_states)
        put(key + ".key_states", key_states)
        put(key + ".value_states", value_states)
        put(key + ".k_rot", k_rot)

    def hook_for(path):
        def hook(mod, args, kwargs, output):
            if not state["enabled"]:
                return
            base = path or "logits"
            n = ncalls.get(base, 0)
            ncalls[base] = n + 1
            key = base if n == 0 else f"{base}#{n}"
            order.append(key)
            if isinstance(output, ModelOutput):
                output = output.to_tuple()
            if isinstance(output, torch.Tensor):
                put(key, output)
            elif isinstance(output, (tuple, list)):
                for i, o in enumerate(output):
                    if isinstance(o, torch.Tensor):
                        put(key if i == 0 else f"{key}.{i}", o)
            if isinstance(mod, mm.GlmMoeDsaTopkRouter):
                put(key + ".topk_weights", output[1])
                put(key + ".topk_indices", output[2])
            state["enabled"] = False
            try:
                with torch.no_grad():
                    if isinstance(mod, mm.GlmMoeDsaIndexer):
                        sc = recompute_indexer(mod, args, kwargs, key)
                        topk = min(mod.index_topk, sc.shape[-1])
                        again = sc.topk(topk, dim=-1).indices.to(torch.int32)
                        if not torch.equal(again, output):
                            notes.append(f"{key}: recomputed index scores give another top-k than the forward's")
                    elif isinstance(mod, mm.GlmMoeDsaAttention):
                        recompute_attention(mod, kwargs, key)
            finally:
                state["enabled"] = True
        return hook

    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre_hook_for(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(hook_for(name), with_kwargs=True))
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            out = model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits[0].detach().float().cpu()
    if not torch.equal(logits, store["logits"]):
        notes.append("root logits differ from the hook's")
    if "lm_head" in store and not torch.equal(logits, store["lm_head"]):
        notes.append("lm_head hook differs from the logits")
    store["input_ids"] = input_ids[0].detach().cpu().clone()
    store["position_ids"] = torch.arange(len(ids), dtype=torch.int64)
    return store, {"token_ids": ids, "execution_order": order, "call_order": call_order,
                   "call_counts": ncalls}, notes


def write_dump(args, torch, transformers, model, device, ids, dtype_name) -> dict:
    from safetensors.torch import save_file
    from safetensors import safe_open

    prev_attn = model.config._attn_implementation
    prev_exp = experts_impl(model)
    model.set_experts_implementation("eager")
    if args.dump_attn != prev_attn:
        model.set_attn_implementation(args.dump_attn)
    t0 = time.perf_counter()
    try:
        store, meta, notes = capture(model, ids, device)
    finally:
        model.set_experts_implementation(prev_exp)
        if args.dump_attn != prev_attn:
            model.set_attn_implementation(prev_attn)
    md = {"token_ids": json.dumps(meta["token_ids"]), "add_special_tokens": "false",
          "transformers": transformers.__version__, "torch": torch.__version__, "dtype": dtype_name,
          "attn_implementation": args.dump_attn, "experts_implementation": "eager",
          "batch_dim_dropped": "true", "int_dtype": "int64",
          "execution_order": json.dumps(meta["execution_order"]),
          "call_order": json.dumps(meta["call_order"]),
          "producer": "tools/hf_bench.py (port of make_fixtures.capture_activations)"}
    Path(args.dump).parent.mkdir(parents=True, exist_ok=True)
    save_file(store, args.dump, metadata=md)
    with safe_open(args.dump, framework="pt") as f:
        if sorted(f.keys()) != sorted(store):
            raise RuntimeError("dump keys differ on read-back")
    return {"path": args.dump, "keys": len(store), "bytes": os.path.getsize(args.dump),
            "seconds": time.perf_counter() - t0, "tokens": len(ids), "notes": notes,
            "attn_implementation": args.dump_attn, "experts_implementation": "eager"}


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers

    report: dict = {"transformers": transformers.__version__, "transformers_path": transformers.__file__,
                    "torch": torch.__version__, "python": platform.python_version(),
                    "command": "python3 tools/hf_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    def flush():  # --out holds what is measured so far, should a timeout end the run
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")

    log(f"transformers {transformers.__version__} ({transformers.__file__}), torch {torch.__version__}")
    if args.expect_version and not transformers.__version__.startswith(args.expect_version):
        report["error"] = f"transformers {transformers.__version__} is not {args.expect_version}x"
        flush()
        print(json.dumps(report))
        sys.exit(f"transformers {transformers.__version__} is not {args.expect_version}x (PYTHONPATH?)")
    device = torch.device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    report.update(device=str(device), dtype=DTYPES[args.dtype])
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(os.cpu_count() or 1)

    gib = args.copy_gib if args.copy_gib is not None else (4.0 if device.type == "cuda" else 0.0)
    if gib > 0:
        report["copy"] = copy_bandwidth(torch, device, gib)
        log(f"device copy {report['copy']['copy_gbps_rw']:.0f} GB/s (read+write)")
        flush()

    try:
        model, source, load_s, loading_info = load_model(args, torch, device, dtype)
    except Exception as e:
        report["error"] = f"load failed: {type(e).__name__}: {e}"
        flush()
        print(json.dumps(report, indent=1))
        raise
    report.update(model=source, load_seconds=load_s, loading_info=loading_info, attn_implementation=model.config._attn_implementation,
                  experts_implementation=experts_impl(model),
                  parameters=sum(p.numel() for p in model.parameters()),
                  parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    if device.type == "cuda":
        report["gpu_bytes_after_load"] = torch.cuda.memory_allocated(device)
        report["peak_gpu_bytes_load"] = torch.cuda.max_memory_allocated(device)
    flush()
    log(f"loaded {source} in {load_s:.1f} s; attn {report['attn_implementation']}, experts {report['experts_implementation']}")

    seqs = [int(s) for s in args.seq.split(",") if s.strip()] if args.seq else []
    explicit = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    runs = []
    cases = [list(range(args.token_start, args.token_start + n)) for n in seqs]
    if explicit and explicit not in cases:
        cases.append(explicit)
    for ids in cases:
        try:
            r = time_forward(args, torch, model, device, ids)
            log(f"seq {len(ids)}: median {r['median_ms']:.2f} ms, min {r['min_ms']:.2f} ms")
        except Exception as e:  # keep the other lengths and the dump
            r = {"seq": len(ids), "error": f"{type(e).__name__}: {e}"}
            log(f"seq {len(ids)} failed: {r['error']}")
        runs.append(r)
        report["runs"] = runs
        flush()
    report["runs"] = runs
    if args.dump:
        ids = explicit or (cases[0] if cases else list(range(args.token_start, args.token_start + 16)))
        try:
            report["dump"] = write_dump(args, torch, transformers, model, device, ids, DTYPES[args.dtype])
            log(f"dump {args.dump}: {report['dump']['keys']} tensors, {report['dump']['bytes'] / 1e6:.1f} MB")
        except Exception as e:
            report["dump"] = {"path": args.dump, "error": f"{type(e).__name__}: {e}"}
            log(f"dump failed: {report['dump']['error']}")
    if device.type == "cuda":
        # per-length peaks are reset before each length's timed forwards; the overall peak is the max
        peaks = [report.get("peak_gpu_bytes_load", 0), torch.cuda.max_memory_allocated(device)]
        peaks += [r.get("peak_gpu_bytes_during_forwards", 0) for r in runs]
        report["peak_gpu_bytes"] = max(peaks)
    report["complete"] = True
    flush()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
