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

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use super::config::{Source, MAX_BLOCKS};
use super::Config;

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

/// The dimension and count fields compared value for value: (HF name, transformers 5.20's
/// `GlmMoeDsaConfig` default, the GGUF's value). Every one is declared by the class
/// (`configuration_glm_moe_dsa.py:92-130`), so an absent key is its default, never unset.
type DimGetter = fn(&Config) -> usize;
const DIMS: &[(&str, u64, DimGetter)] = &[
    // nvidia/model.py:216-217 `make_layers(config.num_hidden_layers, …)`
    ("num_hidden_layers", 78, |c| c.num_hidden_layers),
    // deepseek_v32/attention.py:138 `hidden_size = config.hidden_size`
    ("hidden_size", 6144, |c| c.hidden_size),
    // attention.py:144 `num_heads = config.num_attention_heads` (heads per rank = num_heads / tp)
    ("num_attention_heads", 64, |c| c.num_attention_heads),
    // attention.py:142 `q_lora_rank = config.q_lora_rank`
    ("q_lora_rank", 2048, |c| c.q_lora_rank),
    // attention.py:143 `kv_lora_rank = config.kv_lora_rank`
    ("kv_lora_rank", 512, |c| c.kv_lora_rank),
    // attention.py:139 `qk_nope_head_dim = config.qk_nope_head_dim`
    ("qk_nope_head_dim", 192, |c| c.qk_nope_head_dim),
    // attention.py:140 `qk_rope_head_dim = config.qk_rope_head_dim` (also the indexer's rope dim, :68)
    ("qk_rope_head_dim", 64, |c| c.qk_rope_head_dim),
    // attention.py:141 `v_head_dim = config.v_head_dim`
    ("v_head_dim", 256, |c| c.v_head_dim),
    // deepseek_v2.py:309,323,377 `config.n_routed_experts` (gate rows, FusedMoE num_experts)
    ("n_routed_experts", 256, |c| c.n_routed_experts),
    // deepseek_v2.py:378 `top_k=config.num_experts_per_tok`
    ("num_experts_per_tok", 8, |c| c.num_experts_per_tok),
    // deepseek_v2.py:362 `intermediate_size = config.moe_intermediate_size * config.n_shared_experts`
    ("n_shared_experts", 1, |c| c.n_shared_experts),
    // deepseek_v2.py:380 `intermediate_size=config.moe_intermediate_size`
    ("moe_intermediate_size", 2048, |c| c.moe_intermediate_size),
    // nvidia/model.py:109 `intermediate_size=config.intermediate_size` (the dense MLP)
    ("intermediate_size", 12288, |c| c.intermediate_size),
    // nvidia/model.py:93 `layer_idx >= config.first_k_dense_replace` (deepseek_v2.py:1295 alike)
    ("first_k_dense_replace", 3, |c| c.first_k_dense_replace),
    // deepseek_v2.py:384 `num_expert_group=getattr(config, "n_group", 1)` (the class declares 1)
    ("n_group", 1, |c| c.n_group),
    // deepseek_v2.py:385 `topk_group=getattr(config, "topk_group", 1)` (the class declares 1)
    ("topk_group", 1, |c| c.topk_group),
    // attention.py:66 `self.n_head = config.index_n_heads`
    ("index_n_heads", 32, |c| c.index_n_heads),
    // attention.py:67 `self.head_dim = config.index_head_dim`
    ("index_head_dim", 128, |c| c.index_head_dim),
    // attention.py:65 `self.topk_tokens = config.index_topk`; nvidia/model.py:188-197 allocates
    // the top-k buffer from it unconditionally ("DSA is always sparse"). Handled by its own rule.
    ("index_topk", 2048, |c| c.index_topk),
    // nvidia/model.py:182,205 and deepseek_v2.py:1919 `config.vocab_size` (embedding, lm_head)
    ("vocab_size", 154880, |c| c.vocab_size),
    // attention.py:151 `getattr(config, "max_position_embeddings", 8192)`: the rope cache length
    // (the class declares 202752). Harmless for plain RoPE: the frequencies do not depend on it.
    ("max_position_embeddings", 202752, |c| {
        c.max_position_embeddings
    }),
    // Never read by DeepseekV32Attention (attention.py:126-284): MLA caches one latent per token.
    // The GGUF's head_count_kv is 1 (the latent); HF's value is the head count. Harmless.
    ("num_key_value_heads", 64, |c| c.num_key_value_heads),
];

/// Keys read as non-negative integers that the class does not declare (vLLM's getattr default).
const UNDECLARED_UINTS: &[&str] = &[
    "moe_layer_freq",
    "index_topk_freq",
    "index_skip_topk_offset",
    "num_nextn_predict_layers",
];

/// A deployment's config.json, with the fields vLLM reads typed.
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub path: PathBuf,
    pub model_type: Key<String>,
    pub architectures: Key<Vec<String>>,
    pub hidden_act: Key<String>,
    pub topk_method: Key<String>,
    pub scoring_func: Key<String>,
    /// null reads as False in vLLM's `not getattr(…)`.
    pub indexer_rope_interleave: Key<bool>,
    pub tie_word_embeddings: Key<bool>,
    pub norm_topk_prob: Key<bool>,
    pub routed_scaling_factor: Key<f64>,
    pub rms_norm_eps: Key<f64>,
    /// The top-level (legacy) `rope_theta`.
    pub rope_theta: Key<f64>,
    pub rope_parameters: Key<RopeDict>,
    pub rope_scaling: Key<RopeDict>,
    pub index_topk_pattern: Key<IndexPattern>,
    /// transformers' per-layer indexer modes (`"full"` / `"shared"`); vLLM does not read it.
    pub indexer_types: Key<Vec<String>>,
    uints: Vec<(&'static str, Key<u64>)>,
}

struct Fields<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a bool",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A value as the error shows it: short, one line.
fn shown(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 {
        format!(
            "{} ({}…)",
            json_kind(v),
            s.chars().take(40).collect::<String>()
        )
    } else {
        s
    }
}

