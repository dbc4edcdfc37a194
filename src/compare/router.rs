//! Routed experts: which experts each token chose, the weights paired with them, and each routed
//! expert's activations on the tokens routed to it.

use std::collections::BTreeSet;

use serde::Serialize;

use super::diff::diff;
use super::driver::{ids_rows, Ctx, Exclusion, ExclusionCause, ModuleRow, RowNote, Status};
use super::graph::{expert_act_call, ids_in, router_ids_alternatives};
use super::io::Act;
use super::metrics::{float_row, set_float};

#[derive(Debug, Clone, Serialize)]
pub struct RouterCmp {
    pub tokens: usize,
    /// Tokens whose expert sets differ.
    pub flipped: Vec<usize>,
}

/// Router expert ids `[T, k]`, compared as sets per token. A few flips while the router logits
/// match are near-ties: those tokens are left out of later comparisons (the returned exclusion).
pub(crate) fn compare_router_ids(
    cx: &Ctx,
    row: &mut ModuleRow,
    key: &str,
    ra: &Act,
    ca: &Act,
) -> Option<Exclusion> {
    let (rr, cr) = ids_rows(ra, ca, cx.t, row)?;
    let set = |r: &[i64]| r.iter().copied().collect::<BTreeSet<i64>>();
    let n = cx.keep.kept();
    let flipped: Vec<usize> = cx
        .keep
        .rows()
        .filter(|&i| set(&rr[i]) != set(&cr[i]))
        .collect();
    let logits_ok = cx
        .graph
        .router_of(key)
        .and_then(|logits| cx.status_of.get(logits))
        .is_some_and(|(s, _)| *s == Status::Match);
    let frac = if n == 0 {
        0.0
    } else {
        flipped.len() as f64 / n as f64
    };
    // A few flips are near-ties, and flips the measured noise explains token by token are noise:
    // either way those tokens leave the later comparisons. A token routed to another expert
    // differs there by a whole expert's share (rel-L2 ~0.25 for 4 of 16 tokens with one of 8
    // experts swapped), beyond any kernel-noise bound: kept, it was a false "diverged" on a
    // correct Q8_0 GLM-5 forward. The exclusion is listed; the positions left are counted.
    let few = logits_ok && frac <= cx.tol.router_flip_max;
    let noise = logits_ok && !few && noise_explains(cx, key, &flipped, (&rr, &cr));
    row.status = if flipped.is_empty() {
        Status::Match
    } else if few || noise {
        Status::NearTie
    } else {
        Status::Diverged
    };
    if !flipped.is_empty() {
        row.note = Some(RowNote::ExpertsDiffer {
            flipped: flipped.clone(),
            tokens: n,
        });
    }
    let exclude = (few || noise).then(|| Exclusion {
        module: key.to_string(),
        positions: flipped.clone(),
        from_on: false,
        cause: if few {
            ExclusionCause::NearTiedExperts
        } else {
            ExclusionCause::NoiseFlippedExperts
        },
    });
    row.router = Some(RouterCmp { tokens: n, flipped });
    row.positions_compared = cx.keep.partial();
    exclude
}

/// Whether the router-logit noise the comparison measured explains every flipped token. Two tests,
/// both at every flipped token:
/// - the noise is large enough: the candidate's expert scores (sigmoid of the logits) differ from
///   the reference's by at least half the typical gap between neighbouring scores of that token;
/// - the flip is one the noise made: with the same correction bias and the same selection rule on
///   both sides, an expert the candidate swapped in (b) over one it dropped (a) must have gained at
///   least as much score: Δ_b ≥ Δ_a, Δ = score_cand − score_ref (the bias cancels). A dropped or
///   rounded bias, another gating function or top-k method breaks this even under noise.
fn noise_explains(cx: &Ctx, key: &str, flipped: &[usize], ids: (&[Vec<i64>], &[Vec<i64>])) -> bool {
    let Some(logits) = cx.graph.router_of(key) else {
        return false;
    };
    let (Some(r), Some(c)) = (
        cx.reference.tensors.get(logits),
        cx.cand.tensors.get(logits),
    ) else {
        return false;
    };
    let (Some(rv), Some(cv)) = (r.f32(), c.f32()) else {
        return false;
    };
    let e = match r.shape.as_slice() {
        [t, e] if *t == cx.t && r.shape == c.shape && *e > 1 => *e,
        _ => return false,
    };
    let sig = |x: f32| 1.0 / (1.0 + (-f64::from(x)).exp());
    !flipped.is_empty()
        && flipped.iter().all(|&i| {
            let (Some(ri), Some(ci)) = (rv.get(i * e..(i + 1) * e), cv.get(i * e..(i + 1) * e))
            else {
                return false;
            };
            let rs: Vec<f64> = ri.iter().map(|&x| sig(x)).collect();
            let delta: Vec<f64> = rs.iter().zip(ci).map(|(a, &b)| sig(b) - a).collect();
            let noise = (delta.iter().map(|d| d * d).sum::<f64>() / e as f64).sqrt();
            let mut sorted = rs.clone();
            sorted.sort_by(f64::total_cmp);
            let mut gaps: Vec<f64> = sorted.windows(2).map(|w| w[1] - w[0]).collect();
            gaps.sort_by(f64::total_cmp);
            let typical = gaps[gaps.len() / 2];
            let (Some(rr), Some(cr)) = (ids.0.get(i), ids.1.get(i)) else {
                return false;
            };
            let at = |x: &i64| usize::try_from(*x).ok().and_then(|x| delta.get(x).copied());
            let gained: Option<Vec<f64>> = cr.iter().filter(|x| !rr.contains(x)).map(at).collect();
            let lost: Option<Vec<f64>> = rr.iter().filter(|x| !cr.contains(x)).map(at).collect();
            let (Some(gained), Some(lost)) = (gained, lost) else {
                return false;
            };
            let min_gained = gained.iter().copied().fold(f64::INFINITY, f64::min);
            let max_lost = lost.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            noise > 0.0 && noise >= 0.5 * typical && min_gained >= max_lost - 1e-6
        })
}

