//! The first divergence in execution order, and what it says: a typed [`Reading`] (what diverges,
//! why, what to suspect), worded by [`crate::report::forward`].

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::driver::{ModuleRow, Status};
use super::graph::{Graph, Module, ValueKind};
use super::logits::LogitsCmp;
use super::tolerance::{ReferenceWeights, Tolerances};

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
    /// Serialized as its sentence (crate::report::reading).
    pub reading: Reading,
    /// A behaviour fault whose signature the divergence carries (null when none does).
    pub signature: Option<super::behaviour::Signature>,
}

/// What diverges.
#[derive(Debug, Clone, PartialEq)]
pub enum What {
    /// A float module's output, by this rel-L2.
    Output {
        rel_l2: f64,
    },
    /// A module judged otherwise (the logits, by their distributions).
    Module,
    /// An indexer's top-k, beyond ties.
    Topk,
    /// The routed experts: the tokens whose experts differ, of `tokens` compared.
    Experts {
        flipped: Vec<usize>,
        tokens: usize,
    },
    InputIds,
}

/// Why the divergence is placed at this module, and what to suspect.
#[derive(Debug, Clone, PartialEq)]
pub enum Cause {
    /// The module has no inputs in the dataflow: suspect the module itself.
    Module { suspect: Module },
    /// Some inputs (`missing`, full keys) were not compared: the fault is here or upstream.
    Upstream {
        missing: Vec<String>,
        suspect: Module,
    },
    /// Every input (full keys) matches, or differs only at ties (`up_to_ties`).
    InputsMatch {
        inputs: Vec<String>,
        up_to_ties: bool,
        suspect: Module,
    },
    /// Only the logits were compared: nothing localizes the fault.
    OnlyLogits,
    /// Every module before the output sat inside the noise of different weights (`basis`: the
    /// tolerances' basis): too coarse to localize the fault.
    WeightNoise { basis: super::tolerance::Basis },
    /// The candidate has no indexer outputs and the module's other inputs match: dense attention.
    NoIndexer,
}

/// The logits agree below `index_topk` and diverge from `first_bad` on: the DSA indexer's
/// signature.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerSignature {
    pub index_topk: usize,
    /// Mean KL of the positions before `index_topk` and of those from it on.
    pub kl_before: f64,
    pub kl_after: f64,
    pub first_bad: usize,
}

/// The reading of a first divergence.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    /// The diverging module's key.
    pub module: String,
    pub what: What,
    pub cause: Cause,
    /// Set when the divergence is at the output and the logits show the indexer's signature.
    pub indexer: Option<IndexerSignature>,
}

/// When the logits agree closely below `index_topk` and diverge from there on: the DSA indexer's
/// signature (its top-k restricts attention only once a query sees more than index_topk keys).
pub(crate) fn indexer_signature(
    l: &LogitsCmp,
    index_topk: Option<usize>,
    tol: &Tolerances,
) -> Option<IndexerSignature> {
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
    (ma > tol.kl_mean && ma > 10.0 * mb).then_some(IndexerSignature {
        index_topk: k,
        kl_before: mb,
        kl_after: ma,
        first_bad,
    })
}

/// The first module above tolerance in execution order; if one of its inputs diverges too (a
/// tuple element captured after its consumer, as the attention probabilities after o_proj),
/// follow the dataflow up to the module whose inputs all agree.
pub(crate) fn locate(
    rows: &[ModuleRow],
    graph: &Graph,
    status_of: &HashMap<String, (Status, Option<f64>)>,
    common: &BTreeSet<String>,
) -> Option<FirstDivergence> {
    let by_name: HashMap<&str, &ModuleRow> = rows.iter().map(|r| (r.name.as_str(), r)).collect();
    let mut r = rows.iter().find(|r| r.status == Status::Diverged)?;
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
    Some(first_divergence(r, graph, status_of, common))
}

fn what(r: &ModuleRow) -> What {
    match r.role {
        ValueKind::IndexerIds => What::Topk,
        ValueKind::RouterIds => What::Experts {
            flipped: r.router.as_ref().map_or(Vec::new(), |x| x.flipped.clone()),
            tokens: r.router.as_ref().map_or(0, |x| x.tokens),
        },
        ValueKind::InputIds => What::InputIds,
        ValueKind::Logits => What::Module,
        _ => r
            .rel_l2
            .map_or(What::Module, |rel_l2| What::Output { rel_l2 }),
    }
}

