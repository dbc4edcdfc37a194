//! The vLLM side of the name table (parameters built from HF parts, their TP styles and the names
//! other vLLM versions use) and the MTP-only tensors.

use super::{Dim, Scope, TpStyle, VllmDef};
use Dim::{Hidden, Hidden2, Vocab};

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
