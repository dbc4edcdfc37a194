//! Reading `glm-dsa.*` metadata into a [`Config`]: the GGUF → config mapping as a table
//! ([`FIELDS`], one row per field) and the rows read by their own functions.

use super::{Config, ConfigReport, Derivation, MtpBlocks, Source};
use crate::arch::glm_dsa::{self, Role};
use crate::gguf::{GgufError, GgufModel, Value};

/// Every block that holds a `nextn.*` tensor.
fn mtp_marker_blocks(model: &GgufModel) -> std::collections::BTreeSet<usize> {
    model
        .tensors()
        .filter_map(|t| glm_dsa::mtp_marker_block(&t.info.name))
        .collect()
}

/// Most blocks (layers) a config may declare; GLM-5 has 79 (78 + 1 MTP).
pub const MAX_BLOCKS: usize = 1024;
/// Most routed experts a config may declare; GLM-5 has 256.
pub const MAX_EXPERTS: usize = 1 << 16;

/// How a field's value is read from its key.
#[derive(Clone, Copy)]
enum Read {
    /// A non-negative integer.
    Uint(fn(&mut Config) -> &mut usize),
    /// A non-negative integer of at most this bound (counts that size loops and tables: layers,
    /// experts, checked before anything iterates over them).
    UintMax(fn(&mut Config) -> &mut usize, usize),
    /// An f32 or f64.
    Float(fn(&mut Config) -> &mut f64),
    Bool(fn(&mut Config) -> &mut bool),
    /// Read or derived by its own function (which records its source).
    Special(fn(&mut ConfigReader<'_>, &Field, &mut Config) -> Result<(), GgufError>),
}

/// One row of the GGUF → config mapping: the HF field, its metadata key under `<arch>.`, and how
/// it is read. A missing key takes GLM-5's value ([`Config::glm5`]) and is recorded as a default.
struct Field {
    field: &'static str,
    key: &'static str,
    read: Read,
}

const fn row(field: &'static str, key: &'static str, read: Read) -> Field {
    Field { field, key, read }
}

use Read::{Bool, Float, Special, Uint, UintMax};

/// Every field, in the order the sources are recorded.
const FIELDS: &[Field] = &[
    row(
        "hidden_size",
        "embedding_length",
        Uint(|c| &mut c.hidden_size),
    ),
    // block_count − the trailing MTP blocks; also sets num_nextn_predict_layers.
    row("num_hidden_layers", "block_count", Special(blocks)),
    row(
        "num_attention_heads",
        "attention.head_count",
        Uint(|c| &mut c.num_attention_heads),
    ),
    // MLA: the GGUF's head_count_kv (1) is the latent.
    row("num_key_value_heads", "", Special(kv_heads)),
    row(
        "q_lora_rank",
        "attention.q_lora_rank",
        Uint(|c| &mut c.q_lora_rank),
    ),
    row(
        "kv_lora_rank",
        "attention.kv_lora_rank",
        Uint(|c| &mut c.kv_lora_rank),
    ),
    row(
        "qk_rope_head_dim",
        "rope.dimension_count",
        Uint(|c| &mut c.qk_rope_head_dim),
    ),
    // key_length_mla − rope.dimension_count.
    row(
        "qk_nope_head_dim",
        "attention.key_length_mla",
        Special(qk_nope),
    ),
    row(
        "v_head_dim",
        "attention.value_length_mla",
        Uint(|c| &mut c.v_head_dim),
    ),
    row(
        "n_routed_experts",
        "expert_count",
        UintMax(|c| &mut c.n_routed_experts, MAX_EXPERTS),
    ),
    row(
        "num_experts_per_tok",
        "expert_used_count",
        Uint(|c| &mut c.num_experts_per_tok),
    ),
    row(
        "n_shared_experts",
        "expert_shared_count",
        Uint(|c| &mut c.n_shared_experts),
    ),
    row("n_group", "expert_group_count", Uint(|c| &mut c.n_group)),
    row(
        "topk_group",
        "expert_group_used_count",
        Uint(|c| &mut c.topk_group),
    ),
    row(
        "moe_intermediate_size",
        "expert_feed_forward_length",
        Uint(|c| &mut c.moe_intermediate_size),
    ),
    row(
        "intermediate_size",
        "feed_forward_length",
        Uint(|c| &mut c.intermediate_size),
    ),
    row(
        "first_k_dense_replace",
        "leading_dense_block_count",
        Uint(|c| &mut c.first_k_dense_replace),
    ),
    row(
        "routed_scaling_factor",
        "expert_weights_scale",
        Float(|c| &mut c.routed_scaling_factor),
    ),
    row(
        "norm_topk_prob",
        "expert_weights_norm",
        Bool(|c| &mut c.norm_topk_prob),
    ),
    row(
        "index_n_heads",
        "attention.indexer.head_count",
        Uint(|c| &mut c.index_n_heads),
    ),
    row(
        "index_head_dim",
        "attention.indexer.key_length",
        Uint(|c| &mut c.index_head_dim),
    ),
    row(
        "index_topk",
        "attention.indexer.top_k",
        Uint(|c| &mut c.index_topk),
    ),
    row("rope_theta", "rope.freq_base", Float(|c| &mut c.rope_theta)),
    row(
        "rms_norm_eps",
        "attention.layer_norm_rms_epsilon",
        Float(|c| &mut c.rms_norm_eps),
    ),
    row(
        "max_position_embeddings",
        "context_length",
        Uint(|c| &mut c.max_position_embeddings),
    ),
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid; GLM-5 files may omit it.
    row("scoring_func", "expert_gating_func", Special(gating)),
    // The arch key, else the token list, else the embedding's rows.
    row("vocab_size", "vocab_size", Special(vocab)),
    // Whether the file has an lm_head tensor.
    row("tie_word_embeddings", "", Special(tied)),
];

/// Reads metadata into a [`Config`]. Keys of the wrong type are errors naming file, key and offset;
/// missing keys take GLM-5's defaults and are recorded in the report.
pub struct ConfigReader<'a> {
    model: &'a GgufModel,
    prefix: String,
    sources: Vec<(String, Source)>,
    mtp: MtpBlocks,
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

    /// A non-negative integer of at most `max`.
    fn uint_max(
        &mut self,
        field: &str,
        suffix: &str,
        default: usize,
        max: Option<usize>,
    ) -> Result<usize, GgufError> {
        let expected = match max {
            Some(max) => format!("a non-negative integer of at most {max}"),
            None => "a non-negative integer".to_string(),
        };
        self.value_of(field, suffix, default, &expected, |v| {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| max.is_none_or(|max| n <= max))
        })
    }

