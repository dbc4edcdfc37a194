//! Behaviour-fault signatures: at the first divergence's layer, tests whether the candidate computed
//! what one of [`Behaviour`]'s bugs computes, from the candidate's own inputs to that module.
//! Each test recomputes the module's output under the bug's rule and asks for an (almost) exact
//! match where the correct rule does not match, so an unrelated fault at the same layer (a broken
//! weight upstream of the router, say) is never given a behaviour's name.
//!
//! - router faults (softmax gating, no/rounded correction bias, no renormalization, no scaling
//!   factor): the candidate's chosen experts and their weights are recomputed from the candidate's
//!   router logits under each rule;
//! - `mla-scale-latent`: with the query and key states matching, the attention probabilities'
//!   log-odds are the reference's times a constant (a softmax temperature), and that constant is
//!   √(qk_head_dim / (kv_lora_rank + qk_rope_head_dim));
//! - `mla-rope-neox`, `indexer-rope-neox`: at position 0 (angle 0) interleaved RoPE only
//!   de-interleaves the rope part; half-split leaves it in place, so the candidate's rope part at
//!   position 0 is the reference's with its halves re-interleaved;
//! - `dsa-dense`: the candidate has no indexer output at that layer where the reference has one.

use std::collections::BTreeMap;

use serde::Serialize;

use super::diff::diff;
use super::io::Activations;
use crate::faults::Behaviour;

/// What the signatures need to know about the model (from the GGUF the forward ran).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    pub qk_head_dim: usize,
    pub kv_lora_rank: usize,
    pub qk_rope_head_dim: usize,
    /// `e_score_correction_bias` of each MoE layer.
    pub biases: BTreeMap<usize, Vec<f32>>,
}

/// A behaviour fault recognized at a layer, and what showed it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Signature {
    #[serde(serialize_with = "fault_name")]
    pub fault: Behaviour,
    pub layer: usize,
    /// Serialized as its sentence ([`crate::report::reading`]).
    pub evidence: Evidence,
}

fn fault_name<S: serde::Serializer>(b: &Behaviour, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(crate::faults::Fault::Behaviour(*b).cause())
}

#[derive(Debug, Clone, PartialEq)]
pub enum Evidence {
    /// The candidate's router outputs are the bug's rule applied to its own logits at `matched` of
    /// `tokens` tokens; the correct rule at `correct`.
    Router {
        matched: usize,
        correct: usize,
        tokens: usize,
    },
    /// Attention log-odds = the reference's × `slope` (fit quality `r2`); the bug predicts
    /// `expected`.
    Temperature { slope: f64, expected: f64, r2: f64 },
    /// At position 0 the rope part of `module` is the reference's re-interleaved.
    RopeLayout { module: String },
    /// No indexer output at this layer.
    NoIndexer,
}

/// The first behaviour signature found at `layer`, if any.
pub fn recognise(
    reference: &Activations,
    cand: &Activations,
    layer: usize,
    facts: &ModelFacts,
    rel_l2: f64,
) -> Option<Signature> {
    let at = |key: &str| format!("model.layers.{layer}.{key}");
    let sig = |fault, evidence| Signature {
        fault,
        layer,
        evidence,
    };
    let indexer = at("self_attn.indexer");
    if reference.tensors.contains_key(&indexer) && !cand.tensors.contains_key(&indexer) {
        return Some(sig(Behaviour::DsaDense, Evidence::NoIndexer));
    }
    for (module, fault, rope_first) in [
        ("self_attn.k_rot", Behaviour::MlaRopeNeox, false),
        ("self_attn.indexer.k", Behaviour::IndexerRopeNeox, true),
    ] {
        let key = at(module);
        if rope_reinterleaved(
            reference,
            cand,
            &key,
            facts.qk_rope_head_dim,
            rope_first,
            rel_l2,
        ) {
            return Some(sig(fault, Evidence::RopeLayout { module: key }));
        }
    }
    if let Some(e) = temperature(reference, cand, &at("self_attn"), facts, rel_l2) {
        return Some(sig(Behaviour::MlaScaleLatent, e));
    }
    router(cand, layer, facts).map(|(fault, e)| sig(fault, e))
}

fn f32s<'a>(acts: &'a Activations, key: &str) -> Option<&'a [f32]> {
    acts.tensors.get(key).and_then(|a| a.f32())
}

