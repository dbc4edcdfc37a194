//! GLM-5's dataflow: what each captured key is and which keys it is computed from.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::io::{Act, Activations};
use crate::model::names::{conv, LayerPaths, MlpKind, ModelPaths};

/// What kind of value a key holds; decides how it is compared and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueKind {
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

/// A module (or capture) of GLM-5's dataflow, as the comparison knows it: what decides which
/// inputs it has and what to suspect when it is the first to diverge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Module {
    InputIds,
    PositionIds,
    Embed,
    /// The RoPE tables: `rotary_emb` (cos) and `rotary_emb.1` (sin).
    Rotary,
    RotarySin,
    InputNorm,
    QA,
    QANorm,
    QB,
    KvA,
    KvANorm,
    KvB,
    IdxWqB,
    IdxWk,
    IdxKNorm,
    IdxWeightsProj,
    IdxQ,
    IdxK,
    IdxHeadWeights,
    IdxScores,
    /// The indexer's top-k ids, and the copies the attention (`self_attn.2`) and the layer
    /// (`layers.L.1`) hand on.
    IdxTopk,
    AttnTopk,
    LayerTopk,
    KRot,
    QueryStates,
    KeyStates,
    ValueStates,
    /// The attention probabilities (`self_attn.1`).
    Probs,
    OProj,
    Attn,
    PostNorm,
    MlpGate,
    MlpAct,
    MlpUp,
    MlpDown,
    Mlp,
    /// The router's logits (`mlp.gate`), its tuple elements (`gate.1` weights, `gate.2` ids) and
    /// the recomputed `topk_weights` / `topk_indices`.
    Router,
    RouterWeights,
    TopkWeights,
    RouterIds,
    TopkIndices,
    ExpertAct,
    Experts,
    SharedGate,
    SharedAct,
    SharedUp,
    SharedDown,
    Shared,
    Moe,
    Layer,
    FinalNorm,
    ModelOut,
    LmHead,
    Logits,
    /// The previous layer's output (the embedding before layer 0): an input only.
    Prev,
    /// A key the table does not know.
    Unknown,
}

/// Where a row of [`TABLE`] sits: once before the layers, in every layer, once after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Model,
    Layer,
    Output,
}

/// One choice of inputs: taken when every key in `when` is in a dump and every input exists in this
/// layer (a dense layer has no `Moe`); the first such wins.
#[derive(Clone, Copy)]
pub(crate) struct Alt {
    when: &'static [Module],
    inputs: &'static [Module],
}

/// One row of the dataflow table.
pub(crate) struct Row {
    module: Module,
    scope: Scope,
    role: ValueKind,
    aux: bool,
    inputs: &'static [Alt],
}

const fn row(
    module: Module,
    scope: Scope,
    role: ValueKind,
    aux: bool,
    inputs: &'static [Alt],
) -> Row {
    Row {
        module,
        scope,
        role,
        aux,
        inputs,
    }
}

const fn from(inputs: &'static [Module]) -> Alt {
    Alt { when: &[], inputs }
}

const fn when(when: &'static [Module], inputs: &'static [Module]) -> Alt {
    Alt { when, inputs }
}

use Module as M;
use Scope::{Layer as L, Model as G, Output as O};
use ValueKind::{
    ExpertAct, Float, IndexerIds, IndexerScores, InputIds, Logits, RouterIds, RouterWeights,
};

/// Index scores from the indexer's q, k and head weights when a dump holds them, else from the
/// projections they come from.
const SCORE_INPUTS: [Alt; 2] = [
    when(&[M::IdxQ], &[M::IdxQ, M::IdxK, M::IdxHeadWeights]),
    from(&[M::IdxWqB, M::IdxKNorm, M::IdxWeightsProj]),
];
/// The attention core's inputs when its intermediate states are not captured.
const ATTN_INPUTS: &[Module] = &[M::QB, M::KvB, M::KvA, M::IdxTopk];

