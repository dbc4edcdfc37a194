//! The DSA indexer's top-k compared as sets per query, with ties told apart from divergence.

use std::collections::BTreeSet;

use serde::Serialize;

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

/// Sorted visible (causal) ids of one top-k row.
pub(crate) fn visible(ids: &[i64], i: usize) -> BTreeSet<i64> {
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
