//! One float module's comparison: masked entries, the token positions still compared, shapes.

use super::diff::{diff, Diff};
use super::driver::{ModuleRow, RowNote, Status};
use super::io::Act;
use super::tolerance::Tolerances;
use crate::model::names::conv;

/// Reference entries at or below this are an additive mask (transformers' `finfo(f32).min`).
pub const MASKED: f32 = -1e30;
/// A candidate entry at or below this counts as masked (f16's lowest finite value is −65504).
pub(crate) const CAND_MASKED: f32 = -6.0e4;

pub(crate) fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
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
pub(crate) fn token_axis(key: &str, shape: &[usize], t: usize) -> Option<usize> {
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
pub(crate) fn select(
    values: &[f32],
    shape: &[usize],
    axis: usize,
    keep: &[bool],
) -> (Vec<f32>, Vec<usize>) {
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

pub(crate) struct FloatResult {
    diff: Diff,
    shape: Vec<usize>,
    mask_mismatch: usize,
}

/// Compares float values, skipping the reference's masked entries (the candidate must mask them
/// too).
pub(crate) fn float_diff(cand: &[f32], reference: &[f32], shape: Vec<usize>) -> FloatResult {
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
    let mut diff = diff(&a, &b);
    diff.max_abs_at = map.get(diff.max_abs_at).copied().unwrap_or(0);
    FloatResult {
        diff,
        shape,
        mask_mismatch,
    }
}

/// The positions still compared.
pub(crate) struct Keep {
    pub(crate) keep: Vec<bool>,
    /// The positions the logits (KL, top-1) are judged at: all but those left out after tied
    /// choices. Tokens whose experts the measured noise flipped stay: their logits are held to the
    /// KL bounds, which allow for kernel noise end to end (modules after the flip are not).
    pub(crate) logits: Vec<bool>,
}

impl Keep {
    pub(crate) fn all(t: usize) -> Self {
        Keep {
            keep: vec![true; t],
            logits: vec![true; t],
        }
    }

    pub(crate) fn kept(&self) -> usize {
        self.keep.iter().filter(|&&k| k).count()
    }

    /// `Some(n)` when fewer than all positions are kept.
    pub(crate) fn partial(&self) -> Option<usize> {
        let n = self.kept();
        (n < self.keep.len()).then_some(n)
    }

    pub(crate) fn rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.keep
            .iter()
            .enumerate()
            .filter(|(_, &k)| k)
            .map(|(i, _)| i)
    }

    pub(crate) fn has(&self, i: usize) -> bool {
        self.keep.get(i).copied().unwrap_or(false)
    }
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

pub(crate) fn set_float(row: &mut ModuleRow, d: &Diff, shape: &[usize], tol: &Tolerances) {
    row.rel_l2 = Some(d.rel_l2);
    row.cosine = Some(d.cosine);
    row.max_abs = Some(d.max_abs);
    row.max_abs_at = (!shape.is_empty()).then(|| unravel(d.max_abs_at, shape));
    // The dumps' own storage rounding (a module stored in bf16 carries ~2⁻⁹ relative error of its
    // own) comes on top of the compute/weight profile.
    let bound = tol.rel_l2_for(&row.name) + row.storage_rel_l2;
    row.status = if d.rel_l2.is_nan() || d.rel_l2 > bound {
        Status::Diverged
    } else {
        Status::Match
    };
}

pub(crate) fn float_row(
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
        row.note = Some(RowNote::NotFloat {
            reference: ra.dtype,
            candidate: ca.dtype,
        });
        return;
    };
    if ra.shape != ca.shape {
        row.status = Status::Incomparable;
        row.note = Some(RowNote::Layout {
            reference: ra.shape.clone(),
            candidate: ca.shape.clone(),
        });
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
        row.note = Some(RowNote::Unmasked {
            entries: f.mask_mismatch,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::driver::ModuleRow;
    use crate::compare::graph::ValueKind;
    use crate::compare::io::Values;
    use crate::compare::tolerance::ComputeDtype;
    use crate::gguf::GgmlType;
    use safetensors::Dtype;

    fn act(shape: &[usize], v: Vec<f32>) -> Act {
        Act {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            values: Values::F32(v),
        }
    }

    fn row() -> ModuleRow {
        ModuleRow::new("m", None, ValueKind::Float, false)
    }

    fn tol() -> Tolerances {
        Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32)
    }

    #[test]
    fn shapes_that_differ_in_singletons_share_one() {
        assert_eq!(common_shape(&[1, 3, 4], &[3, 4]), Some(vec![3, 4]));
        assert_eq!(common_shape(&[3, 1, 4], &[3, 4]), Some(vec![3, 4]));
        assert_eq!(common_shape(&[4, 3], &[3, 4]), None);
        assert_eq!(common_shape(&[1], &[1, 1]), Some(vec![1]));
    }

    #[test]
    fn positions_are_selected_along_the_token_axis() {
        // [2 heads, 3 tokens, 1]: keep tokens 0 and 2.
        let v: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let (out, shape) = select(&v, &[2, 3, 1], 1, &[true, false, true]);
        assert_eq!((out, shape), (vec![0.0, 2.0, 3.0, 5.0], vec![2, 2, 1]));
        assert_eq!(
            token_axis("model.layers.0.self_attn.query_states", &[1, 3, 8], 3),
            Some(1)
        );
        assert_eq!(token_axis("model.layers.0.mlp", &[3, 8], 3), Some(0));
        assert_eq!(token_axis("model.layers.0.mlp", &[4, 8], 3), None);
        assert_eq!(unravel(7, &[2, 3, 2]), vec![1, 0, 1]);
    }

    #[test]
    fn masked_entries_must_be_masked_by_both() {
        let f = float_diff(&[1.0, -1e9, 2.0], &[1.0, MASKED, 2.0], vec![3]);
        assert_eq!((f.diff.rel_l2, f.mask_mismatch), (0.0, 0));
        let f = float_diff(&[1.0, 0.0, 2.5], &[1.0, MASKED, 2.0], vec![3]);
        assert_eq!(f.mask_mismatch, 1);
        // The largest difference is reported at its place in the unmasked tensor.
        assert_eq!(f.diff.max_abs_at, 2);
        let mut r = row();
        let keep = Keep::all(3);
        float_row(
            &mut r,
            &act(&[3], vec![1.0, 2.0, 3.0]),
            &act(&[3], vec![1.0, 0.0, 3.0]),
            "m",
            3,
            &keep,
            &tol(),
        );
        assert_eq!(r.status, Status::Diverged);
        assert_eq!(r.note, None);
    }

    #[test]
    fn float_rows_judge_by_the_bound_plus_storage() {
        let keep = Keep {
            keep: vec![true, true, false],
            logits: vec![true, true, false],
        };
        let (a, b) = (
            act(&[3, 2], vec![1.0, 2.0, 3.0, 4.0, 50.0, 60.0]),
            act(&[3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        );
        let mut r = row();
        float_row(&mut r, &b, &a, "model.layers.0.mlp", 3, &keep, &tol());
        // Position 2 (where they differ) follows a tie-break: left out.
        assert_eq!((r.status, r.positions_compared), (Status::Match, Some(2)));
        assert_eq!(r.rel_l2, Some(0.0));
        let mut r = row();
        let all = Keep::all(3);
        float_row(&mut r, &b, &a, "model.layers.0.mlp", 3, &all, &tol());
        assert_eq!(r.status, Status::Diverged);
        assert_eq!(r.max_abs_at, Some(vec![2, 1]));
        let mut r = row();
        float_row(
            &mut r,
            &b,
            &act(&[2, 3], vec![0.0; 6]),
            "m",
            3,
            &all,
            &tol(),
        );
        assert_eq!(r.status, Status::Incomparable);
        assert_eq!(
            r.note,
            Some(RowNote::Layout {
                reference: vec![3, 2],
                candidate: vec![2, 3]
            })
        );
        // Just above the bound, but inside it once bf16 storage is allowed for.
        let mut r = row();
        r.storage_rel_l2 = 2f64.powi(-8);
        let d = diff(&[1.001], &[1.0]);
        set_float(&mut r, &d, &[1], &tol());
        assert_eq!(r.status, Status::Match);
        r.storage_rel_l2 = 0.0;
        set_float(&mut r, &d, &[1], &tol());
        assert_eq!(r.status, Status::Diverged);
    }
}