/// GLM-5's dataflow: every module the comparison knows, with its role and its inputs, in
/// execution order.
#[rustfmt::skip]
pub(crate) const TABLE: &[Row] = &[
    row(M::InputIds, G, InputIds, true, &[]),
    row(M::PositionIds, G, InputIds, true, &[]),
    row(M::Embed, G, Float, false, &[from(&[M::InputIds])]),
    row(M::Rotary, G, Float, true, &[from(&[M::PositionIds])]),
    row(M::RotarySin, G, Float, true, &[from(&[M::PositionIds])]),
    row(M::InputNorm, L, Float, false, &[from(&[M::Prev])]),
    row(M::QA, L, Float, false, &[from(&[M::InputNorm])]),
    row(M::QANorm, L, Float, false, &[from(&[M::QA])]),
    row(M::QB, L, Float, false, &[from(&[M::QANorm])]),
    row(M::KvA, L, Float, false, &[from(&[M::InputNorm])]),
    row(M::KvANorm, L, Float, false, &[from(&[M::KvA])]),
    row(M::KvB, L, Float, false, &[from(&[M::KvANorm])]),
    row(M::IdxWqB, L, Float, false, &[from(&[M::QANorm])]),
    row(M::IdxWk, L, Float, false, &[from(&[M::InputNorm])]),
    row(M::IdxKNorm, L, Float, false, &[from(&[M::IdxWk])]),
    row(M::IdxWeightsProj, L, Float, false, &[from(&[M::InputNorm])]),
    row(M::IdxQ, L, Float, true, &[from(&[M::IdxWqB])]),
    row(M::IdxK, L, Float, true, &[from(&[M::IdxKNorm])]),
    row(M::IdxHeadWeights, L, Float, true, &[from(&[M::IdxWeightsProj])]),
    row(M::IdxScores, L, IndexerScores, true, &SCORE_INPUTS),
    row(M::IdxTopk, L, IndexerIds, false, &[when(&[M::IdxScores], &[M::IdxScores]), SCORE_INPUTS[0], SCORE_INPUTS[1]]),
    row(M::AttnTopk, L, IndexerIds, true, &[from(&[M::IdxTopk])]),
    row(M::LayerTopk, L, IndexerIds, true, &[from(&[M::IdxTopk])]),
    row(M::KRot, L, Float, true, &[from(&[M::KvA])]),
    row(M::QueryStates, L, Float, true, &[from(&[M::QB])]),
    row(M::KeyStates, L, Float, true, &[from(&[M::KvB, M::KRot])]),
    row(M::ValueStates, L, Float, true, &[from(&[M::KvB])]),
    row(M::Probs, L, Float, true, &[when(&[M::QueryStates], &[M::QueryStates, M::KeyStates, M::IdxTopk]), from(ATTN_INPUTS)]),
    row(M::OProj, L, Float, false, &[when(&[M::Probs, M::ValueStates], &[M::Probs, M::ValueStates]), from(ATTN_INPUTS)]),
    row(M::Attn, L, Float, false, &[from(&[M::OProj])]),
    row(M::PostNorm, L, Float, false, &[from(&[M::Attn, M::Prev])]),
    row(M::MlpGate, L, Float, false, &[from(&[M::PostNorm])]),
    row(M::MlpAct, L, Float, false, &[from(&[M::MlpGate])]),
    row(M::MlpUp, L, Float, false, &[from(&[M::PostNorm])]),
    row(M::MlpDown, L, Float, false, &[from(&[M::MlpAct, M::MlpUp])]),
    row(M::Mlp, L, Float, false, &[from(&[M::MlpDown])]),
    row(M::Router, L, Float, false, &[from(&[M::PostNorm])]),
    row(M::RouterWeights, L, RouterWeights, true, &[from(&[M::Router])]),
    row(M::TopkWeights, L, RouterWeights, false, &[from(&[M::Router])]),
    row(M::RouterIds, L, RouterIds, true, &[from(&[M::Router])]),
    row(M::TopkIndices, L, RouterIds, false, &[from(&[M::Router])]),
    row(M::ExpertAct, L, ExpertAct, true, &[from(&[M::PostNorm, M::TopkIndices])]),
    row(M::Experts, L, Float, false, &[from(&[M::PostNorm, M::TopkIndices, M::TopkWeights])]),
    row(M::SharedGate, L, Float, false, &[from(&[M::PostNorm])]),
    row(M::SharedAct, L, Float, false, &[from(&[M::SharedGate])]),
    row(M::SharedUp, L, Float, false, &[from(&[M::PostNorm])]),
    row(M::SharedDown, L, Float, false, &[from(&[M::SharedAct, M::SharedUp])]),
    row(M::Shared, L, Float, false, &[from(&[M::SharedDown])]),
    row(M::Moe, L, Float, false, &[from(&[M::Experts, M::Shared])]),
    row(M::Layer, L, Float, false, &[from(&[M::Mlp, M::PostNorm]), from(&[M::Moe, M::PostNorm])]),
    row(M::FinalNorm, O, Float, false, &[from(&[M::Prev])]),
    row(M::ModelOut, O, Float, true, &[from(&[M::FinalNorm])]),
    row(M::LmHead, O, Logits, false, &[from(&[M::FinalNorm])]),
    row(M::Logits, O, Logits, true, &[from(&[M::LmHead])]),
];

