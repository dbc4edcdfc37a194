//! GLM-5's configuration under Hugging Face names, read from `glm-dsa.*` GGUF metadata.

use serde::Serialize;

use super::glm_dsa::{self, Role};
use crate::gguf::{GgufError, GgufModel, Value};

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
    /// Derived from other values (named).
    Derived(String),
    /// Not in the file: GLM-5's documented default.
    Default(String),
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

/// Every block that holds a `nextn.*` tensor.
fn mtp_marker_blocks(model: &GgufModel) -> std::collections::BTreeSet<usize> {
    model
        .tensors()
        .filter_map(|t| glm_dsa::mtp_marker_block(&t.info.name))
        .collect()
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

/// Most blocks (layers) a config may declare; GLM-5 has 79 (78 + 1 MTP).
pub const MAX_BLOCKS: usize = 1024;
/// Most routed experts a config may declare; GLM-5 has 256.
pub const MAX_EXPERTS: usize = 1 << 16;

/// Reads metadata into a [`Config`]. Keys of the wrong type are errors naming file, key and offset;
/// missing keys take GLM-5's defaults and are recorded in the report.
pub struct ConfigReader<'a> {
    model: &'a GgufModel,
    prefix: String,
    sources: Vec<(String, Source)>,
}

impl<'a> ConfigReader<'a> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    fn wrong_type(&self, key: &str, expected: &str) -> GgufError {
        let entry = self.model.get_meta(key);
        GgufError::invalid(
            self.model.file_of_meta(key),
            format!("metadata `{key}`"),
            entry.map_or(0, |e| e.offset),
            format!(
                "expected {expected}, found {}",
                entry.map_or("nothing".into(), |e| e.value.type_name())
            ),
        )
    }

    fn raw(&self, key: &str) -> Option<&'a Value> {
        self.model.value(key)
    }

    /// Reads `prefix.suffix` with `extract` (None: wrong type, named `expected`), recording where the
    /// value came from; a missing key takes `default`.
    fn value_of<T>(
        &mut self,
        field: &str,
        suffix: &str,
        default: T,
        expected: &str,
        extract: impl Fn(&Value) -> Option<T>,
    ) -> Result<T, GgufError> {
        let key = self.key(suffix);
        match self.raw(&key) {
            Some(v) => {
                let x = extract(v).ok_or_else(|| self.wrong_type(&key, expected))?;
                self.sources.push((field.into(), Source::Metadata(key)));
                Ok(x)
            }
            None => {
                self.sources.push((field.into(), Source::Default(key)));
                Ok(default)
            }
        }
    }

    fn uint(&mut self, field: &str, suffix: &str, default: usize) -> Result<usize, GgufError> {
        self.value_of(field, suffix, default, "a non-negative integer", |v| {
            v.as_u64().and_then(|n| usize::try_from(n).ok())
        })
    }

    /// As [`Self::uint`], but a value above `max` is an error: counts that size loops and tables
    /// (layers, experts) are checked before anything iterates over them.
    fn uint_max(
        &mut self,
        field: &str,
        suffix: &str,
        default: usize,
        max: usize,
    ) -> Result<usize, GgufError> {
        self.value_of(
            field,
            suffix,
            default,
            &format!("a non-negative integer of at most {max}"),
            |v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n <= max)
            },
        )
    }

    fn float(&mut self, field: &str, suffix: &str, default: f64) -> Result<f64, GgufError> {
        self.value_of(field, suffix, default, "a float", |v| match v {
            // The shortest decimal that round-trips the f32: 1e-5, not 9.999999747378752e-6.
            Value::F32(f) => Some(f.to_string().parse().unwrap_or(*f as f64)),
            Value::F64(f) => Some(*f),
            _ => None,
        })
    }

    fn boolean(&mut self, field: &str, suffix: &str, default: bool) -> Result<bool, GgufError> {
        self.value_of(field, suffix, default, "a bool", Value::as_bool)
    }

    fn derived(&mut self, field: &str, how: &str) {
        self.sources
            .push((field.into(), Source::Derived(how.into())));
    }

    /// Reads the config of a `glm-dsa` model (or of another architecture's keys under its own prefix).
    pub fn read(model: &'a GgufModel, arch: &str) -> Result<ConfigReport, GgufError> {
        // A file of another architecture gets no GLM-5 defaults invented for it.
        if let Some(found) = model.value("general.architecture") {
            match found.as_str() {
                Some(a) if a == arch => {}
                Some(a) => {
                    return Err(GgufError::ForeignArch {
                        file: model.file_of_meta("general.architecture").to_path_buf(),
                        found: a.to_string(),
                        wanted: arch.to_string(),
                    })
                }
                None => {
                    let e = model.get_meta("general.architecture");
                    return Err(GgufError::invalid(
                        model.file_of_meta("general.architecture"),
                        "metadata `general.architecture`",
                        e.map_or(0, |e| e.offset),
                        format!("must be a string, found {}", found.type_name()),
                    ));
                }
            }
        }
        let d = Config::glm5();
        let mut r = ConfigReader {
            model,
            prefix: arch.to_string(),
            sources: Vec::new(),
        };
        let hidden_size = r.uint("hidden_size", "embedding_length", d.hidden_size)?;
        let block_key = r.key("block_count");
        let mtp_marks = mtp_marker_blocks(model);
        let highest_block = model
            .tensors()
            .filter_map(|t| glm_dsa::gguf_layer(&t.info.name))
            .filter(|&l| l < MAX_BLOCKS)
            .max();
        // Where the block count came from; None: GLM-5's default (recorded as such).
        let (block_count, block_src) = match (r.raw(&block_key), highest_block) {
            (None, Some(top)) => (
                top + 1,
                Some("1 + the highest blk.N in the file".to_string()),
            ),
            (key, _) => {
                let n = r.uint_max(
                    "num_hidden_layers",
                    "block_count",
                    d.gguf_block_count(),
                    MAX_BLOCKS,
                )?;
                // The key's value: the source becomes derived (minus the MTP blocks) below.
                let src = key.is_some().then(|| format!("`{block_key}`"));
                if src.is_some() {
                    r.sources.pop();
                }
                (n, src)
            }
        };
        // The MTP (nextn) layers are the trailing blocks that hold `nextn.*` tensors: the tensors
        // decide. The metadata key (absent when the converter's config.json had none) is only
        // cross-checked; a GLM-5 default here would drop the last real layer of a file without MTP.
        let nextn_key = r.key("nextn_predict_layers");
        let key = match r.raw(&nextn_key) {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n <= MAX_BLOCKS)
                    .ok_or_else(|| {
                        r.wrong_type(
                            &nextn_key,
                            &format!("a non-negative integer of at most {MAX_BLOCKS}"),
                        )
                    })?,
            ),
        };
        let blocks: Vec<usize> = (0..block_count)
            .rev()
            .take_while(|b| mtp_marks.contains(b))
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let nextn = blocks.len();
        let num_hidden_layers = block_count - nextn;
        let stray = mtp_marks
            .iter()
            .copied()
            .filter(|b| !blocks.contains(b))
            .collect();
        if let Some(block_src) = block_src {
            r.derived(
                "num_hidden_layers",
                &format!(
                    "{block_src} − {nextn} MTP block(s) (trailing blocks with nextn.* tensors)"
                ),
            );
        }
        let nextn_src = match key {
            Some(k) if k == nextn => Source::Metadata(nextn_key.clone()),
            Some(k) => Source::Derived(format!(
                "the trailing blocks with nextn.* tensors ({nextn}); `{nextn_key}` says {k}"
            )),
            None => Source::Derived(format!(
                "the trailing blocks with nextn.* tensors (no `{nextn_key}` in the file)"
            )),
        };
        r.sources
            .push(("num_nextn_predict_layers".into(), nextn_src));
        let mtp = MtpBlocks { key, blocks, stray };
        let num_attention_heads = r.uint(
            "num_attention_heads",
            "attention.head_count",
            d.num_attention_heads,
        )?;
        r.derived(
            "num_key_value_heads",
            "= num_attention_heads (MLA; the GGUF's head_count_kv 1 is the latent)",
        );
        let q_lora_rank = r.uint("q_lora_rank", "attention.q_lora_rank", d.q_lora_rank)?;
        let kv_lora_rank = r.uint("kv_lora_rank", "attention.kv_lora_rank", d.kv_lora_rank)?;
        let qk_rope_head_dim = r.uint(
            "qk_rope_head_dim",
            "rope.dimension_count",
            d.qk_rope_head_dim,
        )?;
        let key_length_mla = r.uint(
            "qk_nope_head_dim",
            "attention.key_length_mla",
            d.qk_head_dim(),
        )?;
        // The entry just pushed describes key_length_mla; qk_nope_head_dim is derived from it.
        if let Some((_, src)) = r.sources.last_mut() {
            if let Source::Metadata(k) = src {
                *src = Source::Derived(format!("{k} − rope.dimension_count"));
            }
        }
        let qk_nope_head_dim = key_length_mla
            .checked_sub(qk_rope_head_dim)
            .ok_or_else(|| {
                r.wrong_type(
                    &r.key("attention.key_length_mla"),
                    &format!("at least rope.dimension_count ({qk_rope_head_dim})"),
                )
            })?;
        let v_head_dim = r.uint("v_head_dim", "attention.value_length_mla", d.v_head_dim)?;
        let n_routed_experts = r.uint_max(
            "n_routed_experts",
            "expert_count",
            d.n_routed_experts,
            MAX_EXPERTS,
        )?;
        let num_experts_per_tok = r.uint(
            "num_experts_per_tok",
            "expert_used_count",
            d.num_experts_per_tok,
        )?;
        let n_shared_experts = r.uint(
            "n_shared_experts",
            "expert_shared_count",
            d.n_shared_experts,
        )?;
        let n_group = r.uint("n_group", "expert_group_count", d.n_group)?;
        let topk_group = r.uint("topk_group", "expert_group_used_count", d.topk_group)?;
        let moe_intermediate_size = r.uint(
            "moe_intermediate_size",
            "expert_feed_forward_length",
            d.moe_intermediate_size,
        )?;
        let intermediate_size = r.uint(
            "intermediate_size",
            "feed_forward_length",
            d.intermediate_size,
        )?;
        let first_k_dense_replace = r.uint(
            "first_k_dense_replace",
            "leading_dense_block_count",
            d.first_k_dense_replace,
        )?;
        let routed_scaling_factor = r.float(
            "routed_scaling_factor",
            "expert_weights_scale",
            d.routed_scaling_factor,
        )?;
        let norm_topk_prob =
            r.boolean("norm_topk_prob", "expert_weights_norm", d.norm_topk_prob)?;
        let index_n_heads = r.uint(
            "index_n_heads",
            "attention.indexer.head_count",
            d.index_n_heads,
        )?;
        let index_head_dim = r.uint(
            "index_head_dim",
            "attention.indexer.key_length",
            d.index_head_dim,
        )?;
        let index_topk = r.uint("index_topk", "attention.indexer.top_k", d.index_topk)?;
        let rope_theta = r.float("rope_theta", "rope.freq_base", d.rope_theta)?;
        let rms_norm_eps = r.float(
            "rms_norm_eps",
            "attention.layer_norm_rms_epsilon",
            d.rms_norm_eps,
        )?;
        let max_position_embeddings = r.uint(
            "max_position_embeddings",
            "context_length",
            d.max_position_embeddings,
        )?;
        // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid; GLM-5 files may omit it.
        let gating_key = r.key("expert_gating_func");
        let scoring_func = match r.raw(&gating_key) {
            None => {
                r.sources
                    .push(("scoring_func".into(), Source::Default(gating_key)));
                d.scoring_func.clone()
            }
            Some(v) => {
                let s = match v.as_u64() {
                    Some(1) => "softmax",
                    Some(2) => "sigmoid",
                    Some(3) => "softmax_weight",
                    _ => return Err(r.wrong_type(&gating_key, "1 (softmax), 2 (sigmoid) or 3")),
                };
                r.sources
                    .push(("scoring_func".into(), Source::Metadata(gating_key)));
                s.to_string()
            }
        };
        // vocab_size: the arch key, else the token list, else the embedding's rows.
        let vocab_key = r.key("vocab_size");
        let vocab_size = if let Some(v) = r.raw(&vocab_key) {
            let n = v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| r.wrong_type(&vocab_key, "a non-negative integer"))?;
            r.sources
                .push(("vocab_size".into(), Source::Metadata(vocab_key)));
            n
        } else if let Some(n) = model
            .value("tokenizer.ggml.tokens")
            .and_then(Value::as_array)
            .map(<[Value]>::len)
        {
            r.derived("vocab_size", "len(tokenizer.ggml.tokens)");
            n
        } else if let Some(t) = glm_dsa::gguf_name_of(Role::Embedding).and_then(|n| model.tensor(n))
        {
            r.derived("vocab_size", "the embedding's ne[1]");
            t.info.ne.get(1).copied().unwrap_or(0) as usize
        } else {
            r.sources
                .push(("vocab_size".into(), Source::Default(vocab_key)));
            d.vocab_size
        };
        let tie_word_embeddings = glm_dsa::gguf_name_of(Role::LmHead)
            .and_then(|n| model.tensor(n))
            .is_none();
        r.derived(
            "tie_word_embeddings",
            if tie_word_embeddings {
                "no lm_head tensor (output.weight) in the file"
            } else {
                "lm_head tensor (output.weight) present"
            },
        );
        let config = Config {
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: num_attention_heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            n_routed_experts,
            num_experts_per_tok,
            n_shared_experts,
            n_group,
            topk_group,
            moe_intermediate_size,
            intermediate_size,
            first_k_dense_replace,
            routed_scaling_factor,
            norm_topk_prob,
            index_n_heads,
            index_head_dim,
            index_topk,
            rope_theta,
            rms_norm_eps,
            vocab_size,
            max_position_embeddings,
            num_nextn_predict_layers: nextn,
            scoring_func,
            tie_word_embeddings,
        };
        Ok(ConfigReport {
            config,
            sources: r.sources,
            mtp,
        })
    }
}
