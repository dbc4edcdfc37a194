//! The comparison engine's typed results in words: the first divergence's reading, what to suspect
//! per module of the dataflow, why positions were left out, the comparison's notes, status words.
//! Each `Serialize` impl writes the sentence, so the JSON holds the same text as the table.

use std::fmt;

use serde::{Serialize, Serializer};

use crate::compare::divergence::{Cause, IndexerSignature, Reading, What};
use crate::compare::driver::{ExclusionCause, Note, RowNote};
use crate::compare::graph::Module;
use crate::compare::{short_name, Status};

impl Status {
    /// The word the table and the JSON's `status` cell show.
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
}

/// What to suspect when `m` is the first module to diverge while its inputs agree.
pub fn suspect(m: Module) -> &'static str {
    use Module as M;
    match m {
        M::Embed => "the token embedding (token_embd: vocab row order)",
        M::Rotary | M::RotarySin => "the RoPE tables (rope theta, rope dimension)",
        M::InputNorm => "the input_layernorm weight",
        M::QA => "the q_a_proj weight",
        M::QANorm => "the q_a_layernorm weight or its epsilon (1e-6 in transformers)",
        M::QB => "the q_b_proj weight",
        M::KvA => "the kv_a_proj_with_mqa weight",
        M::KvANorm => "the kv_a_layernorm weight or its epsilon (1e-6 in transformers)",
        M::KvB => {
            "the kv_b_proj weight (rebuilt from attn_k_b/attn_v_b: rows per head [k_nope | v])"
        }
        M::IdxWqB => "the indexer wq_b weight",
        M::IdxWk => "the indexer wk weight",
        M::IdxKNorm => "the indexer k_norm LayerNorm (weight, bias, eps 1e-6)",
        M::IdxWeightsProj => "the indexer weights_proj weight",
        M::IdxQ => "the indexer's RoPE on q (rope part first, interleaved pairs)",
        M::IdxK => "the indexer's RoPE on k (rope part first, interleaved pairs)",
        M::IdxHeadWeights => "the head-weight scale index_n_heads^-1/2",
        M::IdxScores => {
            "the index score (relu(q·k)·index_head_dim^-1/2 weighted by the head weights, causal mask)"
        }
        M::IdxTopk => "the indexer's top-k selection (k = min(index_topk, T), causal mask)",
        M::AttnTopk | M::LayerTopk => "the top-k ids handed on (they should equal the indexer's)",
        M::KRot => "RoPE on the shared rope key (interleaved pairs, rope theta)",
        M::QueryStates => {
            "RoPE on q (interleaved pairs, rope theta) or the per-head [nope | rope] split of q_b"
        }
        M::KeyStates => "the per-head [k_nope | v] split of kv_b or the shared rope key",
        M::ValueStates => "the per-head [k_nope | v] split of kv_b_proj",
        M::Probs => {
            "the softmax scale (qk_head_dim^-1/2) or the attention mask (causal ∩ indexer top-k)"
        }
        M::OProj => {
            "the attention core (RoPE, softmax scale, mask, head layout) or the o_proj weight"
        }
        M::Attn => "the attention output handed on (it should equal o_proj's)",
        M::PostNorm => "the residual add (x + self_attn) or the post_attention_layernorm weight",
        M::MlpGate => "the mlp gate_proj weight",
        M::MlpAct | M::SharedAct => "the activation (SiLU)",
        M::MlpUp => "the mlp up_proj weight",
        M::MlpDown => "the mlp down_proj weight (or the gate·up product)",
        M::Mlp => "the mlp output",
        M::Router => "the router weight (mlp.gate, kept in f32)",
        M::RouterWeights | M::TopkWeights => {
            "the routing weights (sigmoid of the logits, normalised, × routed_scaling_factor)"
        }
        M::RouterIds | M::TopkIndices => {
            "expert selection (e_score_correction_bias, group-limited top-k)"
        }
        M::ExpertAct => "that routed expert's gate/up weights (w13 layout)",
        M::Experts => "the routed experts' weights (w13/w2 layout, expert order)",
        M::SharedGate => "the shared expert gate_proj weight",
        M::SharedUp => "the shared expert up_proj weight",
        M::SharedDown => "the shared expert down_proj weight",
        M::Shared => "the shared expert output",
        M::Moe => "the sum of routed and shared experts",
        M::Layer => "the residual add (h + mlp)",
        M::FinalNorm => "the final norm weight (output_norm)",
        M::ModelOut => "the model output handed on (it should equal model.norm's)",
        M::LmHead => "the lm_head weight (output: vocab row order, vocab padding)",
        M::Logits => "the logits handed on (they should equal lm_head's)",
        M::InputIds | M::PositionIds => "",
        M::Prev | M::Unknown => "this module",
    }
}

