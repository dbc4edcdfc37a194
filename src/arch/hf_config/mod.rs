//! The deployment's own `config.json` against the GGUF's config: every field vLLM 0.33 reads to
//! build GLM-5 (`GlmMoeDsaForCausalLM`), the value vLLM ends up with, and the fields that make it
//! compute something other than what the GGUF (and llama.cpp, transformers, glmcheck's forward)
//! computes. Typed results only: every sentence is made in `report::hf_config`.
//!
//! How vLLM 0.33 gets its values (read in the wheel's source, `vllm-0.33.0`):
//! - `transformers_utils/config.py:342-447` (`HFConfigParser.parse`): `glm_moe_dsa` is not in vLLM's
//!   own `_CONFIG_REGISTRY` (:122), so `AutoConfig.from_pretrained` builds transformers'
//!   `GlmMoeDsaConfig`. vLLM 0.33 requires transformers `>=5.16.1,<5.21.0` (wheel METADATA); the
//!   class (5.16.1, 5.20.0 and 5.23.0 alike, `models/glm_moe_dsa/configuration_glm_moe_dsa.py:92-133`)
//!   *declares* the dimension fields with GLM-5's values as defaults, so a key removed from
//!   config.json is not "unset" for vLLM: it is the class default ([`Origin::TransformersDefault`]).
//! - Keys the class does not declare (`topk_method`, `scoring_func`, `indexer_rope_interleave`,
//!   `moe_layer_freq`, `index_topk_freq`, …) become plain attributes when present
//!   (`configuration_utils.py:496-503`, 5.20.0) and otherwise take the default of vLLM's own
//!   `getattr(config, key, default)` ([`Origin::VllmDefault`]).
//! - `model_executor/models/registry.py:126`: `GlmMoeDsaForCausalLM` →
//!   `vllm.models.deepseek_v32`, which on CUDA (`models/deepseek_v32/__init__.py:17-22`) is
//!   `nvidia/model.py`'s `DeepseekV32ForCausalLM` (a `DeepseekV2ForCausalLM` with the DSA backbone,
//!   `DeepseekV32Attention` from `models/deepseek_v32/attention.py`, and `DeepseekV2MoE` from
//!   `model_executor/models/deepseek_v2.py`). CPU/XPU use `deepseek_v2.py`'s `GlmMoeDsaForCausalLM`,
//!   which reads the same keys with the same defaults (line numbers given where they differ).

mod check;
mod read;
mod rules;
mod table;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

use serde::Serialize;
use serde_json::Value;

use super::config::Source;

pub use check::check;
pub use read::HfConfig;

/// Every dimension and count transformers' `GlmMoeDsaConfig` declares (the fields compared value
/// for value), with `c`'s value of it, in the comparison's order: what a config.json written for
/// `c` must say (`glmcheck export`).
pub fn declared_dims(c: &crate::arch::Config) -> Vec<(&'static str, usize)> {
    table::DIMS.iter().map(|d| (d.field, (d.gguf)(c))).collect()
}

/// Largest config.json read (GLM-5's is 1.6 KiB; one with a quantization block a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The relative difference below which two floats are the same value (the GGUF stores f32).
const FLOAT_REL_TOL: f64 = 1e-6;

/// A config.json that cannot be read or whose fields have the wrong type.
#[derive(Debug, thiserror::Error)]
pub enum HfConfigError {
    #[error("{}: cannot read the HF config: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: is a directory, not a config.json", path.display())]
    IsDirectory { path: PathBuf },
    #[error("{}: {size} bytes: too large for a config.json (at most {max})", path.display())]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    #[error("{}: not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: the top level must be a JSON object, found {found}", path.display())]
    NotObject { path: PathBuf, found: &'static str },
    #[error("{}: field `{field}`: expected {expected}, found {found}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        expected: &'static str,
        found: String,
    },
}

/// A key of config.json as written.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", content = "value", rename_all = "snake_case")]
pub enum Key<T> {
    Absent,
    /// `"key": null` (vLLM's `getattr` then returns None, not its default).
    Null,
    Set(T),
}

impl<T> Key<T> {
    pub fn set(&self) -> Option<&T> {
        match self {
            Key::Set(v) => Some(v),
            _ => None,
        }
    }

    pub fn is_absent(&self) -> bool {
        matches!(self, Key::Absent)
    }
}

/// A `rope_parameters` / `rope_scaling` object: the keys vLLM's DSA attention reads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RopeDict {
    /// `rope_type` (or the legacy `type`); None: neither key.
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    /// `{}`: falsy in Python, so `rope_scaling or rope_parameters` passes over it.
    #[serde(skip)]
    pub empty: bool,
}

/// `index_topk_pattern`: its entries, and whether it was written as one string (`"FFSS…"`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IndexPattern {
    pub entries: Vec<String>,
    pub from_string: bool,
}

