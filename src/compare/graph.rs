//! GLM-5's dataflow: what each captured key is and which keys it is computed from.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::io::{Act, Activations};
use crate::model::names::{conv, LayerPaths, MlpKind, ModelPaths};

/// What kind of value a key holds; decides how it is compared and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    InputIds,
    Float,
    /// The DSA indexer's top-k key ids `[T, k]` (and its copies in the layer / attention tuples).
    IndexerIds,
    /// Index scores `[T, T]`, causal entries only.
    IndexerScores,
    /// Router expert ids `[T, k]`: compared as sets per token.
    RouterIds,
    /// Router weights `[T, k]`: paired with their expert ids.
    RouterWeights,
    /// One routed expert's activations on the tokens routed to it.
    ExpertAct,
    Logits,
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) role: Role,
    pub(crate) layer: Option<usize>,
    pub(crate) inputs: Vec<String>,
    /// The tail of a reading: "suspect …".
    pub(crate) suspect: String,
    /// A capture beyond the module outputs (tuple elements, aliases, recomputed extras).
    pub(crate) aux: bool,
}

pub(crate) fn layer_of(key: &str) -> Option<usize> {
    key.strip_prefix("model.layers.")?
        .split(['.', '#'])
        .next()?
        .parse()
        .ok()
}

/// `model.layers.L.mlp.experts.act_fn#n` → (L, n).
pub(crate) fn expert_act_call(key: &str) -> Option<(usize, usize)> {
    // Cheap test first: most keys are not an activation call, and the layer's paths cost ~40 names.
    if !key.contains(conv::ACT) {
        return None;
    }
    let l = layer_of(key)?;
    let paths = LayerPaths::new(l, true).ok()?;
    let MlpKind::Moe { experts, .. } = &paths.mlp.kind else {
        return None;
    };
    let act = format!("{experts}.{}", conv::ACT);
    let rest = key.strip_prefix(&act)?;
    if rest.is_empty() {
        return Some((l, 0));
    }
    rest.strip_prefix('#')?.parse().ok().map(|n| (l, n))
}

pub(crate) fn router_ids_keys(layer: usize) -> Vec<String> {
    let Ok(paths) = LayerPaths::new(layer, true) else {
        return Vec::new();
    };
    match &paths.mlp.kind {
        MlpKind::Moe { gate, .. } => router_ids_alternatives(gate),
        MlpKind::Dense(_) => Vec::new(),
    }
}

/// Where a dump may hold a router's expert ids: the fixtures' recomputed `topk_indices`, or the
/// router's own tuple output `gate.2` (what a plain forward hook records), in that order.
pub(crate) fn router_ids_alternatives(gate: &str) -> Vec<String> {
    vec![
        format!("{gate}.{}", conv::TOPK_INDICES),
        format!("{gate}.2"),
    ]
}

/// The rows of the first of `keys` that `acts` holds as an integer tensor.
pub(crate) fn ids_in<'a>(acts: &'a Activations, keys: &[String]) -> Option<Vec<&'a [i64]>> {
    keys.iter()
        .find_map(|k| acts.tensors.get(k).and_then(Act::rows_i64))
}

/// The graph over the keys of both dumps.
pub(crate) struct Graph {
    pub(crate) nodes: HashMap<String, Node>,
    /// indexer ids key → its layer's index-scores key
    pub(crate) scores_of: HashMap<String, String>,
    /// router ids / weights key → (ids key, weights key, logits key) of its layer
    pub(crate) router_of: HashMap<String, (String, String, String)>,
}

