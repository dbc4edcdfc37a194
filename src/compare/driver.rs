//! The comparison: both dumps walked in execution order, each module compared by its role.

use std::collections::{BTreeSet, HashMap};

use safetensors::Dtype;
use serde::Serialize;

use super::diff::activation_storage_rel_l2;
use super::divergence::{at_output, locate, no_indexer, FirstDivergence};
use super::graph::{Graph, ValueKind};
use super::io::{meta, Act, ActError, Activations};
use super::logits::{judge_logits, LogitsCmp};
use super::metrics::{float_row, Keep};
use super::normalize::normalize;
use super::router::{compare_expert_act, compare_router_ids, compare_router_weights, RouterCmp};
use super::tolerance::Tolerances;
use super::topk::{compare_index_scores, compare_indexer_ids, TopkCmp};
use crate::model::names::conv;

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
    pub(crate) fn ok(self) -> bool {
        !matches!(self, Status::Diverged)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModuleRow {
    pub name: String,
    pub layer: Option<usize>,
    pub role: ValueKind,
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
    pub note: Option<RowNote>,
    /// A capture beyond the module outputs (tuple elements, aliases, recomputed extras).
    pub aux: bool,
    /// The rel-L2 the two dumps' storage dtypes alone may put between them (added to the bound).
    pub storage_rel_l2: f64,
}

impl ModuleRow {
    /// A row not yet compared: status match, no numbers.
    pub fn new(name: &str, layer: Option<usize>, role: ValueKind, aux: bool) -> Self {
        ModuleRow {
            name: name.to_string(),
            layer,
            role,
            status: Status::Match,
            rel_l2: None,
            cosine: None,
            max_abs: None,
            max_abs_at: None,
            positions_compared: None,
            topk: None,
            router: None,
            note: None,
            aux,
            storage_rel_l2: 0.0,
        }
    }
}

/// What a row of the table says beside its numbers (worded by crate::report::reading).
#[derive(Debug, Clone, PartialEq)]
pub enum RowNote {
    InputIdsDiffer,
    /// Id tensors in both dumps, of shapes that do not match.
    IdsLayout {
        reference: Vec<usize>,
        candidate: Vec<usize>,
    },
    /// Not integer `[T, k]` ids in both dumps.
    NotIds {
        reference: Dtype,
        candidate: Dtype,
    },
    /// A top-k difference the reference's missing index scores leave unclassified.
    NoIndexScores,
    /// Tokens whose routed experts differ, of `tokens` compared.
    ExpertsDiffer {
        flipped: Vec<usize>,
        tokens: usize,
    },
    /// Router weights of tokens whose experts differ, left out.
    WeightsLeftOut {
        tokens: usize,
    },
    NoTokenRouted,
    /// A routed expert's activations compared on `tokens` tokens.
    Expert {
        expert: i64,
        tokens: usize,
    },
    /// The n-th expert activation call is another expert in each dump.
    RoutingDiffers {
        call: usize,
        reference: i64,
        candidate: i64,
    },
    /// No router ids in a dump to order an expert's rows.
    RowOrderUnknown,
    /// Index scores: causal entries only.
    CausalOnly,
    Logits {
        kl_mean: f64,
        kl_max: f64,
        top1: usize,
        positions: usize,
    },
    /// Every position follows a tie-break.
    AfterTieBreak,
    NotFloat {
        reference: Dtype,
        candidate: Dtype,
    },
    /// Float tensors of shapes that do not match.
    Layout {
        reference: Vec<usize>,
        candidate: Vec<usize>,
    },
    /// Entries the reference masks that the candidate does not.
    Unmasked {
        entries: usize,
    },
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
    pub cause: ExclusionCause,
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
    pub notes: Vec<Note>,
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
    /// Nothing diverged among what was compared, but modules in both dumps could not be compared,
    /// or the logits were compared at too few positions ([`Comparison::thin`]).
    Incomplete,
}

/// The fraction of the prompt's positions the logits must be compared at, at least, for a pass:
/// positions left out after tied choices are not evidence.
pub const MIN_COMPARED: f64 = 0.5;

impl Comparison {
    pub fn diverged(&self) -> bool {
        self.first_divergence.is_some()
    }

    /// `(compared, positions)` when the logits were compared at fewer than [`MIN_COMPARED`] of the
    /// prompt's positions (the rest left out after tied choices).
    pub fn thin(&self) -> Option<(usize, usize)> {
        let l = self.logits.as_ref()?;
        let t = self.tokens.len();
        ((l.positions as f64) < MIN_COMPARED * t as f64).then_some((l.positions, t))
    }

    pub fn verdict(&self) -> CmpVerdict {
        if self.diverged() {
            CmpVerdict::Diverged
        } else if (!self.incomparable.is_empty() && !self.allow_incomparable)
            || self.thin().is_some()
        {
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
    /// The model's router and attention settings, when known (`forward`): the behaviour-fault
    /// signatures ([`super::behaviour`]) need them.
    pub facts: Option<super::behaviour::ModelFacts>,
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
            row.note = Some(RowNote::IdsLayout {
                reference: ra.shape.clone(),
                candidate: ca.shape.clone(),
            });
            None
        }
        _ => {
            row.status = Status::Incomparable;
            row.note = Some(RowNote::NotIds {
                reference: ra.dtype,
                candidate: ca.dtype,
            });
            None
        }
    }
}

pub(crate) type IdRows = (Vec<Vec<i64>>, Vec<Vec<i64>>);

pub(crate) fn row_slice(s: Option<&[f32]>, i: usize, t: usize) -> Option<&[f32]> {
    s.map(|s| &s[i * t..(i + 1) * t])
}

/// What every per-role comparison reads: both dumps, the dataflow, the bounds, the positions still
/// compared.
pub(crate) struct Ctx<'a> {
    pub(crate) reference: &'a Activations,
    pub(crate) cand: &'a Activations,
    pub(crate) graph: &'a Graph,
    pub(crate) tol: &'a Tolerances,
    /// Token positions.
    pub(crate) t: usize,
    pub(crate) keep: &'a Keep,
    /// `"<indexer path>:<position>"` where the candidate replayed the reference's top-k.
    pub(crate) aligned: &'a BTreeSet<String>,
    /// Status and rel-L2 of the modules compared so far.
    pub(crate) status_of: &'a HashMap<String, (Status, Option<f64>)>,
}

