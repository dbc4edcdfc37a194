//! The DSA indexer's top-k compared as sets per query, with ties told apart from divergence.

use std::collections::BTreeSet;

use serde::Serialize;

use super::diff::diff;
use super::driver::{
    get_f32, ids_rows, row_slice, Ctx, Exclusion, ExclusionCause, ModuleRow, RowNote, Status,
};
use super::io::{ancestor, Act};
use super::metrics::{float_row, set_float};

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

/// An indexer's top-k ids (or a copy handed on): compared as causal sets per query row, each
/// difference classified. A tie, near-tie or unclassified difference leaves every later position
/// out of later comparisons (the returned exclusion) unless glmcheck replayed it.
pub(crate) fn compare_indexer_ids(
    cx: &Ctx,
    row: &mut ModuleRow,
    key: &str,
    ra: &Act,
    ca: &Act,
) -> Option<Exclusion> {
    let t = cx.t;
    let (rr, cr) = ids_rows(ra, ca, t, row)?;
    // The ids' last dim: `[T, k]`, or `[1, T, k]` when both dumps kept the batch dim.
    let k = ra.shape.last().copied().unwrap_or(0);
    let scores_key = cx.graph.scores_of(key);
    let rs = scores_key
        .and_then(|s| get_f32(cx.reference, s))
        .filter(|s| s.len() == t * t);
    let cs = scores_key
        .and_then(|s| get_f32(cx.cand, s))
        .filter(|s| s.len() == t * t);
    let indexer_path = scores_key.and_then(|s| ancestor(s)).unwrap_or(key);
    let mut diffs = Vec::new();
    let mut overlap = 0.0;
    let mut n = 0;
    for i in cx.keep.rows() {
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
            cx.tol.score_noise,
        ) {
            d.replayed = cx.aligned.contains(&format!("{indexer_path}:{i}"));
            diffs.push(d);
        }
    }
    row.status = topk_status(&diffs);
    let mut exclude = None;
    if row.status.ok() {
        if let Some(first) = diffs.iter().filter(|d| !d.replayed).map(|d| d.pos).min() {
            exclude = Some(Exclusion {
                module: key.to_string(),
                positions: (first..t).filter(|&i| cx.keep.has(i)).collect(),
                from_on: true,
                cause: ExclusionCause::Topk {
                    status: row.status,
                    pos: first,
                },
            });
        }
    }
    if row.status == Status::Unclassified {
        row.note = Some(RowNote::NoIndexScores);
    }
    row.topk = Some(TopkCmp {
        k,
        positions: n,
        overlap: if n == 0 { 1.0 } else { overlap / n as f64 },
        rows: diffs,
    });
    row.positions_compared = cx.keep.partial();
    exclude
}

/// A module's status from its differing rows: the worst class decides.
pub(crate) fn topk_status(diffs: &[TopkRow]) -> Status {
    if diffs.is_empty() {
        Status::Match
    } else if diffs.iter().any(|d| d.class == TieClass::Divergence) {
        Status::Diverged
    } else if diffs.iter().any(|d| d.class == TieClass::Unavailable) {
        Status::Unclassified
    } else if diffs.iter().any(|d| d.class == TieClass::NearTie) {
        Status::NearTie
    } else {
        Status::Tie
    }
}