impl Graph {
    pub(crate) fn new(keys: &BTreeSet<String>) -> Self {
        let mut g = Graph {
            nodes: HashMap::new(),
            scores_of: HashMap::new(),
            router_of: HashMap::new(),
        };
        let add = |g: &mut Graph,
                   key: &str,
                   role: Role,
                   layer: Option<usize>,
                   inputs: &[&str],
                   suspect: &str,
                   aux: bool| {
            g.nodes.insert(
                key.to_string(),
                Node {
                    role,
                    layer,
                    inputs: inputs.iter().map(|s| s.to_string()).collect(),
                    suspect: suspect.to_string(),
                    aux,
                },
            );
        };
        let Ok(mp) = ModelPaths::new() else { return g };
        let layers: BTreeSet<usize> = keys.iter().filter_map(|k| layer_of(k)).collect();
        use Role::*;
        add(&mut g, conv::INPUT_IDS, InputIds, None, &[], "", true);
        add(&mut g, conv::POSITION_IDS, InputIds, None, &[], "", true);
        add(
            &mut g,
            &mp.embed,
            Float,
            None,
            &[conv::INPUT_IDS],
            "the token embedding (token_embd: vocab row order)",
            false,
        );
        let sin = format!("{}.1", mp.rotary);
        for r in [mp.rotary.as_str(), sin.as_str()] {
            add(
                &mut g,
                r,
                Float,
                None,
                &[conv::POSITION_IDS],
                "the RoPE tables (rope theta, rope dimension)",
                true,
            );
        }
        let mut prev = mp.embed.clone();
        for &l in &layers {
            let moe_gate = LayerPaths::new(l, true)
                .ok()
                .and_then(|p| match p.mlp.kind {
                    MlpKind::Moe { gate, .. } => Some(gate),
                    MlpKind::Dense(_) => None,
                });
            let moe = moe_gate.as_ref().is_some_and(|gate| {
                keys.iter()
                    .any(|k| k == gate || k.starts_with(&format!("{gate}.")))
            });
            let Ok(lp) = LayerPaths::new(l, moe) else {
                continue;
            };
            let li = Some(l);
            let a = &lp.attn;
            let ix = &a.indexer;
            let sub = |p: &str, s: &str| format!("{p}.{s}");
            add(
                &mut g,
                &lp.input_norm,
                Float,
                li,
                &[&prev],
                "the input_layernorm weight",
                false,
            );
            add(
                &mut g,
                &a.q_a,
                Float,
                li,
                &[&lp.input_norm],
                "the q_a_proj weight",
                false,
            );
            add(
                &mut g,
                &a.q_a_norm,
                Float,
                li,
                &[&a.q_a],
                "the q_a_layernorm weight or its epsilon (1e-6 in transformers)",
                false,
            );
            add(
                &mut g,
                &a.q_b,
                Float,
                li,
                &[&a.q_a_norm],
                "the q_b_proj weight",
                false,
            );
            add(
                &mut g,
                &a.kv_a,
                Float,
                li,
                &[&lp.input_norm],
                "the kv_a_proj_with_mqa weight",
                false,
            );
            add(
                &mut g,
                &a.kv_a_norm,
                Float,
                li,
                &[&a.kv_a],
                "the kv_a_layernorm weight or its epsilon (1e-6 in transformers)",
                false,
            );
            add(
                &mut g,
                &a.kv_b,
                Float,
                li,
                &[&a.kv_a_norm],
                "the kv_b_proj weight (rebuilt from attn_k_b/attn_v_b: rows per head [k_nope | v])",
                false,
            );
            add(
                &mut g,
                &ix.wq_b,
                Float,
                li,
                &[&a.q_a_norm],
                "the indexer wq_b weight",
                false,
            );
            add(
                &mut g,
                &ix.wk,
                Float,
                li,
                &[&lp.input_norm],
                "the indexer wk weight",
                false,
            );
            add(
                &mut g,
                &ix.k_norm,
                Float,
                li,
                &[&ix.wk],
                "the indexer k_norm LayerNorm (weight, bias, eps 1e-6)",
                false,
            );
            add(
                &mut g,
                &ix.weights_proj,
                Float,
                li,
                &[&lp.input_norm],
                "the indexer weights_proj weight",
                false,
            );
            let iq = sub(&ix.module, conv::IDX_Q);
            let ik = sub(&ix.module, conv::IDX_K);
            let ihw = sub(&ix.module, conv::IDX_HEAD_WEIGHTS);
            let iscores = sub(&ix.module, conv::IDX_SCORES);
            add(
                &mut g,
                &iq,
                Float,
                li,
                &[&ix.wq_b],
                "the indexer's RoPE on q (rope part first, interleaved pairs)",
                true,
            );
            add(
                &mut g,
                &ik,
                Float,
                li,
                &[&ix.k_norm],
                "the indexer's RoPE on k (rope part first, interleaved pairs)",
                true,
            );
            add(
                &mut g,
                &ihw,
                Float,
                li,
                &[&ix.weights_proj],
                "the head-weight scale index_n_heads^-1/2",
                true,
            );
            let score_inputs: Vec<&str> = if keys.contains(&iq) {
                vec![&iq, &ik, &ihw]
            } else {
                vec![&ix.wq_b, &ix.k_norm, &ix.weights_proj]
            };
            add(
                &mut g,
                &iscores,
                IndexerScores,
                li,
                &score_inputs,
                "the index score (relu(q·k)·index_head_dim^-1/2 weighted by the head weights, causal mask)",
                true,
            );
            let ids_inputs: Vec<&str> = if keys.contains(&iscores) {
                vec![&iscores]
            } else {
                score_inputs.clone()
            };
            add(
                &mut g,
                &ix.module,
                IndexerIds,
                li,
                &ids_inputs,
                "the indexer's top-k selection (k = min(index_topk, T), causal mask)",
                false,
            );
            let attn_ids = sub(&a.module, "2");
            let layer_ids = sub(&lp.layer, "1");
            for copy in [&attn_ids, &layer_ids] {
                add(
                    &mut g,
                    copy,
                    IndexerIds,
                    li,
                    &[&ix.module],
                    "the top-k ids handed on (they should equal the indexer's)",
                    true,
                );
            }
            for k in [&ix.module, &attn_ids, &layer_ids] {
                g.scores_of.insert(k.clone(), iscores.clone());
            }
            let qs = sub(&a.module, conv::QUERY_STATES);
            let ks = sub(&a.module, conv::KEY_STATES);
            let vs = sub(&a.module, conv::VALUE_STATES);
            let kr = sub(&a.module, conv::K_ROT);
            let probs = sub(&a.module, "1");
            add(
                &mut g,
                &kr,
                Float,
                li,
                &[&a.kv_a],
                "RoPE on the shared rope key (interleaved pairs, rope theta)",
                true,
            );
            add(
                &mut g,
                &qs,
                Float,
                li,
                &[&a.q_b],
                "RoPE on q (interleaved pairs, rope theta) or the per-head [nope | rope] split of q_b",
                true,
            );
            add(
                &mut g,
                &ks,
                Float,
                li,
                &[&a.kv_b, &kr],
                "the per-head [k_nope | v] split of kv_b or the shared rope key",
                true,
            );
            add(
                &mut g,
                &vs,
                Float,
                li,
                &[&a.kv_b],
                "the per-head [k_nope | v] split of kv_b_proj",
                true,
            );
            let probs_inputs: Vec<&str> = if keys.contains(&qs) {
                vec![&qs, &ks, &ix.module]
            } else {
                vec![&a.q_b, &a.kv_b, &a.kv_a, &ix.module]
            };
            add(
                &mut g,
                &probs,
                Float,
                li,
                &probs_inputs,
                "the softmax scale (qk_head_dim^-1/2) or the attention mask (causal ∩ indexer top-k)",
                true,
            );
            let o_inputs: Vec<&str> = if keys.contains(&probs) && keys.contains(&vs) {
                vec![&probs, &vs]
            } else {
                vec![&a.q_b, &a.kv_b, &a.kv_a, &ix.module]
            };
            add(
                &mut g,
                &a.o,
                Float,
                li,
                &o_inputs,
                "the attention core (RoPE, softmax scale, mask, head layout) or the o_proj weight",
                false,
            );
            add(
                &mut g,
                &a.module,
                Float,
                li,
                &[&a.o],
                "the attention output handed on (it should equal o_proj's)",
                false,
            );
            add(
                &mut g,
                &lp.post_norm,
                Float,
                li,
                &[&a.module, &prev],
                "the residual add (x + self_attn) or the post_attention_layernorm weight",
                false,
            );
            let mlp_module = lp.mlp.module.clone();
            match &lp.mlp.kind {
                MlpKind::Dense(p) => {
                    add(
                        &mut g,
                        &p.gate,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the mlp gate_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &p.act,
                        Float,
                        li,
                        &[&p.gate],
                        "the activation (SiLU)",
                        false,
                    );
                    add(
                        &mut g,
                        &p.up,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the mlp up_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &p.down,
                        Float,
                        li,
                        &[&p.act, &p.up],
                        "the mlp down_proj weight (or the gate·up product)",
                        false,
                    );
                    add(
                        &mut g,
                        &p.module,
                        Float,
                        li,
                        &[&p.down],
                        "the mlp output",
                        false,
                    );
                }
                MlpKind::Moe {
                    gate,
                    experts,
                    shared,
                } => {
                    let w1 = sub(gate, "1");
                    let i2 = sub(gate, "2");
                    let tw = sub(gate, conv::TOPK_WEIGHTS);
                    let ti = sub(gate, conv::TOPK_INDICES);
                    add(
                        &mut g,
                        gate,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the router weight (mlp.gate, kept in f32)",
                        false,
                    );
                    for (k, aux) in [(&w1, true), (&tw, false)] {
                        add(
                            &mut g,
                            k,
                            RouterWeights,
                            li,
                            &[gate],
                            "the routing weights (sigmoid of the logits, normalised, × routed_scaling_factor)",
                            aux,
                        );
                        g.router_of
                            .insert(k.clone(), (ti.clone(), tw.clone(), gate.clone()));
                    }
                    for (k, aux) in [(&i2, true), (&ti, false)] {
                        add(
                            &mut g,
                            k,
                            RouterIds,
                            li,
                            &[gate],
                            "expert selection (e_score_correction_bias, group-limited top-k)",
                            aux,
                        );
                        g.router_of
                            .insert(k.clone(), (ti.clone(), tw.clone(), gate.clone()));
                    }
                    let act = format!("{experts}.{}", conv::ACT);
                    for k in keys
                        .iter()
                        .filter(|k| k.as_str() == act || k.starts_with(&format!("{act}#")))
                    {
                        add(
                            &mut g,
                            k,
                            ExpertAct,
                            li,
                            &[&lp.post_norm, &ti],
                            "that routed expert's gate/up weights (w13 layout)",
                            true,
                        );
                    }
                    add(
                        &mut g,
                        experts,
                        Float,
                        li,
                        &[&lp.post_norm, &ti, &tw],
                        "the routed experts' weights (w13/w2 layout, expert order)",
                        false,
                    );
                    let s = shared;
                    add(
                        &mut g,
                        &s.gate,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the shared expert gate_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &s.act,
                        Float,
                        li,
                        &[&s.gate],
                        "the activation (SiLU)",
                        false,
                    );
                    add(
                        &mut g,
                        &s.up,
                        Float,
                        li,
                        &[&lp.post_norm],
                        "the shared expert up_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &s.down,
                        Float,
                        li,
                        &[&s.act, &s.up],
                        "the shared expert down_proj weight",
                        false,
                    );
                    add(
                        &mut g,
                        &s.module,
                        Float,
                        li,
                        &[&s.down],
                        "the shared expert output",
                        false,
                    );
                    add(
                        &mut g,
                        &mlp_module,
                        Float,
                        li,
                        &[experts, &s.module],
                        "the sum of routed and shared experts",
                        false,
                    );
                }
            }
            add(
                &mut g,
                &lp.layer,
                Float,
                li,
                &[&mlp_module, &lp.post_norm],
                "the residual add (h + mlp)",
                false,
            );
            prev = lp.layer.clone();
        }
        add(
            &mut g,
            &mp.norm,
            Float,
            None,
            &[&prev],
            "the final norm weight (output_norm)",
            false,
        );
        add(
            &mut g,
            &mp.model,
            Float,
            None,
            &[&mp.norm],
            "the model output handed on (it should equal model.norm's)",
            true,
        );
        add(
            &mut g,
            &mp.lm_head,
            Logits,
            None,
            &[&mp.norm],
            "the lm_head weight (output: vocab row order, vocab padding)",
            false,
        );
        add(
            &mut g,
            conv::LOGITS,
            Logits,
            None,
            &[&mp.lm_head],
            "the logits handed on (they should equal lm_head's)",
            true,
        );
        g
    }

