//! Parameter and module names for the model, all taken from the one name table
//! ([`crate::arch::glm_dsa::HF_TABLE`]): parameters are found by role (each table entry has its
//! own), and HF module paths are their parameter names with the last component stripped. The
//! only strings spelled here are capture conventions of the fixtures that name no tensor
//! (`rotary_emb`, `act_fn`, the recomputed extras, tuple suffixes).

use crate::arch::glm_dsa::{self, HfDef, Idx, Rebuild, Role};

use super::ModelError;

/// Model-side lookups of a parameter, by its role in the one name table.
impl Role {
    /// The table entry of this parameter (every role has exactly one).
    pub(crate) fn def(self) -> Result<&'static HfDef, ModelError> {
        glm_dsa::hf_def(self)
            .ok_or_else(|| ModelError::NameTable(format!("{self:?}: no table entry with its role")))
    }

    /// The concrete HF parameter name (`model.layers.3.self_attn.q_a_proj.weight`).
    pub(crate) fn name(self, layer: Option<usize>) -> Result<String, ModelError> {
        let def = self.def()?;
        if def.rebuild == Rebuild::ExpertSlice {
            return Err(ModelError::NameTable(format!(
                "{self:?} is a per-expert template; load it stacked"
            )));
        }
        let idx = Idx {
            layer,
            expert: None,
        };
        Ok(glm_dsa::name(def.hf, idx))
    }

    /// The HF module path owning this parameter (`model.layers.3.self_attn.q_a_proj`).
    pub(crate) fn module(self, layer: Option<usize>) -> Result<String, ModelError> {
        let def = self.def()?;
        let template = match def.hf.find(".{E}") {
            // A per-expert parameter: its module is the experts container.
            Some(at) => &def.hf[..at],
            None => parent(def.hf)?,
        };
        Ok(glm_dsa::name(
            template,
            Idx {
                layer,
                expert: None,
            },
        ))
    }
}

/// `a.b.c` → `a.b`.
pub(crate) fn parent(path: &str) -> Result<&str, ModelError> {
    path.rsplit_once('.')
        .map(|(p, _)| p)
        .ok_or_else(|| ModelError::NameTable(format!("`{path}` has no parent module")))
}

/// Capture conventions of the fixtures (transformers' module attribute names and the extra tensors
/// the fixture generator recomputes in its hooks). None of these is a tensor name.
pub(crate) mod conv {
    /// The rotary embedding module under `model` (outputs cos, `.1` sin).
    pub const ROTARY: &str = "rotary_emb";
    /// The activation submodule of an MLP / of the experts container.
    pub const ACT: &str = "act_fn";
    /// Router aliases for tuple elements 1 and 2.
    pub const TOPK_WEIGHTS: &str = "topk_weights";
    pub const TOPK_INDICES: &str = "topk_indices";
    /// Attention extras recomputed by the fixture hooks.
    pub const QUERY_STATES: &str = "query_states";
    pub const KEY_STATES: &str = "key_states";
    pub const VALUE_STATES: &str = "value_states";
    pub const K_ROT: &str = "k_rot";
    /// Indexer extras recomputed by the fixture hooks.
    pub const IDX_Q: &str = "q";
    pub const IDX_K: &str = "k";
    pub const IDX_HEAD_WEIGHTS: &str = "head_weights";
    pub const IDX_SCORES: &str = "index_scores";
    /// Root outputs.
    pub const LOGITS: &str = "logits";
    pub const INPUT_IDS: &str = "input_ids";
    pub const POSITION_IDS: &str = "position_ids";
}

