//! Activation dumps and the comparison engine: per-module rel-L2 / cosine / max-abs, the DSA
//! indexer's top-k as sets with ties told apart from divergence, router choices, logit metrics,
//! tolerances by compute dtype and weight quantization, and the first divergence in execution order
//! with a one-line reading. No printing (renderers are in [`crate::report::forward`]).
//!
//! # Dumps
//! A dump is a safetensors file of module outputs keyed by HF module path (the fixtures'
//! convention, see fixtures/README.md), with metadata `token_ids`, `prompt`, `execution_order`. Two
//! producers are known: transformers forward hooks (the fixtures: `execution_order` lists module
//! outputs only; the routed experts' `act_fn#n` rows come slot-major) and glmcheck (`--dump`:
//! `execution_order` lists every key; `act_fn#n` rows in ascending token order, marked by
//! `glmcheck.expert_act_rows = "token"`). On load both are brought to ascending token order.
//!
//! # Ties and positions
//! The model is causal and routes tokens independently, so a choice made at position `p` (an indexer
//! top-k, a router's experts) cannot change any output at a position `< p`. When two dumps choose
//! differently at a tie or near-tie, every later module is compared on the positions before the
//! earliest such choice only, and the table says so; a tie is never reported as a divergence.
//! `glmcheck forward --reference` goes further and replays the reference's choice at indexer ties
//! ([`Aligner`]), so the whole prompt stays comparable.
//!
//! # Tolerances
//! See [`Tolerances::for_profile`] for the figures measured on the fixtures.
//!
//! # Submodules
//! [`forward`]: `glmcheck forward` as a library call (next tokens, greedy continuation, dump,
//! comparison). [`tp`]: the forward as vLLM's tensor-parallel ranks compute it.

pub use crate::forward;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde::Serialize;

use crate::compare;
use crate::dump::{self, DumpTensor};
use crate::gguf::{GgmlType, GgufModel};
use crate::model::names::{conv, LayerPaths, MlpKind, ModelPaths};
use crate::model::{Capture, VecCapture};

/// Reference entries at or below this are an additive mask (transformers' `finfo(f32).min`).
pub const MASKED: f32 = -1e30;
/// A candidate entry at or below this counts as masked (f16's lowest finite value is −65504).
const CAND_MASKED: f32 = -6.0e4;

/// Metadata keys glmcheck writes into its dumps.
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

// ---------------------------------------------------------------------------------------------
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
    fn f32(&self) -> Option<&[f32]> {
        match &self.values {
            Values::F32(v) => Some(v),
            Values::I64(_) => None,
        }
    }

    fn i64(&self) -> Option<&[i64]> {
        match &self.values {
            Values::I64(v) => Some(v),
            Values::F32(_) => None,
        }
    }

    /// Rows of the last dimension of an integer tensor.
    fn rows_i64(&self) -> Option<Vec<&[i64]>> {
        let cols = *self.shape.last()?;
        if cols == 0 {
            return None;
        }
        Some(self.i64()?.chunks(cols).collect())
    }
}

/// Which tokens the rows of one routed expert's `act_fn#n` capture are, and which expert it is.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ExpertRows {
    expert: i64,
    tokens: Vec<usize>,
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
    expert_rows: HashMap<String, ExpertRows>,
}