/// The key of a model-level module.
fn model_path(mp: &ModelPaths, m: Module) -> Option<String> {
    Some(match m {
        M::InputIds => conv::INPUT_IDS.to_string(),
        M::PositionIds => conv::POSITION_IDS.to_string(),
        M::Embed => mp.embed.clone(),
        M::Rotary => mp.rotary.clone(),
        M::RotarySin => format!("{}.1", mp.rotary),
        M::FinalNorm => mp.norm.clone(),
        M::ModelOut => mp.model.clone(),
        M::LmHead => mp.lm_head.clone(),
        M::Logits => conv::LOGITS.to_string(),
        _ => return None,
    })
}

/// The key of a module of one layer, from the model's own capture paths; `None` for modules this
/// layer does not have (a router in a dense layer).
fn layer_path(lp: &LayerPaths, m: Module) -> Option<String> {
    let (a, ix) = (&lp.attn, &lp.attn.indexer);
    let sub = |p: &str, s: &str| format!("{p}.{s}");
    let common = match m {
        M::InputNorm => Some(lp.input_norm.clone()),
        M::QA => Some(a.q_a.clone()),
        M::QANorm => Some(a.q_a_norm.clone()),
        M::QB => Some(a.q_b.clone()),
        M::KvA => Some(a.kv_a.clone()),
        M::KvANorm => Some(a.kv_a_norm.clone()),
        M::KvB => Some(a.kv_b.clone()),
        M::IdxWqB => Some(ix.wq_b.clone()),
        M::IdxWk => Some(ix.wk.clone()),
        M::IdxKNorm => Some(ix.k_norm.clone()),
        M::IdxWeightsProj => Some(ix.weights_proj.clone()),
        M::IdxQ => Some(sub(&ix.module, conv::IDX_Q)),
        M::IdxK => Some(sub(&ix.module, conv::IDX_K)),
        M::IdxHeadWeights => Some(sub(&ix.module, conv::IDX_HEAD_WEIGHTS)),
        M::IdxScores => Some(sub(&ix.module, conv::IDX_SCORES)),
        M::IdxTopk => Some(ix.module.clone()),
        M::AttnTopk => Some(sub(&a.module, "2")),
        M::LayerTopk => Some(sub(&lp.layer, "1")),
        M::KRot => Some(sub(&a.module, conv::K_ROT)),
        M::QueryStates => Some(sub(&a.module, conv::QUERY_STATES)),
        M::KeyStates => Some(sub(&a.module, conv::KEY_STATES)),
        M::ValueStates => Some(sub(&a.module, conv::VALUE_STATES)),
        M::Probs => Some(sub(&a.module, "1")),
        M::OProj => Some(a.o.clone()),
        M::Attn => Some(a.module.clone()),
        M::PostNorm => Some(lp.post_norm.clone()),
        M::Layer => Some(lp.layer.clone()),
        _ => None,
    };
    if common.is_some() {
        return common;
    }
    match &lp.mlp.kind {
        MlpKind::Dense(p) => match m {
            M::MlpGate => Some(p.gate.clone()),
            M::MlpAct => Some(p.act.clone()),
            M::MlpUp => Some(p.up.clone()),
            M::MlpDown => Some(p.down.clone()),
            M::Mlp => Some(p.module.clone()),
            _ => None,
        },
        MlpKind::Moe {
            gate,
            experts,
            shared,
        } => match m {
            M::Router => Some(gate.clone()),
            M::RouterWeights => Some(sub(gate, "1")),
            M::TopkWeights => Some(sub(gate, conv::TOPK_WEIGHTS)),
            M::RouterIds => Some(sub(gate, "2")),
            M::TopkIndices => Some(sub(gate, conv::TOPK_INDICES)),
            M::ExpertAct => Some(sub(experts, conv::ACT)),
            M::Experts => Some(experts.clone()),
            M::SharedGate => Some(shared.gate.clone()),
            M::SharedAct => Some(shared.act.clone()),
            M::SharedUp => Some(shared.up.clone()),
            M::SharedDown => Some(shared.down.clone()),
            M::Shared => Some(shared.module.clone()),
            M::Moe => Some(lp.mlp.module.clone()),
            _ => None,
        },
    }
}

