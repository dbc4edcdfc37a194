//! `glmcheck bisect`: which of a pile of loader patches makes the forward diverge. Each patch is a
//! fault of the one table (a weight fault written into the simulated ranks' weights, or a
//! behaviour fault injected into the model), optionally limited to layers. A set of patches is
//! "bad" when the simulated-TP forward with them diverges from the unpatched forward of the same
//! GGUF, judged at the bounds of bf16 weights (a patch that only rounds weights to bf16 is within
//! what a bf16 deployment computes, not a culprit).
//!
//! Delta debugging (Zeller's ddmin) finds a 1-minimal bad subset; it is taken out and the search
//! repeated until the rest is good, so independent culprits are all found. Every patch left is
//! then run alone to prove it harmless, with the reason.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::compare::{compare, Activations, CompareOptions, Comparison, ComputeDtype};
use crate::compare::{ReferenceWeights, Tolerances};
use crate::dump::RankDump;
use crate::faults::{Fault, Injection};
use crate::gguf::GgmlType;
use crate::model::{Glm5, ModelOptions};
use crate::plan::ShardPlan;
use crate::weights::Weights;

/// One patch of the pile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Patch {
    #[serde(serialize_with = "as_string")]
    pub fault: Fault,
    pub layers: Option<Vec<usize>>,
}

fn as_string<S: serde::Serializer>(f: &Fault, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(f)
}

impl Patch {
    fn in_scope(&self, layer: Option<usize>) -> bool {
        match (&self.layers, layer) {
            (None, _) => true,
            (Some(ls), Some(l)) => ls.contains(&l),
            (Some(_), None) => false,
        }
    }

    pub fn injection(&self) -> Injection {
        Injection {
            fault: self.fault.clone(),
            layers: self.layers.clone(),
        }
    }
}

/// The weight fault `p` gets from `patches`: the last (in the file's order) whose layers hold `p`
/// and whose fault hits it, as a later loader patch overrides what an earlier one did to that
/// tensor (`force-dequant:*` then `kvb-concat`: the rebuilt kv_b_proj; its bf16 rounding, within
/// tolerance anyway, is not composed); `Fault::None` if none does.
pub fn fault_of(patches: &[&Patch], p: &crate::plan::ParamPlan) -> Fault {
    patches
        .iter()
        .rev()
        .find(|x| x.fault.behaviour().is_none() && x.in_scope(p.layer) && x.fault.targets(p))
        .map_or(Fault::None, |x| x.fault.clone())
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchFile {
    #[serde(default)]
    patch: Vec<PatchEntry>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchEntry {
    fault: String,
    layers: Option<Vec<usize>>,
}

/// PATCHES.toml (`[[patch]] fault = NAME, layers = [..]`): each fault parsed and checked against
/// `tp` and the model's `layers`; the error says which patch and why.
pub fn parse_patches(text: &str, tp: usize, layers: usize) -> Result<Vec<Patch>, String> {
    let file: PatchFile = toml::from_str(text).map_err(|e| e.to_string())?;
    if file.patch.is_empty() {
        return Err("no [[patch]] entries".into());
    }
    file.patch
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let n = i + 1;
            let fault: Fault = p.fault.parse().map_err(|e| format!("patch {n}: {e}"))?;
            fault.check_tp(tp).map_err(|e| format!("patch {n}: {e}"))?;
            if let Some(l) = p.layers.iter().flatten().find(|&&l| l >= layers) {
                return Err(format!(
                    "patch {n}: layer {l}, the model has {layers} layers"
                ));
            }
            Ok(Patch {
                fault,
                layers: p.layers,
            })
        })
        .collect()
}

/// Where a culprit's forward first diverges.
#[derive(Debug, Clone, Serialize)]
pub struct Culprit {
    /// The minimal set of patches that diverges (one patch, unless only their combination does).
    pub patches: Vec<Patch>,
    pub first_divergence: Option<crate::compare::FirstDivergence>,
}