fn decode_ints(dtype: Dtype, data: &[u8]) -> Option<Vec<i64>> {
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
fn ancestor(key: &str) -> Option<&str> {
    if let Some((head, n)) = key.rsplit_once('#') {
        if n.chars().all(|c| c.is_ascii_digit()) {
            return Some(head);
        }
    }
    key.rsplit_once('.').map(|(p, _)| p)
}

/// All keys in execution order: `declared` first (those present), the rest after their nearest
/// declared ancestor (alphabetically among siblings), unplaceable keys at the end.
fn full_order(keys: &[String], declared: &[String]) -> (Vec<String>, usize) {
    let present: BTreeSet<&str> = keys.iter().map(String::as_str).collect();
    let mut rank: HashMap<&str, usize> = HashMap::new();
    for k in declared {
        if present.contains(k.as_str()) && !rank.contains_key(k.as_str()) {
            let r = rank.len();
            rank.insert(k.as_str(), r);
        }
    }
    let listed = rank.len();
    let mut sortable: Vec<(usize, usize, &str)> = keys
        .iter()
        .map(|k| {
            if let Some(&r) = rank.get(k.as_str()) {
                return (r, 0, k.as_str());
            }
            let mut a = ancestor(k);
            while let Some(p) = a {
                if let Some(&r) = rank.get(p) {
                    return (r, 1, k.as_str());
                }
                a = ancestor(p);
            }
            (usize::MAX, 0, k.as_str())
        })
        .collect();
    sortable.sort();
    (
        sortable
            .into_iter()
            .map(|(_, _, k)| k.to_string())
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

    fn input_ids(&self) -> Option<Vec<u32>> {
        let t = self.tensors.get(conv::INPUT_IDS)?;
        t.i64()?.iter().map(|&x| u32::try_from(x).ok()).collect()
    }

    fn finish(&mut self, declared: &[String]) {
        let keys: Vec<String> = self.tensors.keys().cloned().collect();
        let (order, listed) = full_order(&keys, declared);
        self.order = order;
        self.ordered_by_producer = listed;
        self.canonicalize_expert_rows();
    }

    /// Whether `act_fn#n` rows of the routed experts come slot-major (transformers' expert loop).
    fn slot_major(&self) -> bool {
        match self.metadata.get(meta::EXPERT_ROWS) {
            Some(v) => v == "slot",
            None => self.metadata.contains_key(meta::TRANSFORMERS),
        }
    }

    /// Brings every routed expert's `act_fn#n` rows into ascending token order and records which
    /// expert and tokens they are.
    fn canonicalize_expert_rows(&mut self) {
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
    fn rename(&mut self, from: &str, to: &str) {
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

// ---------------------------------------------------------------------------------------------
// GLM-5's dataflow: what each captured key is and which keys it is computed from

/// What kind of value a key holds; decides how it is compared and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    InputIds,
    Float,
    /// The DSA indexer's top-k key ids `[T, k]` (and its copies in the layer / attention tuples).
    IndexerIds,
    /// Index scores `[T, T]`, causal entries only.
    IndexerScores,
    /// Router expert ids `[T, k]`: compared as sets per token.
    RouterIds,
    /// Router weights `[T, k]`: paired with their expert ids.
    RouterWeights,
    /// One routed expert's activations on the tokens routed to it.
    ExpertAct,
    Logits,
}

#[derive(Debug, Clone)]
struct Node {
    role: Role,
    layer: Option<usize>,
    inputs: Vec<String>,
    /// The tail of a reading: "suspect …".
    suspect: String,
    /// A capture beyond the module outputs (tuple elements, aliases, recomputed extras).
    aux: bool,
}

fn layer_of(key: &str) -> Option<usize> {
    key.strip_prefix("model.layers.")?
        .split(['.', '#'])
        .next()?
        .parse()
        .ok()
}

/// `model.layers.L.mlp.experts.act_fn#n` → (L, n).
fn expert_act_call(key: &str) -> Option<(usize, usize)> {
    // Cheap test first: most keys are not an activation call, and the layer's paths cost ~40 names.
    if !key.contains(conv::ACT) {
        return None;
    }
    let l = layer_of(key)?;
    let paths = LayerPaths::new(l, true).ok()?;
    let MlpKind::Moe { experts, .. } = &paths.mlp.kind else {
        return None;
    };
    let act = format!("{experts}.{}", conv::ACT);
    let rest = key.strip_prefix(&act)?;
    if rest.is_empty() {
        return Some((l, 0));
    }
    rest.strip_prefix('#')?.parse().ok().map(|n| (l, n))
}

fn router_ids_keys(layer: usize) -> Vec<String> {
    let Ok(paths) = LayerPaths::new(layer, true) else {
        return Vec::new();
    };
    match &paths.mlp.kind {
        MlpKind::Moe { gate, .. } => router_ids_alternatives(gate),
        MlpKind::Dense(_) => Vec::new(),
    }
}

/// Where a dump may hold a router's expert ids: the fixtures' recomputed `topk_indices`, or the
/// router's own tuple output `gate.2` (what a plain forward hook records), in that order.
fn router_ids_alternatives(gate: &str) -> Vec<String> {
    vec![
        format!("{gate}.{}", conv::TOPK_INDICES),
        format!("{gate}.2"),
    ]
}

/// The rows of the first of `keys` that `acts` holds as an integer tensor.
fn ids_in<'a>(acts: &'a Activations, keys: &[String]) -> Option<Vec<&'a [i64]>> {
    keys.iter()
        .find_map(|k| acts.tensors.get(k).and_then(Act::rows_i64))
}

/// The graph over the keys of both dumps.
struct Graph {
    nodes: HashMap<String, Node>,
    /// indexer ids key → its layer's index-scores key
    scores_of: HashMap<String, String>,
    /// router ids / weights key → (ids key, weights key, logits key) of its layer
    router_of: HashMap<String, (String, String, String)>,
}

impl Graph {
    fn new(keys: &BTreeSet<String>) -> Self {
        let mut g = Graph {
            nodes: HashMap::new(),
            scores_of: HashMap::new(),
            router_of: HashMap::new(),
        };
        let add = |g: &mut Graph,
                   key: &str,
                   role: Role,
                   layer: Option<usize>,
                   inputs: &[&str],
                   suspect: &str,
                   aux: bool| {
            g.nodes.insert(
                key.to_string(),
                Node {
                    role,
                    layer,
                    inputs: inputs.iter().map(|s| s.to_string()).collect(),
                    suspect: suspect.to_string(),
                    aux,
                },
            );
        };
        let Ok(mp) = ModelPaths::new() else { return g };
        let layers: BTreeSet<usize> = keys.iter().filter_map(|k| layer_of(k)).collect();
        use Role::*;
        add(&mut g, conv::INPUT_IDS, InputIds, None, &[], "", true);
        add(&mut g, conv::POSITION_IDS, InputIds, None, &[], "", true);
        add(
            &mut g,
            &mp.embed,
            Float,
            None,
            &[conv::INPUT_IDS],
            "the token embedding (token_embd: vocab row order)",
            false,
        );
        let sin = format!("{}.1", mp.rotary);
        for r in [mp.rotary.as_str(), sin.as_str()] {
            add(
                &mut g,
                r,
                Float,
                None,
                &[conv::POSITION_IDS],
                "the RoPE tables (rope theta, rope dimension)",
                true,
            );
        }
        let mut prev = mp.embed.clone();
        for &l in &layers {
            let moe_gate = LayerPaths::new(l, true)
                .ok()
                .and_then(|p| match p.mlp.kind {
                    MlpKind::Moe { gate, .. } => Some(gate),
                    MlpKind::Dense(_) => None,
                });
            let moe = moe_gate.as_ref().is_some_and(|gate| {
                keys.iter()
                    .any(|k| k == gate || k.starts_with(&format!("{gate}.")))
            });
            let Ok(lp) = LayerPaths::new(l, moe) else {
                continue;
            };
            let li = Some(l);
            let a = &lp.attn;
            let ix = &a.indexer;
            let sub = |p: &str, s: &str| format!("{p}.{s}");
            add(
                &mut g,
                &lp.input_norm,
                Float,
                li,
                &[&prev],
                "the input_layernorm weight",
                false,
            );
            add(
                &mut g,
                &a.q_a,
                Float,
                li,
                &[&lp.input_norm],
                "the q_a_proj weight",
                false,
            );
            add(
                &mut g,
                &a.q_a_norm,
                Float,
                li,
                &[&a.q_a],
                "the q_a_layernorm weight or its epsilon (1e-6 in transformers)",
                false,
            );
            add(
                &mut g,
                &a.q_b,
                Float,
                li,
                &[&a.q_a_norm],
                "the q_b_proj weight",
                false,
            );
            add(
                &mut g,
                &a.kv_a,
                Float,
                li,
                &[&lp.input_norm],
                "the kv_a_proj_with_mqa weight",
                false,
            );
            add(
                &mut g,
                &a.kv_a_norm,
                Float,
                li,
                &[&a.kv_a],
                "the kv_a_layernorm weight or its epsilon (1e-6 in transformers)",
                false,
            );
            add(
                &mut g,
                &a.kv_b,
                Float,
                li,
                &[&a.kv_a_norm],
                "the kv_b_proj weight (rebuilt from attn_k_b/attn_v_b: rows per head [k_nope | v])",
                false,
            );
            add(
                &mut g,
                &ix.wq_b,
                Float,
                li,
                &[&a.q_a_norm],
                "the indexer wq_b weight",
                false,
            );
            add(
                &mut g,
                &ix.wk,
                Float,
                li,
                &[&lp.input_norm],
                "the indexer wk weight",
                false,
            );
            add(
                &mut g,
                &ix.k_norm,
                Float,
                li,
                &[&ix.wk],
                "the indexer k_norm LayerNorm (weight, bias, eps 1e-6)",
                false,
            );
            add(
                &mut g,
                &ix.weights_proj,
                Float,
                li,
                &[&lp.input_norm],
                "the indexer weights_proj weight",
                false,
            );
            let iq = sub(&ix.module, conv::IDX_Q);
            let ik = sub(&ix.module, conv::IDX_K);
            let ihw = sub(&ix.module, conv::IDX_HEAD_WEIGHTS);
            let iscores = sub(&ix.module, conv::IDX_SCORES);
            add(
                &mut g,
                &iq,
                Float,
                li,
                &[&ix.wq_b],
                "the indexer's RoPE on q (rope part first, interleaved pairs)",
                true,
            );
            add(
                &mut g,
                &ik,
                Float,
                li,
                &[&ix.k_norm],
                "the indexer's RoPE on k (rope part first, interleaved pairs)",
                true,
            );
            add(
                &mut g,
                &ihw,
                Float,
                li,
                &[&ix.weights_proj],
                "the head-weight scale index_n_heads^-1/2",
                true,
            );
            let score_inputs: Vec<&str> = if keys.contains(&iq) {
                vec![&iq, &ik, &ihw]
            } else {
                vec![&ix.wq_b, &ix.k_norm, &ix.weights_proj]
            };
            add(
                &mut g,
                &iscores,
                IndexerScores,
                li,
                &score_inputs,
                "the index score (relu(q·k)·index_head_dim^-1/2 weighted by the head weights, causal mask)",
                true,
            );
            let ids_inputs: Vec<&str> = if keys.contains(&iscores) {
                vec![&iscores]
            } else {
                score_inputs.clone()
            };
            add(
                &mut g,
                &ix.module,
                IndexerIds,
                li,
                &ids_inputs,
                "the indexer's top-k selection (k = min(index_topk, T), causal mask)",
                false,
            );
            let attn_ids = sub(&a.module, "2");
            let layer_ids = sub(&lp.layer, "1");
            for copy in [&attn_ids, &layer_ids] {
                add(
                    &mut g,
                    copy,
                    IndexerIds,
                    li,
                    &[&ix.module],
                    "the top-k ids handed on (they should equal the indexer's)",
                    true,
                );
            }
            for k in [&ix.module, &attn_ids, &layer_ids] {
                g.scores_of.insert(k.clone(), iscores.clone());
            }
            let qs = sub(&a.module, conv::QUERY_STATES);
            let ks = sub(&a.module, conv::KEY_STATES);
            let vs = sub(&a.module, conv::VALUE_STATES);
            let kr = sub(&a.module, conv::K_ROT);
            let probs = sub(&a.module, "1");
            add(
                &mut g,
                &kr,
                Float,
                li,
                &[&a.kv_a],
                "RoPE on the shared rope key (interleaved pairs, rope theta)",
                true,
            );
            add(
                &mut g,
                &qs,
                Float,
                li,
                &[&a.q_b],
                "RoPE on q (interleaved pairs, rope theta) or the per-head [nope | rope] split of q_b",
                true,
            );
            add(
                &mut g,
                &ks,
                Float,
                li,
                &[&a.kv_b, &kr],
                "the per-head [k_nope | v] split of kv_b or the shared rope key",
                true,
            );
            add(
                &mut g,
                &vs,
                Float,
                li,
                &[&a.kv_b],
                "the per-head [k_nope | v] split of kv_b_proj",
                true,
            );
            let probs_inputs: Vec<&str> = if keys.contains(&qs) {
                vec![&qs, &ks, &ix.module]
            } else {
                vec![&a.q_b, &a.kv_b, &a.kv_a, &ix.module]
            };
            add(
                &mut g,
                &probs,
                Float,
                li,
                &probs_inputs,
                "the softmax scale (qk_head_dim^-1/2) or the attention mask (causal ∩ indexer top-k)",
                true,
            );
            let o_inputs: Vec<&str> = if keys.contains(&probs) && keys.contains(&vs) {
                vec![&probs, &vs]
            } else {
                vec![&a.q_b, &a.kv_b, &a.kv_a, &ix.module]
            };
            add(
                &mut g,
                &a.o,
                Float,
                li,
                &o_inputs,
                "the attention core (RoPE, softmax scale, mask, head layout) or the o_proj weight",
                false,
            );
            add(
                &mut g,
                &a.module,
                Float,
                li,
                &[&a.o],
                "the attention output handed on (it should equal o_proj's)",
                false,
            );
            add(
                &mut g,
                &lp.post_norm,
                Float,
                li,
                &[&a.module, &prev],
                "the residual add (x + self_attn) or the post_attention_layernorm weight",
                false,
            );
            let mlp_module = lp.mlp.module.clone();
            match &lp.mlp.kind {
                MlpKind::Dense(p) => {
                    add(
                        &mut g,
                        &p.gate,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the mlp gate_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &p.act,
                        Float,
                        li,
                        &[&p.gate],
                        "the activation (SiLU)",
                        false,
                    );
                    add(
                        &mut g,
                        &p.up,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the mlp up_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &p.down,
                        Float,
                        li,
                        &[&p.act, &p.up],
                        "the mlp down_proj weight (or the gate·up product)",
                        false,
                    );
                    add(
                        &mut g,
                        &p.module,
                        Float,
                        li,
                        &[&p.down],
                        "the mlp output",
                        false,
                    );
                }
                MlpKind::Moe {
                    gate,
                    experts,
                    shared,
                } => {
                    let w1 = sub(gate, "1");
                    let i2 = sub(gate, "2");
                    let tw = sub(gate, conv::TOPK_WEIGHTS);
                    let ti = sub(gate, conv::TOPK_INDICES);
                    add(
                        &mut g,
                        gate,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the router weight (mlp.gate, kept in f32)",
                        false,
                    );
                    for (k, aux) in [(&w1, true), (&tw, false)] {
                        add(
                            &mut g,
                            k,
                            RouterWeights,
                            li,
                            &[gate],
                            "the routing weights (sigmoid of the logits, normalised, × routed_scaling_factor)",
                            aux,
                        );
                        g.router_of
                            .insert(k.clone(), (ti.clone(), tw.clone(), gate.clone()));
                    }
                    for (k, aux) in [(&i2, true), (&ti, false)] {
                        add(
                            &mut g,
                            k,
                            RouterIds,
                            li,
                            &[gate],
                            "expert selection (e_score_correction_bias, group-limited top-k)",
                            aux,
                        );
                        g.router_of
                            .insert(k.clone(), (ti.clone(), tw.clone(), gate.clone()));
                    }
                    let act = format!("{experts}.{}", conv::ACT);
                    for k in keys
                        .iter()
                        .filter(|k| k.as_str() == act || k.starts_with(&format!("{act}#")))
                    {
                        add(
                            &mut g,
                            k,
                            ExpertAct,
                            li,
                            &[&lp.post_norm, &ti],
                            "that routed expert's gate/up weights (w13 layout)",
                            true,
                        );
                    }
                    add(
                        &mut g,
                        experts,
                        Float,
                        li,
                        &[&lp.post_norm, &ti, &tw],
                        "the routed experts' weights (w13/w2 layout, expert order)",
                        false,
                    );
                    let s = shared;
                    add(
                        &mut g,
                        &s.gate,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the shared expert gate_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &s.act,
                        Float,
                        li,
                        &[&s.gate],
                        "the activation (SiLU)",
                        false,
                    );
                    add(
                        &mut g,
                        &s.up,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the shared expert up_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &s.down,
                        Float,
                        li,
                        &[&s.act, &s.up],
                        "the shared expert down_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &s.module,
                        Float,
                        li,
                        &[&s.down],
                        "the shared expert output",
                        false,
                    );
                    add(
                        &mut g,
                        &mlp_module,
                        Float,
                        li,
                        &[experts, &s.module],
                        "the sum of routed and shared experts",
                        false,
                    );
                }
            }
            add(
                &mut g,
                &lp.layer,
                Float,
                li,
                &[&mlp_module, &lp.post_norm],
                "the residual add (h + mlp)",
                false,
            );
            prev = lp.layer.clone();
        }
        add(
            &mut g,
            &mp.norm,
            Float,
            None,
            &[&prev],
            "the final norm weight (output_norm)",
            false,
        );
        add(
            &mut g,
            &mp.model,
            Float,
            None,
            &[&mp.norm],
            "the model output handed on (it should equal model.norm's)",
            true,
        );
        add(
            &mut g,
            &mp.lm_head,
            Logits,
            None,
            &[&mp.norm],
            "the lm_head weight (output: vocab row order, vocab padding)",
            false,
        );
        add(
            &mut g,
            conv::LOGITS,
            Logits,
            None,
            &[&mp.lm_head],
            "the logits handed on (they should equal lm_head's)",
            true,
        );
        g
    }

    fn node(&self, key: &str) -> Node {
        self.nodes.get(key).cloned().unwrap_or(Node {
            role: Role::Float,
            layer: layer_of(key),
            inputs: Vec::new(),
            suspect: "this module".into(),
            aux: true,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Tolerances

/// The arithmetic a forward ran in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    F32,
    Bf16,
    F16,
}

impl ComputeDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(ComputeDtype::F32),
            "bf16" | "bfloat16" => Some(ComputeDtype::Bf16),
            "f16" | "float16" => Some(ComputeDtype::F16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "f16",
        }
    }

    pub fn candle(self) -> DType {
        match self {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::BF16,
            ComputeDtype::F16 => DType::F16,
        }
    }
}

/// The coarsest type among a GGUF's matrices (≥ 2 dims): what decides its weight noise.
pub fn weight_class(model: &GgufModel) -> GgmlType {
    model
        .tensors()
        .filter(|t| t.info.ne.len() >= 2)
        .map(|t| t.info.dtype)
        .max_by(|a, b| {
            compare::quant_rel_l2_bound(*a)
                .total_cmp(&compare::quant_rel_l2_bound(*b))
                .then(b.bits_per_weight().total_cmp(&a.bits_per_weight()))
        })
        .unwrap_or(GgmlType::F32)
}

/// What the reference's weights are, relative to the candidate's GGUF: what may differ decides the
/// bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReferenceWeights {
    /// The same GGUF run by glmcheck (its `--dump`): only the compute dtype may differ.
    Same,
    /// The same GGUF run by another engine (llama.cpp, a deployment's dump): its kernels differ
    /// (activations quantized for the matmuls, fused kernels), the weights do not.
    SameGguf,
    /// The unquantized originals (a transformers dump of the HF checkpoint): the quant type's
    /// noise on top.
    Original,
}

impl ReferenceWeights {
    pub fn name(self) -> &'static str {
        match self {
            ReferenceWeights::Same => "same",
            ReferenceWeights::SameGguf => "same-gguf",
            ReferenceWeights::Original => "original",
        }
    }

    /// What a dump's metadata says: glmcheck's dump of a GGUF with this file name and weight class
    /// is the same GGUF; anything else is taken as the originals (the loosest, never a false
    /// alarm from weight noise).
    pub fn of_dump(acts: &Activations, gguf: &Path, weights: GgmlType) -> Self {
        let base = |p: &str| {
            Path::new(p)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        };
        let same_file = acts
            .metadata
            .get(meta::GGUF)
            .and_then(|g| base(g))
            .zip(base(&gguf.to_string_lossy()))
            .is_some_and(|(a, b)| a == b);
        let same_type = acts.metadata.get(meta::WEIGHTS).map(String::as_str) == Some(weights.name);
        if same_file && same_type {
            ReferenceWeights::Same
        } else {
            ReferenceWeights::Original
        }
    }
}

/// How far a candidate may be from an f32 transformers reference and still be correct.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tolerances {
    /// Largest rel-L2 of any float module.
    pub rel_l2: f64,
    /// Mean over positions of KL(ref ‖ cand) of the next-token distributions, nats.
    pub kl_mean: f64,
    /// Largest per-position KL.
    pub kl_max: f64,
    /// Smallest fraction of positions whose top-1 token agrees.
    pub top1_min: f64,
    /// Noise of an index score, relative to the largest visible |score| of its row: a top-k swap
    /// whose margin is below it is a near-tie.
    pub score_noise: f64,
    /// Largest fraction of tokens whose routed experts may differ (near-tied expert scores) while
    /// the router logits agree.
    pub router_flip_max: f64,
    /// What the figures are based on.
    pub basis: String,
    /// What the reference's weights are (decides which figures apply).
    pub reference: ReferenceWeights,
}