impl Fields<'_> {
    fn err(&self, field: &str, expected: &'static str, found: &Value) -> HfConfigError {
        HfConfigError::Field {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            expected,
            found: shown(found),
        }
    }

    /// Reads `key` with `extract`; `null_ok`: an explicit null is kept as [`Key::Null`] (else an error).
    fn get<T>(
        &self,
        key: &str,
        expected: &'static str,
        null_ok: bool,
        extract: impl Fn(&Value) -> Option<T>,
    ) -> Result<Key<T>, HfConfigError> {
        match self.map.get(key) {
            None => Ok(Key::Absent),
            Some(Value::Null) if null_ok => Ok(Key::Null),
            Some(v) => extract(v)
                .map(Key::Set)
                .ok_or_else(|| self.err(key, expected, v)),
        }
    }

    fn uint(&self, key: &str) -> Result<Key<u64>, HfConfigError> {
        self.get(key, "a non-negative integer", false, Value::as_u64)
    }

    fn float(&self, key: &str) -> Result<Key<f64>, HfConfigError> {
        self.get(key, "a number", false, Value::as_f64)
    }

    fn boolean(&self, key: &str, null_ok: bool) -> Result<Key<bool>, HfConfigError> {
        self.get(key, "true or false", null_ok, Value::as_bool)
    }

    fn string(&self, key: &str, null_ok: bool) -> Result<Key<String>, HfConfigError> {
        self.get(key, "a string", null_ok, |v| v.as_str().map(str::to_string))
    }

    fn strings(&self, key: &str) -> Result<Key<Vec<String>>, HfConfigError> {
        self.get(key, "an array of strings", true, |v| {
            v.as_array()?
                .iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect()
        })
    }

    fn rope(&self, key: &str) -> Result<Key<RopeDict>, HfConfigError> {
        let Some(v) = self.map.get(key) else {
            return Ok(Key::Absent);
        };
        let obj = match v {
            Value::Null => return Ok(Key::Null),
            Value::Object(o) => o,
            other => return Err(self.err(key, "an object", other)),
        };
        let sub = |name: &str| format!("{key}.{name}");
        let num = |name: &str| -> Result<Option<f64>, HfConfigError> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| self.err(&sub(name), "a number", x)),
            }
        };
        let text = |name: &str| -> Result<Option<String>, HfConfigError> {
            match obj.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_str()
                    .map(|s| Some(s.to_string()))
                    .ok_or_else(|| self.err(&sub(name), "a string", x)),
            }
        };
        // transformers' standardize_rope_params: `rope_type`, else the legacy `type`.
        let rope_type = match text("rope_type")? {
            Some(t) => Some(t),
            None => text("type")?,
        };
        // mscale_all_dim may be written as a bool (vLLM reads it `float(…)`).
        let mscale_all_dim = match obj.get("mscale_all_dim") {
            Some(Value::Bool(b)) => Some(if *b { 1.0 } else { 0.0 }),
            _ => num("mscale_all_dim")?,
        };
        Ok(Key::Set(RopeDict {
            rope_type,
            rope_theta: num("rope_theta")?,
            factor: num("factor")?,
            mscale_all_dim,
            attention_factor: num("attention_factor")?,
            empty: obj.is_empty(),
        }))
    }

    /// `index_topk_pattern`: a string (`"FFSS…"`) or a list of strings.
    fn pattern(&self, key: &str) -> Result<Key<IndexPattern>, HfConfigError> {
        self.get(key, "a string or an array of strings", true, |v| match v {
            Value::String(s) => Some(IndexPattern {
                entries: s.chars().map(String::from).collect(),
                from_string: true,
            }),
            Value::Array(a) => Some(IndexPattern {
                entries: a
                    .iter()
                    .map(|x| x.as_str().map(str::to_string))
                    .collect::<Option<_>>()?,
                from_string: false,
            }),
            _ => None,
        })
    }
}

impl HfConfig {
    /// Reads and types `path` (a deployment's config.json). Unknown keys are ignored.
    pub fn read(path: &Path) -> Result<Self, HfConfigError> {
        let io = |source| HfConfigError::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.is_dir() {
            return Err(HfConfigError::IsDirectory {
                path: path.to_path_buf(),
            });
        }
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(HfConfigError::TooLarge {
                path: path.to_path_buf(),
                size: meta.len(),
                max: MAX_CONFIG_BYTES,
            });
        }
        let mut text = String::new();
        use std::io::Read;
        std::fs::File::open(path)
            .map_err(io)?
            // Bounded even when the size lied (a FIFO, /proc): never more than the limit + 1.
            .take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(HfConfigError::TooLarge {
                path: path.to_path_buf(),
                size: text.len() as u64,
                max: MAX_CONFIG_BYTES,
            });
        }
        Self::parse(path, &text)
    }

    /// Types the JSON text of a config.json (`path` names it in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Self, HfConfigError> {
        let value: Value = serde_json::from_str(text).map_err(|source| HfConfigError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Value::Object(map) = &value else {
            return Err(HfConfigError::NotObject {
                path: path.to_path_buf(),
                found: json_kind(&value),
            });
        };
        let f = Fields { path, map };
        let mut uints = Vec::new();
        for (name, _, _) in DIMS {
            uints.push((*name, f.uint(name)?));
        }
        for name in UNDECLARED_UINTS {
            uints.push((*name, f.uint(name)?));
        }
        Ok(HfConfig {
            path: path.to_path_buf(),
            model_type: f.string("model_type", true)?,
            architectures: f.strings("architectures")?,
            hidden_act: f.string("hidden_act", false)?,
            topk_method: f.string("topk_method", true)?,
            scoring_func: f.string("scoring_func", true)?,
            indexer_rope_interleave: f.boolean("indexer_rope_interleave", true)?,
            tie_word_embeddings: f.boolean("tie_word_embeddings", false)?,
            norm_topk_prob: f.boolean("norm_topk_prob", false)?,
            routed_scaling_factor: f.float("routed_scaling_factor")?,
            rms_norm_eps: f.float("rms_norm_eps")?,
            rope_theta: f.float("rope_theta")?,
            rope_parameters: f.rope("rope_parameters")?,
            rope_scaling: f.rope("rope_scaling")?,
            index_topk_pattern: f.pattern("index_topk_pattern")?,
            indexer_types: f.strings("indexer_types")?,
            uints,
        })
    }

    /// An integer field as written.
    pub fn uint(&self, name: &str) -> Key<u64> {
        self.uints
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(Key::Absent, |(_, k)| k.clone())
    }
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

/// Builds rows and findings.
struct Checker<'a> {
    cfg: &'a Config,
    sources: &'a [(String, Source)],
    rows: Vec<FieldRow>,
    findings: Vec<Finding>,
}

fn same_f64(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= FLOAT_REL_TOL * a.abs().max(b.abs())
}

fn key_value<T: Serialize>(k: &Key<T>) -> Key<Value> {
    match k {
        Key::Absent => Key::Absent,
        Key::Null => Key::Null,
        Key::Set(v) => Key::Set(serde_json::to_value(v).unwrap_or(Value::Null)),
    }
}

