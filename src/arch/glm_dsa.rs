//! The one name table of the `glm-dsa` architecture: every GGUF tensor (llama.cpp's names), the
//! Hugging Face transformers parameter it becomes (`GlmMoeDsaForCausalLM`), and the vLLM parameter
//! (`deepseek_v2.py`) that holds it, with roles, symbolic shapes and tensor-parallel styles.
//! Nothing else in glmcheck spells a tensor name.
//!
//! Templates use `{L}` for the layer index.

use serde::Serialize;

use super::config::Config;

/// A symbolic dimension, resolved against a [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Hidden,
    /// 2 · hidden_size (an MTP block's `eh_proj` input: [enorm(embedding); hnorm(hidden)])
    Hidden2,
    Vocab,
    QLora,
    KvLora,
    Heads,
    /// qk_nope_head_dim
    Nope,
    /// v_head_dim
    V,
    /// kv_lora_rank + qk_rope_head_dim (kv_a_proj_with_mqa's output)
    KvA,
    /// heads · (nope + rope): q_b_proj's output
    HeadsQk,
    /// heads · (nope + v): kv_b_proj's output
    HeadsKv,
    /// heads · v: o_proj's input
    HeadsV,
    IdxHeads,
    IdxDim,
    /// index_n_heads · index_head_dim
    IdxQ,
    Inter,
    MoeInter,
    /// 2 · moe_intermediate_size (fused gate+up of the routed experts)
    MoeInter2,
    /// moe_intermediate_size · n_shared_experts
    SharedInter,
    Experts,
}

impl Dim {
    pub fn resolve(self, c: &Config) -> usize {
        match self {
            Dim::Hidden => c.hidden_size,
            Dim::Hidden2 => 2 * c.hidden_size,
            Dim::Vocab => c.vocab_size,
            Dim::QLora => c.q_lora_rank,
            Dim::KvLora => c.kv_lora_rank,
            Dim::Heads => c.num_attention_heads,
            Dim::Nope => c.qk_nope_head_dim,
            Dim::V => c.v_head_dim,
            Dim::KvA => c.kv_lora_rank + c.qk_rope_head_dim,
            Dim::HeadsQk => c.num_attention_heads * c.qk_head_dim(),
            Dim::HeadsKv => c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
            Dim::HeadsV => c.num_attention_heads * c.v_head_dim,
            Dim::IdxHeads => c.index_n_heads,
            Dim::IdxDim => c.index_head_dim,
            Dim::IdxQ => c.index_n_heads * c.index_head_dim,
            Dim::Inter => c.intermediate_size,
            Dim::MoeInter => c.moe_intermediate_size,
            Dim::MoeInter2 => 2 * c.moe_intermediate_size,
            Dim::SharedInter => c.moe_intermediate_size * c.n_shared_experts,
            Dim::Experts => c.n_routed_experts,
        }
    }
}

pub fn resolve(shape: &[Dim], c: &Config) -> Vec<usize> {
    shape.iter().map(|d| d.resolve(c)).collect()
}

/// Which layers a tensor exists in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Not per layer (embedding, final norm, lm_head).
    Global,
    /// Every decoder layer.
    Layer,
    /// Layers below `first_k_dense_replace`.
    Dense,
    /// Layers from `first_k_dense_replace` on.
    Moe,
}

impl Scope {
    pub fn has_layer(self, c: &Config, l: usize) -> bool {
        match self {
            Scope::Global => false,
            Scope::Layer => true,
            Scope::Dense => !c.is_moe_layer(l),
            Scope::Moe => c.is_moe_layer(l),
        }
    }
}

/// How the HF tensor is rebuilt from its GGUF source(s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rebuild {
    /// One GGUF tensor; the HF shape is its `ne` reversed.
    Direct,
    /// kv_b_proj from `attn_k_b` [H, kv_lora, nope] (k_b transposed) and `attn_v_b` [H, v, kv_lora]:
    /// `cat([k_b.transpose(1, 2), v_b], dim=1).reshape(H·(nope+v), kv_lora)`.
    KvB,
    /// One routed expert's matrix: slice `{E}` of the stacked GGUF tensor (`ffn_*_exps`, [E, …]).
    ExpertSlice,
}