/// Weight noise classes with measured (or derived) tolerances.
fn weight_bits(t: GgmlType) -> u32 {
    match t.name {
        "F32" | "F64" => 32,
        "F16" | "BF16" => 16,
        "Q8_0" | "Q8_1" | "Q8_K" => 8,
        "Q6_K" => 6,
        "Q5_0" | "Q5_1" | "Q5_K" => 5,
        "Q4_0" | "Q4_1" | "Q4_K" | "IQ4_NL" | "IQ4_XS" | "MXFP4" | "NVFP4" => 4,
        _ => 3,
    }
}

impl Tolerances {
    /// Tolerances for a forward in `dtype` on weights whose coarsest matrix type is `weights`,
    /// against an f32 transformers reference.
    ///
    /// Measured on the fixtures (glmcheck's forward of each GGUF against transformers' f32 dumps of
    /// both prompts, the reference's top-k replayed at indexer ties, every captured module; produced
    /// by `cargo test --test forward_cli measured_figures_sit_inside_their_profiles -- --nocapture`, full table in
    /// reports/forward-tolerances.md). Worst over both prompts:
    ///
    /// | compute | weights | worst rel-L2 (module / index scores) | KL mean / max | top-1 | top-k swap margin / row max | routed-expert flips |
    /// |---|---|---|---|---|---|---|
    /// | f32 | F32 | 9.7e-7 / 1.2e-6 | 6.7e-13 / 1.1e-12 | 45/45 | 0 (one exact tie) | 0 |
    /// | f32 | BF16 | 5.2e-3 / 6.9e-3 | 1.7e-5 / 2.5e-5 | 45/45 | 0.002 | 0 |
    /// | f32 | Q8_0 | 1.8e-2 / 2.2e-2 | 1.9e-4 / 3.3e-4 | 43/45 | 0.010 | 0 |
    /// | f32 | Q4_K (Q4_K_M mix) | 0.22 / 0.31 | 2.1e-2 / 3.8e-2 | 34/40 | 0.91 | 3 of 27 tokens in a layer |
    /// | bf16 | F32 or BF16 | 1.2e-2 / 1.6e-2 | 1.1e-4 / 2.2e-4 | 44/45 | 0.007 | 0 |
    /// | bf16 | Q8_0 | 2.2e-2 / 2.6e-2 | 2.6e-4 / 4.4e-4 | 45/45 | 0.010 | 0 |
    /// | bf16 | Q4_K (Q4_K_M mix) | 0.22 / 0.31 | 2.2e-2 / 3.9e-2 | 31/39 | 0.91 | 3 of 27 tokens in a layer |
    ///
    /// The bounds below are those figures with about 3× headroom (rel-L2 covers the index scores,
    /// the noisiest float output; f32 on F32 keeps the acceptance bound 1e-4). At 4 bits a top-k
    /// swap margin reached 0.91 of the row's largest score, so there every indexer swap counts as a
    /// near-tie: the indexer's choices are noise-dominated at that precision, and a broken indexer
    /// shows in its float outputs instead. Not measured, derived: f16 compute takes bf16's bounds;
    /// 5- and 6-bit types take the 4-bit ones; 2- and 3-bit types twice those.
    /// Tolerances against a reference whose weights relate to the candidate's as `reference` says:
    /// the same GGUF through glmcheck leaves only the compute dtype ([`Self::for_profile`] with F32
    /// weights); the same GGUF through another engine adds its kernels' noise, measured against
    /// llama.cpp's logits of the fixtures (llama-cpp-python 0.3.36, both prompts, worst: F32 KL
    /// 9.0e-8, BF16 2.2e-5, Q8_0 mean 8.6e-3 / max 8.0e-2 / top-1 15 of 18, Q4_K_M mean 1.7e-2 /
    /// max 0.15 / top-1 25 of 27 — its indexer picks near-ties differently), bounds about 3× that;
    /// the originals take the full profile.
    pub fn for_reference(
        dtype: ComputeDtype,
        weights: GgmlType,
        reference: ReferenceWeights,
    ) -> Self {
        match reference {
            ReferenceWeights::Original => Self::for_profile(dtype, weights),
            ReferenceWeights::Same => {
                let mut t = Self::for_profile(dtype, GgmlType::F32);
                t.reference = reference;
                t.basis = format!(
                    "{} compute, the same {} weights on both sides (glmcheck's own run)",
                    dtype.name(),
                    weights.name
                );
                t
            }
            ReferenceWeights::SameGguf => {
                let bits = weight_bits(weights);
                let mut t =
                    Self::for_profile(dtype, if bits >= 16 { weights } else { GgmlType::F32 });
                if bits < 16 {
                    let full = Self::for_profile(dtype, weights);
                    let (kl_mean, kl_max) = if bits >= 8 {
                        (3e-2, 0.25)
                    } else {
                        (5e-2, 0.45)
                    };
                    t = Tolerances {
                        kl_mean,
                        kl_max,
                        top1_min: 0.75,
                        ..full
                    };
                }
                t.reference = reference;
                t.basis = format!(
                    "{} compute, the same {} weights run by another engine (kernel noise measured \
                     against llama.cpp)",
                    dtype.name(),
                    weights.name
                );
                t
            }
        }
    }

    pub fn for_profile(dtype: ComputeDtype, weights: GgmlType) -> Self {
        let bits = weight_bits(weights);
        let half = dtype != ComputeDtype::F32;
        // (rel_l2, kl_mean, kl_max, top1_min, score_noise, router_flip_max)
        let (v, basis): ((f64, f64, f64, f64, f64, f64), &str) = match (half, bits) {
            (false, 32) => ((1e-4, 1e-6, 1e-5, 1.0, 1e-5, 0.0), "measured"),
            (false, 16) => ((2e-2, 1e-4, 2e-4, 0.9, 1e-2, 0.1), "measured"),
            (true, 16..) => ((5e-2, 5e-4, 1e-3, 0.85, 3e-2, 0.1), "measured"),
            (false, 8) => ((6e-2, 8e-4, 1.5e-3, 0.85, 4e-2, 0.1), "measured"),
            (true, 8) => ((8e-2, 1e-3, 2e-3, 0.85, 4e-2, 0.1), "measured"),
            (_, 4) => ((0.6, 8e-2, 0.15, 0.5, 2.0, 0.3), "measured"),
            (_, 5..=6) => ((0.6, 8e-2, 0.15, 0.5, 2.0, 0.3), "derived from 4-bit"),
            _ => (
                (1.2, 0.16, 0.3, 0.3, 2.0, 0.5),
                "derived: twice the 4-bit bounds",
            ),
        };
        let basis = if dtype == ComputeDtype::F16 {
            "derived from bf16"
        } else {
            basis
        };
        Tolerances {
            rel_l2: v.0,
            kl_mean: v.1,
            kl_max: v.2,
            top1_min: v.3,
            score_noise: v.4,
            router_flip_max: v.5,
            reference: ReferenceWeights::Original,
            basis: format!(
                "{} compute, {} weights ({basis})",
                dtype.name(),
                weights.name
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The comparison

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Within tolerance.
    Match,
    /// Above tolerance (or a shape / mask / choice that cannot be noise).
    Diverged,
    /// The top-k sets differ only among keys with exactly equal scores.
    Tie,
    /// The sets differ only where the margin is below the noise of dtype and quantization.
    NearTie,
    /// The top-k sets differ and the reference has no index scores to tell why.
    Unclassified,
    /// Not comparable (routed to different tokens, every position follows a tie).
    Skipped,
    /// The two dumps hold it in layouts that cannot be matched (shapes that differ beyond leading
    /// singleton dims, a float where the other has ids): not compared, and never a divergence.
    Incomparable,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Match => "match",
            Status::Diverged => "DIVERGED",
            Status::Tie => "tie",
            Status::NearTie => "near-tie",
            Status::Unclassified => "unclassified",
            Status::Skipped => "skipped",
            Status::Incomparable => "INCOMPARABLE",
        }
    }

    fn ok(self) -> bool {
        !matches!(self, Status::Diverged)
    }
}

/// How one differing top-k row is explained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TieClass {
    ExactTie,
    NearTie,
    Divergence,
    Unavailable,
}