impl Checker<'_> {
    fn source(&self, field: &str) -> Option<Source> {
        self.sources
            .iter()
            .find(|(f, _)| f == field)
            .map(|(_, s)| s.clone())
    }

    fn gguf_defaulted(&self, field: &str) -> bool {
        matches!(self.source(field), Some(Source::Default(_)))
    }

    fn finding(&mut self, field: &str, harmless: bool, kind: FindingKind) {
        self.findings.push(Finding {
            field: field.to_string(),
            harmless,
            kind,
        });
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        field: &str,
        json: Key<Value>,
        vllm: Value,
        vllm_from: Origin,
        gguf: Value,
        gguf_from: Option<Source>,
        verdict: Verdict,
    ) {
        self.rows.push(FieldRow {
            field: field.to_string(),
            json,
            vllm,
            vllm_from,
            gguf,
            gguf_from,
            verdict,
        });
    }

    /// The verdict of a field from the findings recorded for it so far.
    fn verdict_of(&self, field: &str) -> Verdict {
        let mut v = Verdict::Agrees;
        for f in self.findings.iter().filter(|f| f.field == field) {
            if !f.harmless {
                return Verdict::Finding;
            }
            v = Verdict::Harmless;
        }
        v
    }

    /// A value compared with the GGUF's: a [`FindingKind::Mismatch`] when they differ.
    #[allow(clippy::too_many_arguments)]
    fn compare(
        &mut self,
        field: &str,
        json: Key<Value>,
        vllm: Value,
        vllm_from: Origin,
        gguf: Value,
        same: bool,
        harmless: bool,
    ) {
        if !same {
            let gguf_defaulted = self.gguf_defaulted(field);
            self.finding(
                field,
                harmless,
                FindingKind::Mismatch {
                    vllm: vllm.clone(),
                    vllm_from,
                    gguf: gguf.clone(),
                    gguf_defaulted,
                },
            );
        }
        let verdict = self.verdict_of(field);
        let src = self.source(field);
        self.row(field, json, vllm, vllm_from, gguf, src, verdict);
    }
}

/// The value of a declared field: the key, else the class default.
fn declared<T: Clone>(k: &Key<T>, default: T) -> (T, Origin) {
    match k {
        Key::Set(v) => (v.clone(), Origin::ConfigJson),
        _ => (default, Origin::TransformersDefault),
    }
}

/// What vLLM's `getattr(config, key, default)` returns: the key (null is None), else `default`.
fn undeclared<T: Clone>(k: &Key<T>, default: Option<T>) -> (Option<T>, Origin) {
    match k {
        Key::Set(v) => (Some(v.clone()), Origin::ConfigJson),
        Key::Null => (None, Origin::ConfigJson),
        Key::Absent => (default, Origin::VllmDefault),
    }
}

/// The RoPE vLLM builds: transformers' standardization, then vLLM's DSA attention.
struct Rope {
    theta: f64,
    theta_from: Origin,
    rope_type: String,
    factor: Option<f64>,
    mscale_all_dim: Option<f64>,
    attention_factor: Option<f64>,
}

fn rope_of(hf: &HfConfig) -> Rope {
    // modeling_rope_utils.py:752-781 (5.20.0) `convert_rope_params_to_dict`: `rope_scaling` wins
    // over `rope_parameters` when truthy; the theta is the dict's `rope_theta`, else the top-level
    // `rope_theta`, else `default_theta` = 10000.0 (:739); the type is `rope_type`, else `type`,
    // else "default" (:802). GlmMoeDsaConfig does not override default_theta.
    let dict = rope_dict(hf);
    let (theta, theta_from) = match (dict.and_then(|d| d.rope_theta), hf.rope_theta.set()) {
        (Some(t), _) => (t, Origin::ConfigJson),
        (None, Some(t)) => (*t, Origin::ConfigJson),
        (None, None) => (10_000.0, Origin::TransformersDefault),
    };
    Rope {
        theta,
        theta_from,
        rope_type: dict
            .and_then(|d| d.rope_type.clone())
            .unwrap_or_else(|| "default".into()),
        factor: dict.and_then(|d| d.factor),
        mscale_all_dim: dict.and_then(|d| d.mscale_all_dim),
        attention_factor: dict.and_then(|d| d.attention_factor),
    }
}

/// The rope dict transformers keeps: `rope_scaling or rope_parameters` (Python truthiness).
fn rope_dict(hf: &HfConfig) -> Option<&RopeDict> {
    match (&hf.rope_scaling, &hf.rope_parameters) {
        (Key::Set(d), _) if !d.empty => Some(d),
        (_, Key::Set(d)) => Some(d),
        _ => None,
    }
}

/// vLLM's `yarn_get_mscale` (rotary_embedding/common.py:73-76).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Compares `hf` with the GGUF's config (`cfg`, and `sources`: where each of its fields came from).
pub fn check(hf: &HfConfig, cfg: &Config, sources: &[(String, Source)]) -> HfConfigCheck {
    let mut c = Checker {
        cfg,
        sources,
        rows: Vec::new(),
        findings: Vec::new(),
    };
    identity(&mut c, hf);
    routing(&mut c, hf);
    dimensions(&mut c, hf);
    indexer(&mut c, hf);
    rope(&mut c, hf);
    norms_and_heads(&mut c, hf);
    HfConfigCheck {
        path: hf.path.display().to_string(),
        rows: c.rows,
        findings: c.findings,
    }
}

fn identity(c: &mut Checker, hf: &HfConfig) {
    // transformers_utils/config.py:417-447: the model_type picks the config class (AutoConfig →
    // GlmMoeDsaConfig and its defaults for `glm_moe_dsa`; vLLM's registry's DeepseekV3Config for
    // `deepseek_v32`, :132), and deepseek_v2.py:139-142 forces f32 router logits only for
    // `model_type == "glm_moe_dsa"` ("Older GLM-5/5.2 configs require fp32 routing").
    let model_type = hf.model_type.set().cloned();
    if model_type.as_deref() != Some("glm_moe_dsa") {
        c.finding(
            "model_type",
            false,
            FindingKind::ModelType {
                model_type: model_type.clone(),
            },
        );
    }
    let verdict = c.verdict_of("model_type");
    c.row(
        "model_type",
        key_value(&hf.model_type),
        model_type.map_or(Value::Null, Value::String),
        Origin::ConfigJson,
        Value::String("glm_moe_dsa".into()),
        None,
        verdict,
    );
    // registry.py:126 maps `GlmMoeDsaForCausalLM` to vllm.models.deepseek_v32 (and :95-98
    // `DeepseekV32ForCausalLM` to the same module's class, identical on CUDA); anything else
    // builds another model.
    let arch = hf.architectures.set().and_then(|a| a.first()).cloned();
    let harmless = arch.as_deref() == Some("DeepseekV32ForCausalLM");
    if arch.as_deref() != Some("GlmMoeDsaForCausalLM") {
        c.finding(
            "architectures",
            harmless,
            FindingKind::Architecture {
                architecture: arch.clone(),
            },
        );
    }
    let verdict = c.verdict_of("architectures");
    c.row(
        "architectures",
        key_value(&hf.architectures),
        arch.map_or(Value::Null, Value::String),
        Origin::ConfigJson,
        Value::String("GlmMoeDsaForCausalLM".into()),
        None,
        verdict,
    );
    // deepseek_v2.py:314-318: `if config.hidden_act != "silu": raise ValueError(…)`. The class
    // declares "silu" (configuration_glm_moe_dsa.py:112).
    let (act, from) = declared(&hf.hidden_act, "silu".to_string());
    if act != "silu" {
        c.finding(
            "hidden_act",
            false,
            FindingKind::StartFailure(StartFailure::UnsupportedActivation {
                hidden_act: act.clone(),
            }),
        );
    }
    let verdict = c.verdict_of("hidden_act");
    c.row(
        "hidden_act",
        key_value(&hf.hidden_act),
        Value::String(act),
        from,
        Value::String("silu".into()),
        None,
        verdict,
    );
}