/// Where the value vLLM ends up with comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// The key in config.json.
    ConfigJson,
    /// Absent: transformers' `GlmMoeDsaConfig` class default.
    TransformersDefault,
    /// Absent and not declared by the class: vLLM's `getattr(config, key, default)`.
    VllmDefault,
}

/// How a field's row ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// vLLM computes what the GGUF says.
    Agrees,
    /// vLLM computes something else: the command fails (exit 1).
    Finding,
    /// The value differs (or is unusual) without changing what vLLM computes for a request.
    Harmless,
}

/// One field vLLM reads, side by side.
#[derive(Debug, Clone, Serialize)]
pub struct FieldRow {
    pub field: String,
    /// As written in config.json.
    pub json: Key<Value>,
    /// The value vLLM 0.33 ends up with (null: None).
    pub vllm: Value,
    pub vllm_from: Origin,
    /// The GGUF's value (what llama.cpp, transformers' checkpoint and glmcheck compute with).
    pub gguf: Value,
    /// Where the GGUF's value came from; None: fixed by the glm-dsa architecture itself.
    pub gguf_from: Option<Source>,
    pub verdict: Verdict,
}

/// Why vLLM would refuse to build the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
pub enum StartFailure {
    /// deepseek_v2.py:314-318 raises ValueError for any `hidden_act` but silu.
    UnsupportedActivation { hidden_act: String },
    /// attention.py:171-173 computes `… % index_topk_freq`: ZeroDivisionError.
    ZeroIndexTopkFreq,
    /// attention.py:162 reads `config.rope_parameters["factor"]` for any non-default rope type.
    RopeWithoutFactor { rope_type: String },
}

/// A field that makes vLLM compute something else than the GGUF (or that differs harmlessly).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FindingKind {
    /// `topk_method` is not `noaux_tc`: no `e_score_correction_bias` parameter exists.
    NoCorrectionBias { topk_method: Option<String> },
    /// vLLM scores the router with another function than the GGUF's.
    Scoring {
        vllm: Option<String>,
        vllm_from: Origin,
        gguf: String,
    },
    /// The indexer's q/k rope is rotated half-split (NeoX) instead of interleaved.
    IndexerRopeNeox { indexer_rope_interleave: Key<bool> },
    /// `index_topk` is absent: transformers' default top-k applies (DSA stays on).
    IndexTopkDefault { vllm: u64, gguf: u64 },
    /// vLLM builds no indexer on these layers (they reuse the previous layer's top-k).
    IndexerSkipped {
        layers: Vec<usize>,
        num_hidden_layers: usize,
    },
    /// transformers' `indexer_types` and vLLM's schedule disagree on these layers.
    IndexerTypesDisagree {
        transformers_shared: Vec<usize>,
        vllm_skipped: Vec<usize>,
    },
    /// A RoPE scaling type: vLLM's rope and softmax scale change.
    RopeScaling {
        rope_type: String,
        vllm_rope: String,
        factor: Option<f64>,
        /// The factor the attention softmax scale is multiplied by (mscale²; 1 when not yarn).
        softmax_scale_factor: f64,
    },
    /// `moe_layer_freq` ≠ 1: these layers get a dense MLP in vLLM.
    MoeLayerFreq {
        moe_layer_freq: u64,
        dense: Vec<usize>,
    },
    /// `model_type` is not `glm_moe_dsa`.
    ModelType { model_type: Option<String> },
    /// `architectures[0]` is not `GlmMoeDsaForCausalLM`.
    Architecture { architecture: Option<String> },
    /// vLLM refuses to build the model.
    StartFailure(StartFailure),
    /// The GGUF has no lm_head (tied) or the config ties while the GGUF does not.
    TiedEmbeddings { vllm_tie: bool, gguf_tied: bool },
    /// MTP layer count: vLLM's speculative (MTP) decoding and MTP-weight skipping follow it.
    NextnLayers {
        vllm: u64,
        vllm_from: Origin,
        gguf: u64,
    },
    /// A plain value mismatch.
    Mismatch {
        vllm: Value,
        vllm_from: Origin,
        gguf: Value,
        /// The GGUF does not carry the key: the GGUF side is GLM-5's default.
        gguf_defaulted: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub field: String,
    /// Differs without changing what vLLM computes for a request (does not fail the command).
    pub harmless: bool,
    #[serde(flatten)]
    pub kind: FindingKind,
}

/// The whole comparison.
#[derive(Debug, Clone, Serialize)]
pub struct HfConfigCheck {
    pub path: String,
    pub rows: Vec<FieldRow>,
    pub findings: Vec<Finding>,
}

impl HfConfigCheck {
    /// Whether any finding changes what vLLM computes (the command exits 1).
    pub fn fails(&self) -> bool {
        self.findings.iter().any(|f| !f.harmless)
    }
}
