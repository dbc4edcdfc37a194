//! GLM-5's configuration under Hugging Face names, read from `glm-dsa.*` GGUF metadata.

mod reader;

pub use reader::{ConfigReader, MAX_BLOCKS, MAX_EXPERTS};

use serde::Serialize;

/// The GGUF architecture string llama.cpp writes for GLM-5.
pub const ARCH: &str = "glm-dsa";

/// GLM-5's config.json values under transformers' `GlmMoeDsaConfig` names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub moe_intermediate_size: usize,
    pub intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub num_nextn_predict_layers: usize,
    pub scoring_func: String,
    pub tie_word_embeddings: bool,
}

impl Config {
    /// GLM-5's published config (zai-org GLM-5 config.json; transformers' defaults agree).
    pub fn glm5() -> Self {
        Config {
            hidden_size: 6144,
            num_hidden_layers: 78,
            num_attention_heads: 64,
            num_key_value_heads: 64,
            q_lora_rank: 2048,
            kv_lora_rank: 512,
            qk_nope_head_dim: 192,
            qk_rope_head_dim: 64,
            v_head_dim: 256,
            n_routed_experts: 256,
            num_experts_per_tok: 8,
            n_shared_experts: 1,
            n_group: 1,
            topk_group: 1,
            moe_intermediate_size: 2048,
            intermediate_size: 12288,
            first_k_dense_replace: 3,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            index_n_heads: 32,
            index_head_dim: 128,
            index_topk: 2048,
            rope_theta: 1_000_000.0,
            rms_norm_eps: 1e-5,
            vocab_size: 154880,
            max_position_embeddings: 202752,
            num_nextn_predict_layers: 1,
            scoring_func: "sigmoid".into(),
            tie_word_embeddings: false,
        }
    }

    /// The fixtures' tiny model (tools/make_fixtures.py), three layers, one dense.
    pub fn tiny() -> Self {
        Config {
            hidden_size: 256,
            num_hidden_layers: 3,
            num_attention_heads: 8,
            num_key_value_heads: 8,
            q_lora_rank: 128,
            kv_lora_rank: 128,
            qk_nope_head_dim: 64,
            qk_rope_head_dim: 32,
            v_head_dim: 64,
            n_routed_experts: 8,
            num_experts_per_tok: 3,
            n_shared_experts: 1,
            n_group: 4,
            topk_group: 2,
            moe_intermediate_size: 128,
            intermediate_size: 512,
            first_k_dense_replace: 1,
            index_n_heads: 4,
            index_head_dim: 64,
            index_topk: 8,
            vocab_size: 600,
            max_position_embeddings: 2048,
            num_nextn_predict_layers: 0,
            ..Config::glm5()
        }
    }

    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether layer `l` has a routed MoE block (the first `first_k_dense_replace` are dense).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        l >= self.first_k_dense_replace
    }

    /// Whether block `l` of the GGUF is an MTP (nextn) layer: stored after the decoder layers.
    pub fn is_mtp_layer(&self, l: usize) -> bool {
        l >= self.num_hidden_layers && l < self.gguf_block_count()
    }

    /// Layers the GGUF stores, the MTP (nextn) layers included.
    pub fn gguf_block_count(&self) -> usize {
        self.num_hidden_layers + self.num_nextn_predict_layers
    }
}

/// Where a config value came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Read from this metadata key.
    Metadata(String),
    /// Derived from other values (how: worded by `report::config`).
    Derived(Derivation),
    /// Not in the file: GLM-5's documented default.
    Default(String),
}

/// How a config value was derived from other values or from the tensors.
#[derive(Debug, Clone, PartialEq)]
pub enum Derivation {
    /// The block count less the trailing MTP blocks; the block count from metadata `key`, or
    /// (None) 1 + the highest `blk.N` in the file.
    BlockCount {
        key: Option<String>,
        mtp_blocks: usize,
    },
    /// The trailing blocks holding `nextn.*` tensors (`count`); metadata `key` says `says`
    /// (another count), or is absent (None).
    MtpBlocks {
        count: usize,
        key: String,
        says: Option<usize>,
    },
    /// `num_attention_heads` (MLA: the GGUF's head_count_kv 1 is the latent).
    AttentionHeads,
    /// Metadata `key` (key_length_mla) less `rope.dimension_count`.
    KeyLengthLessRope { key: String },
    /// The length of `tokenizer.ggml.tokens`.
    TokenCount,
    /// The embedding tensor's ne[1].
    EmbeddingRows,
    /// Whether the file has an lm_head tensor (`output.weight`).
    LmHead { present: bool },
}

/// The config and, per field, where it came from.
#[derive(Debug, Clone, Serialize)]
pub struct ConfigReport {
    pub config: Config,
    pub sources: Vec<(String, Source)>,
    pub mtp: MtpBlocks,
}

/// Which blocks of the file are MTP (nextn) layers, and what the metadata says about them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct MtpBlocks {
    /// `nextn_predict_layers` as the metadata states it (None: the file has no such key).
    pub key: Option<usize>,
    /// The trailing blocks below `block_count` that hold `nextn.*` tensors: the MTP layers.
    pub blocks: Vec<usize>,
    /// Other blocks holding `nextn.*` tensors (inside the decoder layers or past `block_count`).
    pub stray: Vec<usize>,
}

impl MtpBlocks {
    /// The key's count when it disagrees with the tensors.
    pub fn key_disagrees(&self) -> Option<usize> {
        self.key.filter(|&k| k != self.blocks.len())
    }
}

impl ConfigReport {
    /// Fields that took GLM-5's defaults because their key is missing.
    pub fn defaulted(&self) -> Vec<(&str, &str)> {
        self.sources
            .iter()
            .filter_map(|(f, s)| match s {
                Source::Default(k) => Some((f.as_str(), k.as_str())),
                _ => None,
            })
            .collect()
    }
}
