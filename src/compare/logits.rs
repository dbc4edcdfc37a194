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
    /// Positions whose top-1 differs only between logits closer than the noise the logits' input
    /// carries (counted as agreeing in `top1_agree`): 3·√2·σ with σ = the input's rel-L2 × the
    /// reference row's standard deviation (the lm_head is linear: its output's noise is its
    /// input's). A random-weight model's near-flat logits flip top-1 under 8-bit activations;
    /// a wrong lm_head moves logits far beyond its input's noise and is not excused.
    pub top1_noise_ties: usize,
    /// (position, KL) for every compared position.
    pub kl_by_position: Vec<(usize, f64)>,
    /// The statistics `llama-perplexity --kl-divergence` prints, under its definitions.
    pub kld_stats: KldStats,
}

/// What `llama-perplexity --kl-divergence` prints in its "KL divergence statistics" and "Token
/// probability statistics" blocks, computed as its `kl_divergence()` computes them
/// (tools/perplexity/perplexity.cpp), so that the numbers read like the ones people know.
/// Fractions, not percents (llama.cpp prints Δp and "Same top p" ×100 %).
///
/// - `x ± err`: `mean_and_uncertainty`: mean `f = Σx/n`, `err = sqrt((Σx²/n − f²)/(n − 1))`,
///   and 0 unless that variance is positive and `n > 10`.
/// - Percentiles: the per-position values sorted, the fraction `q` at `i = q·(n − 1)` linearly
///   interpolated between `v[⌊i⌋]` and `v[⌊i⌋ + 1]`; the median is the middle value (the mean of
///   the two middle ones for even `n`); maximum and minimum the ends.
/// - RMS Δp: `sqrt(mean Δp²)`, its error `0.5 / rms · err(mean Δp²)` (from `Σ Δp⁴`); 0 when the
///   RMS is 0 (llama.cpp would print NaN).
/// - Same top p: the fraction of positions whose argmax (the first maximum) is the same in both,
///   without `top1_agree`'s allowance for storage ties; error `sqrt(p(1 − p)/(n − 1))` (0 for
///   `n < 2`).
///
/// Differences: llama.cpp stores the reference's log-probabilities in 16 bits and skips tokens
/// below e⁻¹⁶ in the KL sum (so its KLs can be slightly negative); these use the exact KL of
/// `kl_by_position`. llama.cpp scores only the second half of each context chunk and prints its
/// summary only from 100 positions; these cover the compared positions, however few.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct KldStats {
    /// Positions the KL and same-top statistics cover (those of `kl_by_position`).
    pub positions: usize,
    pub kl_mean: f64,
    pub kl_mean_err: f64,
    pub kl_max: f64,
    pub kl_p999: f64,
    pub kl_p99: f64,
    pub kl_p95: f64,
    pub kl_p90: f64,
    pub kl_median: f64,
    pub kl_p10: f64,
    pub kl_p05: f64,
    pub kl_p01: f64,
    pub kl_p001: f64,
    pub kl_min: f64,
    /// Fraction of positions with the same top token ("Same top p").
    pub same_top: f64,
    pub same_top_err: f64,
    /// Δp, llama.cpp's definition: at position i, the candidate's probability of the prompt's next
    /// token (i + 1) minus the reference's. Over the compared positions that have a next token;
    /// `None` when the dumps name no tokens.
    pub dp: Option<DeltaP>,
}

/// llama.cpp's "Token probability statistics": Δp (a signed fraction) over `positions`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DeltaP {
    pub positions: usize,
    pub mean: f64,
    pub mean_err: f64,
    pub max: f64,
    pub p999: f64,
    pub p99: f64,
    pub p95: f64,
    pub p90: f64,
    pub p75: f64,
    pub median: f64,
    pub p25: f64,
    pub p10: f64,
    pub p05: f64,
    pub p01: f64,
    pub p001: f64,
    pub min: f64,
    /// RMS Δp and its error.
    pub rms: f64,
    pub rms_err: f64,
}

