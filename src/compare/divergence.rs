//! The first divergence in execution order, and what it says.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::driver::{ModuleRow, Status};
use super::graph::{short_name, Graph, Role};
use super::logits::LogitsCmp;
use super::tolerance::Tolerances;

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

/// When the logits agree closely below `index_topk` and diverge from there on: the DSA indexer's
/// signature (its top-k restricts attention only once a query sees more than index_topk keys).
pub(crate) fn indexer_signature(
    l: &LogitsCmp,
    index_topk: Option<usize>,
    tol: &Tolerances,
) -> Option<String> {
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