/// The order a GLM-5 forward produces its captures in, for dumps that do not say (a hook dump
/// written without `execution_order`, whose keys would otherwise sort alphabetically: `mlp`
/// before `post_attention_layernorm` before `self_attn`, the experts before their router).
/// Checked against glmcheck's own capture order by tests/execution_order.rs.
pub(crate) mod order {
    /// Before the first decoder layer (prefixes).
    pub const ROOT_BEFORE: &[&str] = &[
        "input_ids",
        "position_ids",
        "model.embed_tokens",
        "model.rotary_emb",
    ];
    /// Inside `model.layers.N` (module paths relative to it and their sub-keys; "" is the
    /// layer's own output, last).
    pub const LAYER: &[&str] = &[
        "input_layernorm",
        "self_attn.q_a_proj",
        "self_attn.q_a_layernorm",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_a_layernorm",
        "self_attn.kv_b_proj",
        "self_attn.indexer.wq_b",
        "self_attn.indexer.wk",
        "self_attn.indexer.k_norm",
        "self_attn.indexer.q",
        "self_attn.indexer.k",
        "self_attn.indexer.weights_proj",
        "self_attn.indexer.head_weights",
        "self_attn.indexer.index_scores",
        "self_attn.indexer",
        "self_attn.query_states",
        "self_attn.key_states",
        "self_attn.value_states",
        "self_attn.k_rot",
        "self_attn.o_proj",
        "self_attn",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.act_fn",
        "mlp.up_proj",
        "mlp.down_proj",
        "mlp.gate",
        "mlp.gate.topk_weights",
        "mlp.gate.topk_indices",
        "mlp.experts.act_fn",
        "mlp.experts",
        "mlp.shared_experts.gate_proj",
        "mlp.shared_experts.act_fn",
        "mlp.shared_experts.up_proj",
        "mlp.shared_experts.down_proj",
        "mlp.shared_experts",
        "mlp",
        "",
    ];
    /// After the last decoder layer (exact keys, `model.norm` also as a prefix).
    pub const ROOT_AFTER: &[&str] = &["model.norm", "model", "lm_head", "logits"];

    /// The marks of `forward --profile`'s timeline: module outputs handed on as they are (no
    /// capture-only cast or gather), none of them an indexer's (wanting one would run the indexer
    /// where the timed forwards skip it) — inside a layer, and before / after the layers.
    pub const TIMELINE_LAYER: &[&str] = &[
        "input_layernorm",
        "self_attn.q_a_proj",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_b_proj",
        "self_attn.o_proj",
        "self_attn",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "mlp.gate",
        "mlp.experts",
        "mlp.shared_experts",
        "mlp",
        "",
    ];
    pub const TIMELINE_ROOT: &[&str] = &["model.embed_tokens", "model.norm", "lm_head"];

    /// Whether `key` is one of the timeline's marks.
    pub(crate) fn timeline_mark(key: &str) -> bool {
        TIMELINE_ROOT.contains(&key)
            || in_layer(key).is_some_and(|(_, within)| TIMELINE_LAYER.contains(&within))
    }

    /// `model.layers.N.rest` → (N, `rest`; "" for the layer's own output).
    fn in_layer(key: &str) -> Option<(usize, &str)> {
        let tail = key.strip_prefix("model.layers.")?;
        let (n, rest) = tail.split_once('.').unwrap_or((tail, ""));
        Some((n.parse().ok()?, rest))
    }

    /// A sort key in that order: (part, layer, position in the part). Keys outside it sort last.
    pub(crate) fn rank(key: &str) -> (usize, usize, usize) {
        let within = |rest: &str, e: &str| {
            rest == e
                || rest
                    .strip_prefix(e)
                    .is_some_and(|t| t.starts_with('.') || t.starts_with('#'))
        };
        if let Some((n, rest)) = in_layer(key) {
            // The longest listed path the key is (under): `mlp.gate.1` under `mlp.gate`.
            let best = LAYER
                .iter()
                .enumerate()
                .filter(|(_, e)| !e.is_empty() && within(rest, e))
                .max_by_key(|(_, e)| e.len())
                .map_or(LAYER.len() - 1, |(i, _)| i);
            return (1, n, best);
        }
        if let Some(i) = ROOT_BEFORE.iter().position(|e| within(key, e)) {
            return (0, 0, i);
        }
        if let Some(i) = ROOT_AFTER
            .iter()
            .position(|e| key == *e || (*e == "model.norm" && within(key, e)))
        {
            return (2, 0, i);
        }
        (3, 0, 0)
    }
}

/// Every HF module path one decoder layer captures under, resolved once at load.
#[derive(Debug, Clone)]
pub(crate) struct LayerPaths {
    /// `model.layers.N`
    pub layer: String,
    pub input_norm: String,
    pub post_norm: String,
    pub attn: AttnPaths,
    pub mlp: MlpPaths,
}