/// What a tensor is, for reports and for the shard plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Embedding,
    FinalNorm,
    InputNorm,
    PostAttnNorm,
    QANorm,
    KvANorm,
    IndexerKNorm,
    IndexerKNormBias,
    AttnQA,
    AttnQB,
    AttnKvA,
    AttnKvB,
    AttnOut,
    IndexerQB,
    IndexerK,
    IndexerWeights,
    FfnGate,
    FfnUp,
    FfnDown,
    Router,
    RouterBias,
    ExpertGate,
    ExpertUp,
    ExpertDown,
    SharedGate,
    SharedUp,
    SharedDown,
    LmHead,
}

/// One GGUF source tensor: name template and PyTorch-order symbolic shape.
#[derive(Debug, Clone, Copy)]
pub struct GgufSrc {
    pub name: &'static str,
    pub shape: &'static [Dim],
}

/// One Hugging Face parameter and where it comes from in the GGUF.
#[derive(Debug, Clone, Copy)]
pub struct HfDef {
    pub hf: &'static str,
    pub role: Role,
    pub scope: Scope,
    pub shape: &'static [Dim],
    pub rebuild: Rebuild,
    pub gguf: &'static [GgufSrc],
    /// An older single-tensor form some converters wrote instead of `gguf` (kv_b_proj as `attn_kv_b`).
    pub legacy: Option<GgufSrc>,
}

/// vLLM's tensor-parallel style for a parameter (from `deepseek_v2.py` / `linear.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TpStyle {
    Replicated,
    /// Output rows cut (ColumnParallelLinear).
    Column,
    /// Input columns cut (RowParallelLinear).
    Row,
    /// MergedColumnParallelLinear: each part's rows cut, then concatenated.
    MergedColumn,
    /// FusedMoE w13 [E, 2I, H]: gate rows r then up rows r.
    MoeW13,
    /// FusedMoE w2 [E, H, I]: input columns cut.
    MoeW2,
    /// VocabParallelEmbedding / ParallelLMHead: vocab padded to ×64, contiguous rows per rank.
    Vocab,
}

/// One vLLM parameter: the HF parameters it concatenates (along `cat_dim`), and its TP style.
#[derive(Debug, Clone, Copy)]
pub struct VllmDef {
    pub vllm: &'static str,
    pub parts: &'static [&'static str],
    pub cat_dim: usize,
    pub style: TpStyle,
    pub scope: Scope,
    /// vLLM >= 0.33's name, where it differs from the older name in `vllm` (which the plan uses).
    pub v033: Option<&'static str>,
    /// `state_dict()`-only names of modules registered twice (same storage as this parameter).
    /// A dump may hold the parameter under any of its names.
    pub aliases: &'static [&'static str],
}

/// vLLM buffers a `state_dict()` dump may hold beside the parameters: not weights of the GGUF, so
/// recognized and not compared (vLLM 0.33, `deepseek_v32`: attention scales, RoPE caches).
pub const VLLM_BUFFERS: &[&str] = &[
    "model.layers.{L}.self_attn._k_scale",
    "model.layers.{L}.self_attn._v_scale",
    "model.layers.{L}.self_attn._q_scale",
    "model.layers.{L}.self_attn._prob_scale",
    "model.layers.{L}.self_attn.rotary_emb.cos_sin_cache",
    "model.layers.{L}.self_attn.indexer_rope_emb.cos_sin_cache",
];

/// Whether `name` is one of vLLM's buffers ([`VLLM_BUFFERS`]).
pub fn is_vllm_buffer(name: &str) -> bool {
    VLLM_BUFFERS
        .iter()
        .any(|t| match_template(t, name).is_some())
}

/// Which vLLM version's parameter names a dump uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VllmNames {
    /// vLLM >= 0.33 (`MoERunner`: routed experts under `mlp.experts.routed_experts.*`).
    V033,
    /// Earlier vLLM (`mlp.experts.w13_weight`).
    Legacy,
}

impl VllmDef {
    /// The parameter's name (template) under a version's naming.
    pub fn name_in(&self, names: VllmNames) -> &'static str {
        match names {
            VllmNames::V033 => self.v033.unwrap_or(self.vllm),
            VllmNames::Legacy => self.vllm,
        }
    }

    /// Every name (template) a dump may hold this parameter under: the plan's, other versions', and
    /// `state_dict()` aliases.
    pub fn all_names(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.vllm)
            .chain(self.v033)
            .chain(self.aliases.iter().copied())
    }
}