fn routing(c: &mut Checker, hf: &HfConfig) {
    // deepseek_v2.py:327-332:
    //   if getattr(config, "topk_method", None) == "noaux_tc":
    //       self.gate.e_score_correction_bias = nn.Parameter(torch.empty(n_routed_experts, f32))
    //   else:
    //       self.gate.e_score_correction_bias = None
    // and :390 passes it to FusedMoE as `e_score_correction_bias`. GLM-5's router always adds the
    // bias (`exp_probs_b` in the GGUF; transformers' GlmMoeDsaTopkRouter). Not declared by the
    // class (configuration_glm_moe_dsa.py:92-133), so an absent key is None.
    let (method, from) = undeclared(&hf.topk_method, None);
    if method.as_deref() != Some("noaux_tc") {
        c.finding(
            "topk_method",
            false,
            FindingKind::NoCorrectionBias {
                topk_method: method.clone(),
            },
        );
    }
    let verdict = c.verdict_of("topk_method");
    c.row(
        "topk_method",
        key_value(&hf.topk_method),
        method.map_or(Value::Null, Value::String),
        from,
        Value::String("noaux_tc".into()),
        None,
        verdict,
    );

    // deepseek_v2.py:387 `scoring_func=getattr(config, "scoring_func", "softmax")`: not declared
    // by the class, so an absent key routes by softmax. The GGUF's `expert_gating_func` (absent:
    // sigmoid, GLM-5's) is what llama.cpp and glmcheck use.
    let (func, from) = undeclared(&hf.scoring_func, Some("softmax".to_string()));
    let gguf = c.cfg.scoring_func.clone();
    if func.as_deref() != Some(gguf.as_str()) {
        c.finding(
            "scoring_func",
            false,
            FindingKind::Scoring {
                vllm: func.clone(),
                vllm_from: from,
                gguf: gguf.clone(),
            },
        );
    }
    let verdict = c.verdict_of("scoring_func");
    let src = c.source("scoring_func");
    c.row(
        "scoring_func",
        key_value(&hf.scoring_func),
        func.map_or(Value::Null, Value::String),
        from,
        Value::String(gguf),
        src,
        verdict,
    );

    // deepseek_v2.py:381 `renormalize=config.norm_topk_prob` (declared: True, :111).
    let (norm, from) = declared(&hf.norm_topk_prob, true);
    let gguf = c.cfg.norm_topk_prob;
    c.compare(
        "norm_topk_prob",
        key_value(&hf.norm_topk_prob),
        Value::Bool(norm),
        from,
        Value::Bool(gguf),
        norm == gguf,
        false,
    );

    // deepseek_v2.py:305 `self.routed_scaling_factor = getattr(config, "routed_scaling_factor",
    // 1.0)` → FusedMoE :388 (declared: 2.5, :102, so an absent key is 2.5, not 1.0).
    let (scale, from) = declared(&hf.routed_scaling_factor, 2.5);
    let gguf = c.cfg.routed_scaling_factor;
    c.compare(
        "routed_scaling_factor",
        key_value(&hf.routed_scaling_factor),
        Value::from(scale),
        from,
        Value::from(gguf),
        same_f64(scale, gguf),
        false,
    );

    // nvidia/model.py:74,94 `moe_layer_freq = getattr(config, "moe_layer_freq", 1)`; a layer is
    // MoE only when `layer_idx % moe_layer_freq == 0` (deepseek_v2.py:1269,1296 alike). The GGUF
    // (and transformers' mlp_layer_types) make every layer from first_k_dense_replace on MoE.
    let (freq, from) = undeclared(&hf.uint("moe_layer_freq"), Some(1));
    let freq = freq.unwrap_or(1);
    if freq != 1 {
        let n = c.cfg.num_hidden_layers.min(MAX_BLOCKS);
        let dense: Vec<usize> = (c.cfg.first_k_dense_replace..n)
            .filter(|l| freq == 0 || !(*l as u64).is_multiple_of(freq))
            .collect();
        c.finding(
            "moe_layer_freq",
            dense.is_empty(),
            FindingKind::MoeLayerFreq {
                moe_layer_freq: freq,
                dense,
            },
        );
    }
    let verdict = c.verdict_of("moe_layer_freq");
    c.row(
        "moe_layer_freq",
        key_value(&hf.uint("moe_layer_freq")),
        Value::from(freq),
        from,
        Value::from(1u64),
        None,
        verdict,
    );
}

fn dimensions(c: &mut Checker, hf: &HfConfig) {
    for (name, default, get) in DIMS {
        if *name == "index_topk" {
            continue; // indexer()
        }
        let json = hf.uint(name);
        let (v, from) = declared(&json, *default);
        let gguf = get(c.cfg) as u64;
        let harmless = matches!(*name, "max_position_embeddings" | "num_key_value_heads");
        c.compare(
            name,
            key_value(&json),
            Value::from(v),
            from,
            Value::from(gguf),
            v == gguf,
            harmless,
        );
    }
}

/// vLLM's per-layer "skip the indexer" flags for layers `0..n` (attention.py:166-177;
/// deepseek_v2.py:1144-1158 alike). None: `index_topk_freq` is 0 (a ZeroDivisionError).
fn vllm_skipped(hf: &HfConfig, n: usize) -> Option<Vec<usize>> {
    let freq = hf.uint("index_topk_freq").set().copied().unwrap_or(1);
    let offset = hf
        .uint("index_skip_topk_offset")
        .set()
        .copied()
        .unwrap_or(2);
    match hf.index_topk_pattern.set() {
        Some(p) => Some(
            (0..n)
                .filter(|&l| p.entries.get(l).map(String::as_str) == Some("S"))
                .collect(),
        ),
        None if freq == 0 => None,
        None => Some(
            (0..n)
                .filter(|&l| !(l as u64 + 1).saturating_sub(offset).is_multiple_of(freq))
                .collect(),
        ),
    }
}

