//! Logical Hugging Face tensors rebuilt from a GGUF, and vLLM's fused views built from them.
//!
//! The kv_b_proj rebuild lives here, once. Tensors come out as f32 candle tensors in PyTorch
//! (outermost-first) shape order on the requested device.

use candle_core::{Device, Tensor};

use crate::arch::glm_dsa::{self, HfDef, Idx, Rebuild};
use crate::arch::Config;
use crate::gguf::{DequantError, GgufModel};

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("{param}: GGUF tensor `{tensor}` is missing")]
    Missing { param: String, tensor: String },
    #[error("{param}: GGUF tensor `{tensor}` has shape {found:?}, expected {expected:?} (PyTorch order)")]
    Shape {
        param: String,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("`{0}` is not a parameter of GlmMoeDsaForCausalLM under this config")]
    Unknown(String),
    #[error(transparent)]
    Dequant(#[from] DequantError),
    #[error("{param}: {err}")]
    Candle {
        param: String,
        err: candle_core::Error,
    },
}

/// A routed-expert stack's GGUF tensor: `experts` equal runs of bytes, each one expert's
/// `expert_shape` (PyTorch order) in `dtype`'s blocks.
pub struct ExpertBlocks<'a> {
    pub tensor: String,
    pub dtype: crate::gguf::GgmlType,
    pub experts: usize,
    pub expert_shape: Vec<usize>,
    source: crate::gguf::TensorRef<'a>,
}

impl<'a> ExpertBlocks<'a> {
    /// Gives the stack's pages back to the page cache once its blocks have been copied to where
    /// they are used (the process keeps no mapping of a layer it has uploaded).
    pub fn release(&self) {
        self.source.release();
    }

    /// The whole stack's bytes, expert after expert.
    pub fn bytes(&self) -> &'a [u8] {
        self.source.bytes()
    }

    /// Expert `e`'s bytes (the stack is outermost-expert, so each expert is one run), as a handle
    /// that outlives the model's borrow.
    pub fn expert(&self, e: usize) -> Result<crate::gguf::SharedBytes, DequantError> {
        let all = self.source.shared();
        let per = all.len() / self.experts.max(1);
        if per * self.experts != all.len() || e >= self.experts {
            return Err(DequantError::Bad {
                tensor: self.tensor.clone(),
                reason: format!(
                    "{} bytes do not split into {} experts (expert {e} asked)",
                    all.len(),
                    self.experts
                ),
            });
        }
        Ok(all.slice(e * per, per))
    }
}

/// Builds logical tensors from a model.
pub struct Weights<'a> {
    pub model: &'a GgufModel,
    pub config: &'a Config,
    pub device: Device,
}

impl<'a> Weights<'a> {
    pub fn new(model: &'a GgufModel, config: &'a Config, device: Device) -> Self {
        Weights {
            model,
            config,
            device,
        }
    }

    /// One GGUF tensor dequantized, in PyTorch shape order, checked against `expected` when given.
    pub fn gguf_tensor(
        &self,
        param: &str,
        tensor: &str,
        expected: Option<&[usize]>,
    ) -> Result<Tensor, WeightError> {
        let t = match expected {
            Some(e) => self.checked(param, tensor, e)?,
            None => self
                .model
                .tensor(tensor)
                .ok_or_else(|| WeightError::Missing {
                    param: param.into(),
                    tensor: tensor.into(),
                })?,
        };
        let shape = t.info.torch_shape();
        let data = t.dequantize()?;
        Tensor::from_vec(data, shape, &self.device).map_err(|err| WeightError::Candle {
            param: param.into(),
            err,
        })
    }

    /// A Hugging Face parameter by name (`model.layers.3.self_attn.kv_b_proj.weight`).
    pub fn hf(&self, param: &str) -> Result<Tensor, WeightError> {
        let (def, idx) =
            glm_dsa::lookup_hf(param).ok_or_else(|| WeightError::Unknown(param.into()))?;
        self.check_idx(param, def.scope, idx)?;
        self.rebuild(param, def, idx)
    }

    fn check_idx(&self, param: &str, scope: glm_dsa::Scope, idx: Idx) -> Result<(), WeightError> {
        let c = self.config;
        let layer_ok = idx
            .layer
            .is_none_or(|l| l < c.num_hidden_layers && scope.has_layer(c, l));
        let expert_ok = idx.expert.is_none_or(|e| e < c.n_routed_experts);
        if layer_ok && expert_ok {
            Ok(())
        } else {
            Err(WeightError::Unknown(param.into()))
        }
    }