#[derive(Debug, Clone)]
pub(crate) struct AttnPaths {
    /// `model.layers.N.self_attn`
    pub module: String,
    pub q_a: String,
    pub q_a_norm: String,
    pub q_b: String,
    pub kv_a: String,
    pub kv_a_norm: String,
    pub kv_b: String,
    pub o: String,
    /// `model.layers.N.self_attn.2`: the indexer's top-k the attention hands on (its hook's third
    /// output)
    pub topk: String,
    pub indexer: IndexerPaths,
}

#[derive(Debug, Clone)]
pub(crate) struct IndexerPaths {
    /// `model.layers.N.self_attn.indexer`
    pub module: String,
    pub wq_b: String,
    pub wk: String,
    pub k_norm: String,
    pub weights_proj: String,
}

#[derive(Debug, Clone)]
pub(crate) struct MlpPaths {
    /// `model.layers.N.mlp`
    pub module: String,
    pub kind: MlpKind,
}

#[derive(Debug, Clone)]
pub(crate) enum MlpKind {
    Dense(SwiGluPaths),
    Moe {
        gate: String,
        experts: String,
        shared: SwiGluPaths,
    },
}

/// A gate/up/down MLP (the dense MLP, the shared experts).
#[derive(Debug, Clone)]
pub(crate) struct SwiGluPaths {
    pub module: String,
    pub gate: String,
    pub up: String,
    pub down: String,
    pub act: String,
}

impl SwiGluPaths {
    fn new(gate: Role, up: Role, down: Role, l: usize) -> Result<Self, ModelError> {
        let gate = gate.module(Some(l))?;
        let module = parent(&gate)?.to_string();
        Ok(SwiGluPaths {
            act: format!("{module}.{}", conv::ACT),
            up: up.module(Some(l))?,
            down: down.module(Some(l))?,
            gate,
            module,
        })
    }
}

impl LayerPaths {
    pub(crate) fn new(l: usize, moe: bool) -> Result<Self, ModelError> {
        let m = |p: Role| p.module(Some(l));
        let q_a = m(Role::AttnQA)?;
        let attn_module = parent(&q_a)?.to_string();
        let wq_b = m(Role::IndexerQB)?;
        let indexer_module = parent(&wq_b)?.to_string();
        let layer = parent(&attn_module)?.to_string();
        let kind = if moe {
            let gate = m(Role::Router)?;
            MlpKind::Moe {
                experts: m(Role::ExpertGate)?,
                shared: SwiGluPaths::new(Role::SharedGate, Role::SharedUp, Role::SharedDown, l)?,
                gate,
            }
        } else {
            MlpKind::Dense(SwiGluPaths::new(
                Role::FfnGate,
                Role::FfnUp,
                Role::FfnDown,
                l,
            )?)
        };
        let mlp_module = match &kind {
            MlpKind::Dense(p) => p.module.clone(),
            MlpKind::Moe { gate, .. } => parent(gate)?.to_string(),
        };
        Ok(LayerPaths {
            layer,
            input_norm: m(Role::InputNorm)?,
            post_norm: m(Role::PostAttnNorm)?,
            attn: AttnPaths {
                topk: sub(&attn_module, "2"),
                module: attn_module,
                q_a,
                q_a_norm: m(Role::QANorm)?,
                q_b: m(Role::AttnQB)?,
                kv_a: m(Role::AttnKvA)?,
                kv_a_norm: m(Role::KvANorm)?,
                kv_b: m(Role::AttnKvB)?,
                o: m(Role::AttnOut)?,
                indexer: IndexerPaths {
                    module: indexer_module,
                    wq_b,
                    wk: m(Role::IndexerK)?,
                    k_norm: m(Role::IndexerKNorm)?,
                    weights_proj: m(Role::IndexerWeights)?,
                },
            },
            mlp: MlpPaths {
                module: mlp_module,
                kind,
            },
        })
    }
}

/// Paths outside the layers.
#[derive(Debug, Clone)]
pub(crate) struct ModelPaths {
    /// `model`
    pub model: String,
    pub embed: String,
    pub rotary: String,
    pub norm: String,
    pub lm_head: String,
}

