//! Activation dumps: reading (safetensors, memory-mapped), writing, and glmcheck's own capture;
//! routed experts' rows brought to token order.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::DType;
use safetensors::{Dtype, SafeTensors};

use super::graph::{expert_act_call, ids_in, router_ids_keys};
use crate::dump::{self, DumpTensor};
use crate::model::names::conv;
use crate::model::VecCapture;

pub mod meta {
    pub const TOKEN_IDS: &str = "token_ids";
    pub const PROMPT: &str = "prompt";
    pub const EXECUTION_ORDER: &str = "execution_order";
    pub const PRODUCER: &str = "glmcheck.producer";
    pub const DTYPE: &str = "glmcheck.dtype";
    pub const WEIGHTS: &str = "glmcheck.weights";
    pub const DSA: &str = "glmcheck.dsa";
    pub const GGUF: &str = "glmcheck.gguf";
    pub const EXPERT_ROWS: &str = "glmcheck.expert_act_rows";
    /// JSON list of `"<indexer path>:<position>"` where the reference's top-k was replayed.
    pub const ALIGNED: &str = "glmcheck.aligned_topk";
    /// transformers' dumps carry its version under this key.
    pub const TRANSFORMERS: &str = "transformers";
}

#[derive(Debug, thiserror::Error)]
pub enum ActError {
    #[error("{file}: cannot read: {err}")]
    Io { file: PathBuf, err: std::io::Error },
    #[error("{file}: not a valid safetensors file: {reason}")]
    Format { file: PathBuf, reason: String },
    #[error("{file}: tensor `{tensor}` has dtype {dtype:?}; activation dumps hold float or integer tensors")]
    Dtype {
        file: PathBuf,
        tensor: String,
        dtype: Dtype,
    },
    #[error("{file}: metadata `{key}`: {reason}")]
    Meta {
        file: String,
        key: &'static str,
        reason: String,
    },
    #[error("the dumps were made from different tokens ({reference}: {ref_tokens:?}; {candidate}: {cand_tokens:?}): nothing can be compared")]
    TokensDiffer {
        reference: String,
        candidate: String,
        ref_tokens: Vec<u32>,
        cand_tokens: Vec<u32>,
    },
    #[error("neither dump says which tokens it was made from (no `input_ids` tensor, no `token_ids` metadata)")]
    NoTokens,
    #[error("the dumps have no key in common")]
    Disjoint,
    #[error("capture `{key}`: {err}")]
    Capture {
        key: String,
        err: candle_core::Error,
    },
    #[error("{0}")]
    Write(#[from] dump::DumpError),
}

// Dumps

/// Values of one captured tensor, widened for comparison.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// One captured tensor.
#[derive(Debug, Clone)]
pub struct Act {
    /// The dtype it was stored (or captured) in.
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub values: Values,
}

impl Act {
    pub(crate) fn f32(&self) -> Option<&[f32]> {
        match &self.values {
            Values::F32(v) => Some(v),
            Values::I64(_) => None,
        }
    }

    pub(crate) fn i64(&self) -> Option<&[i64]> {
        match &self.values {
            Values::I64(v) => Some(v),
            Values::F32(_) => None,
        }
    }

    /// Rows of the last dimension of an integer tensor.
    pub(crate) fn rows_i64(&self) -> Option<Vec<&[i64]>> {
        let cols = *self.shape.last()?;
        if cols == 0 {
            return None;
        }
        Some(self.i64()?.chunks(cols).collect())
    }
}

/// Which tokens the rows of one routed expert's `act_fn#n` capture are, and which expert it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExpertRows {
    pub(crate) expert: i64,
    pub(crate) tokens: Vec<usize>,
}

/// A dump: module outputs by HF module path, in execution order.
#[derive(Debug, Clone, Default)]
pub struct Activations {
    /// Where it came from (a path, or `glmcheck forward`).
    pub source: String,
    pub tensors: HashMap<String, Act>,
    /// Every key, in execution order (keys the producer did not order are placed right after their
    /// nearest ordered ancestor: `…indexer.q` after `…indexer`).
    pub order: Vec<String>,
    /// How many keys the producer's own `execution_order` listed.
    pub ordered_by_producer: usize,
    pub tokens: Option<Vec<u32>>,
    pub prompt: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub(crate) expert_rows: HashMap<String, ExpertRows>,
}