    fn rebuild(&self, param: &str, def: &HfDef, idx: Idx) -> Result<Tensor, WeightError> {
        let c = self.config;
        let candle = |err| WeightError::Candle {
            param: param.into(),
            err,
        };
        let src = |i: usize| {
            let s = &def.gguf[i];
            let shape = glm_dsa::resolve(s.shape, c);
            self.gguf_tensor(param, &glm_dsa::name(s.name, idx), Some(&shape))
        };
        match def.rebuild {
            Rebuild::Direct => src(0),
            Rebuild::KvB => {
                let h = c.num_attention_heads;
                let k_name = glm_dsa::name(def.gguf[0].name, idx);
                if self.model.tensor(&k_name).is_none() {
                    if let Some(legacy) = def.legacy {
                        let name = glm_dsa::name(legacy.name, idx);
                        if self.model.tensor(&name).is_some() {
                            let shape = glm_dsa::resolve(legacy.shape, c);
                            return self.gguf_tensor(param, &name, Some(&shape));
                        }
                    }
                }
                // attn_k_b: [H, kv_lora, nope] = k_b transposed; attn_v_b: [H, v, kv_lora].
                let k_b = src(0)?;
                let v_b = src(1)?;
                let k = k_b.transpose(1, 2).map_err(candle)?; // [H, nope, kv_lora]
                let kv = Tensor::cat(&[&k, &v_b], 1).map_err(candle)?; // [H, nope + v, kv_lora]
                kv.reshape((h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
                    .map_err(candle)
            }
            Rebuild::ExpertSlice => {
                let e = idx
                    .expert
                    .ok_or_else(|| WeightError::Unknown(param.into()))?;
                let s = &def.gguf[0];
                let stacked = glm_dsa::resolve(s.shape, c);
                let tensor = glm_dsa::name(s.name, idx);
                let t = self.checked(param, &tensor, &stacked)?;
                let data = t.dequantize_outer(e as u64, 1)?;
                Tensor::from_vec(data, &stacked[1..], &self.device).map_err(candle)
            }
        }
    }

    fn checked(
        &self,
        param: &str,
        tensor: &str,
        expected: &[usize],
    ) -> Result<crate::gguf::TensorRef<'a>, WeightError> {
        let t = self
            .model
            .tensor(tensor)
            .ok_or_else(|| WeightError::Missing {
                param: param.into(),
                tensor: tensor.into(),
            })?;
        let shape = t.info.torch_shape();
        if expected != shape.as_slice() {
            return Err(WeightError::Shape {
                param: param.into(),
                tensor: tensor.into(),
                expected: expected.to_vec(),
                found: shape,
            });
        }
        Ok(t)
    }

    /// The GGUF tensor holding layer `layer`'s stack of per-expert HF template `template`: the
    /// parameter's name, the tensor's name and its expected `[E, …]` shape.
    fn expert_stack(
        &self,
        template: &str,
        layer: usize,
    ) -> Result<(String, String, Vec<usize>), WeightError> {
        let def = glm_dsa::HF_TABLE
            .iter()
            .find(|d| d.hf == template && d.rebuild == Rebuild::ExpertSlice)
            .ok_or_else(|| WeightError::Unknown(template.into()))?;
        let param = glm_dsa::name(template, Idx::layer(layer));
        self.check_idx(&param, def.scope, Idx::layer(layer))?;
        let s = &def.gguf[0];
        let shape = glm_dsa::resolve(s.shape, self.config);
        Ok((param, glm_dsa::name(s.name, Idx::layer(layer)), shape))
    }

    /// All experts of one per-expert HF template stacked: [E, …], straight from the GGUF tensor.
    pub fn hf_stacked(&self, template: &str, layer: usize) -> Result<Tensor, WeightError> {
        let (param, tensor, shape) = self.expert_stack(template, layer)?;
        self.gguf_tensor(&param, &tensor, Some(&shape))
    }

    /// Layer `layer`'s routed-expert stack of `template` as the GGUF stores it, shape-checked:
    /// what a model keeps quantized instead of dequantizing [`Self::hf_stacked`].
    pub fn expert_blocks(
        &self,
        template: &str,
        layer: usize,
    ) -> Result<ExpertBlocks<'a>, WeightError> {
        let (param, tensor, shape) = self.expert_stack(template, layer)?;
        let t = self.checked(&param, &tensor, &shape)?;
        Ok(ExpertBlocks {
            tensor,
            dtype: t.info.dtype,
            experts: shape.first().copied().unwrap_or(0),
            expert_shape: shape.get(1..).map(<[usize]>::to_vec).unwrap_or_default(),
            source: t,
        })
    }

    /// The GGUF tensor that stores HF parameter `param` as it is (no rebuild, no transpose: its
    /// bytes are the parameter's rows in order), shape-checked; None for a rebuilt parameter.
    /// What a model keeps quantized instead of dequantizing [`Self::hf`].
    pub fn direct(&self, param: &str) -> Result<Option<crate::gguf::TensorRef<'a>>, WeightError> {
        let (def, idx) =
            glm_dsa::lookup_hf(param).ok_or_else(|| WeightError::Unknown(param.into()))?;
        self.check_idx(param, def.scope, idx)?;
        if def.rebuild != Rebuild::Direct {
            return Ok(None);
        }
        let s = &def.gguf[0];
        let shape = glm_dsa::resolve(s.shape, self.config);
        self.checked(param, &glm_dsa::name(s.name, idx), &shape)
            .map(Some)
    }

    /// A vLLM parameter by name (`model.layers.3.self_attn.fused_qkv_a_proj.weight`), unsharded.
    pub fn vllm(&self, param: &str) -> Result<Tensor, WeightError> {
        let (def, idx) =
            glm_dsa::lookup_vllm(param).ok_or_else(|| WeightError::Unknown(param.into()))?;
        self.check_idx(param, def.scope, idx)?;
        let parts = def
            .parts
            .iter()
            .map(|p| match (p.contains("{E}"), idx.layer) {
                (true, Some(l)) => self.hf_stacked(p, l),
                _ => self.hf(&glm_dsa::name(p, idx)),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if parts.len() == 1 {
            return parts
                .into_iter()
                .next()
                .ok_or_else(|| WeightError::Unknown(param.into()));
        }
        Tensor::cat(&parts, def.cat_dim).map_err(|err| WeightError::Candle {
            param: param.into(),
            err,
        })
    }
}