fn what(module: &str, w: &What) -> String {
    let short = short_name(module);
    match w {
        What::Output { rel_l2 } => format!("{short} output diverges (rel-L2 {rel_l2:.2e})"),
        What::Module => format!("{short} diverges"),
        What::Topk => format!("{short} top-k differs beyond ties"),
        What::Experts { flipped, tokens } => format!(
            "the routed experts differ ({})",
            if flipped.is_empty() {
                String::new()
            } else {
                experts_differ(flipped, *tokens)
            }
        ),
        What::InputIds => "the input ids differ".to_string(),
    }
}

/// The router row's note: how many tokens chose other experts.
pub fn experts_differ(flipped: &[usize], tokens: usize) -> String {
    format!(
        "experts differ in {} of {tokens} tokens ({:?})",
        flipped.len(),
        flipped
    )
}

impl fmt::Display for IndexerSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (k, mb, first_bad, ma) = (
            self.index_topk,
            self.kl_before,
            self.first_bad,
            self.kl_after,
        );
        write!(
            f,
            "the logits agree closely below index_topk ({k}; mean KL {mb:.1e}) and diverge from \
             position {first_bad} on (mean KL {ma:.1e}), where the DSA indexer's top-k starts to \
             restrict attention: suspect the indexer (switched off, or choosing other keys)"
        )
    }
}

impl fmt::Display for Reading {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = what(&self.module, &self.what);
        let short = short_name(&self.module);
        let positions = self.indexer.map_or(String::new(), |p| format!("; {p}"));
        match &self.cause {
            Cause::Module { suspect: s } => write!(f, "{what}: suspect {}{positions}", suspect(*s)),
            Cause::Upstream {
                missing,
                suspect: s,
            } => write!(
                f,
                "{what}; its input{} {} {} not compared (not in both dumps, or incomparable), so \
                 the fault is here or upstream: suspect {} or what feeds it{positions}",
                if missing.len() == 1 { "" } else { "s" },
                missing.join(", "),
                if missing.len() == 1 { "is" } else { "are" },
                suspect(*s)
            ),
            Cause::InputsMatch {
                inputs,
                up_to_ties,
                suspect: s,
            } => {
                let names: Vec<String> = inputs.iter().map(|i| short_name(i)).collect();
                write!(
                    f,
                    "{what} while {} {}{}: suspect {}{positions}",
                    if names.len() == 1 {
                        format!("its input {}", names[0])
                    } else {
                        format!("its inputs {}", names.join(", "))
                    },
                    if names.len() == 1 { "matches" } else { "match" },
                    if *up_to_ties { " (up to ties)" } else { "" },
                    suspect(*s)
                )
            }
            Cause::OnlyLogits => write!(
                f,
                "{short} diverges; only the logits were compared (the reference holds no module \
                 outputs), so the fault cannot be localized to a module{positions}. To find the \
                 module, compare against a dump with module outputs: `forward --dump` of the \
                 same GGUF without the suspected change"
            ),
            Cause::WeightNoise { basis } => write!(
                f,
                "{short} diverges; every module before it matches within the noise of different \
                 weights ({basis}), which is too coarse to localize the fault{positions}. Compare \
                 against a same-weights reference: `forward --dump` of the same GGUF without \
                 the suspected change, or llama.cpp's logits of it (--reference-weights \
                 same-gguf)"
            ),
            Cause::NoIndexer => write!(
                f,
                "{short} diverges while its other inputs match, and the candidate has no indexer: \
                 it attends densely (the DSA indexer is disabled), which differs from GLM-5's \
                 sparse attention once a query sees more than index_topk keys"
            ),
        }
    }
}

impl fmt::Display for ExclusionCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExclusionCause::Topk { status, pos } => write!(
                f,
                "{} top-k choice at position {pos}",
                match status {
                    Status::Tie => "an exact-tie",
                    Status::NearTie => "a near-tie",
                    _ => "an unclassified",
                }
            ),
            ExclusionCause::NearTiedExperts => {
                f.write_str("near-tied expert choices (the router logits agree)")
            }
            ExclusionCause::NoiseFlippedExperts => f.write_str(
                "expert choices flipped by the measured router-logit noise (checked token by token)",
            ),
        }
    }
}

