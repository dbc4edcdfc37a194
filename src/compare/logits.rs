//! Next-token distributions: KL, top-1 agreement, entropy.

use safetensors::Dtype;
use serde::Serialize;

use super::diff::storage_half_ulp;

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
