//! Next-token distributions: KL, top-1 agreement, entropy.

use safetensors::Dtype;
use serde::Serialize;

use super::diff::storage_half_ulp;
use super::driver::{Ctx, ModuleRow, RowNote, Status};
use super::io::Act;

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

pub(crate) fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    row.iter().map(|&x| x as f64 - lse).collect()
}

pub(crate) fn argmax(row: &[f32]) -> usize {
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
    let u = |x: f32, y: f32| storage_half_ulp(storage.0, x) + storage_half_ulp(storage.1, y);
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

/// The logits `[T, V]` (or `[1, T, V]` when both dumps kept the batch dim), judged by their
/// distributions rather than by rel-L2: sets `row`'s status, and returns the metrics.
pub(crate) fn judge_logits(cx: &Ctx, row: &mut ModuleRow, ra: &Act, ca: &Act) -> Option<LogitsCmp> {
    let (rv, cv) = (ra.f32()?, ca.f32()?);
    let lead = ra.shape.len().saturating_sub(2);
    let dims = &ra.shape[lead..];
    let fits = ra.shape == ca.shape
        && ra.shape[..lead].iter().all(|&d| d == 1)
        && dims.len() == 2
        && dims[0] == cx.t;
    if !fits {
        return None;
    }
    let lc = logits_metrics(rv, cv, dims[1], &cx.keep.keep, (ra.dtype, ca.dtype));
    let tol = cx.tol;
    // Storage rounding bound with 4× headroom (the bound is second order).
    let bad = lc.kl_mean > tol.kl_mean + 4.0 * lc.kl_storage_mean
        || lc.kl_max > tol.kl_max + 4.0 * lc.kl_storage_max
        || lc.top1_agree < tol.top1_min
        || lc.kl_mean.is_nan();
    row.status = if bad { Status::Diverged } else { Status::Match };
    row.note = Some(RowNote::Logits {
        kl_mean: lc.kl_mean,
        kl_max: lc.kl_max,
        top1: lc.top1_agree_count,
        positions: lc.positions,
    });
    Some(lc)
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: (Dtype, Dtype) = (Dtype::F32, Dtype::F32);

    #[test]
    fn identical_rows_have_no_divergence() {
        let rows = [0.5f32, -1.0, 2.0, 0.0, 3.0, 1.0];
        let m = logits_metrics(&rows, &rows, 3, &[true, true], F32);
        assert_eq!(m.positions, 2);
        assert_eq!((m.kl_mean, m.kl_max), (0.0, 0.0));
        assert_eq!((m.top1_agree, m.top1_agree_count), (1.0, 2));
        assert_eq!((m.rms_dp, m.max_abs), (0.0, 0.0));
        assert_eq!(m.kl_by_position, vec![(0, 0.0), (1, 0.0)]);
    }

    #[test]
    fn a_known_two_token_example() {
        // Reference uniform over 2 tokens (p = ½, ½); candidate q = (¾, ¼).
        // KL(p‖q) = ½·ln(½/¾) + ½·ln(½/¼) = ½·ln(4/3).
        let reference = [0.0f32, 0.0];
        let cand = [3f32.ln(), 0.0];
        let m = logits_metrics(&reference, &cand, 2, &[true], F32);
        let expected = 0.5 * (4.0f64 / 3.0).ln();
        assert!((m.kl_mean - expected).abs() < 1e-7, "{}", m.kl_mean);
        assert_eq!(m.kl_max_pos, 0);
        // Both pick token 0 (the reference's tie goes to the first); its probability moved ¼.
        assert_eq!(m.top1_agree_count, 1);
        assert!((m.rms_dp - 0.25).abs() < 1e-7);
        assert!((m.entropy_ref_mean - 2f64.ln()).abs() < 1e-12);
        // The reference is uniform itself: near-uniform output is no verdict.
        assert!(m.reference_uniform && !m.garbage);
    }

    #[test]
    fn left_out_positions_are_not_compared() {
        let reference = [0.0f32, 0.0, 0.0, 0.0];
        let cand = [0.0f32, 0.0, 9.0, 0.0];
        let m = logits_metrics(&reference, &cand, 2, &[true, false], F32);
        assert_eq!((m.positions, m.kl_mean), (1, 0.0));
        let m = logits_metrics(&reference, &cand, 2, &[true, true], F32);
        assert!(m.kl_max > 1.0 && m.kl_max_pos == 1);
    }

    #[test]
    fn entropy_and_garbage() {
        assert!((entropy(&[1.0, 1.0, 1.0, 1.0]) - 4f64.ln()).abs() < 1e-12);
        assert!(entropy(&[30.0, 0.0, 0.0, 0.0]) < 1e-9);
        let v = 1000;
        assert!(garbage((v as f64).ln() - 0.1, v));
        assert!(!garbage((v as f64).ln() - 1.0, v));
    }
}