impl ModelPaths {
    pub(crate) fn new() -> Result<Self, ModelError> {
        let embed = Role::Embedding.module(None)?;
        let model = parent(&embed)?.to_string();
        Ok(ModelPaths {
            rotary: format!("{model}.{}", conv::ROTARY),
            norm: Role::FinalNorm.module(None)?,
            lm_head: Role::LmHead.module(None)?,
            embed,
            model,
        })
    }
}

/// `path.suffix`.
pub(crate) fn sub(path: &str, suffix: &str) -> String {
    format!("{path}.{suffix}")
}

/// The fixtures' key for the `n`-th call of a module called more than once (`path`, `path#1`, …).
pub(crate) fn nth_call(path: &str, n: usize) -> String {
    if n == 0 {
        path.to_string()
    } else {
        format!("{path}#{n}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_param_resolves_to_one_entry() {
        let all = [
            Role::Embedding,
            Role::FinalNorm,
            Role::LmHead,
            Role::InputNorm,
            Role::PostAttnNorm,
            Role::AttnQA,
            Role::QANorm,
            Role::AttnQB,
            Role::AttnKvA,
            Role::KvANorm,
            Role::AttnKvB,
            Role::AttnOut,
            Role::IndexerQB,
            Role::IndexerK,
            Role::IndexerKNorm,
            Role::IndexerKNormBias,
            Role::IndexerWeights,
            Role::FfnGate,
            Role::FfnUp,
            Role::FfnDown,
            Role::Router,
            Role::RouterBias,
            Role::ExpertGate,
            Role::ExpertUp,
            Role::ExpertDown,
            Role::SharedGate,
            Role::SharedUp,
            Role::SharedDown,
        ];
        let mut seen = std::collections::HashSet::new();
        for p in all {
            let d = p.def().expect("resolves");
            assert!(seen.insert(d.hf), "{p:?} shares {} with another", d.hf);
        }
        // Every table entry is used by the model.
        assert_eq!(seen.len(), glm_dsa::HF_TABLE.len());
    }

    #[test]
    fn timeline_marks_are_captures_and_none_is_an_indexers() {
        for e in order::LAYER {
            let key = if e.is_empty() {
                "model.layers.4".to_string()
            } else {
                format!("model.layers.4.{e}")
            };
            let want = order::TIMELINE_LAYER.contains(e);
            assert_eq!(order::timeline_mark(&key), want, "{key}");
            // Wanting an indexer output would run the indexer the timed forward skips.
            assert!(!(want && e.contains("indexer")), "{key}");
        }
        // Every mark is a capture point of the forward.
        assert!(order::TIMELINE_LAYER
            .iter()
            .all(|e| order::LAYER.contains(e)));
        let root = |k: &&str| order::ROOT_BEFORE.contains(k) || order::ROOT_AFTER.contains(k);
        assert!(order::TIMELINE_ROOT.iter().all(root));
        for k in [
            "model.layers.x.mlp",
            "model.layers.2.mlp.experts.act_fn",
            "logits",
            "model",
        ] {
            assert!(!order::timeline_mark(k), "{k}");
        }
    }

    #[test]
    fn module_paths_follow_the_hf_layout() {
        let p = LayerPaths::new(1, true).expect("paths");
        assert_eq!(p.layer, "model.layers.1");
        assert_eq!(p.attn.module, "model.layers.1.self_attn");
        assert_eq!(p.attn.indexer.module, "model.layers.1.self_attn.indexer");
        assert_eq!(p.input_norm, "model.layers.1.input_layernorm");
        assert_eq!(p.post_norm, "model.layers.1.post_attention_layernorm");
        assert_eq!(p.mlp.module, "model.layers.1.mlp");
        match &p.mlp.kind {
            MlpKind::Moe {
                gate,
                experts,
                shared,
            } => {
                assert_eq!(gate, "model.layers.1.mlp.gate");
                assert_eq!(experts, "model.layers.1.mlp.experts");
                assert_eq!(shared.module, "model.layers.1.mlp.shared_experts");
                assert_eq!(shared.act, "model.layers.1.mlp.shared_experts.act_fn");
            }
            MlpKind::Dense(_) => panic!("layer 1 is MoE here"),
        }
        let m = ModelPaths::new().expect("paths");
        assert_eq!(m.model, "model");
        assert_eq!(m.rotary, "model.rotary_emb");
        assert_eq!(m.norm, "model.norm");
        assert_eq!(m.lm_head, "lm_head");
    }
}