/// One key of the dataflow.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) module: Module,
    pub(crate) role: ValueKind,
    pub(crate) layer: Option<usize>,
    pub(crate) inputs: Vec<String>,
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

/// The graph over the keys of both dumps: [`TABLE`]'s rows placed on the model's capture paths.
pub(crate) struct Graph {
    pub(crate) nodes: HashMap<String, Node>,
    /// Each module's key, by (layer, module).
    paths: HashMap<(Option<usize>, Module), String>,
}

impl Graph {
    pub(crate) fn new(keys: &BTreeSet<String>) -> Self {
        let mut g = Graph {
            nodes: HashMap::new(),
            paths: HashMap::new(),
        };
        let Ok(mp) = ModelPaths::new() else { return g };
        let layers: BTreeSet<usize> = keys.iter().filter_map(|k| layer_of(k)).collect();
        let mut prev = mp.embed.clone();
        let model_rows = TABLE.iter().filter(|r| r.scope == Scope::Model);
        g.place(model_rows, None, &|m| model_path(&mp, m), &prev, keys);
        for &l in &layers {
            let moe = LayerPaths::new(l, true)
                .ok()
                .and_then(|p| match p.mlp.kind {
                    MlpKind::Moe { gate, .. } => Some(gate),
                    MlpKind::Dense(_) => None,
                })
                .is_some_and(|gate| {
                    keys.iter()
                        .any(|k| k == &gate || k.starts_with(&format!("{gate}.")))
                });
            let Ok(lp) = LayerPaths::new(l, moe) else {
                continue;
            };
            let rows = TABLE.iter().filter(|r| r.scope == Scope::Layer);
            g.place(rows, Some(l), &|m| layer_path(&lp, m), &prev, keys);
            prev = lp.layer.clone();
        }
        let rows = TABLE.iter().filter(|r| r.scope == Scope::Output);
        g.place(rows, None, &|m| model_path(&mp, m), &prev, keys);
        g
    }

