//! The GGUF → vLLM config mapping as a table: one row per field vLLM 0.33 reads to build GLM-5, in
//! the order the comparison shows them. A row names the field, whether the GGUF's side is one of
//! the GGUF config's fields (its source then shown) or fixed by the architecture, and the rule that
//! decides what vLLM ends up with (the key, transformers' class default or vLLM's getattr default)
//! and how it differs from the GGUF. The rules live in `rules`; the declared dimensions, compared
//! value for value, are the [`DIMS`] table.

use super::check::{Ctx, Judged};
use super::rules;
use crate::arch::Config;

/// A declared dimension or count: transformers 5.20's `GlmMoeDsaConfig` default and the GGUF's
/// value. Every one is declared by the class (`configuration_glm_moe_dsa.py:92-130`), so an absent
/// key is its default, never unset.
pub(super) struct Dim {
    pub field: &'static str,
    pub default: u64,
    pub gguf: fn(&Config) -> usize,
    /// A different value does not change what vLLM computes for a request.
    pub harmless: bool,
}

const fn dim(field: &'static str, default: u64, gguf: fn(&Config) -> usize) -> Dim {
    Dim {
        field,
        default,
        gguf,
        harmless: false,
    }
}

/// Every declared dimension, in the order of its rows.
pub(super) const DIMS: &[Dim] = &[
    // nvidia/model.py:216-217 `make_layers(config.num_hidden_layers, …)`
    dim("num_hidden_layers", 78, |c| c.num_hidden_layers),
    // deepseek_v32/attention.py:138 `hidden_size = config.hidden_size`
    dim("hidden_size", 6144, |c| c.hidden_size),
    // attention.py:144 `num_heads = config.num_attention_heads` (heads per rank = num_heads / tp)
    dim("num_attention_heads", 64, |c| c.num_attention_heads),
    // attention.py:142 `q_lora_rank = config.q_lora_rank`
    dim("q_lora_rank", 2048, |c| c.q_lora_rank),
    // attention.py:143 `kv_lora_rank = config.kv_lora_rank`
    dim("kv_lora_rank", 512, |c| c.kv_lora_rank),
    // attention.py:139 `qk_nope_head_dim = config.qk_nope_head_dim`
    dim("qk_nope_head_dim", 192, |c| c.qk_nope_head_dim),
    // attention.py:140 `qk_rope_head_dim = config.qk_rope_head_dim` (also the indexer's rope dim, :68)
    dim("qk_rope_head_dim", 64, |c| c.qk_rope_head_dim),
    // attention.py:141 `v_head_dim = config.v_head_dim`
    dim("v_head_dim", 256, |c| c.v_head_dim),
    // deepseek_v2.py:309,323,377 `config.n_routed_experts` (gate rows, FusedMoE num_experts)
    dim("n_routed_experts", 256, |c| c.n_routed_experts),
    // deepseek_v2.py:378 `top_k=config.num_experts_per_tok`
    dim("num_experts_per_tok", 8, |c| c.num_experts_per_tok),
    // deepseek_v2.py:362 `intermediate_size = config.moe_intermediate_size * config.n_shared_experts`
    dim("n_shared_experts", 1, |c| c.n_shared_experts),
    // deepseek_v2.py:380 `intermediate_size=config.moe_intermediate_size`
    dim("moe_intermediate_size", 2048, |c| c.moe_intermediate_size),
    // nvidia/model.py:109 `intermediate_size=config.intermediate_size` (the dense MLP)
    dim("intermediate_size", 12288, |c| c.intermediate_size),
    // nvidia/model.py:93 `layer_idx >= config.first_k_dense_replace` (deepseek_v2.py:1295 alike)
    dim("first_k_dense_replace", 3, |c| c.first_k_dense_replace),
    // deepseek_v2.py:384 `num_expert_group=getattr(config, "n_group", 1)` (the class declares 1)
    dim("n_group", 1, |c| c.n_group),
    // deepseek_v2.py:385 `topk_group=getattr(config, "topk_group", 1)` (the class declares 1)
    dim("topk_group", 1, |c| c.topk_group),
    // attention.py:66 `self.n_head = config.index_n_heads`
    dim("index_n_heads", 32, |c| c.index_n_heads),
    // attention.py:67 `self.head_dim = config.index_head_dim`
    dim("index_head_dim", 128, |c| c.index_head_dim),
    // attention.py:65 `self.topk_tokens = config.index_topk`; nvidia/model.py:188-197 allocates
    // the top-k buffer from it unconditionally ("DSA is always sparse"). Its row is its own rule
    // (rules::index_topk), among the indexer's.
    dim("index_topk", 2048, |c| c.index_topk),
    // nvidia/model.py:182,205 and deepseek_v2.py:1919 `config.vocab_size` (embedding, lm_head)
    dim("vocab_size", 154880, |c| c.vocab_size),
    // attention.py:151 `getattr(config, "max_position_embeddings", 8192)`: the rope cache length
    // (the class declares 202752). Harmless for plain RoPE: the frequencies do not depend on it.
    Dim {
        harmless: true,
        ..dim("max_position_embeddings", 202752, |c| {
            c.max_position_embeddings
        })
    },
    // Never read by DeepseekV32Attention (attention.py:126-284): MLA caches one latent per token.
    // The GGUF's head_count_kv is 1 (the latent); HF's value is the head count. Harmless.
    Dim {
        harmless: true,
        ..dim("num_key_value_heads", 64, |c| c.num_key_value_heads)
    },
];