    fn float(&mut self, field: &str, suffix: &str, default: f64) -> Result<f64, GgufError> {
        self.value_of(field, suffix, default, "a float", |v| match v {
            // The shortest decimal that round-trips the f32: 1e-5, not 9.999999747378752e-6.
            Value::F32(f) => Some(f.to_string().parse().unwrap_or(*f as f64)),
            Value::F64(f) => Some(*f),
            _ => None,
        })
    }

    fn derived(&mut self, field: &str, how: Derivation) {
        self.sources.push((field.into(), Source::Derived(how)));
    }

    /// Reads one row of [`FIELDS`] into `c` (whose current value is the default).
    fn read_field(&mut self, f: &Field, c: &mut Config) -> Result<(), GgufError> {
        match f.read {
            Uint(slot) => *slot(c) = self.uint_max(f.field, f.key, *slot(c), None)?,
            UintMax(slot, max) => *slot(c) = self.uint_max(f.field, f.key, *slot(c), Some(max))?,
            Float(slot) => *slot(c) = self.float(f.field, f.key, *slot(c))?,
            Bool(slot) => {
                let d = *slot(c);
                *slot(c) = self.value_of(f.field, f.key, d, "a bool", Value::as_bool)?;
            }
            Special(read) => read(self, f, c)?,
        }
        Ok(())
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
        let mut r = ConfigReader {
            model,
            prefix: arch.to_string(),
            sources: Vec::new(),
            mtp: MtpBlocks::default(),
        };
        let mut config = Config::glm5();
        for f in FIELDS {
            r.read_field(f, &mut config)?;
        }
        Ok(ConfigReport {
            config,
            sources: r.sources,
            mtp: r.mtp,
        })
    }
}