use Dim::*;

const fn src(name: &'static str, shape: &'static [Dim]) -> GgufSrc {
    GgufSrc { name, shape }
}

const fn direct(
    hf: &'static str,
    role: Role,
    scope: Scope,
    shape: &'static [Dim],
    gguf: &'static [GgufSrc],
) -> HfDef {
    HfDef {
        hf,
        role,
        scope,
        shape,
        rebuild: Rebuild::Direct,
        gguf,
        legacy: None,
    }
}

const fn expert(
    hf: &'static str,
    role: Role,
    shape: &'static [Dim],
    gguf: &'static [GgufSrc],
) -> HfDef {
    HfDef {
        hf,
        role,
        scope: Scope::Moe,
        shape,
        rebuild: Rebuild::ExpertSlice,
        gguf,
        legacy: None,
    }
}

/// Every parameter of a `GlmMoeDsaForCausalLM` checkpoint (the names `save_pretrained` writes; routed
/// experts per expert, `{E}`, as in zai-org's release — transformers fuses them in memory into
/// `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]) and its GGUF source(s).
pub const HF_TABLE: &[HfDef] = &[
    direct(
        "model.embed_tokens.weight",
        Role::Embedding,
        Scope::Global,
        &[Vocab, Hidden],
        &[src("token_embd.weight", &[Vocab, Hidden])],
    ),
    direct(
        "model.norm.weight",
        Role::FinalNorm,
        Scope::Global,
        &[Hidden],
        &[src("output_norm.weight", &[Hidden])],
    ),
    direct(
        "lm_head.weight",
        Role::LmHead,
        Scope::Global,
        &[Vocab, Hidden],
        &[src("output.weight", &[Vocab, Hidden])],
    ),
    direct(
        "model.layers.{L}.input_layernorm.weight",
        Role::InputNorm,
        Scope::Layer,
        &[Hidden],
        &[src("blk.{L}.attn_norm.weight", &[Hidden])],
    ),
    direct(
        "model.layers.{L}.post_attention_layernorm.weight",
        Role::PostAttnNorm,
        Scope::Layer,
        &[Hidden],
        &[src("blk.{L}.ffn_norm.weight", &[Hidden])],
    ),
    direct(
        "model.layers.{L}.self_attn.q_a_proj.weight",
        Role::AttnQA,
        Scope::Layer,
        &[QLora, Hidden],
        &[src("blk.{L}.attn_q_a.weight", &[QLora, Hidden])],
    ),
    direct(
        "model.layers.{L}.self_attn.q_a_layernorm.weight",
        Role::QANorm,
        Scope::Layer,
        &[QLora],
        &[src("blk.{L}.attn_q_a_norm.weight", &[QLora])],
    ),
    direct(
        "model.layers.{L}.self_attn.q_b_proj.weight",
        Role::AttnQB,
        Scope::Layer,
        &[HeadsQk, QLora],
        &[src("blk.{L}.attn_q_b.weight", &[HeadsQk, QLora])],
    ),
    direct(
        "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        Role::AttnKvA,
        Scope::Layer,
        &[KvA, Hidden],
        &[src("blk.{L}.attn_kv_a_mqa.weight", &[KvA, Hidden])],
    ),
    direct(
        "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        Role::KvANorm,
        Scope::Layer,
        &[KvLora],
        &[src("blk.{L}.attn_kv_a_norm.weight", &[KvLora])],
    ),
    HfDef {
        hf: "model.layers.{L}.self_attn.kv_b_proj.weight",
        role: Role::AttnKvB,
        scope: Scope::Layer,
        shape: &[HeadsKv, KvLora],
        rebuild: Rebuild::KvB,
        gguf: &[
            src("blk.{L}.attn_k_b.weight", &[Heads, KvLora, Nope]),
            src("blk.{L}.attn_v_b.weight", &[Heads, V, KvLora]),
        ],
        legacy: Some(src("blk.{L}.attn_kv_b.weight", &[HeadsKv, KvLora])),
    },
    direct(
        "model.layers.{L}.self_attn.o_proj.weight",
        Role::AttnOut,
        Scope::Layer,
        &[Hidden, HeadsV],
        &[src("blk.{L}.attn_output.weight", &[Hidden, HeadsV])],
    ),
    direct(
        "model.layers.{L}.self_attn.indexer.wq_b.weight",
        Role::IndexerQB,
        Scope::Layer,
        &[IdxQ, QLora],
        &[src("blk.{L}.indexer.attn_q_b.weight", &[IdxQ, QLora])],
    ),
    direct(
        "model.layers.{L}.self_attn.indexer.wk.weight",
        Role::IndexerK,
        Scope::Layer,
        &[IdxDim, Hidden],
        &[src("blk.{L}.indexer.attn_k.weight", &[IdxDim, Hidden])],
    ),
    direct(
        "model.layers.{L}.self_attn.indexer.k_norm.weight",
        Role::IndexerKNorm,
        Scope::Layer,
        &[IdxDim],
        &[src("blk.{L}.indexer.k_norm.weight", &[IdxDim])],
    ),
    direct(
        "model.layers.{L}.self_attn.indexer.k_norm.bias",
        Role::IndexerKNormBias,
        Scope::Layer,
        &[IdxDim],
        &[src("blk.{L}.indexer.k_norm.bias", &[IdxDim])],
    ),
    direct(
        "model.layers.{L}.self_attn.indexer.weights_proj.weight",
        Role::IndexerWeights,
        Scope::Layer,
        &[IdxHeads, Hidden],
        &[src("blk.{L}.indexer.proj.weight", &[IdxHeads, Hidden])],
    ),
    direct(
        "model.layers.{L}.mlp.gate_proj.weight",
        Role::FfnGate,
        Scope::Dense,
        &[Inter, Hidden],
        &[src("blk.{L}.ffn_gate.weight", &[Inter, Hidden])],
    ),
    direct(
        "model.layers.{L}.mlp.up_proj.weight",
        Role::FfnUp,
        Scope::Dense,
        &[Inter, Hidden],
        &[src("blk.{L}.ffn_up.weight", &[Inter, Hidden])],
    ),
    direct(
        "model.layers.{L}.mlp.down_proj.weight",
        Role::FfnDown,
        Scope::Dense,
        &[Hidden, Inter],
        &[src("blk.{L}.ffn_down.weight", &[Hidden, Inter])],
    ),
    direct(
        "model.layers.{L}.mlp.gate.weight",
        Role::Router,
        Scope::Moe,
        &[Experts, Hidden],
        &[src("blk.{L}.ffn_gate_inp.weight", &[Experts, Hidden])],
    ),
    direct(
        "model.layers.{L}.mlp.gate.e_score_correction_bias",
        Role::RouterBias,
        Scope::Moe,
        &[Experts],
        &[src("blk.{L}.exp_probs_b.bias", &[Experts])],
    ),
    expert(
        "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
        Role::ExpertGate,
        &[MoeInter, Hidden],
        &[src(
            "blk.{L}.ffn_gate_exps.weight",
            &[Experts, MoeInter, Hidden],
        )],
    ),
    expert(
        "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        Role::ExpertUp,
        &[MoeInter, Hidden],
        &[src(
            "blk.{L}.ffn_up_exps.weight",
            &[Experts, MoeInter, Hidden],
        )],
    ),
    expert(
        "model.layers.{L}.mlp.experts.{E}.down_proj.weight",
        Role::ExpertDown,
        &[Hidden, MoeInter],
        &[src(
            "blk.{L}.ffn_down_exps.weight",
            &[Experts, Hidden, MoeInter],
        )],
    ),
    direct(
        "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
        Role::SharedGate,
        Scope::Moe,
        &[SharedInter, Hidden],
        &[src("blk.{L}.ffn_gate_shexp.weight", &[SharedInter, Hidden])],
    ),
    direct(
        "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        Role::SharedUp,
        Scope::Moe,
        &[SharedInter, Hidden],
        &[src("blk.{L}.ffn_up_shexp.weight", &[SharedInter, Hidden])],
    ),
    direct(
        "model.layers.{L}.mlp.shared_experts.down_proj.weight",
        Role::SharedDown,
        Scope::Moe,
        &[Hidden, SharedInter],
        &[src("blk.{L}.ffn_down_shexp.weight", &[Hidden, SharedInter])],
    ),
];