/// Router weights `[T, k]`, each paired with its expert id by the dump's own ids (the slot order
/// of the top-k is an implementation detail): its tuple sibling `gate.2` or `topk_indices`.
pub(crate) fn compare_router_weights(cx: &Ctx, row: &mut ModuleRow, key: &str, ra: &Act, ca: &Act) {
    let t = cx.t;
    let ids = cx.graph.router_of(key).and_then(|gate| {
        let keys = router_ids_alternatives(gate);
        let own = if key.ends_with(".1") {
            keys.iter().rev().cloned().collect::<Vec<_>>()
        } else {
            keys
        };
        Some((ids_in(cx.reference, &own)?, ids_in(cx.cand, &own)?))
    });
    let k = ra.shape.last().copied().unwrap_or(0);
    let (Some((ri, ci)), Some(rw), Some(cw)) = (ids, ra.f32(), ca.f32()) else {
        return float_row(row, ra, ca, key, t, cx.keep, cx.tol);
    };
    if !(ra.shape == ca.shape && ri.len() == t && ci.len() == t && rw.len() == t * k) {
        return float_row(row, ra, ca, key, t, cx.keep, cx.tol);
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut skipped = 0;
    for i in cx.keep.rows() {
        let pairs = |ids: &[i64], w: &[f32]| {
            let mut p: Vec<(i64, f32)> = ids.iter().copied().zip(w.iter().copied()).collect();
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
    set_float(row, &d, &[a.len() / k.max(1), k.max(1)], cx.tol);
    if skipped > 0 {
        row.note = Some(RowNote::WeightsLeftOut { tokens: skipped });
    }
    row.positions_compared = cx.keep.partial();
}

/// One routed expert's `act_fn#n` rows, matched by token (both dumps' rows are in token order).
pub(crate) fn compare_expert_act(cx: &Ctx, row: &mut ModuleRow, key: &str, ra: &Act, ca: &Act) {
    let (re, ce) = (
        cx.reference.expert_rows.get(key),
        cx.cand.expert_rows.get(key),
    );
    match (re, ce, ra.f32(), ca.f32()) {
        (Some(re), Some(ce), Some(rv), Some(cv)) if re.expert == ce.expert => {
            let cols = ra.shape.get(1).copied().unwrap_or(0);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            let mut n = 0;
            for (ri, tok) in re.tokens.iter().enumerate() {
                if !cx.keep.has(*tok) {
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
                row.note = Some(RowNote::NoTokenRouted);
            } else {
                let d = diff(&a, &b);
                set_float(row, &d, &[n, cols], cx.tol);
                row.note = Some(RowNote::Expert {
                    expert: re.expert,
                    tokens: n,
                });
            }
        }
        (Some(re), Some(ce), ..) => {
            row.status = Status::Skipped;
            row.note = Some(RowNote::RoutingDiffers {
                call: expert_act_call(key).map_or(0, |x| x.1),
                reference: re.expert,
                candidate: ce.expert,
            });
        }
        _ => {
            row.status = Status::Skipped;
            row.note = Some(RowNote::RowOrderUnknown);
        }
    }
}
