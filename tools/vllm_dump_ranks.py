"""What vLLM 0.33 itself holds on each tensor-parallel rank after load_weights, for a small GLM-5 (glm_moe_dsa)
checkpoint, on a machine without a GPU: one process per rank over gloo.

Adapted from shared/vllm-loader/dump_vllm_ranks.py (same vLLM calls, same one monkeypatch) for the committed
fixtures written by tools/make_other_writers.py.  What changed, and why:
  * parameters are saved in the dtype vLLM holds them in (the shared script casts everything to float32);
    run with DTYPE=bfloat16 so that vLLM itself decides which parameters stay float32 in a bf16 model;
  * the safetensors `__metadata__` says who wrote the file (writer, vllm version, class, tp, rank, model dtype,
    source checkpoint, VLLM_REPLICATE_EMBED) -- the shared script records only version/class/rank/tp;
  * info-rank<r>.json additionally records the model dtype, the source and the environment switches.
Everything vLLM-side (EngineArgs, the CPU platform patch, initialize_model, DefaultModelLoader.load_weights with its
strict all-parameters-loaded check, stopping before process_weights_after_loading) is unchanged.

Usage: MODEL_DIR=dir [DTYPE=bfloat16] [SOURCE=text] python vllm_dump_ranks.py RANK WORLD OUTDIR [registry|nvidia|v2]
"""
import os, sys, json
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
RANK = int(sys.argv[1]); WORLD = int(sys.argv[2]); OUTDIR = sys.argv[3]
CLS = sys.argv[4] if len(sys.argv) > 4 else "registry"  # registry | nvidia | v2
MODEL_DIR = os.environ["MODEL_DIR"]  # an HF model dir: config.json (with topk_method) and model.safetensors
DTYPE = os.environ.get("DTYPE", "bfloat16")
SOURCE = os.environ.get("SOURCE", MODEL_DIR)
PORT = int(os.environ.get("PORT", "29533"))
import torch
from safetensors.torch import save_file
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

ea = EngineArgs(model=MODEL_DIR, tensor_parallel_size=WORLD, dtype=DTYPE, enforce_eager=True,
                max_model_len=1024, max_num_batched_tokens=1024, distributed_executor_backend="mp",
                load_format="safetensors", trust_remote_code=False)
vc = ea.create_engine_config()
# ---- PATCH 1 (not vLLM code): vLLM's CPU platform refuses sparse (DSA) MLA attention backends. The backend only
# decides the attention kernel; it owns no nn.Parameters. Route sparse MLA to the backend CUDA picks on Hopper.
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
_orig_sel = CpuPlatform.get_attn_backend_cls.__func__
def _sel(cls, selected_backend, attn_selector_config, num_heads=None):
    if attn_selector_config.use_sparse:
        return AttentionBackendEnum[os.environ.get("SPARSE_BACKEND", "FLASHMLA_SPARSE")].get_path()
    return _orig_sel(cls, selected_backend, attn_selector_config, num_heads)
CpuPlatform.get_attn_backend_cls = classmethod(_sel)
print("platform", type(__import__("vllm.platforms").platforms.current_platform).__name__, "tp", vc.parallel_config.tensor_parallel_size,
      "dtype", vc.model_config.dtype, flush=True)
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=WORLD, rank=RANK, local_rank=RANK,
                                 distributed_init_method=f"tcp://127.0.0.1:{PORT}", backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=WORLD)
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (RANK, WORLD)
    from vllm.v1.worker.workspace import init_workspace_manager
    init_workspace_manager(torch.device("cpu"))  # what GPUModelRunner.__init__ does (vllm/v1/worker/gpu_worker.py), on cpu
    from vllm.model_executor.model_loader.utils import initialize_model
    if CLS == "registry":
        model_class = None
    elif CLS == "nvidia":
        from vllm.models.deepseek_v32.nvidia.model import DeepseekV32ForCausalLM as model_class
    else:
        from vllm.model_executor.models.deepseek_v2 import GlmMoeDsaForCausalLM as model_class
    # Mirror vllm/model_executor/model_loader/base_loader.py BaseModelLoader.load_model, minus the final
    # process_weights_after_loading (which repacks weights for a particular kernel: we want the loaded layout).
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype
    loader = get_model_loader(vc.load_config)
    with set_default_torch_dtype(vc.model_config.dtype):
        with torch.device("cpu"):
            if model_class is None:
                model = loader.create_model(vllm_config=vc, model_config=vc.model_config)
            else:
                model = initialize_model(vllm_config=vc, model_class=model_class)
        print("model class", type(model).__module__, type(model).__name__, "loader", type(loader).__name__, flush=True)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        # vLLM's own safetensors iterator over MODEL_DIR/*.safetensors + its strict "all params loaded" check
        loader.load_weights(model, vc.model_config)
    params = dict(model.named_parameters())
    cls_name = type(model).__module__ + "." + type(model).__name__
    out = {n: p.detach().contiguous().clone() for n, p in params.items()}  # the dtype vLLM holds, no cast
    os.makedirs(OUTDIR, exist_ok=True)
    vllm_version = __import__("vllm").__version__
    meta = {"writer": f"vllm {vllm_version} loader (DefaultModelLoader.load_weights, before process_weights_after_loading; "
                      "tools/vllm_dump_ranks.py)",
            "vllm": vllm_version, "torch": torch.__version__, "class": cls_name, "rank": str(RANK), "tp": str(WORLD),
            "model_dtype": str(vc.model_config.dtype).replace("torch.", ""), "source_checkpoint": SOURCE,
            "VLLM_REPLICATE_EMBED": os.environ.get("VLLM_REPLICATE_EMBED", "")}
    save_file(out, f"{OUTDIR}/rank{RANK}.safetensors", metadata=meta)
    info = {"rank": RANK, "tp": WORLD, "class": cls_name, "vllm": vllm_version, "model_dtype": meta["model_dtype"],
            "source_checkpoint": SOURCE, "VLLM_REPLICATE_EMBED": meta["VLLM_REPLICATE_EMBED"],
            "params": {n: [list(p.shape), str(p.dtype)] for n, p in params.items()},
            "not_in_loaded_set": "checked by DefaultModelLoader.track_weights_loading",
            "unchanged_after_load": sorted(n for n in params if torch.equal(before[n], params[n].detach())),
            "buffers": {n: [list(b.shape), str(b.dtype)] for n, b in model.named_buffers()},
            "state_dict_only_keys": sorted(set(model.state_dict()) - set(params) - {n for n, _ in model.named_buffers()})}
    with open(f"{OUTDIR}/info-rank{RANK}.json", "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    print("rank", RANK, "saved", len(out), "params", flush=True)