/// Position 0's rope part (the last `rope` values of the first row of `key`, or the first ones
/// when `rope_first`): the candidate's differs from the reference's and equals it re-interleaved.
fn rope_reinterleaved(
    reference: &Activations,
    cand: &Activations,
    key: &str,
    rope: usize,
    rope_first: bool,
    rel_l2: f64,
) -> bool {
    let (Some(r), Some(c)) = (reference.tensors.get(key), cand.tensors.get(key)) else {
        return false;
    };
    let (Some(rv), Some(cv)) = (r.f32(), c.f32()) else {
        return false;
    };
    let row = r.shape.last().copied().unwrap_or(0);
    if r.shape != c.shape || rope == 0 || !rope.is_multiple_of(2) || row < rope || rv.len() < row {
        return false;
    }
    let start = if rope_first { 0 } else { row - rope };
    let (r0, c0) = (&rv[start..start + rope], &cv[start..start + rope]);
    let half = rope / 2;
    let re: Vec<f32> = (0..rope)
        .map(|i| {
            if i % 2 == 0 {
                r0[i / 2]
            } else {
                r0[half + i / 2]
            }
        })
        .collect();
    // Closer to the re-interleaved reference than the noise allows, and far closer to it than to
    // the reference itself (a vector and its re-interleaving are ~1.4 rel-L2 apart).
    let (to_re, to_ref) = (diff(c0, &re).rel_l2, diff(c0, r0).rel_l2);
    to_re <= rel_l2.min(0.3) && to_ref > 1e-2 && to_ref > 4.0 * to_re
}