/// llama.cpp's `mean_and_uncertainty(sum, sum2, count)`: the mean, and the standard error
/// `sqrt((sum2/n − mean²)/(n − 1))`, 0 unless the variance is positive and `n > 10`.
pub fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> (f64, f64) {
    if count < 1 {
        return (0.0, 0.0);
    }
    let n = count as f64;
    let f = sum / n;
    let df = sum2 / n - f * f;
    let df = if df > 0.0 && count > 10 {
        (df / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    (f, df)
}

/// llama.cpp's `percentile(values, fraction)` of ascending `sorted` values: linear interpolation
/// at `fraction·(n − 1)`; the ends for fractions ≤ 0 and ≥ 1. 0 for no values.
pub fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    let (Some(&first), Some(&last)) = (sorted.first(), sorted.last()) else {
        return 0.0;
    };
    if fraction <= 0.0 {
        return first;
    }
    if fraction >= 1.0 {
        return last;
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let ip = p as usize;
    let p = p - ip as f64;
    (1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]
}

/// llama.cpp's median: the middle value, or the mean of the two middle ones. 0 for no values.
pub fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n.is_multiple_of(2) => 0.5 * (sorted[n / 2] + sorted[n / 2 - 1]),
        _ => sorted[n / 2],
    }
}

fn sorted(values: &[f64]) -> Vec<f64> {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

impl KldStats {
    /// From the per-position KLs, the count of positions whose top token agrees, and the
    /// per-position Δp (`None`: no tokens to take it of).
    pub fn from_values(kl: &[f64], same_top: usize, dp: Option<&[f64]>) -> KldStats {
        let n = kl.len();
        let (kl_mean, kl_mean_err) =
            mean_and_uncertainty(kl.iter().sum(), kl.iter().map(|x| x * x).sum(), n);
        let s = sorted(kl);
        let same = if n == 0 {
            0.0
        } else {
            same_top as f64 / n as f64
        };
        KldStats {
            positions: n,
            kl_mean,
            kl_mean_err,
            kl_max: s.last().copied().unwrap_or(0.0),
            kl_p999: percentile(&s, 0.999),
            kl_p99: percentile(&s, 0.99),
            kl_p95: percentile(&s, 0.95),
            kl_p90: percentile(&s, 0.90),
            kl_median: median(&s),
            kl_p10: percentile(&s, 0.10),
            kl_p05: percentile(&s, 0.05),
            kl_p01: percentile(&s, 0.01),
            kl_p001: percentile(&s, 0.001),
            kl_min: s.first().copied().unwrap_or(0.0),
            same_top: same,
            same_top_err: if n < 2 {
                0.0
            } else {
                (same * (1.0 - same) / (n - 1) as f64).sqrt()
            },
            dp: dp.map(DeltaP::from_values),
        }
    }
}

impl DeltaP {
    pub fn from_values(dp: &[f64]) -> DeltaP {
        let n = dp.len();
        let sum2: f64 = dp.iter().map(|x| x * x).sum();
        let (mean, mean_err) = mean_and_uncertainty(dp.iter().sum(), sum2, n);
        let (mse, mse_err) = mean_and_uncertainty(sum2, dp.iter().map(|x| x.powi(4)).sum(), n);
        let rms = mse.sqrt();
        let s = sorted(dp);
        DeltaP {
            positions: n,
            mean,
            mean_err,
            max: s.last().copied().unwrap_or(0.0),
            p999: percentile(&s, 0.999),
            p99: percentile(&s, 0.99),
            p95: percentile(&s, 0.95),
            p90: percentile(&s, 0.90),
            p75: percentile(&s, 0.75),
            median: median(&s),
            p25: percentile(&s, 0.25),
            p10: percentile(&s, 0.10),
            p05: percentile(&s, 0.05),
            p01: percentile(&s, 0.01),
            p001: percentile(&s, 0.001),
            min: s.first().copied().unwrap_or(0.0),
            rms,
            rms_err: if rms > 0.0 { 0.5 / rms * mse_err } else { 0.0 },
        }
    }
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
/// over the positions `keep` marks. Without token ids: `kld_stats.dp` is `None`.
pub fn logits_metrics(
    reference: &[f32],
    cand: &[f32],
    v: usize,
    keep: &[bool],
    storage: (Dtype, Dtype),
) -> LogitsCmp {
    logits_metrics_with_tokens(reference, cand, v, keep, storage, None, None)
}

/// [`logits_metrics`], with the prompt's token ids (`tokens[i + 1]` is the token position `i`
/// predicts) for llama.cpp's Δp in `kld_stats`, and the rel-L2 measured on the logits' input
/// (`input_noise`, for [`LogitsCmp::top1_noise_ties`]).
pub fn logits_metrics_with_tokens(
    reference: &[f32],
    cand: &[f32],
    v: usize,
    keep: &[bool],
    storage: (Dtype, Dtype),
    tokens: Option<&[u32]>,
    input_noise: Option<f64>,
) -> LogitsCmp {
    let (mut kl_sum, mut kl_max, mut kl_max_pos, mut agree, mut dp2) = (0.0, 0.0, 0, 0, 0.0);
    let (mut h_c, mut h_r, mut max_abs) = (0.0, 0.0, 0f64);
    let (mut ks_sum, mut ks_max, mut storage_ties, mut noise_ties) = (0.0, 0f64, 0, 0);
    let mut kl_by_position = Vec::new();
    // llama.cpp's statistics: strict top-token agreement, Δp of the next prompt token.
    let (mut same_top, mut dp_next) = (0, Vec::new());
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
            same_top += 1;
        } else if (r[top] as f64 - r[ctop] as f64) <= u(r[top], c[top]) + u(r[ctop], c[ctop]) {
            // The two tokens' reference logits are within the storage rounding of each other: the
            // stored values cannot say which one the computation preferred.
            agree += 1;
            storage_ties += 1;
        } else if input_noise.is_some_and(|rel| {
            r[top] as f64 - r[ctop] as f64 <= 3.0 * std::f64::consts::SQRT_2 * rel * finite_std(r)
        }) {
            agree += 1;
            noise_ties += 1;
        }
        dp2 += (lr[top].exp() - lc[top].exp()).powi(2);
        if let Some(&next) = tokens.and_then(|t| t.get(i + 1)) {
            let next = next as usize;
            if next < v {
                dp_next.push(lc[next].exp() - lr[next].exp());
            }
        }
        h_r -= lr.iter().map(|&l| l.exp() * l).sum::<f64>();
        h_c -= lc.iter().map(|&l| l.exp() * l).sum::<f64>();
        for (a, b) in r.iter().zip(c) {
            max_abs = max_abs.max((*a as f64 - *b as f64).abs());
        }
    }
    let nf = n.max(1) as f64;
    let log_vocab = (v as f64).ln();
    let entropy_mean = h_c / nf;
    let kls: Vec<f64> = kl_by_position.iter().map(|&(_, kl)| kl).collect();
    let kld_stats = KldStats::from_values(&kls, same_top, tokens.map(|_| &dp_next[..]));
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
        top1_noise_ties: noise_ties,
        kl_by_position,
        kld_stats,
    }
}