pub(crate) fn decode_ints(dtype: Dtype, data: &[u8]) -> Option<Vec<i64>> {
    Some(match dtype {
        Dtype::I64 => data
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        Dtype::I32 => data
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::U32 => data
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        // Ids never come near 2⁶³; a larger u64 wraps and then differs, as it should.
        Dtype::U64 => data
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as i64)
            .collect(),
        Dtype::U16 => data
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::I16 => data
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as i64)
            .collect(),
        Dtype::U8 => data.iter().map(|&b| b as i64).collect(),
        Dtype::I8 => data.iter().map(|&b| b as i8 as i64).collect(),
        _ => return None,
    })
}

/// `a.b#2` → `a.b`; `a.b.c` → `a.b`.
pub(crate) fn ancestor(key: &str) -> Option<&str> {
    if let Some((head, n)) = key.rsplit_once('#') {
        if n.chars().all(|c| c.is_ascii_digit()) {
            return Some(head);
        }
    }
    key.rsplit_once('.').map(|(p, _)| p)
}

/// `names::order::rank`: (part, layer, position in the part).
type Canon = (usize, usize, usize);

/// All keys in execution order: `declared` first (those present), the rest after their nearest
/// declared ancestor, unplaceable keys at the end; undeclared keys among themselves in GLM-5's
/// execution order (`names::order`), then alphabetically.
pub(crate) fn full_order(keys: &[String], declared: &[String]) -> (Vec<String>, usize) {
    let present: BTreeSet<&str> = keys.iter().map(String::as_str).collect();
    let mut rank: HashMap<&str, usize> = HashMap::new();
    for k in declared {
        if present.contains(k.as_str()) && !rank.contains_key(k.as_str()) {
            let r = rank.len();
            rank.insert(k.as_str(), r);
        }
    }
    let listed = rank.len();
    let canon = crate::model::names::order::rank;
    // (declared rank, 0 declared / 1 under a declared ancestor, GLM-5 order, name)
    let mut sortable: Vec<(usize, usize, Canon, &str)> = keys
        .iter()
        .map(|k| {
            if let Some(&r) = rank.get(k.as_str()) {
                return (r, 0, (0, 0, 0), k.as_str());
            }
            let mut a = ancestor(k);
            while let Some(p) = a {
                if let Some(&r) = rank.get(p) {
                    return (r, 1, canon(k), k.as_str());
                }
                a = ancestor(p);
            }
            (usize::MAX, 0, canon(k), k.as_str())
        })
        .collect();
    sortable.sort();
    (
        sortable
            .into_iter()
            .map(|(_, _, _, k)| k.to_string())
            .collect(),
        listed,
    )
}

impl Activations {
    /// Reads a dump (memory-mapped, read-only).
    pub fn load(path: &Path) -> Result<Self, ActError> {
        let io = |err| ActError::Io {
            file: path.to_path_buf(),
            err,
        };
        Self::from_bytes(path, &dump::map_read_only(path).map_err(io)?)
    }

