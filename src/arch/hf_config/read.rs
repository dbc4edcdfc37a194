//! Reading a deployment's config.json: the keys vLLM reads, typed ([`Key`] keeps absent and null
//! apart); a wrong type is an error naming file and field.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::table::DIMS;
use super::{HfConfigError, IndexPattern, Key, RopeDict, MAX_CONFIG_BYTES};

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
        for dim in DIMS {
            uints.push((dim.field, f.uint(dim.field)?));
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