/// `num_hidden_layers` and `num_nextn_predict_layers`: the block count (the key, else 1 + the
/// highest `blk.N`, else GLM-5's 79) less the trailing blocks that hold `nextn.*` tensors.
fn blocks(r: &mut ConfigReader<'_>, f: &Field, c: &mut Config) -> Result<(), GgufError> {
    let model = r.model;
    let block_key = r.key(f.key);
    let mtp_marks = mtp_marker_blocks(model);
    let highest_block = model
        .tensors()
        .filter_map(|t| glm_dsa::gguf_layer(&t.info.name))
        .filter(|&l| l < MAX_BLOCKS)
        .max();
    // Where the block count came from: Some(metadata key, or None for the highest blk.N), or
    // None for GLM-5's default (recorded as such).
    let (block_count, block_src) = match (r.raw(&block_key), highest_block) {
        (None, Some(top)) => (top + 1, Some(None)),
        (key, _) => {
            let n = r.uint_max(
                f.field,
                f.key,
                Config::glm5().gguf_block_count(),
                Some(MAX_BLOCKS),
            )?;
            // The key's value: the source becomes derived (minus the MTP blocks) below.
            let src = key.is_some().then(|| Some(block_key.clone()));
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
    let mut blocks: Vec<usize> = (0..block_count)
        .rev()
        .take_while(|b| mtp_marks.contains(b))
        .collect();
    blocks.reverse();
    let nextn = blocks.len();
    c.num_hidden_layers = block_count - nextn;
    c.num_nextn_predict_layers = nextn;
    let stray = mtp_marks
        .iter()
        .copied()
        .filter(|b| !blocks.contains(b))
        .collect();
    if let Some(key) = block_src {
        r.derived(
            f.field,
            Derivation::BlockCount {
                key,
                mtp_blocks: nextn,
            },
        );
    }
    let nextn_src = match key {
        Some(k) if k == nextn => Source::Metadata(nextn_key),
        says => Source::Derived(Derivation::MtpBlocks {
            count: nextn,
            key: nextn_key,
            says,
        }),
    };
    r.sources
        .push(("num_nextn_predict_layers".into(), nextn_src));
    r.mtp = MtpBlocks { key, blocks, stray };
    Ok(())
}

/// `num_key_value_heads` = `num_attention_heads` (MLA).
fn kv_heads(r: &mut ConfigReader<'_>, f: &Field, c: &mut Config) -> Result<(), GgufError> {
    c.num_key_value_heads = c.num_attention_heads;
    r.derived(f.field, Derivation::AttentionHeads);
    Ok(())
}

/// `qk_nope_head_dim` = `key_length_mla` − `qk_rope_head_dim` (read before it).
fn qk_nope(r: &mut ConfigReader<'_>, f: &Field, c: &mut Config) -> Result<(), GgufError> {
    let key_length_mla = r.uint_max(f.field, f.key, Config::glm5().qk_head_dim(), None)?;
    // The entry just pushed describes key_length_mla; qk_nope_head_dim is derived from it.
    if let Some((_, src)) = r.sources.last_mut() {
        if let Source::Metadata(k) = src {
            *src = Source::Derived(Derivation::KeyLengthLessRope { key: k.clone() });
        }
    }
    let rope = c.qk_rope_head_dim;
    c.qk_nope_head_dim = key_length_mla.checked_sub(rope).ok_or_else(|| {
        r.wrong_type(
            &r.key(f.key),
            &format!("at least rope.dimension_count ({rope})"),
        )
    })?;
    Ok(())
}

/// `scoring_func` from llama.cpp's gating function number.
fn gating(r: &mut ConfigReader<'_>, f: &Field, c: &mut Config) -> Result<(), GgufError> {
    let key = r.key(f.key);
    let Some(v) = r.raw(&key) else {
        r.sources.push((f.field.into(), Source::Default(key)));
        return Ok(());
    };
    let s = match v.as_u64() {
        Some(1) => "softmax",
        Some(2) => "sigmoid",
        Some(3) => "softmax_weight",
        _ => return Err(r.wrong_type(&key, "1 (softmax), 2 (sigmoid) or 3")),
    };
    r.sources.push((f.field.into(), Source::Metadata(key)));
    c.scoring_func = s.to_string();
    Ok(())
}

/// `vocab_size`: the arch key, else the token list, else the embedding's rows, else GLM-5's.
fn vocab(r: &mut ConfigReader<'_>, f: &Field, c: &mut Config) -> Result<(), GgufError> {
    let model = r.model;
    let key = r.key(f.key);
    if let Some(v) = r.raw(&key) {
        c.vocab_size = v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| r.wrong_type(&key, "a non-negative integer"))?;
        r.sources.push((f.field.into(), Source::Metadata(key)));
    } else if let Some(n) = model
        .value("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .map(<[Value]>::len)
    {
        r.derived(f.field, Derivation::TokenCount);
        c.vocab_size = n;
    } else if let Some(t) = glm_dsa::gguf_name_of(Role::Embedding).and_then(|n| model.tensor(n)) {
        r.derived(f.field, Derivation::EmbeddingRows);
        c.vocab_size = t.info.ne.get(1).copied().unwrap_or(0) as usize;
    } else {
        r.sources.push((f.field.into(), Source::Default(key)));
    }
    Ok(())
}

/// `tie_word_embeddings`: the file has no lm_head tensor.
fn tied(r: &mut ConfigReader<'_>, f: &Field, c: &mut Config) -> Result<(), GgufError> {
    c.tie_word_embeddings = glm_dsa::gguf_name_of(Role::LmHead)
        .and_then(|n| r.model.tensor(n))
        .is_none();
    r.derived(
        f.field,
        Derivation::LmHead {
            present: !c.tie_word_embeddings,
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::ARCH;
    use crate::gguf::writer::write_gguf;

    /// A GGUF of `metadata` (no tensors) written to a temporary file and opened.
    fn model(name: &str, metadata: &[(&str, Value)]) -> GgufModel {
        let meta: Vec<(String, Value)> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let path = std::env::temp_dir().join(format!(
            "glmcheck-config-{name}-{}.gguf",
            std::process::id()
        ));
        let mut f = std::fs::File::create(&path).expect("temp file");
        write_gguf(&mut f, &meta, &[], 32).expect("written");
        let m = GgufModel::open(&path).expect("opens");
        let _ = std::fs::remove_file(&path);
        m
    }

    fn source<'r>(r: &'r ConfigReport, field: &str) -> &'r Source {
        &r.sources
            .iter()
            .find(|(f, _)| f == field)
            .unwrap_or_else(|| panic!("no source for {field}"))
            .1
    }

    #[test]
    fn reads_keys_derives_and_defaults() {
        let m = model(
            "small",
            &[
                ("general.architecture", Value::String("glm-dsa".into())),
                ("glm-dsa.embedding_length", Value::U32(256)),
                ("glm-dsa.block_count", Value::U32(4)),
                ("glm-dsa.rope.dimension_count", Value::U32(32)),
                ("glm-dsa.attention.key_length_mla", Value::U32(96)),
                ("glm-dsa.attention.head_count", Value::U32(8)),
                ("glm-dsa.expert_gating_func", Value::U32(1)),
                ("glm-dsa.rope.freq_base", Value::F32(10_000.0)),
                ("glm-dsa.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
                ("glm-dsa.expert_weights_norm", Value::Bool(false)),
            ],
        );
        let r = ConfigReader::read(&m, ARCH).expect("reads");
        let c = &r.config;
        assert_eq!(c.hidden_size, 256);
        assert_eq!((c.num_hidden_layers, c.num_nextn_predict_layers), (4, 0));
        assert_eq!((c.qk_rope_head_dim, c.qk_nope_head_dim), (32, 64));
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (8, 8));
        assert_eq!(c.scoring_func, "softmax");
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.rms_norm_eps, 1e-6, "the f32's shortest decimal");
        assert!(!c.norm_topk_prob);
        // Absent keys: GLM-5's values, each recorded under the key that was missing.
        assert_eq!(c.q_lora_rank, 2048);
        assert_eq!(
            source(&r, "q_lora_rank"),
            &Source::Default("glm-dsa.attention.q_lora_rank".into())
        );
        assert_eq!(
            source(&r, "vocab_size"),
            &Source::Default("glm-dsa.vocab_size".into())
        );
        assert_eq!(
            source(&r, "hidden_size"),
            &Source::Metadata("glm-dsa.embedding_length".into())
        );
        assert_eq!(
            source(&r, "qk_nope_head_dim"),
            &Source::Derived(Derivation::KeyLengthLessRope {
                key: "glm-dsa.attention.key_length_mla".into()
            })
        );
        assert!(c.tie_word_embeddings, "no output.weight");
        // One source per field, in the table's order.
        let fields: Vec<&str> = r.sources.iter().map(|(f, _)| f.as_str()).collect();
        assert_eq!(fields.len(), FIELDS.len() + 1, "{fields:?}");
        assert_eq!(
            &fields[..3],
            [
                "hidden_size",
                "num_hidden_layers",
                "num_nextn_predict_layers"
            ]
        );
        assert_eq!(r.defaulted().len(), 17, "{:?}", r.defaulted());
    }

    #[test]
    fn wrong_types_name_the_key() {
        let err = |name: &str, key: &str, v: Value| {
            let m = model(name, &[(key, v)]);
            match ConfigReader::read(&m, ARCH) {
                Err(GgufError::Invalid { field, reason, .. }) => (field, reason),
                other => panic!("{other:?}"),
            }
        };
        let (field, reason) = err("str", "glm-dsa.expert_count", Value::String("256".into()));
        assert_eq!(field, "metadata `glm-dsa.expert_count`");
        assert_eq!(
            reason,
            "expected a non-negative integer of at most 65536, found string"
        );
        let (field, reason) = err("big", "glm-dsa.expert_count", Value::U64(1 << 20));
        assert_eq!(field, "metadata `glm-dsa.expert_count`");
        assert!(reason.starts_with("expected a non-negative integer of at most 65536"));
        let (field, _) = err("gate", "glm-dsa.expert_gating_func", Value::U32(7));
        assert_eq!(field, "metadata `glm-dsa.expert_gating_func`");
        // key_length_mla below the rope dimension.
        let m = model(
            "mla",
            &[
                ("glm-dsa.rope.dimension_count", Value::U32(64)),
                ("glm-dsa.attention.key_length_mla", Value::U32(32)),
            ],
        );
        match ConfigReader::read(&m, ARCH) {
            Err(GgufError::Invalid { field, reason, .. }) => {
                assert_eq!(field, "metadata `glm-dsa.attention.key_length_mla`");
                assert!(
                    reason.contains("at least rope.dimension_count (64)"),
                    "{reason}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