/// Why positions were left out of later comparisons.
#[derive(Debug, Clone, PartialEq)]
pub enum ExclusionCause {
    /// The indexer's top-k chose differently at `pos`, classified as `status` (tie, near-tie or
    /// unclassified).
    Topk { status: Status, pos: usize },
    /// Near-tied expert choices while the router logits agree.
    NearTiedExperts,
    /// Expert choices the measured router-logit noise explains, token by token (more flips than
    /// `router_flip_max`: kernel noise over a router whose scores crowd together).
    NoiseFlippedExperts,
}

/// Something the comparison wants said beside its table.
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    /// Modules matched under another name: (the name in one dump, the name both now use).
    Renamed(Vec<(String, String)>),
    /// Modules compared after dropping singleton dims one dump kept: (key, the reference's shape,
    /// the candidate's shape).
    Reshaped(Vec<(String, Vec<usize>, Vec<usize>)>),
    /// At `key`, every position was left out: nothing after it is compared.
    NothingLeft { key: String, cause: ExclusionCause },
    /// The candidate (`source`) has no indexer outputs: it ran with dense attention.
    NoIndexer { source: String },
}

/// The tokens both dumps were made from.
fn tokens_of(reference: &Activations, cand: &Activations) -> Result<Vec<u32>, ActError> {
    match (&reference.tokens, &cand.tokens) {
        (Some(a), Some(b)) if a != b => Err(ActError::TokensDiffer {
            reference: reference.source.clone(),
            candidate: cand.source.clone(),
            ref_tokens: a.clone(),
            cand_tokens: b.clone(),
        }),
        (Some(a), _) | (None, Some(a)) => Ok(a.clone()),
        (None, None) => Err(ActError::NoTokens),
    }
}