/// Every vLLM parameter of `GlmMoeDsaForCausalLM` (a `DeepseekV2ForCausalLM`), built from HF parameters.
pub const VLLM_TABLE: &[VllmDef] = &[
    VllmDef {
        vllm: "model.embed_tokens.weight",
        parts: &["model.embed_tokens.weight"],
        cat_dim: 0,
        style: TpStyle::Vocab,
        scope: Scope::Global,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.input_layernorm.weight",
        parts: &["model.layers.{L}.input_layernorm.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.fused_qkv_a_proj.weight",
        parts: &[
            "model.layers.{L}.self_attn.q_a_proj.weight",
            "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight",
        ],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.q_a_layernorm.weight",
        parts: &["model.layers.{L}.self_attn.q_a_layernorm.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.q_b_proj.weight",
        parts: &["model.layers.{L}.self_attn.q_b_proj.weight"],
        cat_dim: 0,
        style: TpStyle::Column,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.kv_a_layernorm.weight",
        parts: &["model.layers.{L}.self_attn.kv_a_layernorm.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.kv_b_proj.weight",
        parts: &["model.layers.{L}.self_attn.kv_b_proj.weight"],
        cat_dim: 0,
        style: TpStyle::Column,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.o_proj.weight",
        parts: &["model.layers.{L}.self_attn.o_proj.weight"],
        cat_dim: 0,
        style: TpStyle::Row,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.indexer.wq_b.weight",
        parts: &["model.layers.{L}.self_attn.indexer.wq_b.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.indexer.wk_weights_proj.weight",
        parts: &[
            "model.layers.{L}.self_attn.indexer.wk.weight",
            "model.layers.{L}.self_attn.indexer.weights_proj.weight",
        ],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.indexer.k_norm.weight",
        parts: &["model.layers.{L}.self_attn.indexer.k_norm.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.self_attn.indexer.k_norm.bias",
        parts: &["model.layers.{L}.self_attn.indexer.k_norm.bias"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.post_attention_layernorm.weight",
        parts: &["model.layers.{L}.post_attention_layernorm.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Layer,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.gate_up_proj.weight",
        parts: &[
            "model.layers.{L}.mlp.gate_proj.weight",
            "model.layers.{L}.mlp.up_proj.weight",
        ],
        cat_dim: 0,
        style: TpStyle::MergedColumn,
        scope: Scope::Dense,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.down_proj.weight",
        parts: &["model.layers.{L}.mlp.down_proj.weight"],
        cat_dim: 0,
        style: TpStyle::Row,
        scope: Scope::Dense,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.gate.weight",
        parts: &["model.layers.{L}.mlp.gate.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Moe,
        v033: None,
        aliases: &["model.layers.{L}.mlp.experts.gate.weight"],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.gate.e_score_correction_bias",
        parts: &["model.layers.{L}.mlp.gate.e_score_correction_bias"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Moe,
        v033: None,
        aliases: &[
            "model.layers.{L}.mlp.experts.gate.e_score_correction_bias",
            "model.layers.{L}.mlp.experts.routed_experts.e_score_correction_bias",
        ],
    },
    // Expert parts are stacked over {E} first ([E, I, H]), then concatenated along cat_dim.
    VllmDef {
        vllm: "model.layers.{L}.mlp.experts.w13_weight",
        parts: &[
            "model.layers.{L}.mlp.experts.{E}.gate_proj.weight",
            "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
        ],
        cat_dim: 1,
        style: TpStyle::MoeW13,
        scope: Scope::Moe,
        // vLLM >= 0.33 keeps the routed experts in `FusedMoE.routed_experts` (its MoERunner).
        v033: Some("model.layers.{L}.mlp.experts.routed_experts.w13_weight"),
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.experts.w2_weight",
        parts: &["model.layers.{L}.mlp.experts.{E}.down_proj.weight"],
        cat_dim: 0,
        style: TpStyle::MoeW2,
        scope: Scope::Moe,
        v033: Some("model.layers.{L}.mlp.experts.routed_experts.w2_weight"),
        aliases: &[],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.shared_experts.gate_up_proj.weight",
        parts: &[
            "model.layers.{L}.mlp.shared_experts.gate_proj.weight",
            "model.layers.{L}.mlp.shared_experts.up_proj.weight",
        ],
        cat_dim: 0,
        style: TpStyle::MergedColumn,
        scope: Scope::Moe,
        v033: None,
        aliases: &["model.layers.{L}.mlp.experts._shared_experts._layer.gate_up_proj.weight"],
    },
    VllmDef {
        vllm: "model.layers.{L}.mlp.shared_experts.down_proj.weight",
        parts: &["model.layers.{L}.mlp.shared_experts.down_proj.weight"],
        cat_dim: 0,
        style: TpStyle::Row,
        scope: Scope::Moe,
        v033: None,
        aliases: &["model.layers.{L}.mlp.experts._shared_experts._layer.down_proj.weight"],
    },
    VllmDef {
        vllm: "model.norm.weight",
        parts: &["model.norm.weight"],
        cat_dim: 0,
        style: TpStyle::Replicated,
        scope: Scope::Global,
        v033: None,
        aliases: &[],
    },
    VllmDef {
        vllm: "lm_head.weight",
        parts: &["lm_head.weight"],
        cat_dim: 0,
        style: TpStyle::Vocab,
        scope: Scope::Global,
        v033: None,
        aliases: &[],
    },
];

/// One tensor an MTP (multi-token prediction, "nextn") block holds beyond a full MoE decoder layer.
/// GLM-5 stores one such block after its decoder layers (HF `model.layers.78.*`, GGUF `blk.78.*`);
/// neither transformers' `GlmMoeDsaForCausalLM` nor vLLM's main model runs it (vLLM loads it only as a
/// speculative-decoding draft), so it is inventoried and shape-checked, never planned or run.
#[derive(Debug, Clone, Copy)]
pub struct MtpDef {
    pub hf: &'static str,
    pub gguf: &'static str,
    pub shape: &'static [Dim],
    /// llama.cpp's converter writes it only when the checkpoint has it.
    pub optional: bool,
}

/// The MTP-only tensors (llama.cpp's `LLM_TENSOR_NEXTN_*`; DeepSeek-V3 / GLM checkpoint names).
pub const MTP_TABLE: &[MtpDef] = &[
    MtpDef {
        hf: "model.layers.{L}.eh_proj.weight",
        gguf: "blk.{L}.nextn.eh_proj.weight",
        shape: &[Hidden, Hidden2],
        optional: false,
    },
    MtpDef {
        hf: "model.layers.{L}.enorm.weight",
        gguf: "blk.{L}.nextn.enorm.weight",
        shape: &[Hidden],
        optional: false,
    },
    MtpDef {
        hf: "model.layers.{L}.hnorm.weight",
        gguf: "blk.{L}.nextn.hnorm.weight",
        shape: &[Hidden],
        optional: false,
    },
    MtpDef {
        hf: "model.layers.{L}.shared_head.norm.weight",
        gguf: "blk.{L}.nextn.shared_head_norm.weight",
        shape: &[Hidden],
        optional: false,
    },
    MtpDef {
        hf: "model.layers.{L}.embed_tokens.weight",
        gguf: "blk.{L}.nextn.embed_tokens.weight",
        shape: &[Vocab, Hidden],
        optional: true,
    },
    MtpDef {
        hf: "model.layers.{L}.shared_head.head.weight",
        gguf: "blk.{L}.nextn.shared_head_head.weight",
        shape: &[Vocab, Hidden],
        optional: true,
    },
];

/// The MTP definition and layer of a concrete GGUF tensor name (`blk.N.nextn.*`).
pub fn lookup_mtp(tensor: &str) -> Option<(&'static MtpDef, Idx)> {
    MTP_TABLE
        .iter()
        .find_map(|d| match_template(d.gguf, tensor).map(|i| (d, i)))
}

/// The block of a GGUF tensor that marks an MTP block: any `blk.N.nextn.*` tensor, known to the
/// table or not (a newer converter's extra nextn tensor still marks its block).
pub fn mtp_marker_block(tensor: &str) -> Option<usize> {
    let l = gguf_layer(tensor)?;
    let rest = tensor.strip_prefix("blk.")?.split_once('.')?.1;
    rest.starts_with("nextn.").then_some(l)
}

/// Layer and expert indices of a concrete name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Idx {
    pub layer: Option<usize>,
    pub expert: Option<usize>,
}

impl Idx {
    pub fn layer(l: usize) -> Self {
        Idx {
            layer: Some(l),
            expert: None,
        }
    }
}

impl VllmDef {
    /// The role of the parameter's (first) HF part.
    pub fn role(&self) -> Option<Role> {
        let first = self.parts.first()?;
        HF_TABLE.iter().find(|d| d.hf == *first).map(|d| d.role)
    }
}

/// The (first) HF definition with this role.
pub fn hf_def(role: Role) -> Option<&'static HfDef> {
    HF_TABLE.iter().find(|d| d.role == role)
}

/// The GGUF tensor name (template) of a role's first source.
pub fn gguf_name_of(role: Role) -> Option<&'static str> {
    hf_def(role).and_then(|d| d.gguf.first()).map(|s| s.name)
}

/// Fills `{L}` (and `{E}`) in a template.
pub fn name(template: &str, idx: Idx) -> String {
    let mut s = template.to_string();
    if let Some(l) = idx.layer {
        s = s.replace("{L}", &l.to_string());
    }
    if let Some(e) = idx.expert {
        s = s.replace("{E}", &e.to_string());
    }
    s
}

/// A concrete (index-resolved) HF parameter.
#[derive(Debug, Clone)]
pub struct HfParam {
    pub name: String,
    pub idx: Idx,
    pub def: &'static HfDef,
}

impl HfParam {
    pub fn shape(&self, c: &Config) -> Vec<usize> {
        resolve(self.def.shape, c)
    }

    pub fn gguf_names(&self) -> Vec<String> {
        self.def
            .gguf
            .iter()
            .map(|s| name(s.name, self.idx))
            .collect()
    }
}

/// Every HF checkpoint parameter the config implies, in model order.
pub fn hf_params(c: &Config) -> Vec<HfParam> {
    let mut out = Vec::new();
    let push = |out: &mut Vec<HfParam>, d: &'static HfDef, idx: Idx| {
        out.push(HfParam {
            name: name(d.hf, idx),
            idx,
            def: d,
        });
    };
    if let Some(d) = hf_def(Role::Embedding) {
        push(&mut out, d, Idx::default());
    }
    for l in 0..c.num_hidden_layers {
        for d in HF_TABLE.iter().filter(|d| d.scope.has_layer(c, l)) {
            if d.rebuild == Rebuild::ExpertSlice {
                for e in 0..c.n_routed_experts {
                    push(
                        &mut out,
                        d,
                        Idx {
                            layer: Some(l),
                            expert: Some(e),
                        },
                    );
                }
            } else {
                push(&mut out, d, Idx::layer(l));
            }
        }
    }
    for d in HF_TABLE
        .iter()
        .filter(|d| d.scope == Scope::Global && d.role != Role::Embedding)
    {
        if d.role == Role::LmHead && c.tie_word_embeddings {
            continue;
        }
        push(&mut out, d, Idx::default());
    }
    out
}

/// Finds the HF definition and indices of a concrete HF parameter name.
pub fn lookup_hf(param: &str) -> Option<(&'static HfDef, Idx)> {
    HF_TABLE
        .iter()
        .find_map(|d| match_template(d.hf, param).map(|i| (d, i)))
}

/// Finds the vLLM definition and layer of a concrete vLLM parameter name (its canonical name or any
/// alias).
pub fn lookup_vllm(param: &str) -> Option<(&'static VllmDef, Idx)> {
    VLLM_TABLE.iter().find_map(|d| {
        d.all_names()
            .find_map(|t| match_template(t, param))
            .map(|i| (d, i))
    })
}

/// The canonical vLLM name (glmcheck's plan's) of a concrete name or alias, when it is one of a
/// parameter that exists in this config (its layer below `num_hidden_layers`, in its scope).
pub fn canonical_vllm(param: &str, c: &Config) -> Option<String> {
    let (d, idx) = lookup_vllm(param)?;
    let exists = match idx.layer {
        None => d.scope == Scope::Global,
        Some(l) => l < c.num_hidden_layers && d.scope.has_layer(c, l),
    };
    exists.then(|| name(d.vllm, idx))
}

/// Finds the GGUF source definition (and its owner) of a concrete GGUF tensor name.
pub fn lookup_gguf(tensor: &str) -> Option<(&'static HfDef, &'static GgufSrc, Idx)> {
    HF_TABLE.iter().find_map(|d| {
        d.gguf
            .iter()
            .chain(d.legacy.iter())
            .find_map(|s| match_template(s.name, tensor).map(|i| (d, s, i)))
    })
}

/// The indices when `concrete` is `template` with `{L}` / `{E}` filled by canonical decimal numbers.
pub fn match_template(template: &str, concrete: &str) -> Option<Idx> {
    let mut idx = Idx::default();
    let mut rest_t = template;
    let mut rest_c = concrete;
    loop {
        let next = [("{L}", true), ("{E}", false)]
            .iter()
            .filter_map(|&(p, is_layer)| rest_t.find(p).map(|at| (at, is_layer)))
            .min_by_key(|&(at, _)| at);
        let Some((at, is_layer)) = next else {
            return (rest_t == rest_c).then_some(idx);
        };
        rest_c = rest_c.strip_prefix(&rest_t[..at])?;
        rest_t = &rest_t[at + 3..];
        let digits = rest_c.bytes().take_while(u8::is_ascii_digit).count();
        let num = &rest_c[..digits];
        if num.is_empty() || (num.len() > 1 && num.starts_with('0')) {
            return None;
        }
        let n: usize = num.parse().ok()?;
        if is_layer {
            idx.layer = Some(n);
        } else {
            idx.expert = Some(n);
        }
        rest_c = &rest_c[digits..];
    }
}

/// The layer number of a `blk.N.` GGUF tensor name.
pub fn gguf_layer(tensor: &str) -> Option<usize> {
    let rest = tensor.strip_prefix("blk.")?;
    rest.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vllm_part_is_an_hf_parameter_of_the_same_scope() {
        for v in VLLM_TABLE {
            for p in v.parts {
                let d = HF_TABLE.iter().find(|d| d.hf == *p);
                let d = d.unwrap_or_else(|| panic!("{} names unknown HF parameter {p}", v.vllm));
                assert_eq!(d.scope, v.scope, "{}", v.vllm);
            }
        }
        // And every HF parameter lands in exactly one vLLM parameter.
        for d in HF_TABLE {
            let n = VLLM_TABLE
                .iter()
                .filter(|v| v.parts.contains(&d.hf))
                .count();
            assert_eq!(n, 1, "{}", d.hf);
        }
    }

    #[test]
    fn every_table_entry_has_its_own_role() {
        for (i, a) in HF_TABLE.iter().enumerate() {
            for b in &HF_TABLE[i + 1..] {
                assert_ne!(a.role, b.role, "{} and {} share a role", a.hf, b.hf);
            }
        }
    }

    #[test]
    fn templates_match_only_their_own_names() {
        assert_eq!(
            match_template("blk.{L}.attn_k_b.weight", "blk.12.attn_k_b.weight"),
            Some(Idx::layer(12))
        );
        assert_eq!(
            match_template("blk.{L}.attn_k_b.weight", "blk.x.attn_k_b.weight"),
            None
        );
        assert_eq!(
            match_template("blk.{L}.attn_k_b.weight", "blk.012.attn_k_b.weight"),
            None
        );
        assert_eq!(
            match_template("output.weight", "output.weight"),
            Some(Idx::default())
        );
        assert_eq!(
            match_template(
                "model.layers.{L}.mlp.experts.{E}.up_proj.weight",
                "model.layers.4.mlp.experts.17.up_proj.weight"
            ),
            Some(Idx {
                layer: Some(4),
                expert: Some(17)
            })
        );
        let (d, s, i) = lookup_gguf("blk.3.attn_v_b.weight").unwrap();
        assert_eq!(d.role, Role::AttnKvB);
        assert_eq!(s.name, "blk.{L}.attn_v_b.weight");
        assert_eq!(i, Idx::layer(3));
    }

    #[test]
    fn glm5_shapes_match_the_reference_sheet() {
        let c = Config::glm5();
        let shape = |n: &str| {
            let (d, _) = lookup_hf(n).unwrap();
            resolve(d.shape, &c)
        };
        assert_eq!(
            shape("model.layers.5.self_attn.kv_b_proj.weight"),
            [28672, 512]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.q_b_proj.weight"),
            [16384, 2048]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.o_proj.weight"),
            [6144, 16384]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.kv_a_proj_with_mqa.weight"),
            [576, 6144]
        );
        assert_eq!(
            shape("model.layers.5.self_attn.indexer.wq_b.weight"),
            [4096, 2048]
        );
        assert_eq!(
            shape("model.layers.5.mlp.experts.255.down_proj.weight"),
            [6144, 2048]
        );
        let n_params = hf_params(&c).len();
        // 3 dense layers × 17 + 75 MoE layers × (19 + 3 × 256 experts) + 3 globals
        assert_eq!(n_params, 3 * 17 + 75 * (19 + 3 * 256) + 3);
    }
}