pub(crate) fn first_divergence(
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
    // Inputs not in both dumps, or in both but not comparable, say nothing about this module's
    // weights: the fault may be upstream.
    let missing: Vec<String> = inputs
        .iter()
        .filter(|i| matches!(i.status, None | Some(Status::Incomparable)))
        .map(|i| i.name.clone())
        .collect();
    let suspect = node.module;
    let cause = if node.inputs.is_empty() {
        Cause::Module { suspect }
    } else if !missing.is_empty() {
        Cause::Upstream { missing, suspect }
    } else {
        Cause::InputsMatch {
            inputs: node.inputs.clone(),
            up_to_ties: !inputs.iter().all(|i| i.status == Some(Status::Match)),
            suspect,
        }
    };
    FirstDivergence {
        module: r.name.clone(),
        layer: r.layer,
        status: r.status,
        rel_l2: r.rel_l2,
        cosine: r.cosine,
        max_abs: r.max_abs,
        inputs,
        reading: Reading {
            module: r.name.clone(),
            what: what(r),
            cause,
            indexer: None,
        },
        signature: None,
    }
}

/// A divergence first seen at the output says nothing about the lm_head weight when nothing
/// before it could show one: no module was compared, or every module sat inside the loose noise of
/// different weights (GGUF vs the originals). Say so, and what the positions show.
pub(crate) fn at_output(
    f: &mut FirstDivergence,
    rows: &[ModuleRow],
    graph: &Graph,
    logits: Option<&LogitsCmp>,
    index_topk: Option<usize>,
    tol: &Tolerances,
) {
    let lm_head = graph.lm_head();
    let at_output =
        graph.node(&f.module).role == ValueKind::Logits || lm_head == Some(f.module.as_str());
    if !at_output {
        return;
    }
    let inner = rows
        .iter()
        .filter(|r| {
            r.role != ValueKind::Logits
                && r.role != ValueKind::InputIds
                && lm_head != Some(r.name.as_str())
        })
        .count();
    f.reading.indexer = logits.and_then(|l| indexer_signature(l, index_topk, tol));
    if inner == 0 {
        f.reading.cause = Cause::OnlyLogits;
    } else if tol.reference == ReferenceWeights::Original {
        f.reading.cause = Cause::WeightNoise {
            basis: tol.basis.clone(),
        };
    }
}