/// The attention probabilities' log-odds against the reference's, where the query and key states
/// match: a slope away from 1 that the latent-dim scale predicts.
fn temperature(
    reference: &Activations,
    cand: &Activations,
    module: &str,
    facts: &ModelFacts,
    rel_l2: f64,
) -> Option<Evidence> {
    for k in ["query_states", "key_states"] {
        let key = format!("{module}.{k}");
        let (r, c) = (f32s(reference, &key)?, f32s(cand, &key)?);
        if r.len() != c.len() || diff(c, r).rel_l2 > rel_l2 {
            return None;
        }
    }
    let key = format!("{module}.1");
    let (r, c) = (reference.tensors.get(&key)?, cand.tensors.get(&key)?);
    let (rv, cv) = (r.f32()?, c.f32()?);
    let t = *r.shape.last()?;
    if r.shape != c.shape || t < 2 {
        return None;
    }
    let (mut sxy, mut sxx, mut syy) = (0f64, 0f64, 0f64);
    for (rr, cr) in rv.chunks(t).zip(cv.chunks(t)) {
        let idx: Vec<usize> = (0..t).filter(|&j| rr[j] > 1e-20 && cr[j] > 1e-20).collect();
        if idx.len() < 2 {
            continue;
        }
        let lr: Vec<f64> = idx.iter().map(|&j| f64::from(rr[j]).ln()).collect();
        let lc: Vec<f64> = idx.iter().map(|&j| f64::from(cr[j]).ln()).collect();
        let (mr, mc) = (mean(&lr), mean(&lc));
        for (x, y) in lr.iter().zip(&lc) {
            let (x, y) = (x - mr, y - mc);
            sxy += x * y;
            sxx += x * x;
            syy += y * y;
        }
    }
    if sxx <= 0.0 || syy <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let r2 = sxy * sxy / (sxx * syy);
    let expected =
        (facts.qk_head_dim as f64 / (facts.kv_lora_rank + facts.qk_rope_head_dim) as f64).sqrt();
    let named = (slope - expected).abs() < 0.02 * expected && (slope - 1.0).abs() > 0.02;
    (named && r2 > 0.999).then_some(Evidence::Temperature {
        slope,
        expected,
        r2,
    })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// One way of routing: how scores come from logits, which bias the choice adds, whether the
/// chosen weights are renormalized and scaled.
#[derive(Clone, Copy)]
struct Rule {
    softmax: bool,
    /// 0: no bias, 1: the bias, 2: the bias rounded to bf16.
    bias: u8,
    norm: bool,
    scale: bool,
}

/// The candidate's chosen experts and weights under each rule, from its own router logits.
fn router(cand: &Activations, layer: usize, f: &ModelFacts) -> Option<(Behaviour, Evidence)> {
    let at = |k: &str| format!("model.layers.{layer}.mlp.gate{k}");
    let logits = cand.tensors.get(&at(""))?;
    let e = *logits.shape.last()?;
    let lv = logits.f32()?;
    let ids = cand
        .tensors
        .get(&at(".topk_indices"))
        .or_else(|| cand.tensors.get(&at(".2")))?;
    let w = f32s(cand, &at(".topk_weights")).or_else(|| f32s(cand, &at(".1")))?;
    let bias = f.biases.get(&layer)?;
    let k = *ids.shape.last()?;
    let (ids, t) = (ids.i64()?, lv.len() / e.max(1));
    if e == 0 || bias.len() != e || k != f.top_k || ids.len() != t * k || w.len() != t * k {
        return None;
    }
    let correct = Rule {
        softmax: false,
        bias: 1,
        norm: f.norm_topk_prob,
        scale: true,
    };
    let rules = [
        (
            Behaviour::RouterSoftmax,
            Rule {
                softmax: true,
                ..correct
            },
        ),
        (Behaviour::RouterNoBias, Rule { bias: 0, ..correct }),
        (Behaviour::BiasBf16, Rule { bias: 2, ..correct }),
        (
            Behaviour::NoNormTopk,
            Rule {
                norm: false,
                ..correct
            },
        ),
        (
            Behaviour::RoutedScaleMissing,
            Rule {
                scale: false,
                ..correct
            },
        ),
    ];
    let count = |rule: Rule| {
        (0..t)
            .filter(|&i| {
                let got: Vec<(i64, f32)> = (0..k).map(|j| (ids[i * k + j], w[i * k + j])).collect();
                same_routing(&route(&lv[i * e..(i + 1) * e], bias, rule, f), &got)
            })
            .count()
    };
    let ok = count(correct);
    let need = (t * 9).div_ceil(10);
    if ok >= need {
        return None;
    }
    rules.into_iter().find_map(|(fault, rule)| {
        // A rule the model's settings make identical to the correct one cannot be told apart.
        let m = count(rule);
        (m >= need && m > ok).then_some((
            fault,
            Evidence::Router {
                matched: m,
                correct: ok,
                tokens: t,
            },
        ))
    })
}

/// One token's (expert, weight) pairs under `rule`.
fn route(logits: &[f32], bias: &[f32], rule: Rule, f: &ModelFacts) -> Vec<(i64, f32)> {
    let scores: Vec<f64> = if rule.softmax {
        let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let ex: Vec<f64> = logits.iter().map(|&x| (x as f64 - m).exp()).collect();
        let s: f64 = ex.iter().sum();
        ex.into_iter().map(|x| x / s).collect()
    } else {
        logits
            .iter()
            .map(|&x| 1.0 / (1.0 + (-(x as f64)).exp()))
            .collect()
    };
    let choice: Vec<f64> = scores
        .iter()
        .zip(bias)
        .map(|(&s, &b)| match rule.bias {
            0 => s,
            1 => s + b as f64,
            _ => s + f64::from(half::bf16::from_f32(b)),
        })
        .collect();
    // Group limit: the topk_group groups with the largest sum of their top-2 choice scores.
    let e = choice.len();
    let per = e / f.n_group.max(1);
    let mut groups: Vec<(usize, f64)> = (0..f.n_group.max(1))
        .map(|g| {
            let mut v: Vec<f64> = choice[g * per..(g + 1) * per].to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            (g, v.iter().take(2).sum())
        })
        .collect();
    groups.sort_by(|a, b| b.1.total_cmp(&a.1));
    let kept: Vec<usize> = groups.iter().take(f.topk_group).map(|g| g.0).collect();
    let mut cand: Vec<usize> = (0..e).filter(|i| kept.contains(&(i / per))).collect();
    cand.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
    cand.truncate(f.top_k);
    let mut w: Vec<f64> = cand.iter().map(|&i| scores[i]).collect();
    if rule.norm {
        let s: f64 = w.iter().sum::<f64>() + 1e-20;
        w.iter_mut().for_each(|x| *x /= s);
    }
    if rule.scale {
        w.iter_mut().for_each(|x| *x *= f.routed_scaling_factor);
    }
    cand.iter()
        .zip(w)
        .map(|(&i, w)| (i as i64, w as f32))
        .collect()
}

/// The same experts, each with its weight within 1 % (the candidate may have computed in bf16).
fn same_routing(want: &[(i64, f32)], got: &[(i64, f32)]) -> bool {
    want.len() == got.len()
        && want.iter().all(|&(e, w)| {
            got.iter()
                .find(|g| g.0 == e)
                .is_some_and(|g| (g.1 - w).abs() <= 1e-2 * w.abs().max(1e-6))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(e: usize) -> ModelFacts {
        ModelFacts {
            top_k: 2,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
            qk_head_dim: 256,
            kv_lora_rank: 512,
            qk_rope_head_dim: 64,
            biases: [(1, (0..e).map(|i| 0.01 * i as f32).collect())].into(),
        }
    }

    /// A router dump of `t` tokens at layer 1 whose choices and weights follow `rule`.
    fn router_dump(f: &ModelFacts, rule: Rule, t: usize, e: usize) -> Activations {
        use super::super::io::{Act, Values};
        let mut logits = Vec::new();
        let (mut ids, mut ws) = (Vec::new(), Vec::new());
        for i in 0..t {
            let row: Vec<f32> = (0..e)
                .map(|j| (((i * 7 + j * 13) % 17) as f32 - 8.0) * 0.003)
                .collect();
            for (x, w) in route(&row, &f.biases[&1], rule, f) {
                ids.push(x);
                ws.push(w);
            }
            logits.extend(row);
        }
        let mut a = Activations::default();
        let k = f.top_k;
        for (key, shape, values) in [
            ("model.layers.1.mlp.gate", vec![t, e], Values::F32(logits)),
            (
                "model.layers.1.mlp.gate.topk_indices",
                vec![t, k],
                Values::I64(ids),
            ),
            (
                "model.layers.1.mlp.gate.topk_weights",
                vec![t, k],
                Values::F32(ws),
            ),
        ] {
            let dtype = match values {
                Values::F32(_) => safetensors::Dtype::F32,
                Values::I64(_) => safetensors::Dtype::I64,
            };
            a.tensors.insert(
                key.to_string(),
                Act {
                    dtype,
                    shape,
                    values,
                },
            );
        }
        a
    }

    /// GLM-5's correction biases sit near a common offset with small differences between experts;
    /// bf16 keeps 8 bits, so rounding erases those differences and the choices move (sglang
    /// #37133). The tiny fixture's biases are too spread for that: there the fault is harmless.
    #[test]
    fn a_bias_rounded_to_bf16_is_named_and_a_correct_router_is_not() {
        let e = 16;
        let mut f = facts(e);
        f.biases = [(1, (0..e).map(|i| 4.0 + 0.002 * i as f32).collect())].into();
        let correct = Rule {
            softmax: false,
            bias: 1,
            norm: true,
            scale: true,
        };
        let bad = router_dump(&f, Rule { bias: 2, ..correct }, 12, e);
        let good = router_dump(&f, correct, 12, e);
        let sig = recognise(&good, &bad, 1, &f, 1e-3).expect("a signature");
        assert_eq!(sig.fault, Behaviour::BiasBf16);
        assert!(
            matches!(sig.evidence, Evidence::Router { correct, tokens: 12, .. } if correct < 11),
            "{:?}",
            sig.evidence
        );
        assert_eq!(recognise(&good, &good, 1, &f, 1e-3), None);
    }

    #[test]
    fn each_routing_rule_is_told_apart_from_the_others() {
        let f = facts(8);
        let logits = [0.3f32, -0.2, 1.1, 0.05, -1.0, 0.9, 0.2, 0.1];
        let bias = &f.biases[&1];
        let correct = Rule {
            softmax: false,
            bias: 1,
            norm: true,
            scale: true,
        };
        let base = route(&logits, bias, correct, &f);
        assert_eq!(base.len(), 2);
        let total: f32 = base.iter().map(|x| x.1).sum();
        assert!(
            (total - 2.5).abs() < 1e-5,
            "normalized then scaled: {total}"
        );
        for other in [
            Rule {
                softmax: true,
                ..correct
            },
            Rule {
                norm: false,
                ..correct
            },
            Rule {
                scale: false,
                ..correct
            },
        ] {
            assert!(!same_routing(&route(&logits, bias, other, &f), &base));
        }
    }
}
