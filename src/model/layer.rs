//! One decoder layer: pre-norm MLA attention and a dense or MoE feed-forward, each with a residual.
//! transformers `GlmMoeDsaDecoderLayer`.

use candle_core::{DType, Result, Tensor};

use super::attention::{AttnOut, Mla};
use super::capture::{emit, emit_with, Capture};
use super::mlp::Mlp;
use super::moe::Moe;
use super::names::{sub, LayerPaths, MlpKind};
use super::ops::{CausalMask, RmsNorm, Rope, RopeTables};
use super::parallel::all_reduce;
use super::source::{Params, WeightSource};
use super::{DsaMode, ModelError};
use crate::arch::glm_dsa::Role;
use crate::arch::Config;

#[derive(Debug, Clone)]
pub enum FeedForward {
    /// Layers below `first_k_dense_replace`.
    Dense(Mlp),
    Moe(Box<Moe>),
}

impl FeedForward {
    /// `[T, hidden]` → `[T, hidden]` (this rank's partial sum under tensor parallel).
    pub fn forward(&self, x: &Tensor, capture: &mut dyn Capture) -> Result<Tensor> {
        match self {
            FeedForward::Dense(m) => m.forward(x, capture),
            FeedForward::Moe(m) => m.forward(x, capture),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// RMSNorm `[hidden]`, rms_norm_eps
    pub input_norm: RmsNorm,
    pub attn: Mla,
    /// RMSNorm `[hidden]`, rms_norm_eps
    pub post_norm: RmsNorm,
    pub ffn: FeedForward,
    pub(crate) paths: LayerPaths,
}

impl DecoderLayer {
    /// Layer `l` as the source's rank holds it.
    pub fn new<S: WeightSource + ?Sized>(
        c: &Config,
        l: usize,
        vb: &mut Params<S>,
    ) -> std::result::Result<Self, ModelError> {
        let paths = LayerPaths::new(l, c.is_moe_layer(l))?;
        let li = Some(l);
        let eps = c.rms_norm_eps;
        let attn = Mla::new(c, l, vb, paths.attn.clone())?;
        let ffn = match paths.mlp.kind.clone() {
            MlpKind::Dense(p) => FeedForward::Dense(Mlp::new(
                [Role::FfnGate, Role::FfnUp, Role::FfnDown],
                l,
                vb,
                p,
            )?),
            MlpKind::Moe {
                gate,
                experts,
                shared,
            } => FeedForward::Moe(Box::new(Moe::new(
                c,
                l,
                vb,
                [gate, experts, paths.mlp.module.clone()],
                shared,
            )?)),
        };
        let fused = vb.fused_norms();
        Ok(DecoderLayer {
            input_norm: RmsNorm::new(vb.get(Role::InputNorm, li)?, eps).fused(fused),
            attn,
            post_norm: RmsNorm::new(vb.get(Role::PostAttnNorm, li)?, eps).fused(fused),
            ffn,
            paths,
        })
    }

    /// `model.layers.N`
    pub fn path(&self) -> &str {
        &self.paths.layer
    }

    /// `[T, hidden]` → `[T, hidden]`, the whole layer on one device.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        tables: &RopeTables,
        causal: &CausalMask,
        mode: DsaMode,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        forward_ranks(&[self], x, rope, tables, causal, mode, capture)
    }
}

/// `[T, hidden]` → `[T, hidden]`: one layer as its `ranks` run it (a single rank: the unsharded
/// layer). The norms are replicated (rank 0's is used); every rank runs its attention heads and its
/// share of the feed-forward, and the partial outputs are summed where vLLM all-reduces (after
/// `o_proj`, after the MLP / MoE).
pub fn forward_ranks(
    ranks: &[&DecoderLayer],
    x: &Tensor,
    rope: &Rope,
    tables: &RopeTables,
    causal: &CausalMask,
    mode: DsaMode,
    capture: &mut dyn Capture,
) -> Result<Tensor> {
    let Some(first) = ranks.first() else {
        candle_core::bail!("a layer with no ranks")
    };
    let p = &first.paths;
    let h = first.input_norm.forward(x)?;
    emit(capture, &p.input_norm, &h)?;
    let (attn, topk) = all_reduce(ranks.len(), p, capture, |r, cap| {
        let AttnOut { hidden, topk } =
            ranks[r].attn.forward(&h, rope, tables, causal, mode, cap)?;
        Ok((hidden, topk))
    })?;
    let x = (x + attn)?;
    let h = first.post_norm.forward(&x)?;
    emit(capture, &p.post_norm, &h)?;
    let (y, ()) = all_reduce(ranks.len(), p, capture, |r, cap| {
        Ok((ranks[r].ffn.forward(&h, cap)?, ()))
    })?;
    let x = (x + y)?;
    emit(capture, &p.layer, &x)?;
    if let Some(ids) = &topk {
        emit_with(capture, &sub(&p.layer, "1"), || ids.to_dtype(DType::I64))?;
    }
    Ok(x)
}