/// Why a patch is harmless here.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Why {
    /// Dense and sparse attention see the same keys: the prompt is no longer than index_topk.
    PromptWithinTopk { tokens: usize, index_topk: usize },
    /// Its forward stays within the bounds of bf16 weights (worst module and rel-L2).
    WithinTolerance {
        worst: Option<String>,
        rel_l2: Option<f64>,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct Harmless {
    pub patch: Patch,
    pub why: Why,
}

#[derive(Debug, Clone, Serialize)]
pub struct BisectReport {
    pub tp: usize,
    pub tokens: usize,
    pub patches: Vec<Patch>,
    pub culprits: Vec<Culprit>,
    pub harmless: Vec<Harmless>,
    /// Forwards run (the unpatched one included).
    pub forwards: usize,
}

impl From<crate::forward::ForwardError> for BisectError {
    fn from(e: crate::forward::ForwardError) -> Self {
        BisectError::Forward(Box::new(e))
    }
}

impl From<crate::model::ModelError> for BisectError {
    fn from(e: crate::model::ModelError) -> Self {
        BisectError::Model(Box::new(e))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BisectError {
    #[error(transparent)]
    Model(Box<crate::model::ModelError>),
    #[error(transparent)]
    Forward(Box<crate::forward::ForwardError>),
    #[error(transparent)]
    Acts(#[from] crate::compare::ActError),
    #[error(transparent)]
    Shards(#[from] crate::shards::AgainstError),
    #[error(transparent)]
    Dump(#[from] crate::dump::DumpError),
    #[error("{0}")]
    Io(String),
}

/// Runs forwards of patch subsets and remembers what each gave.
struct Trials<'a> {
    w: &'a Weights<'a>,
    plan: &'a ShardPlan,
    patches: &'a [Patch],
    tokens: &'a [u32],
    base: Activations,
    options: ModelOptions,
    tolerances: Tolerances,
    index_topk: usize,
    scratch: std::path::PathBuf,
    memo: BTreeMap<BTreeSet<usize>, Comparison>,
    forwards: usize,
}

impl Trials<'_> {
    /// The comparison of the forward with the patches `set` against the unpatched one.
    fn run(&mut self, set: &BTreeSet<usize>) -> Result<&Comparison, BisectError> {
        if !self.memo.contains_key(set) {
            let c = self.forward(set)?;
            self.memo.insert(set.clone(), c);
        }
        self.memo
            .get(set)
            .ok_or_else(|| BisectError::Io("a trial without a result".into()))
    }

    fn bad(&mut self, set: &BTreeSet<usize>) -> Result<bool, BisectError> {
        Ok(self.run(set)?.diverged())
    }

    fn forward(&mut self, set: &BTreeSet<usize>) -> Result<Comparison, BisectError> {
        let chosen: Vec<&Patch> = set.iter().filter_map(|&i| self.patches.get(i)).collect();
        let weight: Vec<&Patch> = chosen
            .iter()
            .copied()
            .filter(|p| p.fault.behaviour().is_none())
            .collect();
        let dump = if weight.is_empty() {
            None
        } else {
            let dir = self.scratch.join(format!("trial{}", self.forwards));
            std::fs::create_dir_all(&dir).map_err(|e| BisectError::Io(e.to_string()))?;
            let spec = crate::shards::InjectSpec {
                fault: &Fault::None,
                layer: None,
                params: &[],
                dtype: safetensors::Dtype::F32,
                names: crate::arch::glm_dsa::VllmNames::V033,
            };
            crate::shards::inject_with(self.w, self.plan, &spec, &dir, &[], &|p| {
                fault_of(&weight, p)
            })?;
            Some(RankDump::open(&dir)?)
        };
        // fp16-compute is the compute dtype: the trial's model is built in f16.
        let fp16 = chosen
            .iter()
            .any(|p| p.fault.behaviour() == Some(crate::faults::Behaviour::Fp16Compute));
        let options = ModelOptions {
            dtype: if fp16 {
                candle_core::DType::F16
            } else {
                self.options.dtype
            },
            ..self.options
        };
        let mut m = Glm5::sharded(self.w, self.plan, dump.as_ref(), options)?;
        for p in &chosen {
            if let Some(b) = p.fault.behaviour() {
                m.inject(b, p.layers.as_deref())?;
            }
        }
        let acts = crate::forward::capture(&m, self.tokens, None)?;
        self.forwards += 1;
        let facts = m.injected().then(|| m.facts()).transpose()?;
        Ok(compare(
            &self.base,
            &acts,
            &CompareOptions {
                tolerances: self.tolerances.clone(),
                index_topk: Some(self.index_topk),
                facts,
            },
        )?)
    }
}

/// Zeller's ddmin: a 1-minimal subset of `c` (which is bad) that is still bad.
fn ddmin(t: &mut Trials<'_>, c: BTreeSet<usize>) -> Result<BTreeSet<usize>, BisectError> {
    let mut c: Vec<usize> = c.into_iter().collect();
    let mut n = 2usize;
    while c.len() >= 2 {
        let chunk = c.len().div_ceil(n);
        let parts: Vec<Vec<usize>> = c.chunks(chunk).map(<[usize]>::to_vec).collect();
        let mut reduced = false;
        for part in &parts {
            if t.bad(&part.iter().copied().collect())? {
                c = part.clone();
                n = 2;
                reduced = true;
                break;
            }
        }
        if !reduced && parts.len() > 2 {
            for part in &parts {
                let rest: Vec<usize> = c.iter().copied().filter(|i| !part.contains(i)).collect();
                if t.bad(&rest.iter().copied().collect())? {
                    c = rest;
                    n = (n - 1).max(2);
                    reduced = true;
                    break;
                }
            }
        }
        if !reduced {
            if n >= c.len() {
                break;
            }
            n = (2 * n).min(c.len());
        }
    }
    Ok(c.into_iter().collect())
}

/// What to bisect and how.
pub struct BisectSpec<'a> {
    pub tokens: &'a [u32],
    pub dtype: ComputeDtype,
    /// The GGUF's coarsest weight type.
    pub weights: GgmlType,
    pub scratch: &'a std::path::Path,
}

/// Finds the culprits among `patches` on `plan`'s simulated ranks.
pub fn bisect(
    w: &Weights<'_>,
    plan: &ShardPlan,
    patches: &[Patch],
    spec: &BisectSpec<'_>,
) -> Result<BisectReport, BisectError> {
    let options = ModelOptions {
        dtype: spec.dtype.candle(),
        ..ModelOptions::default()
    };
    let base = crate::forward::capture(&Glm5::load_with(w, options)?, spec.tokens, None)?;
    // bf16 weights' bounds, or the GGUF's own quantization's when coarser.
    let class = if spec.weights.noise_rel_l2() > GgmlType::BF16.noise_rel_l2() {
        spec.weights
    } else {
        GgmlType::BF16
    };
    let index_topk = w.config.index_topk;
    let mut t = Trials {
        w,
        plan,
        patches,
        tokens: spec.tokens,
        base,
        options,
        tolerances: Tolerances::for_reference(spec.dtype, class, ReferenceWeights::Original),
        index_topk,
        scratch: spec.scratch.to_path_buf(),
        memo: BTreeMap::new(),
        forwards: 1,
    };
    let mut rest: BTreeSet<usize> = (0..patches.len()).collect();
    let mut culprits = Vec::new();
    while !rest.is_empty() && t.bad(&rest)? {
        let minimal = ddmin(&mut t, rest.clone())?;
        let first = t.run(&minimal)?.first_divergence.clone();
        culprits.push(Culprit {
            patches: minimal.iter().map(|&i| patches[i].clone()).collect(),
            first_divergence: first,
        });
        rest.retain(|i| !minimal.contains(i));
    }
    let mut harmless = Vec::new();
    for i in rest {
        let alone: BTreeSet<usize> = [i].into();
        let c = t.run(&alone)?;
        let patch = patches[i].clone();
        if c.diverged() {
            // Bad alone though the set without the culprits was good: a culprit all the same.
            let first = c.first_divergence.clone();
            culprits.push(Culprit {
                patches: vec![patch],
                first_divergence: first,
            });
            continue;
        }
        let dsa_dense = patch.fault.behaviour() == Some(crate::faults::Behaviour::DsaDense);
        let why = if dsa_dense && spec.tokens.len() <= index_topk {
            Why::PromptWithinTopk {
                tokens: spec.tokens.len(),
                index_topk,
            }
        } else {
            let worst = c
                .modules
                .iter()
                .filter(|r| r.rel_l2.is_some())
                .max_by(|a, b| {
                    a.rel_l2
                        .partial_cmp(&b.rel_l2)
                        .unwrap_or(std::cmp::Ordering::Equal)
                });
            Why::WithinTolerance {
                worst: worst.map(|r| r.name.clone()),
                rel_l2: worst.and_then(|r| r.rel_l2),
            }
        };
        harmless.push(Harmless { patch, why });
    }
    Ok(BisectReport {
        tp: plan.tp,
        tokens: spec.tokens.len(),
        patches: patches.to_vec(),
        culprits,
        harmless,
        forwards: t.forwards,
    })
}