    /// Reads a dump held in memory, validated exactly as [`Activations::load`] validates a file;
    /// `path` is only used in messages. Values are copied out, nothing borrows `map`.
    pub fn from_bytes(path: &Path, map: &[u8]) -> Result<Self, ActError> {
        let format = |reason: String| ActError::Format {
            file: path.to_path_buf(),
            reason,
        };
        let (_, header) = SafeTensors::read_metadata(map).map_err(|e| format(e.to_string()))?;
        let metadata: BTreeMap<String, String> = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let st = SafeTensors::deserialize(map).map_err(|e| format(e.to_string()))?;
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            let dtype = view.dtype();
            let values = if dump::is_float(dtype) {
                Values::F32(dump::decode(dtype, view.data()))
            } else if let Some(v) = decode_ints(dtype, view.data()) {
                Values::I64(v)
            } else {
                return Err(ActError::Dtype {
                    file: path.to_path_buf(),
                    tensor: name,
                    dtype,
                });
            };
            tensors.insert(
                name,
                Act {
                    dtype,
                    shape: view.shape().to_vec(),
                    values,
                },
            );
        }
        let source = path.display().to_string();
        let json_list = |key: &'static str| -> Result<Option<Vec<serde_json::Value>>, ActError> {
            match metadata.get(key) {
                None => Ok(None),
                Some(s) => serde_json::from_str(s)
                    .map(Some)
                    .map_err(|e| ActError::Meta {
                        file: source.clone(),
                        key,
                        reason: format!("not a JSON list: {e}"),
                    }),
            }
        };
        let declared: Vec<String> = json_list(meta::EXECUTION_ORDER)?
            .unwrap_or_default()
            .into_iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        let meta_tokens: Option<Vec<u32>> = match json_list(meta::TOKEN_IDS)? {
            None => None,
            Some(v) => Some(
                v.iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| ActError::Meta {
                        file: source.clone(),
                        key: meta::TOKEN_IDS,
                        reason: "not a list of token ids".into(),
                    })?,
            ),
        };
        let mut acts = Activations {
            source,
            prompt: metadata.get(meta::PROMPT).cloned(),
            tensors,
            metadata,
            ..Default::default()
        };
        acts.tokens = acts.input_ids().or(meta_tokens);
        acts.finish(&declared);
        Ok(acts)
    }

    /// glmcheck's own capture (already in execution order).
    pub fn from_capture(
        cap: &VecCapture,
        prompt: Option<&str>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Self, ActError> {
        let mut tensors = HashMap::new();
        let mut declared = Vec::with_capacity(cap.len());
        for (key, t) in &cap.entries {
            let err = |err| ActError::Capture {
                key: key.clone(),
                err,
            };
            let shape = t.dims().to_vec();
            let flat = t.flatten_all().map_err(err)?;
            let (dtype, values) = match t.dtype() {
                DType::F32 | DType::BF16 | DType::F16 | DType::F64 => {
                    let d = match t.dtype() {
                        DType::BF16 => Dtype::BF16,
                        DType::F16 => Dtype::F16,
                        _ => Dtype::F32,
                    };
                    let v = flat
                        .to_dtype(DType::F32)
                        .and_then(|t| t.to_vec1::<f32>())
                        .map_err(err)?;
                    (d, Values::F32(v))
                }
                _ => {
                    let v = flat
                        .to_dtype(DType::I64)
                        .and_then(|t| t.to_vec1::<i64>())
                        .map_err(err)?;
                    (Dtype::I64, Values::I64(v))
                }
            };
            if tensors
                .insert(
                    key.clone(),
                    Act {
                        dtype,
                        shape,
                        values,
                    },
                )
                .is_none()
            {
                declared.push(key.clone());
            }
        }
        let mut metadata = metadata;
        metadata.insert(meta::EXPERT_ROWS.into(), "token".into());
        let mut acts = Activations {
            source: "glmcheck forward".into(),
            tensors,
            prompt: prompt.map(str::to_string),
            metadata,
            ..Default::default()
        };
        acts.tokens = acts.input_ids();
        acts.finish(&declared);
        Ok(acts)
    }

    pub(crate) fn input_ids(&self) -> Option<Vec<u32>> {
        let t = self.tensors.get(conv::INPUT_IDS)?;
        t.i64()?.iter().map(|&x| u32::try_from(x).ok()).collect()
    }

    pub(crate) fn finish(&mut self, declared: &[String]) {
        let keys: Vec<String> = self.tensors.keys().cloned().collect();
        let (order, listed) = full_order(&keys, declared);
        self.order = order;
        self.ordered_by_producer = listed;
        self.canonicalize_expert_rows();
    }

    /// Whether `act_fn#n` rows of the routed experts come slot-major (transformers' expert loop).
    pub(crate) fn slot_major(&self) -> bool {
        match self.metadata.get(meta::EXPERT_ROWS) {
            Some(v) => v == "slot",
            None => self.metadata.contains_key(meta::TRANSFORMERS),
        }
    }

    /// Brings every routed expert's `act_fn#n` rows into ascending token order and records which
    /// expert and tokens they are.
    pub(crate) fn canonicalize_expert_rows(&mut self) {
        let slot_major = self.slot_major();
        let keys: Vec<String> = self.tensors.keys().cloned().collect();
        for key in keys {
            let Some((layer, n)) = expert_act_call(&key) else {
                continue;
            };
            if self.expert_rows.contains_key(&key) {
                // Already in token order (this runs again after keys are renamed).
                continue;
            }
            let Some(rows) = ids_in(self, &router_ids_keys(layer)) else {
                continue;
            };
            let hit: BTreeSet<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
            let Some(&expert) = hit.iter().nth(n) else {
                continue;
            };
            let k = rows.first().map_or(0, |r| r.len());
            let mut produced = Vec::new();
            if slot_major {
                for slot in 0..k {
                    for (tok, r) in rows.iter().enumerate() {
                        if r[slot] == expert {
                            produced.push(tok);
                        }
                    }
                }
            } else {
                for (tok, r) in rows.iter().enumerate() {
                    if r.contains(&expert) {
                        produced.push(tok);
                    }
                }
            }
            let mut tokens = produced.clone();
            tokens.sort_unstable();
            let Some(act) = self.tensors.get_mut(&key) else {
                continue;
            };
            if act.shape.first() != Some(&produced.len()) || act.shape.len() != 2 {
                continue;
            }
            if slot_major {
                let cols = act.shape[1];
                if let Values::F32(v) = &act.values {
                    let mut out = Vec::with_capacity(v.len());
                    for tok in &tokens {
                        if let Some(at) = produced.iter().position(|x| x == tok) {
                            out.extend_from_slice(&v[at * cols..(at + 1) * cols]);
                        }
                    }
                    act.values = Values::F32(out);
                }
            }
            self.expert_rows
                .insert(key.clone(), ExpertRows { expert, tokens });
        }
    }

    /// Renames one key (tensor, order, expert rows); the expert rows of newly matching keys are
    /// worked out again.
    pub(crate) fn rename(&mut self, from: &str, to: &str) {
        if let Some(a) = self.tensors.remove(from) {
            self.tensors.insert(to.to_string(), a);
        }
        for k in self.order.iter_mut().filter(|k| k.as_str() == from) {
            *k = to.to_string();
        }
        if let Some(r) = self.expert_rows.remove(from) {
            self.expert_rows.insert(to.to_string(), r);
        }
    }

    /// Writes the dump atomically (temp file + rename), refusing to overwrite any of `inputs`.
    pub fn save(&self, path: &Path, inputs: &[&Path]) -> Result<(), ActError> {
        let mut tensors = BTreeMap::new();
        for (k, a) in &self.tensors {
            let data = match &a.values {
                Values::F32(v) => dump::encode(a.dtype, v),
                Values::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            let dtype = match &a.values {
                Values::F32(_) => a.dtype,
                Values::I64(_) => Dtype::I64,
            };
            tensors.insert(
                k.clone(),
                DumpTensor {
                    dtype,
                    shape: a.shape.clone(),
                    data,
                },
            );
        }
        let mut metadata: HashMap<String, String> = self.metadata.clone().into_iter().collect();
        metadata.insert(
            meta::EXECUTION_ORDER.into(),
            serde_json::to_string(&self.order).unwrap_or_default(),
        );
        if let Some(t) = &self.tokens {
            metadata.insert(
                meta::TOKEN_IDS.into(),
                serde_json::to_string(t).unwrap_or_default(),
            );
        }
        if let Some(p) = &self.prompt {
            metadata.insert(meta::PROMPT.into(), p.clone());
        }
        dump::write_file(path, &tensors, Some(metadata), inputs)?;
        Ok(())
    }
}

// GLM-5's dataflow: what each captured key is and which keys it is computed from

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::names::{LayerPaths, MlpKind};

    fn floats(shape: &[usize], v: Vec<f32>) -> Act {
        Act {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            values: Values::F32(v),
        }
    }

    #[test]
    fn keys_without_an_order_follow_their_ancestor() {
        assert_eq!(ancestor("a.b#2"), Some("a.b"));
        assert_eq!(ancestor("a.b.c"), Some("a.b"));
        assert_eq!(ancestor("a"), None);
        let keys: Vec<String> = ["z", "a.x", "a", "b", "a.x.q", "b#1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let declared: Vec<String> = ["b", "a", "missing"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (order, listed) = full_order(&keys, &declared);
        assert_eq!(order, vec!["b", "b#1", "a", "a.x", "a.x.q", "z"]);
        assert_eq!(listed, 2);
    }

    #[test]
    fn integer_dtypes_widen() {
        assert_eq!(
            decode_ints(Dtype::I32, &(-3i32).to_le_bytes()),
            Some(vec![-3])
        );
        assert_eq!(decode_ints(Dtype::U16, &[1, 1]), Some(vec![257]));
        assert_eq!(decode_ints(Dtype::I8, &[0xff]), Some(vec![-1]));
        assert_eq!(decode_ints(Dtype::F32, &[0; 4]), None);
    }

    #[test]
    fn slot_major_expert_rows_come_to_token_order() {
        let lp = LayerPaths::new(3, true).expect("paths");
        let MlpKind::Moe { gate, experts, .. } = &lp.mlp.kind else {
            panic!("a MoE layer");
        };
        let ids = format!("{gate}.{}", conv::TOPK_INDICES);
        let act1 = format!("{experts}.{}#1", conv::ACT);
        let mut a = Activations::default();
        // Three tokens, k = 2: token 0 → {0, 1}, token 1 → {1, 2}, token 2 → {0, 2}.
        a.tensors.insert(
            ids.clone(),
            Act {
                dtype: Dtype::I64,
                shape: vec![3, 2],
                values: Values::I64(vec![0, 1, 1, 2, 0, 2]),
            },
        );
        // Expert 1 (the second expert hit) ran on token 1 (its slot 0) before token 0 (slot 1).
        a.tensors
            .insert(act1.clone(), floats(&[2, 2], vec![10.0, 11.0, 0.0, 1.0]));
        a.metadata.insert(meta::TRANSFORMERS.into(), "4.57".into());
        a.finish(&[ids.clone(), act1.clone()]);
        assert_eq!(
            a.tensors[&act1].values,
            Values::F32(vec![0.0, 1.0, 10.0, 11.0])
        );
        let rows = &a.expert_rows[&act1];
        assert_eq!((rows.expert, rows.tokens.clone()), (1, vec![0, 1]));
        // glmcheck's own dumps are already in token order.
        let mut b = Activations {
            tensors: a.tensors.clone(),
            ..Default::default()
        };
        b.tensors
            .insert(act1.clone(), floats(&[2, 2], vec![10.0, 11.0, 0.0, 1.0]));
        b.metadata.insert(meta::EXPERT_ROWS.into(), "token".into());
        b.finish(&[]);
        assert_eq!(
            b.tensors[&act1].values,
            Values::F32(vec![10.0, 11.0, 0.0, 1.0])
        );
    }

    #[test]
    fn a_saved_dump_loads_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("d.safetensors");
        let mut a = Activations {
            tokens: Some(vec![5, 6]),
            prompt: Some("hi".into()),
            ..Default::default()
        };
        a.tensors.insert(
            conv::INPUT_IDS.into(),
            Act {
                dtype: Dtype::I64,
                shape: vec![2],
                values: Values::I64(vec![5, 6]),
            },
        );
        a.tensors.insert(
            "model.embed_tokens".into(),
            floats(&[2, 1], vec![0.5, -2.0]),
        );
        a.finish(&[conv::INPUT_IDS.into(), "model.embed_tokens".into()]);
        a.save(&path, &[]).expect("save");
        let b = Activations::load(&path).expect("load");
        assert_eq!(b.tokens, Some(vec![5, 6]));
        assert_eq!(b.prompt.as_deref(), Some("hi"));
        assert_eq!(b.order, a.order);
        assert_eq!(
            b.tensors["model.embed_tokens"].values,
            Values::F32(vec![0.5, -2.0])
        );
        // Not a safetensors file: a typed error, no panic.
        assert!(matches!(
            Activations::from_bytes(&path, b"nonsense"),
            Err(ActError::Format { .. })
        ));
    }
}