/// transformers' "shared" indexer layers (configuration_glm_moe_dsa.py:137-148): `indexer_types`,
/// else the pattern (a string's `S` → "shared"; a list is taken as the types themselves), else the
/// freq/offset schedule with `freq = max(freq, 1)`.
fn transformers_shared(hf: &HfConfig, n: usize) -> Vec<usize> {
    if let Some(t) = hf.indexer_types.set() {
        return t
            .iter()
            .enumerate()
            .filter(|(_, s)| s.as_str() == "shared")
            .map(|(l, _)| l)
            .collect();
    }
    if let Some(p) = hf.index_topk_pattern.set() {
        let shared = if p.from_string { "S" } else { "shared" };
        return (0..n.min(p.entries.len()))
            .filter(|&l| p.entries[l] == shared)
            .collect();
    }
    let freq = hf
        .uint("index_topk_freq")
        .set()
        .copied()
        .unwrap_or(1)
        .max(1);
    let offset = hf
        .uint("index_skip_topk_offset")
        .set()
        .copied()
        .unwrap_or(2);
    (0..n)
        .filter(|&l| !(l as u64 + 1).saturating_sub(offset).is_multiple_of(freq))
        .collect()
}

fn indexer(c: &mut Checker, hf: &HfConfig) {
    // index_topk: declared by the class with 2048 (configuration_glm_moe_dsa.py:125), so removing
    // the key does NOT switch DSA off in vLLM 0.33: `hasattr(config, "index_topk")` stays true
    // (deepseek_v2.py:1138,1439) and the CUDA model is sparse unconditionally (nvidia/model.py:
    // 188-197 allocates `config.index_topk` columns; attention.py:212 `use_sparse=True`). Each
    // query attends to its top-2048 keys: every key while the context is at most 2048 tokens.
    let json = hf.uint("index_topk");
    let (topk, from) = declared(&json, 2048);
    let gguf = c.cfg.index_topk as u64;
    if json.is_absent() {
        c.finding(
            "index_topk",
            topk == gguf,
            FindingKind::IndexTopkDefault { vllm: topk, gguf },
        );
        let verdict = c.verdict_of("index_topk");
        let src = c.source("index_topk");
        c.row(
            "index_topk",
            key_value(&json),
            Value::from(topk),
            from,
            Value::from(gguf),
            src,
            verdict,
        );
    } else {
        c.compare(
            "index_topk",
            key_value(&json),
            Value::from(topk),
            from,
            Value::from(gguf),
            topk == gguf,
            false,
        );
    }

    // attention.py:279-284 (deepseek_v2.py:1173-1177 alike):
    //   self.indexer_rope_emb = get_rope(…, is_neox_style=not getattr(config,
    //       "indexer_rope_interleave", False))
    // and :244 passes the same flag to the fused norm+rope kernels. Not declared by the class:
    // absent (or null, or false) is NeoX half-split. transformers 5.20/5.23 always interleaves the
    // indexer's rope (modeling_glm_moe_dsa.py:220-221 `apply_rotary_pos_emb_interleave`), as do
    // llama.cpp and glmcheck.
    let (inter, from) = undeclared(&hf.indexer_rope_interleave, Some(false));
    let inter = inter.unwrap_or(false);
    if !inter {
        c.finding(
            "indexer_rope_interleave",
            false,
            FindingKind::IndexerRopeNeox {
                indexer_rope_interleave: hf.indexer_rope_interleave.clone(),
            },
        );
    }
    let verdict = c.verdict_of("indexer_rope_interleave");
    c.row(
        "indexer_rope_interleave",
        key_value(&hf.indexer_rope_interleave),
        Value::Bool(inter),
        from,
        Value::Bool(true),
        None,
        verdict,
    );

    // The indexer schedule: attention.py:166-187 builds an indexer only on layers with
    // `not skip_topk` (MTP layers always); a skipped layer reuses the previous layer's top-k.
    // transformers turns the same keys (or an explicit `indexer_types`) into "shared" layers.
    // glmcheck's forward, like the GGUF's per-layer indexer tensors, runs every layer's indexer.
    let n = (hf
        .uint("num_hidden_layers")
        .set()
        .copied()
        .unwrap_or(78)
        .min(MAX_BLOCKS as u64)) as usize;
    let field = "index_topk_freq";
    let schedule_keys = [
        hf.uint("index_topk_freq").is_absent(),
        hf.uint("index_skip_topk_offset").is_absent(),
        hf.index_topk_pattern.is_absent(),
        hf.indexer_types.is_absent(),
    ];
    if schedule_keys.iter().all(|a| *a) {
        return;
    }
    let tf = transformers_shared(hf, n);
    match vllm_skipped(hf, n) {
        None => c.finding(
            field,
            false,
            FindingKind::StartFailure(StartFailure::ZeroIndexTopkFreq),
        ),
        Some(skipped) => {
            if !skipped.is_empty() {
                c.finding(
                    field,
                    false,
                    FindingKind::IndexerSkipped {
                        layers: skipped.clone(),
                        num_hidden_layers: n,
                    },
                );
            }
            if skipped != tf {
                c.finding(
                    field,
                    false,
                    FindingKind::IndexerTypesDisagree {
                        transformers_shared: tf,
                        vllm_skipped: skipped,
                    },
                );
            }
        }
    }
    let verdict = c.verdict_of(field);
    let freq = hf.uint("index_topk_freq");
    let (v, from) = undeclared(&freq, Some(1));
    c.row(
        field,
        key_value(&freq),
        v.map_or(Value::Null, Value::from),
        from,
        Value::from(1u64),
        None,
        verdict,
    );
}

