//! The HF side of the name table: every checkpoint parameter and its GGUF source(s).

use super::{Dim, GgufSrc, HfDef, Rebuild, Role, Scope};

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