/// The first `n` of `items`, comma-separated, with ", …" when there are more.
fn first_few(items: impl ExactSizeIterator<Item = String>, n: usize) -> String {
    let more = items.len() > n;
    let shown: Vec<String> = items.take(n).collect();
    format!("{}{}", shown.join(", "), if more { ", …" } else { "" })
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Note::Renamed(pairs) => write!(
                f,
                "{} module(s) matched under another name: {}",
                pairs.len(),
                first_few(pairs.iter().map(|(a, b)| format!("{a} → {b}")), 4)
            ),
            Note::Reshaped(list) => write!(
                f,
                "{} module(s) compared after dropping singleton dims one dump kept (a batch dim, a \
                 squeezed head dim): {}",
                list.len(),
                first_few(
                    list.iter()
                        .map(|(k, r, c)| format!("{} ({r:?} / {c:?})", short_name(k))),
                    3
                )
            ),
            Note::NothingLeft { key, cause } => write!(
                f,
                "{key}: {cause}: every position is left out from here on, so nothing after it is \
                 compared"
            ),
            Note::NoIndexer { source } => write!(
                f,
                "{source} has no indexer outputs: it ran without the DSA indexer (dense attention)"
            ),
        }
    }
}

macro_rules! serialize_as_sentence {
    ($($t:ty),*) => {$(
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    )*};
}

impl fmt::Display for RowNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RowNote::InputIdsDiffer => f.write_str("the input ids differ"),
            RowNote::IdsLayout {
                reference,
                candidate,
            } => write!(
                f,
                "shape {reference:?} vs {candidate:?}: not the same layout, not compared"
            ),
            RowNote::NotIds {
                reference,
                candidate,
            } => write!(
                f,
                "{reference:?} vs {candidate:?}: not integer [T, k] ids in both dumps, not compared"
            ),
            RowNote::NoIndexScores => f.write_str(
                "the reference has no index_scores: a tie cannot be told from a divergence",
            ),
            RowNote::ExpertsDiffer { flipped, tokens } => {
                f.write_str(&experts_differ(flipped, *tokens))
            }
            RowNote::WeightsLeftOut { tokens } => write!(
                f,
                "{tokens} token(s) whose experts differ left out (see the router ids)"
            ),
            RowNote::NoTokenRouted => f.write_str("no token routed to this expert in both dumps"),
            RowNote::Expert { expert, tokens } => write!(f, "expert {expert}, {tokens} token(s)"),
            RowNote::RoutingDiffers {
                call,
                reference,
                candidate,
            } => write!(
                f,
                "call #{call} is expert {reference} in the reference, {candidate} in the \
                 candidate (routing differs)"
            ),
            RowNote::RowOrderUnknown => f.write_str("row order unknown (no router ids in a dump)"),
            RowNote::CausalOnly => f.write_str("causal entries only"),
            RowNote::Logits {
                kl_mean,
                kl_max,
                top1,
                positions,
            } => write!(
                f,
                "KL mean {kl_mean:.2e} (max {kl_max:.2e}), top-1 {top1}/{positions}"
            ),
            RowNote::AfterTieBreak => f.write_str("every position follows a tie-break"),
            RowNote::NotFloat {
                reference,
                candidate,
            } => write!(
                f,
                "dtype {reference:?} vs {candidate:?}: not both float, not compared"
            ),
            RowNote::Layout {
                reference,
                candidate,
            } => write!(
                f,
                "shape {reference:?} vs {candidate:?}: not the same layout (transposed or \
                 rearranged?), not compared"
            ),
            RowNote::Unmasked { entries } => {
                write!(f, "{entries} entries the reference masks are not masked")
            }
        }
    }
}

/// What showed a behaviour fault's signature.
impl fmt::Display for crate::compare::behaviour::Evidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use crate::compare::behaviour::Evidence::*;
        match self {
            Router {
                matched,
                correct,
                tokens,
            } => write!(
                f,
                "recomputed from the candidate's own router logits, its chosen experts and weights \
                 follow this rule at {matched} of {tokens} tokens (the correct rule: {correct})"
            ),
            Temperature {
                slope,
                expected,
                r2,
            } => write!(
                f,
                "with query and key states matching, the attention log-odds are the reference's \
                 × {slope:.3} (R² {r2:.4}); a scale of (kv_lora_rank + rope dim)^-1/2 instead of \
                 qk_head_dim^-1/2 gives × {expected:.3}"
            ),
            RopeLayout { module } => write!(
                f,
                "at position 0 (angle 0) the rope part of {module} is the reference's with its \
                 halves re-interleaved: rotated half-split where the checkpoint pairs adjacent dims"
            ),
            NoIndexer => write!(
                f,
                "the reference's indexer output at this layer has no counterpart: attention ran \
                 without the DSA top-k"
            ),
            Overflow {
                module,
                nonfinite,
                max_abs,
            } => write!(
                f,
                "{module} holds {nonfinite} inf/NaN value(s) where the reference's are finite and \
                 reach {max_abs:.3e}, beyond fp16's largest finite value 65504 (bf16 and f32 reach \
                 3.4e38)"
            ),
        }
    }
}