    /// Adds `rows` at `layer`, each at the key `path` gives (rows without one are not in this
    /// layer: a dense layer has no router). `prev` is the previous layer's output.
    fn place<'t>(
        &mut self,
        rows: impl Iterator<Item = &'t Row> + Clone,
        layer: Option<usize>,
        path: &dyn Fn(Module) -> Option<String>,
        prev: &str,
        keys: &BTreeSet<String>,
    ) {
        for r in rows.clone() {
            if let Some(p) = path(r.module) {
                self.paths.insert((layer, r.module), p);
            }
        }
        let key_of = |m: Module| match m {
            Module::Prev => Some(prev.to_string()),
            _ => self.paths.get(&(layer, m)).cloned(),
        };
        let mut added = Vec::new();
        for r in rows {
            let Some(p) = key_of(r.module) else { continue };
            let alt = r
                .inputs
                .iter()
                .find(|a| {
                    a.inputs.iter().all(|&m| key_of(m).is_some())
                        && a.when
                            .iter()
                            .all(|&m| key_of(m).is_some_and(|k| keys.contains(&k)))
                })
                .map_or(&[][..], |a| a.inputs);
            let inputs: Vec<String> = alt.iter().filter_map(|&m| key_of(m)).collect();
            let targets: Vec<String> = if r.module == Module::ExpertAct {
                // One key per call of the routed experts' activation: `act_fn`, `act_fn#1`, …
                keys.iter()
                    .filter(|k| **k == p || k.starts_with(&format!("{p}#")))
                    .cloned()
                    .collect()
            } else {
                vec![p]
            };
            for k in targets {
                added.push((
                    k,
                    Node {
                        module: r.module,
                        role: r.role,
                        layer,
                        inputs: inputs.clone(),
                        aux: r.aux,
                    },
                ));
            }
        }
        self.nodes.extend(added);
    }

    pub(crate) fn node(&self, key: &str) -> Node {
        self.nodes.get(key).cloned().unwrap_or(Node {
            module: Module::Unknown,
            role: ValueKind::Float,
            layer: layer_of(key),
            inputs: Vec::new(),
            aux: true,
        })
    }

    /// The lm_head's key.
    pub(crate) fn lm_head(&self) -> Option<&str> {
        self.paths.get(&(None, Module::LmHead)).map(String::as_str)
    }

    /// An indexer's own top-k (not a copy handed on).
    pub(crate) fn is_indexer(&self, key: &str) -> bool {
        let n = self.node(key);
        n.role == ValueKind::IndexerIds && !n.aux
    }

    /// The key of `module` in the layer of `key`.
    fn sibling(&self, key: &str, module: Module) -> Option<&String> {
        let layer = self.nodes.get(key)?.layer;
        self.paths.get(&(layer, module))
    }

    /// The index-scores key of an indexer ids key (the indexer's own, or a copy handed on).
    pub(crate) fn scores_of(&self, key: &str) -> Option<&String> {
        let m = self.nodes.get(key)?.module;
        matches!(m, Module::IdxTopk | Module::AttnTopk | Module::LayerTopk)
            .then(|| self.sibling(key, Module::IdxScores))
            .flatten()
    }

    /// The router (logits) key of a router ids or weights key.
    pub(crate) fn router_of(&self, key: &str) -> Option<&String> {
        let m = self.nodes.get(key)?.module;
        matches!(
            m,
            Module::RouterWeights | Module::TopkWeights | Module::RouterIds | Module::TopkIndices
        )
        .then(|| self.sibling(key, Module::Router))
        .flatten()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> BTreeSet<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn inputs(g: &Graph, key: &str) -> Vec<String> {
        g.node(key).inputs
    }

    #[test]
    fn attention_edges_follow_the_model_paths() {
        let l0 = LayerPaths::new(0, false).expect("paths");
        let l1 = LayerPaths::new(1, false).expect("paths");
        let (a, ix) = (&l1.attn, &l1.attn.indexer);
        let g = Graph::new(&keys(&[&l0.layer, &a.q_b, &ix.module]));
        assert_eq!(inputs(&g, &a.q_b), vec![a.q_a_norm.clone()]);
        assert_eq!(inputs(&g, &a.q_a_norm), vec![a.q_a.clone()]);
        assert_eq!(inputs(&g, &a.kv_b), vec![a.kv_a_norm.clone()]);
        // Layer 1 starts from layer 0's output.
        assert_eq!(inputs(&g, &l1.input_norm), vec![l0.layer.clone()]);
        assert_eq!(
            inputs(&g, &l1.post_norm),
            vec![a.module.clone(), l0.layer.clone()]
        );
        let n = g.node(&a.q_b);
        assert_eq!(
            (n.module, n.role, n.layer, n.aux),
            (Module::QB, ValueKind::Float, Some(1), false)
        );
        // Neither index scores nor q/k captured: the top-k is computed from the projections.
        assert_eq!(
            inputs(&g, &ix.module),
            vec![ix.wq_b.clone(), ix.k_norm.clone(), ix.weights_proj.clone()]
        );
        // The attention's own top-k copy points back at the indexer's scores.
        let scores = format!("{}.{}", ix.module, conv::IDX_SCORES);
        assert_eq!(g.scores_of(&format!("{}.2", a.module)), Some(&scores));
        assert!(g.is_indexer(&ix.module) && !g.is_indexer(&format!("{}.2", a.module)));
    }

    #[test]
    fn captured_intermediates_become_the_inputs() {
        let lp = LayerPaths::new(0, false).expect("paths");
        let (a, ix) = (&lp.attn, &lp.attn.indexer);
        let sub = |p: &str, s: &str| format!("{p}.{s}");
        let scores = sub(&ix.module, conv::IDX_SCORES);
        let (probs, v) = (sub(&a.module, "1"), sub(&a.module, conv::VALUE_STATES));
        let g = Graph::new(&keys(&[&ix.module, &scores, &probs, &v]));
        assert_eq!(inputs(&g, &ix.module), vec![scores.clone()]);
        assert_eq!(inputs(&g, &a.o), vec![probs.clone(), v.clone()]);
        assert_eq!(g.node(&scores).role, ValueKind::IndexerScores);
        // Without the value states o_proj reads from the projections and the indexer.
        let g = Graph::new(&keys(&[&ix.module, &probs]));
        assert_eq!(
            inputs(&g, &a.o),
            vec![
                a.q_b.clone(),
                a.kv_b.clone(),
                a.kv_a.clone(),
                ix.module.clone()
            ]
        );
    }

    #[test]
    fn moe_layers_have_a_router_and_experts() {
        let lp = LayerPaths::new(3, true).expect("paths");
        let MlpKind::Moe {
            gate,
            experts,
            shared,
        } = &lp.mlp.kind
        else {
            panic!("a MoE layer");
        };
        let act2 = format!("{experts}.{}#2", conv::ACT);
        let ids = format!("{gate}.{}", conv::TOPK_INDICES);
        let g = Graph::new(&keys(&[gate, &act2]));
        assert_eq!(g.node(&act2).role, ValueKind::ExpertAct);
        assert_eq!(inputs(&g, &act2), vec![lp.post_norm.clone(), ids.clone()]);
        assert_eq!(g.node(&ids).role, ValueKind::RouterIds);
        assert_eq!(g.router_of(&format!("{gate}.1")), Some(gate));
        assert_eq!(
            inputs(&g, &lp.mlp.module),
            vec![experts.clone(), shared.module.clone()]
        );
        assert_eq!(
            inputs(&g, &lp.layer),
            vec![lp.mlp.module.clone(), lp.post_norm.clone()]
        );
        // An unknown key is a float module with no inputs.
        let n = g.node("model.layers.3.something_new");
        assert_eq!((n.module, n.layer, n.aux), (Module::Unknown, Some(3), true));
        assert!(n.inputs.is_empty());
    }

    #[test]
    fn the_output_follows_the_last_layer() {
        let mp = ModelPaths::new().expect("paths");
        let l2 = LayerPaths::new(2, false).expect("paths");
        let g = Graph::new(&keys(&[&l2.layer]));
        assert_eq!(inputs(&g, &mp.norm), vec![l2.layer.clone()]);
        assert_eq!(inputs(&g, &mp.lm_head), vec![mp.norm.clone()]);
        assert_eq!(g.node(conv::LOGITS).role, ValueKind::Logits);
        assert_eq!(g.lm_head(), Some(mp.lm_head.as_str()));
        assert_eq!(inputs(&g, &mp.embed), vec![conv::INPUT_IDS.to_string()]);
    }

    #[test]
    fn short_names() {
        assert_eq!(
            short_name("model.layers.3.self_attn.kv_b_proj"),
            "kv_b_proj"
        );
        assert_eq!(short_name("model.layers.3.self_attn.1"), "self_attn.1");
        assert_eq!(
            short_name("model.layers.3.self_attn.indexer.index_scores"),
            "indexer.index_scores"
        );
        assert_eq!(short_name("model.layers.3.1"), "layer 3.1");
    }
}