fn rope(c: &mut Checker, hf: &HfConfig) {
    let r = rope_of(hf);
    // attention.py:272-284 `get_rope(qk_rope_head_dim, …, rope_parameters=config.rope_parameters)`
    // for the MLA rope and the indexer's: the base is `rope_parameters["rope_theta"]`.
    let gguf = c.cfg.rope_theta;
    let json = match rope_dict(hf).and_then(|d| d.rope_theta) {
        Some(t) => Key::Set(Value::from(t)),
        None => key_value(&hf.rope_theta),
    };
    c.compare(
        "rope_theta",
        json,
        Value::from(r.theta),
        r.theta_from,
        Value::from(gguf),
        same_f64(r.theta, gguf),
        false,
    );

    // attention.py:153-164: any rope_type but "default" becomes "deepseek_llama_scaling" (when
    // `attention_factor == 1.0`) or "deepseek_yarn", and for deepseek_yarn the softmax scale is
    // multiplied by `yarn_get_mscale(factor, mscale_all_dim)²`. The GGUF's config carries no RoPE
    // scaling (GLM-5 has none), so glmcheck, like llama.cpp without rope.scaling keys, uses plain
    // RoPE.
    let field = "rope_type";
    let json = match rope_dict(hf) {
        Some(d) => key_value(&Key::Set(d.rope_type.clone())),
        None if hf.rope_scaling == Key::Null || hf.rope_parameters == Key::Null => Key::Null,
        None => Key::Absent,
    };
    let vllm_rope = if r.rope_type == "default" {
        "default".to_string()
    } else if r.attention_factor == Some(1.0) {
        "deepseek_llama_scaling".to_string()
    } else {
        "deepseek_yarn".to_string()
    };
    if r.rope_type != "default" {
        match r.factor {
            None => c.finding(
                field,
                false,
                FindingKind::StartFailure(StartFailure::RopeWithoutFactor {
                    rope_type: r.rope_type.clone(),
                }),
            ),
            Some(factor) => {
                let m = if vllm_rope == "deepseek_yarn" {
                    yarn_mscale(factor, r.mscale_all_dim.unwrap_or(0.0))
                } else {
                    1.0
                };
                c.finding(
                    field,
                    false,
                    FindingKind::RopeScaling {
                        rope_type: r.rope_type.clone(),
                        vllm_rope: vllm_rope.clone(),
                        factor: Some(factor),
                        softmax_scale_factor: m * m,
                    },
                );
            }
        }
    }
    let verdict = c.verdict_of(field);
    let from = if json.is_absent() {
        Origin::TransformersDefault
    } else {
        Origin::ConfigJson
    };
    c.row(
        field,
        json,
        Value::String(vllm_rope),
        from,
        Value::String("default".into()),
        None,
        verdict,
    );
}