/// The common keys in execution order: the order of the producer that ordered more of them
/// itself (glmcheck orders all).
fn execution_order<'a>(
    reference: &'a Activations,
    cand: &'a Activations,
    common: &BTreeSet<String>,
) -> Vec<&'a String> {
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
    order_src
        .order
        .iter()
        .filter(|k| common.contains(*k))
        .collect()
}

/// The table's rows, built in execution order.
struct Walk<'a> {
    reference: &'a Activations,
    cand: &'a Activations,
    graph: &'a Graph,
    tol: &'a Tolerances,
    t: usize,
    aligned: BTreeSet<String>,
    rows: Vec<ModuleRow>,
    status_of: HashMap<String, (Status, Option<f64>)>,
    keep: Keep,
    exclusions: Vec<Exclusion>,
    logits: Option<LogitsCmp>,
    notes: Vec<Note>,
}

impl Walk<'_> {
    /// Compares one key both dumps hold.
    fn module(&mut self, key: &str, ra: &Act, ca: &Act) {
        let node = self.graph.node(key);
        let mut row = ModuleRow {
            storage_rel_l2: activation_storage_rel_l2(ra.dtype)
                + activation_storage_rel_l2(ca.dtype),
            ..ModuleRow::new(key, node.layer, node.role, node.aux)
        };
        let cx = Ctx {
            reference: self.reference,
            cand: self.cand,
            graph: self.graph,
            tol: self.tol,
            t: self.t,
            keep: &self.keep,
            aligned: &self.aligned,
            status_of: &self.status_of,
        };
        let exclude = match node.role {
            ValueKind::InputIds => {
                if ra.values != ca.values || ra.shape != ca.shape {
                    row.status = Status::Diverged;
                    row.note = Some(RowNote::InputIdsDiffer);
                }
                None
            }
            ValueKind::IndexerIds => compare_indexer_ids(&cx, &mut row, key, ra, ca),
            ValueKind::RouterIds => compare_router_ids(&cx, &mut row, key, ra, ca),
            ValueKind::RouterWeights => {
                compare_router_weights(&cx, &mut row, key, ra, ca);
                None
            }
            ValueKind::ExpertAct => {
                compare_expert_act(&cx, &mut row, key, ra, ca);
                None
            }
            ValueKind::IndexerScores => {
                compare_index_scores(&cx, &mut row, key, ra, ca);
                None
            }
            ValueKind::Float => {
                float_row(&mut row, ra, ca, key, self.t, &self.keep, self.tol);
                None
            }
            ValueKind::Logits => {
                float_row(&mut row, ra, ca, key, self.t, &self.keep, self.tol);
                if let Some(lc) = judge_logits(&cx, &mut row, ra, ca) {
                    if self.logits.is_none() || key == conv::LOGITS {
                        self.logits = Some(lc);
                    }
                }
                None
            }
        };
        if let Some(ex) = exclude {
            self.exclude(key, ex);
        }
        push(&mut self.rows, &mut self.status_of, row);
    }

    /// Leaves the positions of `ex` still compared out of every later comparison.
    fn exclude(&mut self, key: &str, ex: Exclusion) {
        let fresh: Vec<usize> = ex
            .positions
            .iter()
            .copied()
            .filter(|&i| self.keep.has(i))
            .collect();
        if fresh.is_empty() {
            return;
        }
        let noise = ex.cause == ExclusionCause::NoiseFlippedExperts;
        for &i in &fresh {
            self.keep.keep[i] = false;
            if !noise {
                self.keep.logits[i] = false;
            }
        }
        if self.keep.kept() == 0 {
            self.notes.push(Note::NothingLeft {
                key: key.to_string(),
                cause: ex.cause.clone(),
            });
        }
        self.exclusions.push(Exclusion {
            positions: fresh,
            ..ex
        });
    }
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
    let tokens = tokens_of(reference, cand)?;
    let t = tokens.len();
    let ref_keys: BTreeSet<String> = reference.tensors.keys().cloned().collect();
    let cand_keys: BTreeSet<String> = cand.tensors.keys().cloned().collect();
    let common: BTreeSet<String> = ref_keys.intersection(&cand_keys).cloned().collect();
    if common.is_empty() {
        return Err(ActError::Disjoint);
    }
    let all: BTreeSet<String> = ref_keys.union(&cand_keys).cloned().collect();
    let graph = Graph::new(&all);
    let mut walk = Walk {
        reference,
        cand,
        graph: &graph,
        tol,
        t,
        aligned: cand
            .metadata
            .get(meta::ALIGNED)
            .and_then(|s| serde_json::from_str::<Vec<String>>(s).ok())
            .unwrap_or_default()
            .into_iter()
            .collect(),
        rows: Vec::new(),
        status_of: HashMap::new(),
        keep: Keep::all(t),
        exclusions: Vec::new(),
        logits: None,
        notes,
    };
    for key in execution_order(reference, cand, &common) {
        if let (Some(ra), Some(ca)) = (reference.tensors.get(key), cand.tensors.get(key)) {
            walk.module(key, ra, ca);
        }
    }
    let Walk {
        mut rows,
        status_of,
        exclusions,
        logits,
        mut notes,
        ..
    } = walk;
    // Nothing left to compare is not a match.
    for r in &mut rows {
        if r.positions_compared == Some(0) && r.status == Status::Match {
            r.status = Status::Skipped;
            r.note = Some(RowNote::AfterTieBreak);
        }
    }
    let mut first_divergence = locate(&rows, &graph, &status_of, &common);
    if let Some(f) = first_divergence.as_mut() {
        at_output(f, &rows, &graph, logits.as_ref(), opts.index_topk, tol);
    }
    let only_reference: Vec<String> = ref_keys.difference(&cand_keys).cloned().collect();
    let only_candidate: Vec<String> = cand_keys.difference(&ref_keys).cloned().collect();
    let is_indexer = |k: &String| graph.is_indexer(k);
    if only_reference.iter().any(is_indexer) && !cand_keys.iter().any(is_indexer) {
        notes.push(Note::NoIndexer {
            source: cand.source.clone(),
        });
        if let Some(f) = first_divergence.as_mut() {
            no_indexer(f, &graph);
        }
    }
    if let (Some(f), Some(facts)) = (first_divergence.as_mut(), &opts.facts) {
        f.signature = super::behaviour::recognise(reference, cand, f, facts, tol.rel_l2);
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
        logits,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn comparison(compared: usize, tokens: usize) -> Comparison {
        let logits = LogitsCmp {
            positions: compared,
            kl_mean: 0.0,
            kl_max: 0.0,
            kl_max_pos: 0,
            top1_agree: 1.0,
            top1_agree_count: compared,
            rms_dp: 0.0,
            max_abs: 0.0,
            entropy_mean: 1.0,
            entropy_ref_mean: 1.0,
            log_vocab: 6.0,
            garbage: false,
            reference_uniform: false,
            kl_storage_mean: 0.0,
            kl_storage_max: 0.0,
            top1_storage_ties: 0,
            top1_noise_ties: 0,
            kl_by_position: Vec::new(),
            kld_stats: Default::default(),
        };
        Comparison {
            reference: "r".into(),
            candidate: "c".into(),
            tokens: vec![1; tokens],
            tolerances: Tolerances::for_profile(
                crate::compare::ComputeDtype::F32,
                crate::gguf::GgmlType::F32,
            ),
            modules: Vec::new(),
            logits: Some(logits),
            first_divergence: None,
            exclusions: Vec::new(),
            only_reference: Vec::new(),
            only_candidate: Vec::new(),
            notes: Vec::new(),
            incomparable: Vec::new(),
            allow_incomparable: false,
        }
    }

    /// A pass needs the logits compared at half the positions or more.
    #[test]
    fn a_pass_on_a_few_positions_is_incomplete() {
        assert_eq!(comparison(16, 16).verdict(), CmpVerdict::WithinTolerance);
        assert_eq!(comparison(8, 16).verdict(), CmpVerdict::WithinTolerance);
        assert_eq!(comparison(3, 16).thin(), Some((3, 16)));
        assert_eq!(comparison(3, 16).verdict(), CmpVerdict::Incomplete);
    }
}