    pub(crate) fn node(&self, key: &str) -> Node {
        self.nodes.get(key).cloned().unwrap_or(Node {
            role: Role::Float,
            layer: layer_of(key),
            inputs: Vec::new(),
            suspect: "this module".into(),
            aux: true,
        })
    }
}

/// `model.layers.3.self_attn.kv_b_proj` → `kv_b_proj`; tuple elements and extras keep their
/// parent (`self_attn.1`, `indexer.index_scores`).
pub fn short_name(key: &str) -> String {
    let mut parts = key.rsplitn(3, '.');
    let last = parts.next().unwrap_or(key);
    let parent = parts.next();
    let keep_parent = last.chars().all(|c| c.is_ascii_digit() || c == '#')
        || [
            conv::QUERY_STATES,
            conv::KEY_STATES,
            conv::VALUE_STATES,
            conv::K_ROT,
            conv::IDX_Q,
            conv::IDX_K,
            conv::IDX_HEAD_WEIGHTS,
            conv::IDX_SCORES,
            conv::TOPK_WEIGHTS,
            conv::TOPK_INDICES,
        ]
        .contains(&last)
        || last.starts_with(conv::ACT);
    match parent {
        Some(p) if keep_parent && !p.chars().all(|c| c.is_ascii_digit()) => format!("{p}.{last}"),
        Some(p) if keep_parent => key
            .rsplit_once(&format!(".{p}."))
            .map_or(key.to_string(), |_| format!("layer {p}.{last}")),
        _ => last.to_string(),
    }
}