/// Index scores `[T, T]`: the causal entries of the positions still compared.
pub(crate) fn compare_index_scores(cx: &Ctx, row: &mut ModuleRow, key: &str, ra: &Act, ca: &Act) {
    let t = cx.t;
    match (ra.f32(), ca.f32()) {
        (Some(rv), Some(cv)) if ra.shape == [t, t] && ca.shape == [t, t] => {
            let (mut a, mut b, mut at) = (Vec::new(), Vec::new(), Vec::new());
            for i in cx.keep.rows() {
                for j in (0..=i).filter(|&j| cx.keep.has(j)) {
                    a.push(cv[i * t + j]);
                    b.push(rv[i * t + j]);
                    at.push(vec![i, j]);
                }
            }
            let d = diff(&a, &b);
            set_float(row, &d, &[], cx.tol);
            row.max_abs_at = at.get(d.max_abs_at).cloned();
            row.positions_compared = cx.keep.partial();
            row.note = Some(RowNote::CausalOnly);
        }
        _ => float_row(row, ra, ca, key, t, cx.keep, cx.tol),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::driver::{compare, CompareOptions};
    use crate::compare::io::{Activations, Values};
    use crate::compare::metrics::MASKED;
    use crate::compare::tolerance::{ComputeDtype, Tolerances};
    use crate::gguf::GgmlType;
    use crate::model::names::{conv, LayerPaths};
    use safetensors::Dtype;

    /// Query 3 of 4 keys, k = 2; the reference scores keys 0..=3 as `scores`.
    fn classify(ref_ids: &[i64], cand_ids: &[i64], scores: &[f32]) -> Option<TopkRow> {
        classify_topk_row(3, 2, ref_ids, cand_ids, Some(scores), None, 0.01)
    }

    #[test]
    fn the_same_causal_set_is_no_difference() {
        assert!(classify(&[0, 1], &[1, 0], &[5.0, 3.0, 1.0, 0.0]).is_none());
        // A non-causal id (4 > position 3) and padding (−1) are not part of the set.
        assert!(classify(&[0, 1, 4], &[1, 0, -1], &[5.0, 3.0, 1.0, 0.0]).is_none());
    }

    #[test]
    fn an_exact_tie_is_a_tie() {
        let r = classify(&[0, 1], &[0, 2], &[5.0, 3.0, 3.0, 1.0]).expect("differs");
        assert_eq!(r.class, TieClass::ExactTie);
        assert_eq!((r.only_ref, r.only_cand), (vec![1], vec![2]));
        assert_eq!((r.kth, r.next), (Some(3.0), Some(3.0)));
        assert_eq!(r.margin, Some(0.0));
    }

    #[test]
    fn a_swap_within_the_noise_is_a_near_tie() {
        // Margin 0.02 against noise 0.01 × the row's largest |score| 5.
        let r = classify(&[0, 1], &[0, 2], &[5.0, 3.0, 2.98, 1.0]).expect("differs");
        assert_eq!(r.class, TieClass::NearTie);
        assert!((r.margin.expect("margin") - 0.02).abs() < 1e-6);
        assert!((r.noise.expect("noise") - 0.05).abs() < 1e-9);
    }

    #[test]
    fn a_real_mismatch_is_a_divergence() {
        let r = classify(&[0, 1], &[0, 2], &[5.0, 3.0, 0.5, 1.0]).expect("differs");
        assert_eq!(r.class, TieClass::Divergence);
        assert_eq!(r.margin, Some(2.5));
        // While at most k keys are visible, each must be chosen: any difference diverges.
        let r = classify_topk_row(1, 2, &[0, 1], &[0, -1], None, None, 1.0).expect("differs");
        assert_eq!(r.class, TieClass::Divergence);
        // Without the reference's scores nothing can be said.
        let r = classify_topk_row(3, 2, &[0, 1], &[0, 2], None, None, 0.01).expect("differs");
        assert_eq!(r.class, TieClass::Unavailable);
    }

    #[test]
    fn the_worst_row_decides_the_status() {
        let row = |class| TopkRow {
            pos: 3,
            only_ref: vec![1],
            only_cand: vec![2],
            kth: None,
            next: None,
            margin: None,
            noise: None,
            class,
            replayed: false,
        };
        assert_eq!(topk_status(&[]), Status::Match);
        assert_eq!(topk_status(&[row(TieClass::ExactTie)]), Status::Tie);
        let mixed = [row(TieClass::ExactTie), row(TieClass::NearTie)];
        assert_eq!(topk_status(&mixed), Status::NearTie);
        let bad = [row(TieClass::NearTie), row(TieClass::Divergence)];
        assert_eq!(topk_status(&bad), Status::Diverged);
        let unknown = [row(TieClass::Unavailable), row(TieClass::ExactTie)];
        assert_eq!(topk_status(&unknown), Status::Unclassified);
    }

    fn dumps(ids_shape: &[usize]) -> (Activations, Activations) {
        let ix = LayerPaths::new(0, false)
            .expect("paths")
            .attn
            .indexer
            .module;
        let scores_key = format!("{ix}.{}", conv::IDX_SCORES);
        let scores: Vec<f32> = [
            [1.0, MASKED, MASKED, MASKED],
            [2.0, 1.0, MASKED, MASKED],
            [4.0, 3.0, 1.0, MASKED],
            [5.0, 3.0, 3.0, 1.0],
        ]
        .concat();
        let make = |last: [i64; 2]| {
            let mut a = Activations {
                tokens: Some(vec![1, 2, 3, 4]),
                ..Default::default()
            };
            let ids = [[0, -1], [0, 1], [0, 1], last].concat();
            a.tensors.insert(
                scores_key.clone(),
                Act {
                    dtype: Dtype::F32,
                    shape: vec![4, 4],
                    values: Values::F32(scores.clone()),
                },
            );
            a.tensors.insert(
                ix.clone(),
                Act {
                    dtype: Dtype::I64,
                    shape: ids_shape.to_vec(),
                    values: Values::I64(ids),
                },
            );
            a.order = vec![scores_key.clone(), ix.clone()];
            a.ordered_by_producer = 2;
            a
        };
        (make([0, 1]), make([0, 2]))
    }

    #[test]
    fn a_tie_leaves_the_later_positions_out() {
        let opts = CompareOptions {
            tolerances: Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32),
            index_topk: Some(2),
            facts: None,
        };
        // [T, k], and [1, T, k] when both dumps kept the batch dim: k is the last dim.
        for shape in [vec![4, 2], vec![1, 4, 2]] {
            let (r, c) = dumps(&shape);
            let cmp = compare(&r, &c, &opts).expect("compare");
            let row = cmp.modules.last().expect("row");
            assert_eq!(row.status, Status::Tie, "{shape:?}");
            let topk = row.topk.as_ref().expect("topk");
            assert_eq!((topk.k, topk.positions, topk.rows.len()), (2, 4, 1));
            assert_eq!(topk.rows[0].class, TieClass::ExactTie);
            assert_eq!(cmp.exclusions.len(), 1);
            assert_eq!(cmp.exclusions[0].positions, vec![3]);
            assert_eq!(
                cmp.exclusions[0].cause,
                ExclusionCause::Topk {
                    status: Status::Tie,
                    pos: 3
                }
            );
            assert!(cmp.first_divergence.is_none());
        }
    }
}