/// One query position where the two top-k sets (restricted to causal keys) differ.
#[derive(Debug, Clone, Serialize)]
pub struct TopkRow {
    pub pos: usize,
    pub only_ref: Vec<i64>,
    pub only_cand: Vec<i64>,
    /// The reference's k-th and (k+1)-th largest visible score.
    pub kth: Option<f32>,
    pub next: Option<f32>,
    /// Largest reference score among keys only the reference chose minus the smallest among keys
    /// only the candidate chose: how much the scores would have to move to swap the choice.
    pub margin: Option<f64>,
    /// The noise a score may carry here (score_noise × the row's largest |score|).
    pub noise: Option<f64>,
    pub class: TieClass,
    /// glmcheck replayed the reference's choice here (so later modules are comparable).
    pub replayed: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopkCmp {
    pub k: usize,
    /// Causal positions compared.
    pub positions: usize,
    /// Mean over positions of |ref ∩ cand| / |ref| on causal keys.
    pub overlap: f64,
    pub rows: Vec<TopkRow>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RouterCmp {
    pub tokens: usize,
    /// Tokens whose expert sets differ.
    pub flipped: Vec<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModuleRow {
    pub name: String,
    pub layer: Option<usize>,
    pub role: Role,
    pub status: Status,
    pub rel_l2: Option<f64>,
    pub cosine: Option<f64>,
    pub max_abs: Option<f64>,
    /// Index (in the compared tensor's shape) of the largest absolute difference.
    pub max_abs_at: Option<Vec<usize>>,
    /// Token positions compared, when fewer than all (positions after a tie-break left out).
    pub positions_compared: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topk: Option<TopkCmp>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<RouterCmp>,
    pub note: Option<String>,
    /// A capture beyond the module outputs (tuple elements, aliases, recomputed extras).
    pub aux: bool,
    /// The rel-L2 the two dumps' storage dtypes alone may put between them (added to the bound).
    pub storage_rel_l2: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogitsCmp {
    /// Positions compared (all but those left out after a tie-break).
    pub positions: usize,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub kl_max_pos: usize,
    /// Fraction of positions whose argmax agrees.
    pub top1_agree: f64,
    pub top1_agree_count: usize,
    /// RMS over positions of the change in probability of the reference's top token.
    pub rms_dp: f64,
    pub max_abs: f64,
    /// Mean next-token entropy of the candidate and of the reference, nats.
    pub entropy_mean: f64,
    pub entropy_ref_mean: f64,
    pub log_vocab: f64,
    /// The candidate's next-token distribution is close to uniform while the reference's is not:
    /// it outputs noise.
    pub garbage: bool,
    /// The reference's own distribution is close to uniform (a random-weight model): near-uniform
    /// output says nothing then.
    pub reference_uniform: bool,
    /// What the two dumps' storage rounding alone may contribute (second-order bound
    /// ½·Σ p·(δ_ref + δ_cand)², mean and max over positions), added to the KL bounds.
    pub kl_storage_mean: f64,
    pub kl_storage_max: f64,
    /// Positions whose top-1 differs only between logits closer than the storage rounding (counted
    /// as agreeing in `top1_agree`).
    pub top1_storage_ties: usize,
    /// (position, KL) for every compared position.
    pub kl_by_position: Vec<(usize, f64)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct InputStatus {
    pub name: String,
    /// `None` when the input is not in both dumps.
    pub status: Option<Status>,
    pub rel_l2: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FirstDivergence {
    pub module: String,
    pub layer: Option<usize>,
    pub status: Status,
    pub rel_l2: Option<f64>,
    pub cosine: Option<f64>,
    pub max_abs: Option<f64>,
    pub inputs: Vec<InputStatus>,
    pub reading: String,
}

/// Positions left out of later comparisons because the dumps chose differently at a tie.
#[derive(Debug, Clone, Serialize)]
pub struct Exclusion {
    /// The module whose choice differed.
    pub module: String,
    /// The positions left out from there on.
    pub positions: Vec<usize>,
    /// `true`: every position from `positions[0]` on (an indexer choice reaches all later
    /// positions through attention); `false`: those tokens only (a routed-expert choice, whose
    /// small spill-over into later positions through attention stays within tolerance).
    pub from_on: bool,
    pub cause: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub reference: String,
    pub candidate: String,
    pub tokens: Vec<u32>,
    pub tolerances: Tolerances,
    pub modules: Vec<ModuleRow>,
    pub logits: Option<LogitsCmp>,
    pub first_divergence: Option<FirstDivergence>,
    pub exclusions: Vec<Exclusion>,
    /// Keys only one dump has.
    pub only_reference: Vec<String>,
    pub only_candidate: Vec<String>,
    pub notes: Vec<String>,
    /// Modules in both dumps whose layouts could not be matched (not compared).
    pub incomparable: Vec<String>,
    /// The user accepts incomparable modules (`--allow-incomparable`): they no longer make the
    /// run incomplete. Set by the caller.
    pub allow_incomparable: bool,
}

/// The outcome of a comparison of activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CmpVerdict {
    WithinTolerance,
    Diverged,
    /// Nothing diverged among what was compared, but modules in both dumps could not be compared.
    Incomplete,
}

impl Comparison {
    pub fn diverged(&self) -> bool {
        self.first_divergence.is_some()
    }

    pub fn verdict(&self) -> CmpVerdict {
        if self.diverged() {
            CmpVerdict::Diverged
        } else if !self.incomparable.is_empty() && !self.allow_incomparable {
            CmpVerdict::Incomplete
        } else {
            CmpVerdict::WithinTolerance
        }
    }
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            idx[i] = flat % d;
            flat /= d;
        }
    }
    idx
}

/// The axis of a key that runs over token positions.
fn token_axis(key: &str, shape: &[usize], t: usize) -> Option<usize> {
    let tail = key.rsplit('.').next().unwrap_or(key);
    let axis1 = [
        conv::QUERY_STATES,
        conv::KEY_STATES,
        conv::VALUE_STATES,
        conv::K_ROT,
    ]
    .contains(&tail)
        || key.ends_with(".kv_b_proj")
        || (key.ends_with(".self_attn.1") && shape.len() == 3);
    // Those keys carry a leading (batch or head) dim; once a comparison dropped it, tokens lead.
    let axis = if axis1 && shape.len() >= 3 { 1 } else { 0 };
    (shape.get(axis) == Some(&t)).then_some(axis)
}

/// Keeps the indices `keep` says along `axis`.
fn select(values: &[f32], shape: &[usize], axis: usize, keep: &[bool]) -> (Vec<f32>, Vec<usize>) {
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let n = shape[axis];
    let kept = keep.iter().take(n).filter(|&&k| k).count();
    let mut out = Vec::with_capacity(outer * kept * inner);
    for o in 0..outer {
        for (i, _) in keep.iter().take(n).enumerate().filter(|(_, &k)| k) {
            let base = (o * n + i) * inner;
            out.extend_from_slice(&values[base..base + inner]);
        }
    }
    let mut s = shape.to_vec();
    s[axis] = kept;
    (out, s)
}

struct FloatResult {
    diff: compare::Diff,
    shape: Vec<usize>,
    mask_mismatch: usize,
}

/// Compares float values, skipping the reference's masked entries (the candidate must mask them
/// too).
fn float_diff(cand: &[f32], reference: &[f32], shape: Vec<usize>) -> FloatResult {
    let mut mask_mismatch = 0;
    let (mut a, mut b) = (
        Vec::with_capacity(cand.len()),
        Vec::with_capacity(cand.len()),
    );
    let mut map = Vec::with_capacity(cand.len());
    for (i, (&x, &y)) in cand.iter().zip(reference).enumerate() {
        if y <= MASKED || y == f32::NEG_INFINITY {
            if x > CAND_MASKED {
                mask_mismatch += 1;
            }
            continue;
        }
        a.push(x);
        b.push(y);
        map.push(i);
    }
    let mut diff = compare::diff(&a, &b);
    diff.max_abs_at = map.get(diff.max_abs_at).copied().unwrap_or(0);
    FloatResult {
        diff,
        shape,
        mask_mismatch,
    }
}

/// Sorted visible (causal) ids of one top-k row.
fn visible(ids: &[i64], i: usize) -> BTreeSet<i64> {
    ids.iter()
        .copied()
        .filter(|&j| j >= 0 && j <= i as i64)
        .collect()
}

/// Classifies one query row's top-k difference; `None` when the causal sets agree.
///
/// `ref_scores` / `cand_scores` are the row's index scores over all keys (masked ones included).
/// Exact tie: every differing key scores exactly the k-th score (in both dumps when both have
/// scores). Near-tie: the margin (largest reference score among keys only the reference chose
/// minus the smallest among keys only the candidate chose) is at most `score_noise` × the row's
/// largest visible |score|. Anything else, and any difference while at most k keys are visible
/// (all must be chosen), is a divergence; without reference scores the row is unclassified.
pub fn classify_topk_row(
    i: usize,
    k: usize,
    ref_ids: &[i64],
    cand_ids: &[i64],
    ref_scores: Option<&[f32]>,
    cand_scores: Option<&[f32]>,
    score_noise: f64,
) -> Option<TopkRow> {
    let (a, b) = (visible(ref_ids, i), visible(cand_ids, i));
    if a == b {
        return None;
    }
    let only_ref: Vec<i64> = a.difference(&b).copied().collect();
    let only_cand: Vec<i64> = b.difference(&a).copied().collect();
    let mut row = TopkRow {
        pos: i,
        only_ref,
        only_cand,
        kth: None,
        next: None,
        margin: None,
        noise: None,
        class: TieClass::Unavailable,
        replayed: false,
    };
    if i < k || a.len() != b.len() {
        // At most k keys visible: both must select every one of them.
        row.class = TieClass::Divergence;
        return Some(row);
    }
    let Some(rs) = ref_scores.filter(|s| s.len() > i) else {
        return Some(row);
    };
    let vis = |s: &[f32]| -> Vec<f32> {
        let mut v: Vec<f32> = s[..=i].to_vec();
        v.sort_by(|x, y| y.total_cmp(x));
        v
    };
    let rv = vis(rs);
    let kth = rv[k - 1];
    row.kth = Some(kth);
    row.next = rv.get(k).copied();
    let score = |s: &[f32], j: i64| s.get(j as usize).copied().unwrap_or(f32::NAN);
    let hi = row
        .only_ref
        .iter()
        .map(|&j| score(rs, j))
        .fold(f32::NEG_INFINITY, f32::max);
    let lo = row
        .only_cand
        .iter()
        .map(|&j| score(rs, j))
        .fold(f32::INFINITY, f32::min);
    let margin = hi as f64 - lo as f64;
    row.margin = Some(margin);
    let scale = rv.iter().map(|x| x.abs()).fold(0f32, f32::max) as f64;
    let noise = score_noise * scale;
    row.noise = Some(noise);
    let diff_ids: Vec<i64> = row.only_ref.iter().chain(&row.only_cand).copied().collect();
    let exact_ref = diff_ids.iter().all(|&j| score(rs, j) == kth);
    let exact_cand = match cand_scores.filter(|s| s.len() > i) {
        None => true,
        Some(cs) => {
            let cv = vis(cs);
            let ck = cv[k - 1];
            diff_ids.iter().all(|&j| score(cs, j) == ck)
        }
    };
    row.class = if exact_ref && exact_cand {
        TieClass::ExactTie
    } else if margin.is_finite() && margin <= noise {
        TieClass::NearTie
    } else {
        TieClass::Divergence
    };
    Some(row)
}

/// Options of one comparison.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    pub tolerances: Tolerances,
    /// The model's `index_topk`, when known: a divergence that starts at that position points at
    /// the DSA indexer.
    pub index_topk: Option<usize>,
}

fn get_f32<'a>(acts: &'a Activations, key: &str) -> Option<&'a [f32]> {
    acts.tensors.get(key).and_then(Act::f32)
}

