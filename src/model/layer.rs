//! One decoder layer: pre-norm MLA attention and a dense or MoE feed-forward, each with a residual.
//! transformers `GlmMoeDsaDecoderLayer`.

use candle_core::{DType, Result, Tensor};

use super::attention::Mla;
use super::capture::{emit, emit_with, Capture};
use super::mlp::Mlp;
use super::moe::Moe;
use super::names::sub;
use super::ops::{CausalMask, RmsNorm, Rope, RopeTables};
use super::DsaMode;

#[derive(Debug, Clone)]
pub enum FeedForward {
    /// Layers below `first_k_dense_replace`.
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// RMSNorm `[hidden]`, rms_norm_eps
    pub input_norm: RmsNorm,
    pub attn: Mla,
    /// RMSNorm `[hidden]`, rms_norm_eps
    pub post_norm: RmsNorm,
    pub ffn: FeedForward,
    pub(crate) path: String,
    pub(crate) input_norm_path: String,
    pub(crate) post_norm_path: String,
}

impl DecoderLayer {
    /// `[T, hidden]` → `[T, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        tables: &RopeTables,
        causal: &CausalMask,
        mode: DsaMode,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        let h = self.input_norm.forward(x)?;
        emit(capture, &self.input_norm_path, &h)?;
        let attn = self.attn.forward(&h, rope, tables, causal, mode, capture)?;
        let x = (x + attn.hidden)?;
        let h = self.post_norm.forward(&x)?;
        emit(capture, &self.post_norm_path, &h)?;
        let h = match &self.ffn {
            FeedForward::Dense(m) => m.forward(&h, capture)?,
            FeedForward::Moe(m) => m.forward(&h, capture)?,
        };
        let x = (x + h)?;
        emit(capture, &self.path, &x)?;
        if let Some(ids) = &attn.topk {
            emit_with(capture, &sub(&self.path, "1"), || ids.to_dtype(DType::I64))?;
        }
        Ok(x)
    }
}