/// How a row's values and findings are decided.
#[derive(Clone, Copy)]
pub(super) enum Judge {
    /// A [`DIMS`] row: the key, else the class default, against the GGUF's value.
    Dim(&'static Dim),
    /// Its own rule; None: no row (the field plays no part in this config).
    Rule(fn(&Ctx<'_>) -> Option<Judged>),
}

/// One field vLLM reads.
#[derive(Clone, Copy)]
pub(super) struct Row {
    pub field: &'static str,
    /// The GGUF's side is the GGUF config's field of this name (its source is shown); false: fixed
    /// by the glm-dsa architecture itself.
    pub gguf_field: bool,
    pub judge: Judge,
}

const fn rule(field: &'static str, gguf_field: bool, judge: fn(&Ctx<'_>) -> Option<Judged>) -> Row {
    Row {
        field,
        gguf_field,
        judge: Judge::Rule(judge),
    }
}

/// The rows before the dimensions: identity and routing.
const BEFORE_DIMS: &[Row] = &[
    rule("model_type", false, rules::model_type),
    rule("architectures", false, rules::architectures),
    rule("hidden_act", false, rules::hidden_act),
    rule("topk_method", false, rules::topk_method),
    rule("scoring_func", true, rules::scoring_func),
    rule("norm_topk_prob", true, rules::norm_topk_prob),
    rule("routed_scaling_factor", true, rules::routed_scaling_factor),
    rule("moe_layer_freq", false, rules::moe_layer_freq),
];

/// The rows after the dimensions: the indexer, RoPE, norms and heads.
const AFTER_DIMS: &[Row] = &[
    rule("index_topk", true, rules::index_topk),
    rule(
        "indexer_rope_interleave",
        false,
        rules::indexer_rope_interleave,
    ),
    rule("index_topk_freq", false, rules::indexer_schedule),
    rule("rope_theta", true, rules::rope_theta),
    rule("rope_type", false, rules::rope_type),
    rule("rms_norm_eps", true, rules::rms_norm_eps),
    rule("num_nextn_predict_layers", true, rules::nextn_layers),
    rule("tie_word_embeddings", true, rules::tie_word_embeddings),
];

/// Every row, in order.
pub(super) fn rows() -> impl Iterator<Item = Row> {
    let dims = DIMS
        .iter()
        .filter(|d| d.field != "index_topk")
        .map(|d| Row {
            field: d.field,
            gguf_field: true,
            judge: Judge::Dim(d),
        });
    BEFORE_DIMS
        .iter()
        .copied()
        .chain(dims)
        .chain(AFTER_DIMS.iter().copied())
}