/// The positions still compared.
struct Keep {
    keep: Vec<bool>,
}

impl Keep {
    fn kept(&self) -> usize {
        self.keep.iter().filter(|&&k| k).count()
    }

    /// `Some(n)` when fewer than all positions are kept.
    fn partial(&self) -> Option<usize> {
        let n = self.kept();
        (n < self.keep.len()).then_some(n)
    }

    fn rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.keep
            .iter()
            .enumerate()
            .filter(|(_, &k)| k)
            .map(|(i, _)| i)
    }

    fn has(&self, i: usize) -> bool {
        self.keep.get(i).copied().unwrap_or(false)
    }
}

/// Both dumps' `[T, k]` integer rows, or why they cannot be compared (set on `row`).
fn ids_rows(ra: &Act, ca: &Act, t: usize, row: &mut ModuleRow) -> Option<IdRows> {
    match (ra.rows_i64(), ca.rows_i64()) {
        (Some(rr), Some(cr)) if ra.shape == ca.shape && rr.len() == t => Some((
            rr.into_iter().map(<[i64]>::to_vec).collect(),
            cr.into_iter().map(<[i64]>::to_vec).collect(),
        )),
        (Some(_), Some(_)) => {
            row.status = Status::Incomparable;
            row.note = Some(format!(
                "shape {:?} vs {:?}: not the same layout, not compared",
                ra.shape, ca.shape
            ));
            None
        }
        _ => {
            row.status = Status::Incomparable;
            row.note = Some(format!(
                "{:?} vs {:?}: not integer [T, k] ids in both dumps, not compared",
                ra.dtype, ca.dtype
            ));
            None
        }
    }
}

type IdRows = (Vec<Vec<i64>>, Vec<Vec<i64>>);

fn row_slice(s: Option<&[f32]>, i: usize, t: usize) -> Option<&[f32]> {
    s.map(|s| &s[i * t..(i + 1) * t])
}

/// The shape both of two shapes mean, when they differ only in singleton dims: leading ones dropped
/// from the longer (a batch dim kept by one dump), else every singleton dropped (a head dim of 1
/// squeezed by one dump). Singleton dims do not move data, so the values compare as they are.
pub fn common_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    if a == b {
        return Some(a.to_vec());
    }
    let (mut x, mut y) = (a, b);
    while x.len() > y.len() && x.first() == Some(&1) {
        x = &x[1..];
    }
    while y.len() > x.len() && y.first() == Some(&1) {
        y = &y[1..];
    }
    if x == y {
        return Some(x.to_vec());
    }
    let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    let (sa, sb) = (squeeze(a), squeeze(b));
    (sa == sb && !sa.is_empty()).then_some(sa)
}

/// Other names the same module may have in a dump made another way: `logits` ↔ `lm_head`, a
/// `model.` prefix more or less (hooks registered on the inner model, or on a wrapper).
fn alternative_keys(key: &str) -> Vec<String> {
    let mut alts = Vec::new();
    let lm_head = ModelPaths::new().map(|m| m.lm_head).ok();
    if let Some(lm_head) = lm_head {
        if key == conv::LOGITS {
            alts.push(lm_head);
        } else if key == lm_head {
            alts.push(conv::LOGITS.to_string());
        }
    }
    if let Some(rest) = key.strip_prefix("model.") {
        alts.push(rest.to_string());
    }
    alts.push(format!("model.{key}"));
    alts
}

/// The two dumps brought to one naming and one shape per module ("comparison by meaning"): a key
/// only one dump has is matched to the other's name for the same module where that is unambiguous,
/// and shapes that differ only in singleton dims are given their common shape. Returns copies only
/// when something changed, and a note per kind of change.
fn normalize<'a>(
    reference: &'a Activations,
    cand: &'a Activations,
    notes: &mut Vec<String>,
) -> (Cow<'a, Activations>, Cow<'a, Activations>) {
    let mut cand_c: Cow<'a, Activations> = Cow::Borrowed(cand);
    let mut ref_c: Cow<'a, Activations> = Cow::Borrowed(reference);
    let only_ref: Vec<String> = reference
        .order
        .iter()
        .filter(|k| !cand.tensors.contains_key(*k))
        .cloned()
        .collect();
    // Both sides end under glmcheck's own naming (HF paths from the top module, `logits`), which
    // the dataflow knows; a pair is renamed only where exactly one alternative matches.
    let canonical = |k: &str| {
        k == conv::LOGITS
            || k == conv::INPUT_IDS
            || (k.starts_with("model.") && !k.starts_with("model.model."))
            || k == "model"
    };
    let mut claimed = BTreeSet::new();
    let mut renamed = Vec::new();
    for k in &only_ref {
        let hits: Vec<String> = alternative_keys(k)
            .into_iter()
            .filter(|a| cand.tensors.contains_key(a) && !reference.tensors.contains_key(a))
            .filter(|a| !claimed.contains(a))
            .collect();
        let [alt] = hits.as_slice() else {
            continue;
        };
        claimed.insert(alt.clone());
        // Keep the canonical one of the two names (`logits` over the lm_head path).
        let keep_ref = if k == conv::LOGITS || alt == conv::LOGITS {
            k == conv::LOGITS
        } else {
            canonical(k) || !canonical(alt)
        };
        if keep_ref {
            cand_c.to_mut().rename(alt, k);
            renamed.push(format!("{alt} → {k}"));
        } else {
            ref_c.to_mut().rename(k, alt);
            renamed.push(format!("{k} → {alt}"));
        }
    }
    if !renamed.is_empty() {
        if let Cow::Owned(c) = &mut cand_c {
            c.canonicalize_expert_rows();
        }
        if let Cow::Owned(r) = &mut ref_c {
            r.canonicalize_expert_rows();
        }
        notes.push(format!(
            "{} module(s) matched under another name: {}{}",
            renamed.len(),
            renamed
                .iter()
                .take(4)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            if renamed.len() > 4 { ", …" } else { "" }
        ));
    }
    let mut reshaped = Vec::new();
    let keys: Vec<String> = ref_c.order.clone();
    for k in keys {
        let (Some(ra), Some(ca)) = (ref_c.tensors.get(&k), cand_c.tensors.get(&k)) else {
            continue;
        };
        if ra.shape == ca.shape {
            continue;
        }
        let Some(shape) = common_shape(&ra.shape, &ca.shape) else {
            continue;
        };
        let (from_r, from_c) = (ra.shape.clone(), ca.shape.clone());
        if let Some(a) = ref_c.to_mut().tensors.get_mut(&k) {
            a.shape = shape.clone();
        }
        if let Some(a) = cand_c.to_mut().tensors.get_mut(&k) {
            a.shape = shape.clone();
        }
        reshaped.push(format!("{} ({from_r:?} / {from_c:?})", short_name(&k)));
    }
    if !reshaped.is_empty() {
        notes.push(format!(
            "{} module(s) compared after dropping singleton dims one dump kept (a batch dim, a \
             squeezed head dim): {}{}",
            reshaped.len(),
            reshaped
                .iter()
                .take(3)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            if reshaped.len() > 3 { ", …" } else { "" }
        ));
    }
    (ref_c, cand_c)
}