/// The standard deviation of a logits row's finite values (a row masked with −inf, e.g. vocab
/// padding, would otherwise make every noise tie pass).
fn finite_std(row: &[f32]) -> f64 {
    let mut s = crate::gguf::stats::Stats::default();
    s.add(row);
    s.std()
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
    let tokens = cx.reference.tokens.as_deref().or(cx.cand.tokens.as_deref());
    // The noise the logits' input carries: the largest rel-L2 among its inputs that matched.
    let input_noise = cx
        .graph
        .node(&row.name)
        .inputs
        .iter()
        .filter_map(|k| cx.status_of.get(k))
        .filter(|(s, _)| *s == Status::Match)
        .filter_map(|&(_, rel)| rel)
        .reduce(f64::max);
    let lc = logits_metrics_with_tokens(
        rv,
        cv,
        dims[1],
        &cx.keep.logits,
        (ra.dtype, ca.dtype),
        tokens,
        input_noise,
    );
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

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn percentiles_interpolate_at_q_times_n_minus_1() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        // 0.9·4 = 3.6: 0.4·v[3] + 0.6·v[4].
        assert!(close(percentile(&v, 0.9), 4.6));
        // 0.999·4 = 3.996.
        assert!(close(percentile(&v, 0.999), 0.004 * 4.0 + 0.996 * 5.0));
        assert!(close(percentile(&v, 0.25), 2.0));
        assert!(close(percentile(&v, 0.01), 0.96 * 1.0 + 0.04 * 2.0));
        assert_eq!((percentile(&v, 0.0), percentile(&v, 1.0)), (1.0, 5.0));
        assert_eq!(percentile(&[7.0], 0.5), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(median(&v), 3.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 10.0]), 2.5);
    }

    #[test]
    fn uncertainty_is_the_standard_error_from_eleven_values_on() {
        // 0, 1, …, 10: mean 5, Σx² = 385, variance 385/11 − 25 = 10, error √(10/10) = 1.
        let x: Vec<f64> = (0..=10).map(f64::from).collect();
        let (s, s2) = (x.iter().sum(), x.iter().map(|v| v * v).sum());
        let (m, e) = mean_and_uncertainty(s, s2, 11);
        assert!(close(m, 5.0) && close(e, 1.0), "{m} ± {e}");
        // Ten values or fewer: no error, as llama.cpp.
        let (m, e) = mean_and_uncertainty(45.0, 285.0, 10);
        assert_eq!((m, e), (4.5, 0.0));
        assert_eq!(mean_and_uncertainty(0.0, 0.0, 0), (0.0, 0.0));
    }

    #[test]
    fn kld_stats_of_known_values() {
        // Unsorted on purpose: the statistics sort them.
        let kl: Vec<f64> = [3, 9, 0, 7, 1, 10, 5, 2, 8, 4, 6]
            .iter()
            .map(|&k| f64::from(k) / 100.0)
            .collect();
        let k = KldStats::from_values(&kl, 8, None);
        assert_eq!(k.positions, 11);
        assert!(close(k.kl_mean, 0.05) && close(k.kl_mean_err, 0.01));
        assert_eq!((k.kl_max, k.kl_min, k.kl_median), (0.10, 0.0, 0.05));
        // q·10 positions into 0.00 … 0.10: 99.9 % → 9.99 → 0.0999, 95 % → 9.5 → 0.095.
        assert!(close(k.kl_p999, 0.0999) && close(k.kl_p99, 0.099));
        assert!(close(k.kl_p95, 0.095) && close(k.kl_p90, 0.09));
        assert!(close(k.kl_p10, 0.01) && close(k.kl_p001, 0.0001));
        // 8 of 11 agree: p = 8/11, error √(p(1 − p)/10).
        let p = 8.0 / 11.0;
        assert!(close(k.same_top, p));
        assert!(close(k.same_top_err, (p * (1.0 - p) / 10.0).sqrt()));
        assert_eq!(k.dp, None);
        // 4 of 5: √(0.8·0.2/4) = 0.2 (few positions do not zero this one in llama.cpp).
        let k = KldStats::from_values(&[0.0; 5], 4, Some(&[]));
        assert!(close(k.same_top_err, 0.2));
        assert_eq!(
            k.dp.map(|d| (d.positions, d.rms, d.rms_err)),
            Some((0, 0.0, 0.0))
        );
    }

    #[test]
    fn delta_p_statistics_of_known_values() {
        // Δp = 0, 0.1, …, 1.0 (reversed: sorting is theirs to do).
        let dp: Vec<f64> = (0..=10).rev().map(|k| f64::from(k) / 10.0).collect();
        let d = DeltaP::from_values(&dp);
        assert_eq!(d.positions, 11);
        // Mean 0.5, variance 3.85/11 − 0.25 = 0.1, error √(0.1/10) = 0.1.
        assert!(close(d.mean, 0.5) && close(d.mean_err, 0.1));
        // Mean Δp² = 0.35; its variance Σk⁴/10⁴/11 − 0.35² with Σk⁴ = 25333.
        let mse_err = ((25333.0 / 1e4 / 11.0 - 0.35f64 * 0.35) / 10.0).sqrt();
        assert!(close(d.rms, 0.35f64.sqrt()));
        assert!(
            close(d.rms_err, 0.5 / 0.35f64.sqrt() * mse_err),
            "{}",
            d.rms_err
        );
        assert!(close(d.p99, 0.99) && close(d.p75, 0.75) && close(d.p25, 0.25));
        assert!(close(d.p01, 0.01) && close(d.p05, 0.05));
        assert_eq!((d.max, d.median, d.min), (1.0, 0.5, 0.0));
    }

    #[test]
    fn kld_stats_from_logits_follow_llama_cpp() {
        // Position 0: p = (½, ½), q = (¾, ¼); position 1: p = (¼, ¾), q = (½, ½); position 2 equal.
        let l3 = 3f32.ln();
        let reference = [0.0f32, 0.0, 0.0, l3, 0.0, 0.0];
        let cand = [l3, 0.0, 0.0, 0.0, 0.0, 0.0];
        let tokens = [0u32, 1, 0];
        let m =
            logits_metrics_with_tokens(&reference, &cand, 2, &[true; 3], F32, Some(&tokens), None);
        let k = &m.kld_stats;
        let kl0 = 0.5 * (4.0f64 / 3.0).ln();
        let kl1 = 0.25 * 0.5f64.ln() + 0.75 * 1.5f64.ln();
        assert_eq!(k.positions, 3);
        assert!((k.kl_mean - m.kl_mean).abs() < 1e-15 && k.kl_max == m.kl_max);
        assert!((k.kl_max - kl0.max(kl1)).abs() < 1e-7);
        assert!((k.kl_median - kl0.min(kl1)).abs() < 1e-7 && k.kl_min == 0.0);
        // Tops: 0/0 (ties go to the first), 1/0, 0/0.
        assert!(close(k.same_top, 2.0 / 3.0));
        // Δp of the next token: position 0 → token 1: ¼ − ½; position 1 → token 0: ½ − ¼; position
        // 2 has no next token.
        let d = k.dp.as_ref().expect("tokens given");
        assert_eq!(d.positions, 2);
        assert!((d.min + 0.25).abs() < 1e-7 && (d.max - 0.25).abs() < 1e-7);
        assert!(d.mean.abs() < 1e-7 && (d.rms - 0.25).abs() < 1e-7);
        // The existing RMS Δp is of the reference's top token: ¼ at positions 0 and 1, 0 at 2.
        assert!((m.rms_dp - (2.0f64 * 0.0625 / 3.0).sqrt()).abs() < 1e-7);
        // A left-out position is left out of these too; no tokens, no Δp.
        let m = logits_metrics_with_tokens(
            &reference,
            &cand,
            2,
            &[false, true, true],
            F32,
            Some(&tokens),
            None,
        );
        assert_eq!(m.kld_stats.positions, 2);
        let d = m.kld_stats.dp.expect("tokens given");
        assert!(d.positions == 1 && (d.max - 0.25).abs() < 1e-7);
        assert_eq!(
            logits_metrics(&reference, &cand, 2, &[true; 3], F32)
                .kld_stats
                .dp,
            None
        );
    }

    #[test]
    fn same_top_has_no_storage_tie_allowance() {
        // The two reference logits are within bf16 rounding of each other: `top1_agree` counts the
        // flip as agreement, llama.cpp's "Same top p" does not.
        let (reference, cand) = ([1.0f32, 1.001], [1.001f32, 1.0]);
        let m = logits_metrics(&reference, &cand, 2, &[true], (Dtype::BF16, Dtype::BF16));
        assert_eq!((m.top1_agree_count, m.top1_storage_ties), (1, 1));
        assert_eq!(m.kld_stats.same_top, 0.0);
    }

    /// Deterministic standard normals (Box–Muller over a 64-bit LCG).
    fn normals(seed: u64, n: usize) -> Vec<f32> {
        let mut x = seed;
        let mut u = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (a, b) = (u(), u());
                ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32
            })
            .collect()
    }

    #[test]
    fn top1_flips_within_the_inputs_noise_are_ties_and_a_permutation_is_not() {
        let (t, v) = (64, 1000);
        // Near-flat logits (a random-weight model) and 5 % rel-L2 noise on them.
        let r: Vec<f32> = normals(1, t * v).iter().map(|x| 0.05 * x).collect();
        let c: Vec<f32> = r
            .iter()
            .zip(normals(2, t * v))
            .map(|(a, n)| a + 0.0025 * n)
            .collect();
        let keep = vec![true; t];
        let strict = logits_metrics_with_tokens(&r, &c, v, &keep, F32, None, None);
        assert!(strict.top1_agree_count < t, "the case needs flips");
        let noisy = logits_metrics_with_tokens(&r, &c, v, &keep, F32, None, Some(0.05));
        assert_eq!(
            (noisy.top1_agree_count, noisy.top1_noise_ties),
            (t, t - strict.top1_agree_count)
        );
        // A vocab permutation (a wrong lm_head) behind an input that matched to 5 %: not excused.
        let permuted: Vec<f32> = r
            .chunks(v)
            .flat_map(|row| row.iter().rev().copied().collect::<Vec<_>>())
            .collect();
        let wrong = logits_metrics_with_tokens(&r, &permuted, v, &keep, F32, None, Some(0.05));
        assert!(wrong.top1_agree < 0.2, "{}", wrong.top1_agree);
        // A −inf (masked) logit does not widen the noise allowance.
        assert_eq!(finite_std(&[1.0, -1.0, f32::NEG_INFINITY]), 1.0);
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