/// A behaviour fault's signature in one line: `router-softmax at layer 1: …`.
pub fn signature_line(s: &crate::compare::behaviour::Signature) -> String {
    let name = crate::faults::Fault::Behaviour(s.fault);
    format!(
        "signature of {} ({}) at layer {}: {}",
        name.cause(),
        name.spec().about,
        s.layer,
        s.evidence
    )
}

serialize_as_sentence!(
    Reading,
    ExclusionCause,
    Note,
    RowNote,
    crate::compare::behaviour::Evidence
);

/// A tolerance basis in words: `f32 compute, Q8_0 weights (measured)`, with the overriding flags.
impl fmt::Display for crate::compare::tolerance::Basis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use crate::compare::tolerance::BasisKind::*;
        let (d, w) = (self.dtype.name(), self.weights.name);
        match self.kind {
            Measured => write!(f, "{d} compute, {w} weights (measured)")?,
            FromFourBit => write!(f, "{d} compute, {w} weights (derived from 4-bit)")?,
            TwiceFourBit => write!(
                f,
                "{d} compute, {w} weights (derived: twice the 4-bit bounds)"
            )?,
            FromBf16 => write!(f, "{d} compute, {w} weights (derived from bf16)")?,
            SameWeights => write!(
                f,
                "{d} compute, the same {w} weights on both sides (glmcheck's own run)"
            )?,
            OtherEngine => write!(
                f,
                "{d} compute, the same {w} weights run by another engine (kernel noise measured \
                 against llama.cpp)"
            )?,
        }
        if !self.overridden.is_empty() {
            write!(f, "; overridden: {}", self.overridden.join(", "))?;
        }
        Ok(())
    }
}

impl Serialize for crate::compare::tolerance::Basis {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(what: What, cause: Cause) -> Reading {
        Reading {
            module: "model.layers.2.self_attn.kv_b_proj".into(),
            what,
            cause,
            indexer: None,
        }
    }

    #[test]
    fn readings_in_words() {
        let r = reading(
            What::Output { rel_l2: 1.3217 },
            Cause::InputsMatch {
                inputs: vec!["model.layers.2.self_attn.kv_a_layernorm".into()],
                up_to_ties: false,
                suspect: Module::KvB,
            },
        );
        assert_eq!(
            r.to_string(),
            "kv_b_proj output diverges (rel-L2 1.32e0) while its input kv_a_layernorm matches: \
             suspect the kv_b_proj weight (rebuilt from attn_k_b/attn_v_b: rows per head \
             [k_nope | v])"
        );
        assert_eq!(
            serde_json::to_value(&r).expect("json"),
            serde_json::Value::String(r.to_string())
        );
        let r = reading(
            What::Topk,
            Cause::Upstream {
                missing: vec!["a.b".into(), "a.c".into()],
                suspect: Module::IdxTopk,
            },
        );
        assert!(r.to_string().starts_with(
            "kv_b_proj top-k differs beyond ties; its inputs a.b, a.c are not compared"
        ));
        let mut r = reading(What::Module, Cause::OnlyLogits);
        r.indexer = Some(IndexerSignature {
            index_topk: 8,
            kl_before: 1e-6,
            kl_after: 0.5,
            first_bad: 9,
        });
        let s = r.to_string();
        assert!(
            s.contains("to a module; the logits agree closely below index_topk (8; mean KL 1.0e-6) and diverge from position 9 on (mean KL 5.0e-1)"),
            "{s}"
        );
    }

    #[test]
    fn causes_and_notes_in_words() {
        let c = ExclusionCause::Topk {
            status: Status::NearTie,
            pos: 25,
        };
        assert_eq!(c.to_string(), "a near-tie top-k choice at position 25");
        let pairs: Vec<(String, String)> =
            (0..5).map(|i| (format!("x{i}"), format!("y{i}"))).collect();
        assert_eq!(
            Note::Renamed(pairs).to_string(),
            "5 module(s) matched under another name: x0 → y0, x1 → y1, x2 → y2, x3 → y3, …"
        );
        assert_eq!(Status::Diverged.name(), "DIVERGED");
        assert_eq!(suspect(Module::Unknown), "this module");
    }
}