/// Compares `cand` against `reference` (an f32 transformers dump, or any dump taken as truth).
pub fn compare(
    reference: &Activations,
    cand: &Activations,
    opts: &CompareOptions,
) -> Result<Comparison, ActError> {
    let tol = &opts.tolerances;
    let mut notes = Vec::new();
    let (reference, cand) = normalize(reference, cand, &mut notes);
    let (reference, cand) = (reference.as_ref(), cand.as_ref());
    let tokens = match (&reference.tokens, &cand.tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ActError::TokensDiffer {
                reference: reference.source.clone(),
                candidate: cand.source.clone(),
                ref_tokens: a.clone(),
                cand_tokens: b.clone(),
            })
        }
        (Some(a), _) | (None, Some(a)) => a.clone(),
        (None, None) => return Err(ActError::NoTokens),
    };
    let t = tokens.len();
    let ref_keys: BTreeSet<String> = reference.tensors.keys().cloned().collect();
    let cand_keys: BTreeSet<String> = cand.tensors.keys().cloned().collect();
    let common: BTreeSet<String> = ref_keys.intersection(&cand_keys).cloned().collect();
    if common.is_empty() {
        return Err(ActError::Disjoint);
    }
    let all: BTreeSet<String> = ref_keys.union(&cand_keys).cloned().collect();
    let graph = Graph::new(&all);
    // The order: the producer that ordered more of the common keys itself (glmcheck orders all).
    let covered = |a: &Activations| {
        a.order
            .iter()
            .take(a.ordered_by_producer)
            .filter(|k| common.contains(*k))
            .count()
    };
    let order_src = if covered(cand) > covered(reference) {
        cand
    } else {
        reference
    };
    let order: Vec<&String> = order_src
        .order
        .iter()
        .filter(|k| common.contains(*k))
        .collect();

    let aligned: BTreeSet<String> = cand
        .metadata
        .get(meta::ALIGNED)
        .and_then(|s| serde_json::from_str::<Vec<String>>(s).ok())
        .unwrap_or_default()
        .into_iter()
        .collect();

    let mut rows: Vec<ModuleRow> = Vec::with_capacity(order.len());
    let mut status_of: HashMap<String, (Status, Option<f64>)> = HashMap::new();
    let mut keep = Keep {
        keep: vec![true; t],
    };
    let mut exclusions: Vec<Exclusion> = Vec::new();
    let mut logits_cmp = None;

    for key in order {
        let node = graph.node(key);
        let (Some(ra), Some(ca)) = (reference.tensors.get(key), cand.tensors.get(key)) else {
            continue;
        };
        let mut row = ModuleRow {
            name: key.clone(),
            layer: node.layer,
            role: node.role,
            status: Status::Match,
            rel_l2: None,
            cosine: None,
            max_abs: None,
            max_abs_at: None,
            positions_compared: None,
            topk: None,
            router: None,
            note: None,
            aux: node.aux,
            storage_rel_l2: compare::activation_storage_rel_l2(ra.dtype)
                + compare::activation_storage_rel_l2(ca.dtype),
        };
        let mut exclude: Option<Exclusion> = None;
        match node.role {
            Role::InputIds => {
                if ra.values != ca.values || ra.shape != ca.shape {
                    row.status = Status::Diverged;
                    row.note = Some("the input ids differ".into());
                }
            }
            Role::IndexerIds => {
                let Some((rr, cr)) = ids_rows(ra, ca, t, &mut row) else {
                    push(&mut rows, &mut status_of, row);
                    continue;
                };
                let k = ra.shape[1];
                let scores_key = graph.scores_of.get(key);
                let rs = scores_key
                    .and_then(|s| get_f32(reference, s))
                    .filter(|s| s.len() == t * t);
                let cs = scores_key
                    .and_then(|s| get_f32(cand, s))
                    .filter(|s| s.len() == t * t);
                let indexer_path = scores_key
                    .and_then(|s| ancestor(s))
                    .unwrap_or(key.as_str())
                    .to_string();
                let mut diffs = Vec::new();
                let mut overlap = 0.0;
                let mut n = 0;
                for i in keep.rows() {
                    let va = visible(&rr[i], i);
                    let vb = visible(&cr[i], i);
                    n += 1;
                    overlap += if va.is_empty() {
                        1.0
                    } else {
                        va.intersection(&vb).count() as f64 / va.len() as f64
                    };
                    if let Some(mut d) = classify_topk_row(
                        i,
                        k,
                        &rr[i],
                        &cr[i],
                        row_slice(rs, i, t),
                        row_slice(cs, i, t),
                        tol.score_noise,
                    ) {
                        d.replayed = aligned.contains(&format!("{indexer_path}:{i}"));
                        diffs.push(d);
                    }
                }
                row.status = if diffs.is_empty() {
                    Status::Match
                } else if diffs.iter().any(|d| d.class == TieClass::Divergence) {
                    Status::Diverged
                } else if diffs.iter().any(|d| d.class == TieClass::Unavailable) {
                    Status::Unclassified
                } else if diffs.iter().any(|d| d.class == TieClass::NearTie) {
                    Status::NearTie
                } else {
                    Status::Tie
                };
                if row.status.ok() {
                    if let Some(first) = diffs.iter().filter(|d| !d.replayed).map(|d| d.pos).min() {
                        exclude = Some(Exclusion {
                            module: key.clone(),
                            positions: (first..t).filter(|&i| keep.has(i)).collect(),
                            from_on: true,
                            cause: format!(
                                "{} top-k choice at position {first}",
                                match row.status {
                                    Status::Tie => "an exact-tie",
                                    Status::NearTie => "a near-tie",
                                    _ => "an unclassified",
                                }
                            ),
                        });
                    }
                }
                if row.status == Status::Unclassified {
                    row.note = Some(
                        "the reference has no index_scores: a tie cannot be told from a divergence"
                            .into(),
                    );
                }
                row.topk = Some(TopkCmp {
                    k,
                    positions: n,
                    overlap: if n == 0 { 1.0 } else { overlap / n as f64 },
                    rows: diffs,
                });
                row.positions_compared = keep.partial();
            }
            Role::RouterIds => {
                let Some((rr, cr)) = ids_rows(ra, ca, t, &mut row) else {
                    push(&mut rows, &mut status_of, row);
                    continue;
                };
                let set = |r: &[i64]| r.iter().copied().collect::<BTreeSet<i64>>();
                let n = keep.kept();
                let flipped: Vec<usize> = keep
                    .rows()
                    .filter(|&i| set(&rr[i]) != set(&cr[i]))
                    .collect();
                let logits_ok = graph
                    .router_of
                    .get(key)
                    .and_then(|(_, _, logits)| status_of.get(logits))
                    .is_some_and(|(s, _)| *s == Status::Match);
                let frac = if n == 0 {
                    0.0
                } else {
                    flipped.len() as f64 / n as f64
                };
                row.status = if flipped.is_empty() {
                    Status::Match
                } else if logits_ok && frac <= tol.router_flip_max {
                    Status::NearTie
                } else {
                    Status::Diverged
                };
                if !flipped.is_empty() {
                    row.note = Some(format!(
                        "experts differ in {} of {n} tokens ({:?})",
                        flipped.len(),
                        flipped
                    ));
                }
                if row.status == Status::NearTie {
                    exclude = Some(Exclusion {
                        module: key.clone(),
                        positions: flipped.clone(),
                        from_on: false,
                        cause: "near-tied expert choices (the router logits agree)".into(),
                    });
                }
                row.router = Some(RouterCmp { tokens: n, flipped });
                row.positions_compared = keep.partial();
            }
            Role::RouterWeights => {
                // Each dump's own ids pair its weights with experts (the slot order of the top-k
                // is an implementation detail): its tuple sibling `gate.2` or `topk_indices`.
                let ids = graph.router_of.get(key).and_then(|(_, _, gate)| {
                    let keys = router_ids_alternatives(gate);
                    let own = if key.ends_with(".1") {
                        keys.iter().rev().cloned().collect::<Vec<_>>()
                    } else {
                        keys
                    };
                    Some((ids_in(reference, &own)?, ids_in(cand, &own)?))
                });
                let k = ra.shape.last().copied().unwrap_or(0);
                match (ids, ra.f32(), ca.f32()) {
                    (Some((ri, ci)), Some(rw), Some(cw))
                        if ra.shape == ca.shape
                            && ri.len() == t
                            && ci.len() == t
                            && rw.len() == t * k =>
                    {
                        let (mut a, mut b) = (Vec::new(), Vec::new());
                        let mut skipped = 0;
                        for i in keep.rows() {
                            let pairs = |ids: &[i64], w: &[f32]| {
                                let mut p: Vec<(i64, f32)> =
                                    ids.iter().copied().zip(w.iter().copied()).collect();
                                p.sort_by_key(|x| x.0);
                                p
                            };
                            let rp = pairs(ri[i], &rw[i * k..(i + 1) * k]);
                            let cp = pairs(ci[i], &cw[i * k..(i + 1) * k]);
                            if rp.iter().map(|x| x.0).ne(cp.iter().map(|x| x.0)) {
                                skipped += 1;
                                continue;
                            }
                            b.extend(rp.iter().map(|x| x.1));
                            a.extend(cp.iter().map(|x| x.1));
                        }
                        let d = compare::diff(&a, &b);
                        set_float(&mut row, &d, &[a.len() / k.max(1), k.max(1)], tol);
                        if skipped > 0 {
                            row.note = Some(format!(
                                "{skipped} token(s) whose experts differ left out (see the router ids)"
                            ));
                        }
                        row.positions_compared = keep.partial();
                    }
                    _ => float_row(&mut row, ra, ca, key, t, &keep, tol),
                }
            }
            Role::ExpertAct => {
                let (re, ce) = (reference.expert_rows.get(key), cand.expert_rows.get(key));
                match (re, ce, ra.f32(), ca.f32()) {
                    (Some(re), Some(ce), Some(rv), Some(cv)) if re.expert == ce.expert => {
                        let cols = ra.shape.get(1).copied().unwrap_or(0);
                        let (mut a, mut b) = (Vec::new(), Vec::new());
                        let mut n = 0;
                        for (ri, tok) in re.tokens.iter().enumerate() {
                            if !keep.has(*tok) {
                                continue;
                            }
                            let Some(ci) = ce.tokens.iter().position(|x| x == tok) else {
                                continue;
                            };
                            b.extend_from_slice(&rv[ri * cols..(ri + 1) * cols]);
                            a.extend_from_slice(&cv[ci * cols..(ci + 1) * cols]);
                            n += 1;
                        }
                        if n == 0 {
                            row.status = Status::Skipped;
                            row.note = Some("no token routed to this expert in both dumps".into());
                        } else {
                            let d = compare::diff(&a, &b);
                            set_float(&mut row, &d, &[n, cols], tol);
                            row.note = Some(format!("expert {}, {n} token(s)", re.expert));
                        }
                    }
                    (Some(re), Some(ce), ..) => {
                        row.status = Status::Skipped;
                        row.note = Some(format!(
                            "call #{} is expert {} in the reference, {} in the candidate (routing differs)",
                            expert_act_call(key).map_or(0, |x| x.1),
                            re.expert,
                            ce.expert
                        ));
                    }
                    _ => {
                        row.status = Status::Skipped;
                        row.note = Some("row order unknown (no router ids in a dump)".into());
                    }
                }
            }
            Role::IndexerScores => match (ra.f32(), ca.f32()) {
                (Some(rv), Some(cv)) if ra.shape == [t, t] && ca.shape == [t, t] => {
                    let (mut a, mut b, mut at) = (Vec::new(), Vec::new(), Vec::new());
                    for i in keep.rows() {
                        for j in (0..=i).filter(|&j| keep.has(j)) {
                            a.push(cv[i * t + j]);
                            b.push(rv[i * t + j]);
                            at.push(vec![i, j]);
                        }
                    }
                    let d = compare::diff(&a, &b);
                    set_float(&mut row, &d, &[], tol);
                    row.max_abs_at = at.get(d.max_abs_at).cloned();
                    row.positions_compared = keep.partial();
                    row.note = Some("causal entries only".into());
                }
                _ => float_row(&mut row, ra, ca, key, t, &keep, tol),
            },
            Role::Float | Role::Logits => {
                float_row(&mut row, ra, ca, key, t, &keep, tol);
                if node.role == Role::Logits {
                    if let (Some(rv), Some(cv)) = (ra.f32(), ca.f32()) {
                        // [T, V], or [1, T, V] when both dumps kept the batch dim.
                        let lead = ra.shape.len().saturating_sub(2);
                        let dims = &ra.shape[lead..];
                        if ra.shape == ca.shape
                            && ra.shape[..lead].iter().all(|&d| d == 1)
                            && dims.len() == 2
                            && dims[0] == t
                        {
                            let lc =
                                logits_metrics(rv, cv, dims[1], &keep.keep, (ra.dtype, ca.dtype));
                            // Storage rounding bound with 4× headroom (the bound is second order).
                            let bad = lc.kl_mean > tol.kl_mean + 4.0 * lc.kl_storage_mean
                                || lc.kl_max > tol.kl_max + 4.0 * lc.kl_storage_max
                                || lc.top1_agree < tol.top1_min
                                || lc.kl_mean.is_nan();
                            // The logits are judged by their distributions, not by rel-L2.
                            row.status = if bad { Status::Diverged } else { Status::Match };
                            row.note = Some(format!(
                                "KL mean {:.2e} (max {:.2e}), top-1 {}/{}",
                                lc.kl_mean, lc.kl_max, lc.top1_agree_count, lc.positions
                            ));
                            if logits_cmp.is_none() || key == conv::LOGITS {
                                logits_cmp = Some(lc);
                            }
                        }
                    }
                }
            }
        }
        if let Some(ex) = exclude {
            let fresh: Vec<usize> = ex
                .positions
                .iter()
                .copied()
                .filter(|&i| keep.has(i))
                .collect();
            if !fresh.is_empty() {
                for &i in &fresh {
                    keep.keep[i] = false;
                }
                if keep.kept() == 0 {
                    notes.push(format!(
                        "{key}: {}: every position is left out from here on, so nothing after it is compared",
                        ex.cause
                    ));
                }
                exclusions.push(Exclusion {
                    positions: fresh,
                    ..ex
                });
            }
        }
        push(&mut rows, &mut status_of, row);
    }

    // Nothing left to compare is not a match.
    for r in &mut rows {
        if r.positions_compared == Some(0) && r.status == Status::Match {
            r.status = Status::Skipped;
            r.note = Some("every position follows a tie-break".into());
        }
    }

    // The first module above tolerance in execution order; if one of its inputs diverges too (a
    // tuple element captured after its consumer, as the attention probabilities after o_proj),
    // follow the dataflow up to the module whose inputs all agree.
    let by_name: HashMap<&str, &ModuleRow> = rows.iter().map(|r| (r.name.as_str(), r)).collect();
    let first_divergence = rows
        .iter()
        .find(|r| r.status == Status::Diverged)
        .map(|mut r| {
            let mut seen = BTreeSet::new();
            while seen.insert(r.name.clone()) {
                let up = graph.node(&r.name).inputs.iter().find_map(|i| {
                    by_name
                        .get(i.as_str())
                        .filter(|u| u.status == Status::Diverged)
                        .copied()
                });
                match up {
                    Some(u) => r = u,
                    None => break,
                }
            }
            first_divergence(r, &graph, &status_of, &common)
        });

    let only_reference: Vec<String> = ref_keys.difference(&cand_keys).cloned().collect();
    let only_candidate: Vec<String> = cand_keys.difference(&ref_keys).cloned().collect();
    let mut first_divergence = first_divergence;
    // A divergence first seen at the output says nothing about the lm_head weight when nothing
    // before it could show one: no module was compared, or every module sat inside the loose
    // noise of different weights (GGUF vs the originals). Say so, and what the positions show.
    let lm_head = ModelPaths::new().map(|m| m.lm_head).ok();
    if let Some(f) = first_divergence.as_mut() {
        let at_output = graph.node(&f.module).role == Role::Logits
            || lm_head.as_deref() == Some(f.module.as_str());
        let inner = rows
            .iter()
            .filter(|r| {
                r.role != Role::Logits
                    && r.role != Role::InputIds
                    && lm_head.as_deref() != Some(r.name.as_str())
            })
            .count();
        let positions = logits_cmp
            .as_ref()
            .and_then(|l| indexer_signature(l, opts.index_topk, tol));
        if at_output && (inner == 0 || tol.reference == ReferenceWeights::Original) {
            let positions = positions.map_or(String::new(), |p| format!("; {p}"));
            f.reading = if inner == 0 {
                format!(
                    "{} diverges; only the logits were compared (the reference holds no module \
                     outputs), so the fault cannot be localized to a module{positions}. To find the \
                     module, compare against a dump with module outputs: `forward --dump` of the \
                     same GGUF without the suspected change",
                    short_name(&f.module)
                )
            } else {
                format!(
                    "{} diverges; every module before it matches within the noise of different \
                     weights ({}), which is too coarse to localize the fault{positions}. Compare \
                     against a same-weights reference: `forward --dump` of the same GGUF without \
                     the suspected change, or llama.cpp's logits of it (--reference-weights \
                     same-gguf)",
                    short_name(&f.module),
                    tol.basis
                )
            };
        } else if let Some(p) = positions.filter(|_| at_output) {
            f.reading = format!("{}; {p}", f.reading);
        }
    }
    let is_indexer = |k: &str| graph.node(k).role == Role::IndexerIds && !graph.node(k).aux;
    if only_reference.iter().any(|k| is_indexer(k)) && !cand_keys.iter().any(|k| is_indexer(k)) {
        notes.push(format!(
            "{} has no indexer outputs: it ran without the DSA indexer (dense attention)",
            cand.source
        ));
        if let Some(f) = first_divergence.as_mut() {
            let missing_indexer = f
                .inputs
                .iter()
                .any(|i| i.status.is_none() && is_indexer(&i.name));
            if missing_indexer && f.inputs.iter().all(|i| i.status != Some(Status::Diverged)) {
                f.reading = format!(
                    "{} diverges while its other inputs match, and the candidate has no indexer: it \
                     attends densely (the DSA indexer is disabled), which differs from GLM-5's sparse \
                     attention once a query sees more than index_topk keys",
                    short_name(&f.module)
                );
            }
        }
    }
    let incomparable = rows
        .iter()
        .filter(|r| r.status == Status::Incomparable)
        .map(|r| r.name.clone())
        .collect();
    Ok(Comparison {
        incomparable,
        allow_incomparable: false,
        reference: reference.source.clone(),
        candidate: cand.source.clone(),
        tokens,
        tolerances: tol.clone(),
        modules: rows,
        logits: logits_cmp,
        first_divergence,
        exclusions,
        only_reference,
        only_candidate,
        notes,
    })
}