/// The candidate ran without the DSA indexer (the reference has indexer outputs, it has none):
/// when the first divergence lacks only its indexer input, that is the reading.
pub(crate) fn no_indexer(f: &mut FirstDivergence, graph: &Graph) {
    let is_indexer = |k: &str| graph.is_indexer(k);
    let missing_indexer = f
        .inputs
        .iter()
        .any(|i| i.status.is_none() && is_indexer(&i.name));
    if missing_indexer && f.inputs.iter().all(|i| i.status != Some(Status::Diverged)) {
        f.reading.cause = Cause::NoIndexer;
        f.reading.indexer = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::driver::{compare, CompareOptions};
    use crate::compare::io::{Act, Activations, Values};
    use crate::compare::tolerance::ComputeDtype;
    use crate::gguf::GgmlType;
    use crate::model::names::{conv, LayerPaths};
    use safetensors::Dtype;

    const T: usize = 3;

    /// A dump of `keys` in this execution order, each `[T, 4]`; `scale` multiplies the values of
    /// the keys it names.
    fn dump(keys: &[String], scale: &[(&str, f32)]) -> Activations {
        let mut a = Activations {
            source: "test".into(),
            tokens: Some(vec![1, 2, 3]),
            ..Default::default()
        };
        for (n, k) in keys.iter().enumerate() {
            let s = scale.iter().find(|(x, _)| x == k).map_or(1.0, |x| x.1);
            let v: Vec<f32> = (0..T * 4).map(|i| s * (1.0 + (i + n) as f32)).collect();
            a.tensors.insert(
                k.clone(),
                Act {
                    dtype: Dtype::F32,
                    shape: vec![T, 4],
                    values: Values::F32(v),
                },
            );
            a.order.push(k.clone());
        }
        a.ordered_by_producer = a.order.len();
        a
    }

    /// Layers 0..=2's attention chain up to o_proj and the layer outputs.
    fn chain() -> Vec<String> {
        let mut keys = Vec::new();
        for l in 0..3 {
            let lp = LayerPaths::new(l, false).expect("paths");
            let a = &lp.attn;
            keys.extend([
                lp.input_norm.clone(),
                a.kv_a.clone(),
                a.kv_a_norm.clone(),
                a.kv_b.clone(),
                a.o.clone(),
                lp.layer.clone(),
            ]);
        }
        keys
    }

    fn run(cand_scale: &[(&str, f32)]) -> crate::compare::Comparison {
        let keys = chain();
        let opts = CompareOptions {
            tolerances: Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32),
            index_topk: None,
            facts: None,
        };
        compare(&dump(&keys, &[]), &dump(&keys, cand_scale), &opts).expect("compare")
    }

    #[test]
    fn a_broken_kv_b_proj_is_the_first_divergence() {
        let lp = LayerPaths::new(2, false).expect("paths");
        let a = &lp.attn;
        // kv_b_proj of layer 2 doubled, and everything after it off too.
        let bad = [
            (a.kv_b.as_str(), 2.0),
            (a.o.as_str(), 3.0),
            (lp.layer.as_str(), 3.0),
        ];
        let c = run(&bad);
        let f = c.first_divergence.expect("diverges");
        assert_eq!(f.module, a.kv_b);
        assert_eq!((f.layer, f.status), (Some(2), Status::Diverged));
        assert!((f.rel_l2.expect("rel-L2") - 1.0).abs() < 1e-9);
        assert_eq!(f.inputs.len(), 1);
        assert_eq!(f.inputs[0].name, a.kv_a_norm);
        assert_eq!(f.inputs[0].status, Some(Status::Match));
        assert_eq!(f.reading.what, What::Output { rel_l2: 1.0 });
        assert_eq!(
            f.reading.cause,
            Cause::InputsMatch {
                inputs: vec![a.kv_a_norm.clone()],
                up_to_ties: false,
                suspect: Module::KvB,
            }
        );
        assert_eq!(f.reading.indexer, None);
    }

    #[test]
    fn a_divergence_captured_late_is_followed_upstream() {
        // A dump that records kv_b_proj after o_proj (a tuple element captured after its
        // consumer): both diverge, o_proj comes first in execution order, but kv_b_proj feeds it.
        let lp = LayerPaths::new(1, false).expect("paths");
        let a = &lp.attn;
        let mut keys = chain();
        let (kv_b, o) = (
            keys.iter().position(|k| *k == a.kv_b).expect("kv_b"),
            keys.iter().position(|k| *k == a.o).expect("o_proj"),
        );
        keys.swap(kv_b, o);
        let opts = CompareOptions {
            tolerances: Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32),
            index_topk: None,
            facts: None,
        };
        let bad = [(a.kv_b.as_str(), 2.0), (a.o.as_str(), 2.0)];
        let c = compare(&dump(&keys, &[]), &dump(&keys, &bad), &opts).expect("compare");
        let first_in_order = c.modules.iter().find(|r| r.status == Status::Diverged);
        assert_eq!(first_in_order.map(|r| r.name.as_str()), Some(a.o.as_str()));
        let f = c.first_divergence.expect("diverges");
        assert_eq!(f.module, a.kv_b);
        // Had o_proj been the reading, its inputs (projections, the indexer) are not all in
        // both dumps: the fault would be placed "here or upstream".
        let o_row = c
            .modules
            .iter()
            .find(|r| r.name == a.o)
            .expect("o_proj row");
        let graph = Graph::new(&chain().into_iter().collect());
        let status_of: HashMap<String, (Status, Option<f64>)> = c
            .modules
            .iter()
            .map(|r| (r.name.clone(), (r.status, r.rel_l2)))
            .collect();
        let common: BTreeSet<String> = chain().into_iter().collect();
        let fo = first_divergence(o_row, &graph, &status_of, &common);
        let Cause::Upstream { missing, suspect } = &fo.reading.cause else {
            panic!("{:?}", fo.reading.cause);
        };
        assert_eq!(*suspect, Module::OProj);
        assert!(missing.contains(&a.q_b), "{missing:?}");
        assert!(!missing.contains(&a.kv_b), "{missing:?}");
    }

    #[test]
    fn matching_dumps_have_no_divergence() {
        let c = run(&[]);
        assert!(c.first_divergence.is_none());
        assert!(c.modules.iter().all(|r| r.status == Status::Match));
        assert_eq!(c.modules.len(), chain().len());
    }

    #[test]
    fn only_logits_compared_cannot_localize() {
        let keys = vec![conv::LOGITS.to_string()];
        let opts = CompareOptions {
            tolerances: Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32),
            index_topk: None,
            facts: None,
        };
        let c = compare(
            &dump(&keys, &[]),
            &dump(&keys, &[(conv::LOGITS, 0.2)]),
            &opts,
        )
        .expect("compare");
        let f = c.first_divergence.expect("diverges");
        assert_eq!(f.reading.cause, Cause::OnlyLogits);
        assert_eq!(f.reading.what, What::Module);
    }
}
