//! The comparison: both dumps walked in execution order, each module compared by its role.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::diff::{activation_storage_rel_l2, diff};
use super::divergence::{first_divergence, indexer_signature, FirstDivergence};
use super::graph::{expert_act_call, ids_in, router_ids_alternatives, short_name, Graph, Role};
use super::io::{ancestor, meta, Act, ActError, Activations};
use super::logits::{logits_metrics, LogitsCmp};
use super::metrics::{float_row, set_float, Keep};
use super::normalize::normalize;
use super::router::RouterCmp;
use super::tolerance::{ReferenceWeights, Tolerances};
use super::topk::{classify_topk_row, visible, TieClass, TopkCmp};
use crate::model::names::{conv, ModelPaths};

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

    pub(crate) fn ok(self) -> bool {
        !matches!(self, Status::Diverged)
    }
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

/// Options of one comparison.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    pub tolerances: Tolerances,
    /// The model's `index_topk`, when known: a divergence that starts at that position points at
    /// the DSA indexer.
    pub index_topk: Option<usize>,
}

pub(crate) fn get_f32<'a>(acts: &'a Activations, key: &str) -> Option<&'a [f32]> {
    acts.tensors.get(key).and_then(Act::f32)
}

/// Both dumps' `[T, k]` integer rows, or why they cannot be compared (set on `row`).
pub(crate) fn ids_rows(ra: &Act, ca: &Act, t: usize, row: &mut ModuleRow) -> Option<IdRows> {
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

pub(crate) type IdRows = (Vec<Vec<i64>>, Vec<Vec<i64>>);

pub(crate) fn row_slice(s: Option<&[f32]>, i: usize, t: usize) -> Option<&[f32]> {
    s.map(|s| &s[i * t..(i + 1) * t])
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
            storage_rel_l2: activation_storage_rel_l2(ra.dtype)
                + activation_storage_rel_l2(ca.dtype),
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
                        let d = diff(&a, &b);
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
                            let d = diff(&a, &b);
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
                    let d = diff(&a, &b);
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

pub(crate) fn push(
    rows: &mut Vec<ModuleRow>,
    status_of: &mut HashMap<String, (Status, Option<f64>)>,
    row: ModuleRow,
) {
    status_of.insert(row.name.clone(), (row.status, row.rel_l2));
    rows.push(row);
}