/// When the logits agree closely below `index_topk` and diverge from there on: the DSA indexer's
/// signature (its top-k restricts attention only once a query sees more than index_topk keys).
fn indexer_signature(l: &LogitsCmp, index_topk: Option<usize>, tol: &Tolerances) -> Option<String> {
    let k = index_topk?;
    let before: Vec<&(usize, f64)> = l.kl_by_position.iter().filter(|(i, _)| *i < k).collect();
    let after: Vec<&(usize, f64)> = l.kl_by_position.iter().filter(|(i, _)| *i >= k).collect();
    if before.is_empty() || after.is_empty() {
        return None;
    }
    let mean = |v: &[&(usize, f64)]| v.iter().map(|x| x.1).sum::<f64>() / v.len() as f64;
    let (mb, ma) = (mean(&before), mean(&after));
    let worst_before = before.iter().map(|x| x.1).fold(0.0, f64::max);
    let first_bad = after
        .iter()
        .find(|(_, kl)| *kl > (2.0 * worst_before).max(tol.kl_mean))?
        .0;
    (ma > tol.kl_mean && ma > 10.0 * mb).then(|| {
        format!(
            "the logits agree closely below index_topk ({k}; mean KL {mb:.1e}) and diverge from \
             position {first_bad} on (mean KL {ma:.1e}), where the DSA indexer's top-k starts to \
             restrict attention: suspect the indexer (switched off, or choosing other keys)"
        )
    })
}

fn push(
    rows: &mut Vec<ModuleRow>,
    status_of: &mut HashMap<String, (Status, Option<f64>)>,
    row: ModuleRow,
) {
    status_of.insert(row.name.clone(), (row.status, row.rel_l2));
    rows.push(row);
}

fn set_float(row: &mut ModuleRow, d: &compare::Diff, shape: &[usize], tol: &Tolerances) {
    row.rel_l2 = Some(d.rel_l2);
    row.cosine = Some(d.cosine);
    row.max_abs = Some(d.max_abs);
    row.max_abs_at = (!shape.is_empty()).then(|| unravel(d.max_abs_at, shape));
    // The dumps' own storage rounding (a module stored in bf16 carries ~2⁻⁹ relative error of its
    // own) comes on top of the compute/weight profile.
    row.status = if d.rel_l2.is_nan() || d.rel_l2 > tol.rel_l2 + row.storage_rel_l2 {
        Status::Diverged
    } else {
        Status::Match
    };
}