fn norms_and_heads(c: &mut Checker, hf: &HfConfig) {
    // attention.py:253,261 (q_a/kv_a RMSNorm) and nvidia/model.py:116-119,228 (layer and final
    // norms) `eps=config.rms_norm_eps` (declared: 1e-5, :115).
    let (eps, from) = declared(&hf.rms_norm_eps, 1e-5);
    let gguf = c.cfg.rms_norm_eps;
    c.compare(
        "rms_norm_eps",
        key_value(&hf.rms_norm_eps),
        Value::from(eps),
        from,
        Value::from(gguf),
        same_f64(eps, gguf),
        false,
    );

    // MTP: model_executor/models/utils.py:589-596 skips weights of layers
    // `num_hidden_layers … + num_nextn_predict_layers` (getattr default 0) when loading the main
    // model; config/speculative.py:733-760 builds the MTP draft from it. The served model's
    // outputs do not depend on it (a draft's tokens are verified by the main model): harmless.
    let json = hf.uint("num_nextn_predict_layers");
    let (n, from) = undeclared(&json, Some(0));
    let n = n.unwrap_or(0);
    let gguf = c.cfg.num_nextn_predict_layers as u64;
    if n != gguf {
        c.finding(
            "num_nextn_predict_layers",
            true,
            FindingKind::NextnLayers {
                vllm: n,
                vllm_from: from,
                gguf,
            },
        );
    }
    let verdict = c.verdict_of("num_nextn_predict_layers");
    let src = c.source("num_nextn_predict_layers");
    c.row(
        "num_nextn_predict_layers",
        key_value(&json),
        Value::from(n),
        from,
        Value::from(gguf),
        src,
        verdict,
    );

    // tie_word_embeddings: DeepseekV2ForCausalLM always builds its own `ParallelLMHead`
    // (deepseek_v2.py:1917-1923) and never ties it (nvidia/model.py:209 only passes the flag to
    // make_input_embedding's VLLM_REPLICATE_EMBED assertion, fused_embed_norm.py:58-63). A GGUF
    // without `output.weight` (tied) leaves vLLM's lm_head without a weight whatever the config
    // says; a config that ties while the GGUF has its own lm_head changes transformers (it would
    // use the embedding) but not vLLM: harmless for the deployment.
    let (tie, from) = declared(&hf.tie_word_embeddings, false);
    let gguf_tied = c.cfg.tie_word_embeddings;
    if gguf_tied || tie {
        c.finding(
            "tie_word_embeddings",
            !gguf_tied,
            FindingKind::TiedEmbeddings {
                vllm_tie: tie,
                gguf_tied,
            },
        );
    }
    let verdict = c.verdict_of("tie_word_embeddings");
    let src = c.source("tie_word_embeddings");
    c.row(
        "tie_word_embeddings",
        key_value(&hf.tie_word_embeddings),
        Value::Bool(tie),
        from,
        Value::Bool(gguf_tied),
        src,
        verdict,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GLM-5's config.json (zai-org/GLM-5, as in fixtures/hf_config/glm5.json).
    const GLM5: &str = r#"{
      "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
      "hidden_act": "silu", "hidden_size": 6144, "num_hidden_layers": 78,
      "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
      "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
      "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
      "moe_intermediate_size": 2048, "intermediate_size": 12288, "first_k_dense_replace": 3,
      "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
      "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
      "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
      "indexer_rope_interleave": true, "rope_interleave": true,
      "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
      "rms_norm_eps": 1e-05, "vocab_size": 154880, "max_position_embeddings": 202752,
      "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "some_future_key": [1, 2]
    }"#;

    fn edited(edit: impl FnOnce(&mut Map<String, Value>)) -> HfConfig {
        let mut v: Value = serde_json::from_str(GLM5).expect("GLM5 is JSON");
        edit(v.as_object_mut().expect("object"));
        HfConfig::parse(Path::new("config.json"), &v.to_string()).expect("parses")
    }

    fn run(hf: &HfConfig) -> HfConfigCheck {
        check(hf, &Config::glm5(), &[])
    }

    fn kinds(c: &HfConfigCheck) -> Vec<(&str, bool, &FindingKind)> {
        c.findings
            .iter()
            .map(|f| (f.field.as_str(), f.harmless, &f.kind))
            .collect()
    }

    #[test]
    fn glm5_config_agrees_with_glm5() {
        let c = run(&edited(|_| {}));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        assert!(!c.fails());
        assert!(c.rows.iter().all(|r| r.verdict == Verdict::Agrees));
        for f in [
            "topk_method",
            "scoring_func",
            "indexer_rope_interleave",
            "rope_theta",
        ] {
            assert!(c.rows.iter().any(|r| r.field == f), "no row for {f}");
        }
    }

    #[test]
    fn no_topk_method_means_no_correction_bias() {
        let c = run(&edited(|m| {
            m.remove("topk_method");
        }));
        assert_eq!(
            kinds(&c),
            vec![(
                "topk_method",
                false,
                &FindingKind::NoCorrectionBias { topk_method: None }
            )]
        );
        assert!(c.fails());
        let c = run(&edited(|m| {
            m.insert("topk_method".into(), "greedy".into());
        }));
        assert_eq!(
            c.findings[0].kind,
            FindingKind::NoCorrectionBias {
                topk_method: Some("greedy".into())
            }
        );
    }

    #[test]
    fn no_scoring_func_means_softmax() {
        let c = run(&edited(|m| {
            m.remove("scoring_func");
        }));
        assert_eq!(
            c.findings,
            vec![Finding {
                field: "scoring_func".into(),
                harmless: false,
                kind: FindingKind::Scoring {
                    vllm: Some("softmax".into()),
                    vllm_from: Origin::VllmDefault,
                    gguf: "sigmoid".into()
                }
            }]
        );
    }

    #[test]
    fn no_or_false_indexer_rope_interleave_means_neox() {
        for (edit, key) in [
            (None, Key::Absent),
            (Some(Value::Bool(false)), Key::Set(false)),
            (Some(Value::Null), Key::Null),
        ] {
            let c = run(&edited(|m| match edit {
                None => {
                    m.remove("indexer_rope_interleave");
                }
                Some(v) => {
                    m.insert("indexer_rope_interleave".into(), v);
                }
            }));
            assert_eq!(
                kinds(&c),
                vec![(
                    "indexer_rope_interleave",
                    false,
                    &FindingKind::IndexerRopeNeox {
                        indexer_rope_interleave: key.clone()
                    }
                )]
            );
        }
    }

    #[test]
    fn removed_index_topk_keeps_dsa_at_the_class_default() {
        let hf = edited(|m| {
            m.remove("index_topk");
        });
        let c = run(&hf);
        assert_eq!(
            kinds(&c),
            vec![(
                "index_topk",
                true,
                &FindingKind::IndexTopkDefault {
                    vllm: 2048,
                    gguf: 2048
                }
            )]
        );
        assert!(!c.fails(), "GLM-5's own top-k: harmless");
        // A model whose top-k is not 2048 (the tiny fixture's 8) gets 2048 in vLLM: a finding.
        let mut cfg = Config::glm5();
        cfg.index_topk = 8;
        let c = check(&hf, &cfg, &[]);
        assert!(c.fails());
        assert_eq!(
            c.findings[0].kind,
            FindingKind::IndexTopkDefault {
                vllm: 2048,
                gguf: 8
            }
        );
    }

    #[test]
    fn absent_declared_dimension_takes_the_class_default() {
        let hf = edited(|m| {
            m.remove("hidden_size");
        });
        assert!(run(&hf).findings.is_empty(), "6144 is GLM-5's");
        let mut cfg = Config::glm5();
        cfg.hidden_size = 256;
        let c = check(&hf, &cfg, &[]);
        assert_eq!(
            kinds(&c),
            vec![(
                "hidden_size",
                false,
                &FindingKind::Mismatch {
                    vllm: Value::from(6144u64),
                    vllm_from: Origin::TransformersDefault,
                    gguf: Value::from(256u64),
                    gguf_defaulted: false
                }
            )]
        );
    }

    #[test]
    fn every_dimension_mismatch_is_named() {
        for (name, _, get) in DIMS {
            let gguf = get(&Config::glm5()) as u64;
            let c = run(&edited(|m| {
                m.insert((*name).into(), Value::from(gguf + 1));
            }));
            let f: Vec<_> = c.findings.iter().filter(|f| f.field == *name).collect();
            assert_eq!(f.len(), 1, "{name}: {:?}", c.findings);
            let harmless = matches!(*name, "max_position_embeddings" | "num_key_value_heads");
            assert_eq!(f[0].harmless, harmless, "{name}");
            assert_eq!(c.fails(), !harmless, "{name}");
        }
    }

    #[test]
    fn float_and_bool_mismatches() {
        let c = run(&edited(|m| {
            m.insert("rms_norm_eps".into(), Value::from(1e-6));
            m.insert("routed_scaling_factor".into(), Value::from(1.0));
            m.insert("norm_topk_prob".into(), Value::Bool(false));
        }));
        let fields: Vec<&str> = c.findings.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(
            fields,
            vec!["norm_topk_prob", "routed_scaling_factor", "rms_norm_eps"]
        );
        // The GGUF's f32 1e-5 (9.99999974738e-6) is the same value.
        let mut cfg = Config::glm5();
        cfg.rms_norm_eps = 1e-5f32 as f64;
        assert!(check(&edited(|_| {}), &cfg, &[]).findings.is_empty());
    }

    #[test]
    fn rope_theta_sources_and_default() {
        // Top-level rope_theta (older configs) is honoured when the dict has none.
        let c = run(&edited(|m| {
            m.remove("rope_parameters");
            m.insert("rope_theta".into(), Value::from(1e6));
        }));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        // Nowhere: transformers' default_theta 10000.
        let c = run(&edited(|m| {
            m.remove("rope_parameters");
        }));
        assert_eq!(
            kinds(&c),
            vec![(
                "rope_theta",
                false,
                &FindingKind::Mismatch {
                    vllm: Value::from(10000.0),
                    vllm_from: Origin::TransformersDefault,
                    gguf: Value::from(1e6),
                    gguf_defaulted: false
                }
            )]
        );
    }

    #[test]
    fn yarn_rope_scaling_changes_rope_and_softmax_scale() {
        let c = run(&edited(|m| {
            m.insert(
                "rope_scaling".into(),
                serde_json::json!({"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                                   "rope_theta": 1e6}),
            );
        }));
        assert_eq!(c.findings.len(), 1, "{:?}", c.findings);
        match &c.findings[0].kind {
            FindingKind::RopeScaling {
                rope_type,
                vllm_rope,
                factor,
                softmax_scale_factor,
            } => {
                assert_eq!(rope_type, "yarn");
                assert_eq!(vllm_rope, "deepseek_yarn");
                assert_eq!(*factor, Some(4.0));
                let m = 0.1 * 4f64.ln() + 1.0;
                assert!((softmax_scale_factor - m * m).abs() < 1e-12);
            }
            k => panic!("{k:?}"),
        }
        let c = run(&edited(|m| {
            m.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6}),
            );
        }));
        assert_eq!(
            c.findings[0].kind,
            FindingKind::StartFailure(StartFailure::RopeWithoutFactor {
                rope_type: "yarn".into()
            })
        );
    }

    #[test]
    fn group_routing_mismatch() {
        let c = run(&edited(|m| {
            m.insert("n_group".into(), Value::from(8u64));
            m.insert("topk_group".into(), Value::from(4u64));
        }));
        let fields: Vec<&str> = c.findings.iter().map(|f| f.field.as_str()).collect();
        assert_eq!(fields, vec!["n_group", "topk_group"]);
        assert!(c.fails());
    }

    #[test]
    fn nextn_and_tied_embeddings() {
        let c = run(&edited(|m| {
            m.remove("num_nextn_predict_layers");
        }));
        assert_eq!(
            kinds(&c),
            vec![(
                "num_nextn_predict_layers",
                true,
                &FindingKind::NextnLayers {
                    vllm: 0,
                    vllm_from: Origin::VllmDefault,
                    gguf: 1
                }
            )]
        );
        assert!(!c.fails());
        // Config ties, GGUF has its own lm_head: vLLM ignores the flag.
        let c = run(&edited(|m| {
            m.insert("tie_word_embeddings".into(), Value::Bool(true));
        }));
        assert_eq!(
            kinds(&c),
            vec![(
                "tie_word_embeddings",
                true,
                &FindingKind::TiedEmbeddings {
                    vllm_tie: true,
                    gguf_tied: false
                }
            )]
        );
        // GGUF without output.weight: vLLM's lm_head gets no weight.
        let mut cfg = Config::glm5();
        cfg.tie_word_embeddings = true;
        let c = check(&edited(|_| {}), &cfg, &[]);
        assert!(c.fails());
    }

    #[test]
    fn indexer_schedule() {
        // GLM-5.2's keys: the indexer runs on layers 0, 1, 2, then every 4th.
        let c = run(&edited(|m| {
            m.insert("index_topk_freq".into(), Value::from(4u64));
            m.insert("index_skip_topk_offset".into(), Value::from(3u64));
            m.insert("num_hidden_layers".into(), Value::from(8u64));
        }));
        let skipped = c
            .findings
            .iter()
            .find_map(|f| match &f.kind {
                FindingKind::IndexerSkipped { layers, .. } => Some(layers.clone()),
                _ => None,
            })
            .expect("skipped layers named");
        // (l - 3 + 1).max(0) % 4 != 0  →  3, 4, 5 skipped; 6 full; 7 skipped.
        assert_eq!(skipped, vec![3, 4, 5, 7]);
        assert!(!c
            .findings
            .iter()
            .any(|f| matches!(f.kind, FindingKind::IndexerTypesDisagree { .. })));
        // An explicit indexer_types that vLLM does not read.
        let c = run(&edited(|m| {
            m.insert("num_hidden_layers".into(), Value::from(4u64));
            m.insert(
                "indexer_types".into(),
                serde_json::json!(["full", "full", "full", "shared"]),
            );
        }));
        assert!(c.findings.iter().any(|f| f.kind
            == FindingKind::IndexerTypesDisagree {
                transformers_shared: vec![3],
                vllm_skipped: vec![]
            }));
        let c = run(&edited(|m| {
            m.insert("index_topk_freq".into(), Value::from(0u64));
        }));
        assert!(c
            .findings
            .iter()
            .any(|f| f.kind == FindingKind::StartFailure(StartFailure::ZeroIndexTopkFreq)));
    }

    #[test]
    fn identity_and_activation() {
        let c = run(&edited(|m| {
            m.insert("model_type".into(), "deepseek_v32".into());
            m.insert(
                "architectures".into(),
                serde_json::json!(["DeepseekV32ForCausalLM"]),
            );
            m.insert("hidden_act".into(), "gelu".into());
        }));
        assert_eq!(
            kinds(&c),
            vec![
                (
                    "model_type",
                    false,
                    &FindingKind::ModelType {
                        model_type: Some("deepseek_v32".into())
                    }
                ),
                (
                    "architectures",
                    true,
                    &FindingKind::Architecture {
                        architecture: Some("DeepseekV32ForCausalLM".into())
                    }
                ),
                (
                    "hidden_act",
                    false,
                    &FindingKind::StartFailure(StartFailure::UnsupportedActivation {
                        hidden_act: "gelu".into()
                    })
                ),
            ]
        );
    }

    #[test]
    fn moe_layer_freq_makes_layers_dense() {
        let mut cfg = Config::glm5();
        cfg.num_hidden_layers = 6;
        let c = check(
            &edited(|m| {
                m.insert("moe_layer_freq".into(), Value::from(2u64));
                m.insert("num_hidden_layers".into(), Value::from(6u64));
            }),
            &cfg,
            &[],
        );
        assert_eq!(
            kinds(&c),
            vec![(
                "moe_layer_freq",
                false,
                &FindingKind::MoeLayerFreq {
                    moe_layer_freq: 2,
                    dense: vec![3, 5]
                }
            )]
        );
    }

    #[test]
    fn gguf_default_is_marked() {
        let sources = vec![(
            "hidden_size".to_string(),
            Source::Default("glm-dsa.embedding_length".into()),
        )];
        let c = check(
            &edited(|m| {
                m.insert("hidden_size".into(), Value::from(256u64));
            }),
            &Config::glm5(),
            &sources,
        );
        assert!(matches!(
            c.findings[0].kind,
            FindingKind::Mismatch {
                gguf_defaulted: true,
                ..
            }
        ));
    }

    #[test]
    fn malformed_input_names_file_and_field() {
        let p = Path::new("/x/config.json");
        let e = HfConfig::parse(p, r#"{"hidden_size": "6144"}"#).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("/x/config.json") && s.contains("`hidden_size`"),
            "{s}"
        );
        assert!(
            s.contains("non-negative integer") && s.contains("\"6144\""),
            "{s}"
        );
        let e = HfConfig::parse(p, r#"{"index_topk": null}"#).unwrap_err();
        assert!(e.to_string().contains("`index_topk`"), "{e}");
        let e = HfConfig::parse(p, r#"{"rope_parameters": {"rope_theta": "big"}}"#).unwrap_err();
        assert!(
            e.to_string().contains("`rope_parameters.rope_theta`"),
            "{e}"
        );
        let e = HfConfig::parse(p, "[1, 2]").unwrap_err();
        assert!(
            matches!(
                e,
                HfConfigError::NotObject {
                    found: "an array",
                    ..
                }
            ),
            "{e}"
        );
        let e = HfConfig::parse(p, "{\"a\": ").unwrap_err();
        assert!(matches!(e, HfConfigError::Json { .. }), "{e}");
        // Unknown keys and nulls where vLLM's getattr tolerates them are fine.
        let hf = HfConfig::parse(
            p,
            r#"{"quantization_config": {"x": 1}, "topk_method": null}"#,
        )
        .expect("parses");
        assert_eq!(hf.topk_method, Key::Null);
    }

    #[test]
    fn read_refuses_directories_and_huge_files() {
        let dir = std::env::temp_dir();
        assert!(matches!(
            HfConfig::read(&dir),
            Err(HfConfigError::IsDirectory { .. })
        ));
        assert!(matches!(
            HfConfig::read(&dir.join("glmcheck-no-such-config.json")),
            Err(HfConfigError::Io { .. })
        ));
    }
}
