//! Behaviour faults injected into a built model ([`Glm5::inject`]): every weight stays right and
//! the chosen layers compute what a buggy loader or kernel computes. Each fault changes one
//! module's setting, so the faulted forward is the same code as the correct one.

use candle_core::DType;

use super::layer::FeedForward;
use super::moe::Gating;
use super::ops::RopeLayout;
use super::{Glm5, ModelError};
use crate::faults::Behaviour;

impl Glm5 {
    /// Whether a behaviour fault was injected ([`Glm5::inject`]).
    pub fn injected(&self) -> bool {
        self.loaded_facts.is_some()
    }

    /// What the behaviour signatures need to know about this model (rank 0's routers), as loaded:
    /// before any [`Glm5::inject`] changed them.
    pub fn facts(&self) -> Result<crate::compare::ModelFacts, ModelError> {
        if let Some(f) = &self.loaded_facts {
            return Ok(f.clone());
        }
        let c = self.config();
        let mut biases = std::collections::BTreeMap::new();
        for (l, layer) in self.layers().iter().enumerate() {
            if let FeedForward::Moe(m) = &layer.ffn {
                let b = m
                    .router
                    .bias
                    .to_dtype(DType::F32)
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(at(l))?;
                biases.insert(l, b);
            }
        }
        Ok(crate::compare::ModelFacts {
            top_k: c.num_experts_per_tok,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor,
            qk_head_dim: c.qk_head_dim(),
            kv_lora_rank: c.kv_lora_rank,
            qk_rope_head_dim: c.qk_rope_head_dim,
            index_topk: c.index_topk,
            dsa_dense: self.dsa_mode() == super::DsaMode::Dense,
            biases,
        })
    }

    /// Applies `b` to `layers` (None: every layer it can change) on every rank. A layer it cannot
    /// change (a router fault on a dense layer) is an error when named, skipped otherwise; a fault
    /// that changes no layer at all is an error.
    pub fn inject(&mut self, b: Behaviour, layers: Option<&[usize]>) -> Result<(), ModelError> {
        let n = self.config().num_hidden_layers;
        if b == Behaviour::Fp16Compute {
            // The compute dtype is chosen when the model is built (every weight converted).
            if layers.is_some() || self.options().dtype != DType::F16 {
                return Err(ModelError::Unsupported(
                    "fp16-compute is the whole forward's compute dtype: build the model in f16, \
                     on every layer (forward --fault fp16-compute does)"
                        .into(),
                ));
            }
            if self.loaded_facts.is_none() {
                self.loaded_facts = Some(self.facts()?);
            }
            return Ok(());
        }
        if let Some(bad) = layers.and_then(|ls| ls.iter().find(|&&l| l >= n)) {
            return Err(ModelError::Unsupported(format!(
                "layer {bad}: the model has {n} layers (0..{})",
                n.saturating_sub(1)
            )));
        }
        if self.loaded_facts.is_none() {
            self.loaded_facts = Some(self.facts()?);
        }
        let c = self.config().clone();
        let mut changed = 0;
        for rank in &mut self.ranks {
            changed = 0;
            for (l, layer) in rank.layers.iter_mut().enumerate() {
                let named = layers.is_some_and(|ls| ls.contains(&l));
                if layers.is_some() && !named {
                    continue;
                }
                let attn = &mut layer.attn;
                let router = match &mut layer.ffn {
                    FeedForward::Moe(m) => Some(&mut m.router),
                    FeedForward::Dense(_) => None,
                };
                let done = match (b, router) {
                    (Behaviour::DsaDense, _) => {
                        attn.force_dense = true;
                        true
                    }
                    (Behaviour::IndexerRopeNeox, _) => {
                        attn.indexer.rope_layout = RopeLayout::HalfSplit;
                        true
                    }
                    (Behaviour::MlaRopeNeox, _) => {
                        attn.rope_layout = RopeLayout::HalfSplit;
                        true
                    }
                    (Behaviour::Fp16Compute, _) => true,
                    (Behaviour::MlaScaleLatent, _) => {
                        attn.scale = ((c.kv_lora_rank + c.qk_rope_head_dim) as f64).powf(-0.5);
                        true
                    }
                    (_, None) => false,
                    (Behaviour::RouterSoftmax, Some(r)) => {
                        r.gating = Gating::Softmax;
                        true
                    }
                    (Behaviour::RouterNoBias, Some(r)) => {
                        r.bias = r.bias.zeros_like().map_err(at(l))?;
                        true
                    }
                    (Behaviour::BiasBf16, Some(r)) => {
                        r.bias = r
                            .bias
                            .to_dtype(DType::BF16)
                            .and_then(|t| t.to_dtype(DType::F32))
                            .map_err(at(l))?;
                        true
                    }
                    (Behaviour::NoNormTopk, Some(r)) => {
                        r.norm_topk_prob = false;
                        true
                    }
                    (Behaviour::RoutedScaleMissing, Some(r)) => {
                        r.routed_scaling_factor = 1.0;
                        true
                    }
                };
                if !done && named {
                    return Err(ModelError::Unsupported(format!(
                        "layer {l} has no router (a dense layer): this fault changes nothing there"
                    )));
                }
                changed += usize::from(done);
            }
        }
        if changed == 0 {
            return Err(ModelError::Unsupported(
                "the fault changes no layer of this model (no MoE layer)".into(),
            ));
        }
        Ok(())
    }
}

fn at(l: usize) -> impl FnOnce(candle_core::Error) -> ModelError {
    move |source| ModelError::Candle {
        module: format!("model.layers.{l}.mlp.gate"),
        source,
    }
}