fn float_row(
    row: &mut ModuleRow,
    ra: &Act,
    ca: &Act,
    key: &str,
    t: usize,
    keep: &Keep,
    tol: &Tolerances,
) {
    let (Some(rv), Some(cv)) = (ra.f32(), ca.f32()) else {
        row.status = Status::Incomparable;
        row.note = Some(format!(
            "dtype {:?} vs {:?}: not both float, not compared",
            ra.dtype, ca.dtype
        ));
        return;
    };
    if ra.shape != ca.shape {
        row.status = Status::Incomparable;
        row.note = Some(format!(
            "shape {:?} vs {:?}: not the same layout (transposed or rearranged?), not compared",
            ra.shape, ca.shape
        ));
        return;
    }
    let (rv, cv, shape) = match (keep.partial(), token_axis(key, &ra.shape, t)) {
        (Some(_), Some(axis)) => {
            let (r, s) = select(rv, &ra.shape, axis, &keep.keep);
            let (c, _) = select(cv, &ca.shape, axis, &keep.keep);
            row.positions_compared = keep.partial();
            (r, c, s)
        }
        _ => (rv.to_vec(), cv.to_vec(), ra.shape.clone()),
    };
    let f = float_diff(&cv, &rv, shape);
    set_float(row, &f.diff, &f.shape, tol);
    if f.mask_mismatch > 0 {
        row.status = Status::Diverged;
        row.note = Some(format!(
            "{} entries the reference masks are not masked",
            f.mask_mismatch
        ));
    }
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    row.iter().map(|&x| x as f64 - lse).collect()
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// Next-token entropy of a logits row, nats.
pub fn entropy(row: &[f32]) -> f64 {
    let lp = log_softmax(row);
    -lp.iter().map(|&l| l.exp() * l).sum::<f64>()
}

/// `[T, V]` logits: KL(ref ‖ cand), top-1 agreement, Δp of the reference's top token, entropies,
/// over the positions `keep` marks.
pub fn logits_metrics(
    reference: &[f32],
    cand: &[f32],
    v: usize,
    keep: &[bool],
    storage: (Dtype, Dtype),
) -> LogitsCmp {
    let (mut kl_sum, mut kl_max, mut kl_max_pos, mut agree, mut dp2) = (0.0, 0.0, 0, 0, 0.0);
    let (mut h_c, mut h_r, mut max_abs) = (0.0, 0.0, 0f64);
    let (mut ks_sum, mut ks_max, mut storage_ties) = (0.0, 0f64, 0);
    let mut kl_by_position = Vec::new();
    let u = |x: f32, y: f32| {
        compare::storage_half_ulp(storage.0, x) + compare::storage_half_ulp(storage.1, y)
    };
    let mut n = 0;
    for (i, _) in keep.iter().enumerate().filter(|(_, &k)| k) {
        if (i + 1) * v > reference.len().min(cand.len()) {
            break;
        }
        n += 1;
        let r = &reference[i * v..(i + 1) * v];
        let c = &cand[i * v..(i + 1) * v];
        let (lr, lc) = (log_softmax(r), log_softmax(c));
        let kl: f64 = lr
            .iter()
            .zip(&lc)
            .map(|(&a, &b)| {
                if a.is_finite() {
                    a.exp() * (a - b)
                } else {
                    0.0
                }
            })
            .sum();
        kl_sum += kl;
        kl_by_position.push((i, kl));
        if kl > kl_max || kl.is_nan() {
            kl_max = kl;
            kl_max_pos = i;
        }
        let ks: f64 = 0.5
            * lr.iter()
                .zip(r.iter().zip(c))
                .map(|(&l, (&x, &y))| l.exp() * u(x, y).powi(2))
                .sum::<f64>();
        ks_sum += ks;
        ks_max = ks_max.max(ks);
        let top = argmax(r);
        let ctop = argmax(c);
        if ctop == top {
            agree += 1;
        } else if (r[top] as f64 - r[ctop] as f64) <= u(r[top], c[top]) + u(r[ctop], c[ctop]) {
            // The two tokens' reference logits are within the storage rounding of each other: the
            // stored values cannot say which one the computation preferred.
            agree += 1;
            storage_ties += 1;
        }
        dp2 += (lr[top].exp() - lc[top].exp()).powi(2);
        h_r -= lr.iter().map(|&l| l.exp() * l).sum::<f64>();
        h_c -= lc.iter().map(|&l| l.exp() * l).sum::<f64>();
        for (a, b) in r.iter().zip(c) {
            max_abs = max_abs.max((*a as f64 - *b as f64).abs());
        }
    }
    let nf = n.max(1) as f64;
    let log_vocab = (v as f64).ln();
    let entropy_mean = h_c / nf;
    LogitsCmp {
        positions: n,
        kl_mean: kl_sum / nf,
        kl_max,
        kl_max_pos,
        top1_agree: agree as f64 / nf,
        top1_agree_count: agree,
        rms_dp: (dp2 / nf).sqrt(),
        max_abs,
        entropy_mean,
        entropy_ref_mean: h_r / nf,
        log_vocab,
        garbage: garbage(entropy_mean, v) && !garbage(h_r / nf, v),
        reference_uniform: garbage(h_r / nf, v),
        kl_storage_mean: ks_sum / nf,
        kl_storage_max: ks_max,
        top1_storage_ties: storage_ties,
        kl_by_position,
    }
}

/// A next-token distribution within 0.5 nats of uniform is noise, not a prediction.
pub fn garbage(entropy: f64, vocab: usize) -> bool {
    entropy > (vocab as f64).ln() - 0.5
}

/// `model.layers.3.self_attn.kv_b_proj` → `kv_b_proj`; tuple elements and extras keep their
/// parent (`self_attn.1`, `indexer.index_scores`).
pub fn short_name(key: &str) -> String {
    let mut parts = key.rsplitn(3, '.');
    let last = parts.next().unwrap_or(key);
    let parent = parts.next();
    let keep_parent = last.chars().all(|c| c.is_ascii_digit() || c == '#')
        || [
            conv::QUERY_STATES,
            conv::KEY_STATES,
            conv::VALUE_STATES,
            conv::K_ROT,
            conv::IDX_Q,
            conv::IDX_K,
            conv::IDX_HEAD_WEIGHTS,
            conv::IDX_SCORES,
            conv::TOPK_WEIGHTS,
            conv::TOPK_INDICES,
        ]
        .contains(&last)
        || last.starts_with(conv::ACT);
    match parent {
        Some(p) if keep_parent && !p.chars().all(|c| c.is_ascii_digit()) => format!("{p}.{last}"),
        Some(p) if keep_parent => key
            .rsplit_once(&format!(".{p}."))
            .map_or(key.to_string(), |_| format!("layer {p}.{last}")),
        _ => last.to_string(),
    }
}

fn first_divergence(
    r: &ModuleRow,
    graph: &Graph,
    status_of: &HashMap<String, (Status, Option<f64>)>,
    common: &BTreeSet<String>,
) -> FirstDivergence {
    let node = graph.node(&r.name);
    let inputs: Vec<InputStatus> = node
        .inputs
        .iter()
        .map(|i| InputStatus {
            name: i.clone(),
            status: common
                .contains(i)
                .then(|| status_of.get(i).map(|s| s.0))
                .flatten(),
            rel_l2: status_of.get(i).and_then(|s| s.1),
        })
        .collect();
    let short = |s: &str| short_name(s);
    let what = match &r.rel_l2 {
        Some(x) if r.role != Role::Logits => {
            format!("{} output diverges (rel-L2 {x:.2e})", short(&r.name))
        }
        _ => format!("{} diverges", short(&r.name)),
    };
    let what = match r.role {
        Role::IndexerIds => format!("{} top-k differs beyond ties", short(&r.name)),
        Role::RouterIds => format!(
            "the routed experts differ ({})",
            r.note.as_deref().unwrap_or("")
        ),
        Role::InputIds => "the input ids differ".to_string(),
        _ => what,
    };
    // Inputs not in both dumps, or in both but not comparable, say nothing about this module's
    // weights: the fault may be upstream.
    let missing: Vec<&str> = inputs
        .iter()
        .filter(|i| matches!(i.status, None | Some(Status::Incomparable)))
        .map(|i| i.name.as_str())
        .collect();
    let names: Vec<String> = inputs.iter().map(|i| short(&i.name)).collect();
    let reading = if node.inputs.is_empty() {
        format!("{what}: suspect {}", node.suspect)
    } else if !missing.is_empty() {
        format!(
            "{what}; its input{} {} {} not compared (not in both dumps, or incomparable), so the fault is here or upstream: suspect {} or what feeds it",
            if missing.len() == 1 { "" } else { "s" },
            missing.join(", "),
            if missing.len() == 1 { "is" } else { "are" },
            node.suspect
        )
    } else {
        let qual = if inputs.iter().all(|i| i.status == Some(Status::Match)) {
            ""
        } else {
            " (up to ties)"
        };
        format!(
            "{what} while {} {}{qual}: suspect {}",
            if names.len() == 1 {
                format!("its input {}", names[0])
            } else {
                format!("its inputs {}", names.join(", "))
            },
            if names.len() == 1 { "matches" } else { "match" },
            node.suspect
        )
    };
    FirstDivergence {
        module: r.name.clone(),
        layer: r.layer,
        status: r.status,
        rel_l2: r.rel_l2,
        cosine: r.cosine,
        max_abs: r.max_abs,
        inputs,
        reading,
    }
}

// ---------------------------------------------------------------------------------------------
// Replaying the reference's top-k at ties

/// A capture that keeps everything and, at each indexer, replays the reference's top-k on rows
/// where ours differs only by an exact tie or a near-tie (so later modules compare on the whole
/// prompt). Rows that differ for real are left alone.
pub struct Aligner<'r> {
    pub inner: VecCapture,
    reference: &'r Activations,
    score_noise: f64,
    /// Our index scores by indexer path (captured just before its top-k).
    scores: HashMap<String, Vec<f32>>,
    /// `"<indexer path>:<position>"` of every replayed row.
    pub replayed: Vec<String>,
}

impl<'r> Aligner<'r> {
    pub fn new(reference: &'r Activations, score_noise: f64) -> Self {
        Aligner {
            inner: VecCapture::new(),
            reference,
            score_noise,
            scores: HashMap::new(),
            replayed: Vec::new(),
        }
    }
}

impl Capture for Aligner<'_> {
    fn capture(&mut self, path: &str, tensor: &Tensor) -> candle_core::Result<()> {
        if let Some(indexer) = path.strip_suffix(&format!(".{}", conv::IDX_SCORES)) {
            self.scores.insert(
                indexer.to_string(),
                tensor
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        self.inner.capture(path, tensor)
    }

    fn replace(&mut self, path: &str, ours: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let our_scores = self.scores.remove(path);
        let Some(theirs) = self.reference.tensors.get(path) else {
            return Ok(None);
        };
        let (t, k) = ours.dims2()?;
        // A reference that kept the batch dim ([1, T, k]) holds the same rows.
        if common_shape(&theirs.shape, &[t, k]).as_deref() != Some(&[t, k][..]) {
            return Ok(None);
        }
        let Some(their_rows) = theirs.rows_i64() else {
            return Ok(None);
        };
        let Some(ref_scores) = get_f32(self.reference, &format!("{path}.{}", conv::IDX_SCORES))
            .filter(|s| s.len() == t * t)
        else {
            return Ok(None);
        };
        let ours_flat: Vec<i64> = ours.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        let mut out: Vec<u32> = ours_flat.iter().map(|&x| x as u32).collect();
        let mut changed = false;
        for i in 0..t {
            let row = |s: &[f32]| s[i * t..(i + 1) * t].to_vec();
            let cand_row = our_scores.as_deref().filter(|s| s.len() == t * t).map(row);
            let Some(d) = classify_topk_row(
                i,
                k,
                their_rows[i],
                &ours_flat[i * k..(i + 1) * k],
                Some(&row(ref_scores)),
                cand_row.as_deref(),
                self.score_noise,
            ) else {
                continue;
            };
            if matches!(d.class, TieClass::ExactTie | TieClass::NearTie)
                && their_rows[i].iter().all(|&j| j >= 0 && (j as usize) < t)
            {
                for (o, &j) in out[i * k..(i + 1) * k].iter_mut().zip(their_rows[i]) {
                    *o = j as u32;
                }
                self.replayed.push(format!("{path}:{i}"));
                changed = true;
            }
        }
        if !changed {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec(out, (t, k), ours.device())?))
    }
}

/// The compute dtype and weight type a dump says it was made with: glmcheck's metadata, else the
/// transformers dump's `dtype` (its weights are taken as the f32 originals), else f32 / F32.
pub fn profile_of(acts: &Activations) -> (ComputeDtype, GgmlType) {
    let dtype = acts
        .metadata
        .get(meta::DTYPE)
        .or_else(|| acts.metadata.get("dtype"))
        .and_then(|s| ComputeDtype::parse(s))
        .unwrap_or(ComputeDtype::F32);
    let weights = acts
        .metadata
        .get(meta::WEIGHTS)
        .and_then(|s| GgmlType::from_name(s))
        .unwrap_or(GgmlType::F32);
    (dtype, weights)
}
