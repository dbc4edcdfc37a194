//! Multi-head latent attention (MLA) with DSA top-k masking. transformers 5.23
//! `GlmMoeDsaAttention` (eager path).

use candle_core::{DType, Result, Tensor};

use super::capture::{emit, emit_with, Capture};
use super::indexer::Indexer;
use super::linear::Linear;
use super::names::{conv, sub, AttnPaths};
use super::ops::{
    additive, masked_softmax, one_hot_rows, CausalMask, RmsNorm, Rope, RopeLayout, RopeTables,
};
use super::source::{Params, WeightSource};
use super::{DsaMode, ModelError};
use crate::arch::glm_dsa::Role;
use crate::arch::Config;

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` as `GlmMoeDsaRMSNorm(n)` without
/// passing `config.rms_norm_eps`, so they use the class default 1e-6 (the layer norms use
/// rms_norm_eps, 1e-5 for GLM-5). llama.cpp's glm-dsa graph (`LLM_NORM_RMS`, f_norm_rms_eps) and
/// vLLM's `DeepseekV2MLAAttention` (`RMSNorm(q_lora_rank, eps=config.rms_norm_eps)`) use
/// rms_norm_eps for these two norms instead; we follow transformers. On the tiny fixture the
/// difference is ~7e-6 relative, below the end-to-end tolerance; tests check it in isolation.
pub const LATENT_NORM_EPS: f64 = 1e-6;

#[derive(Debug, Clone)]
pub struct Mla {
    /// `[q_lora, hidden]`
    pub q_a: Linear,
    /// RMSNorm `[q_lora]`, eps 1e-6
    pub q_a_norm: RmsNorm,
    /// `[H·(nope+rope), q_lora]`, rows per head `[nope | rope]`
    pub q_b: Linear,
    /// `[kv_lora + rope, hidden]`, rows `[latent | shared rope key]`
    pub kv_a: Linear,
    /// RMSNorm `[kv_lora]`, eps 1e-6
    pub kv_a_norm: RmsNorm,
    /// `[H·(nope+v), kv_lora]`, rows per head `[k_nope | v]`
    pub kv_b: Linear,
    /// `[hidden, H·v]`
    pub o: Linear,
    pub indexer: Indexer,
    pub n_heads: usize,
    pub nope: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
    /// qk_head_dim^-½ (no yarn mscale: default RoPE)
    pub scale: f64,
    /// The RoPE layout of q_pe / k_pe (interleaved; half-split only under `mla-rope-neox`).
    pub rope_layout: RopeLayout,
    /// Plain causal attention whatever the model's [`DsaMode`] (`dsa-dense` on this layer).
    pub force_dense: bool,
    /// Run the indexer even where its top-k is every key and nothing reads it
    /// (`GLMCHECK_INDEXER=always`: the same work as transformers, to measure against it).
    pub always_index: bool,
    pub(crate) paths: AttnPaths,
}

/// What one attention call hands back.
#[derive(Debug, Clone)]
pub struct AttnOut {
    /// `[T, hidden]`
    pub hidden: Tensor,
    /// The top-k key ids used `[T, k]` U32 (`None` in [`DsaMode::Dense`]).
    pub topk: Option<Tensor>,
}

impl Mla {
    /// Layer `l`'s attention as one rank holds it: `num_attention_heads / tp` heads of `q_b_proj`,
    /// `kv_b_proj` (column-parallel) and `o_proj` (row-parallel); the latent projections, their
    /// norms and the indexer replicated.
    pub(crate) fn new<S: WeightSource + ?Sized>(
        c: &Config,
        l: usize,
        vb: &mut Params<S>,
        paths: AttnPaths,
    ) -> std::result::Result<Self, ModelError> {
        let li = Some(l);
        let tp = vb.shard().tp;
        let fused = vb.fused_norms();
        Ok(Mla {
            q_a: vb.linear(Role::AttnQA, li)?,
            q_a_norm: RmsNorm::new(vb.get(Role::QANorm, li)?, LATENT_NORM_EPS).fused(fused),
            q_b: vb.linear(Role::AttnQB, li)?,
            kv_a: vb.linear(Role::AttnKvA, li)?,
            kv_a_norm: RmsNorm::new(vb.get(Role::KvANorm, li)?, LATENT_NORM_EPS).fused(fused),
            kv_b: vb.linear(Role::AttnKvB, li)?,
            o: vb.linear(Role::AttnOut, li)?,
            indexer: Indexer::new(c, l, vb, paths.indexer.clone())?,
            n_heads: c.num_attention_heads / tp,
            nope: c.qk_nope_head_dim,
            rope_dim: c.qk_rope_head_dim,
            v_dim: c.v_head_dim,
            kv_lora: c.kv_lora_rank,
            // Default RoPE: no yarn mscale (transformers applies it only for rope_type != default
            // with mscale_all_dim; the GGUF config carries no rope scaling).
            scale: (c.qk_head_dim() as f64).powf(-0.5),
            rope_layout: RopeLayout::Interleaved,
            force_dense: false,
            always_index: super::knobs::knobs().indexer_always,
            paths,
        })
    }

    /// `x` `[T, hidden]` (already input_layernorm'ed) → `[T, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        tables: &RopeTables,
        causal: &CausalMask,
        mode: DsaMode,
        capture: &mut dyn Capture,
    ) -> Result<AttnOut> {
        let p = &self.paths;
        let (t, _) = x.dims2()?;
        let h = self.n_heads;
        let qk = self.nope + self.rope_dim;

        // Query: q_a → RMSNorm → q_b, per head [nope | rope].
        let q_a = self.q_a.forward(x)?; // [T, q_lora]
        emit(capture, &p.q_a, &q_a)?;
        let q_resid = self.q_a_norm.forward(&q_a)?;
        emit(capture, &p.q_a_norm, &q_resid)?;
        let q = self.q_b.forward(&q_resid)?; // [T, H·qk]
        emit(capture, &p.q_b, &q)?;
        // [T, H, qk] → per head [H, T, qk], the rope part rotated: `[q_pass | rope(q_rot)]`.
        let query = rope.rotate_part(
            self.rope_layout,
            &q.reshape((t, h, qk))?,
            tables,
            self.nope,
            true,
        )?;

        // Keys/values: kv_a → [latent | rope key]; latent → RMSNorm → kv_b, per head [k_nope | v].
        let ckv = self.kv_a.forward(x)?; // [T, kv_lora + rope]
        emit(capture, &p.kv_a, &ckv)?;
        let kv_pass = ckv.narrow(1, 0, self.kv_lora)?;
        let k_rot = ckv
            .narrow(1, self.kv_lora, self.rope_dim)?
            .contiguous()?
            .unsqueeze(0)?; // [1, T, rope]: one key shared by all heads
        let k_pass = self.kv_a_norm.forward(&kv_pass)?; // [T, kv_lora]
        emit(capture, &p.kv_a_norm, &k_pass)?;

        let k_rot = rope.rotate(self.rope_layout, &k_rot, tables, false)?; // [1, T, rope]

        let kv = self.kv_b.forward(&k_pass)?; // [T, H·(nope+v)]
                                              // transformers applies kv_b_proj to a [B, 1, S, kv_lora] view: its output keeps a 1.
        emit_with(capture, &p.kv_b, || kv.unsqueeze(0))?;
        let (key, value) =
            self.keys_values(&kv.reshape((t, h, self.nope + self.v_dim))?, &k_rot)?;

        // DSA: the keys each query may see.
        let mode = if self.force_dense {
            DsaMode::Dense
        } else {
            mode
        };
        let (topk, allowed) = match mode {
            // A prompt no longer than index_topk: every key is in the top-k, so the mask is the
            // causal one whatever the scores. The indexer runs only when something reads it (a
            // capture, a comparison, a replayed top-k: every sink but `NoCapture` wants it); the
            // logits are the same bits either way (the dense arm's mask, which the sparse arm
            // below also hands on for a top-k of all T keys).
            DsaMode::Sparse
                if self.indexer.selects_all(t)
                    && !self.always_index
                    && !self.indexer.read_by(capture, &p.topk) =>
            {
                (None, causal.additive.clone())
            }
            DsaMode::Sparse => {
                let ours = self
                    .indexer
                    .forward(x, &q_resid, rope, tables, causal, capture)?;
                let replaced = capture.replace(&self.indexer.paths.module, &ours)?;
                // Our own top-k of all T keys is a permutation of 0..T (an argsort), so its mask
                // is the causal one: skip the scatter (one CUDA block per layer, ~0.15 ms at 256
                // tokens on an H200). A replayed top-k is scattered whatever its width.
                if replaced.is_none() && ours.dim(1)? == t {
                    return self.attend(
                        x,
                        [query, key, value, k_rot],
                        &causal.additive,
                        Some(ours),
                        capture,
                    );
                }
                let used = match replaced {
                    Some(r) => {
                        if r.dims() != ours.dims() {
                            candle_core::bail!(
                                "{}: replacement top-k has shape {:?}, expected {:?}",
                                self.indexer.paths.module,
                                r.dims(),
                                ours.dims()
                            );
                        }
                        r.to_dtype(DType::U32)?.to_device(ours.device())?
                    }
                    None => ours,
                };
                // transformers: mask = causal, then finfo.min wherever the key is not in the top-k.
                let allowed = (one_hot_rows(&used, t)? * &causal.allowed)?;
                (Some(used), additive(&allowed, causal.min)?)
            }
            DsaMode::Dense => (None, causal.additive.clone()),
        };

        self.attend(x, [query, key, value, k_rot], &allowed, topk, capture)
    }

    /// `kv` `[T, H, nope+v]` (kv_b's output) and the rotated shared key `k_rot` `[1, T, rope]` →
    /// per head `key` `[H, T, nope+rope]` = `[k_nope | k_rot]` and `value` `[H, T, v]`. On CUDA
    /// one launch of copies (`fused_cuda::mla_kv`) for the narrows, broadcast and cat.
    fn keys_values(&self, kv: &Tensor, k_rot: &Tensor) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if let Some(kv) = super::fused_cuda::mla_kv(kv, &k_rot.squeeze(0)?, self.nope)? {
            return Ok(kv);
        }
        let (t, h, _) = kv.dims3()?;
        let kv = kv.transpose(0, 1)?; // [H, T, nope+v]
        let k_nope = kv.narrow(2, 0, self.nope)?;
        let value = kv.narrow(2, self.nope, self.v_dim)?.contiguous()?; // [H, T, v]
        let key = Tensor::cat(&[&k_nope, &k_rot.broadcast_as((h, t, self.rope_dim))?], 2)?;
        Ok((key, value))
    }

    /// Softmax attention of `query` `[H, T, qk]` over `key` `[H, T, qk]` and `value` `[H, T, v]`
    /// (`k_rot` `[1, T, rope]` only captured) with the additive mask `allowed` `[T, T]` (f32: 0
    /// or `finfo.min`), then o_proj. Eager attention: scores in the compute dtype, mask added and
    /// softmax in f32 (candle's softmax computes in its input dtype), probabilities rounded to
    /// the compute dtype.
    fn attend(
        &self,
        x: &Tensor,
        [query, key, value, k_rot]: [Tensor; 4],
        allowed: &Tensor,
        topk: Option<Tensor>,
        capture: &mut dyn Capture,
    ) -> Result<AttnOut> {
        let p = &self.paths;
        let (t, _) = x.dims2()?;
        let h = self.n_heads;
        emit(capture, &sub(&p.module, conv::QUERY_STATES), &query)?;
        emit(capture, &sub(&p.module, conv::KEY_STATES), &key)?;
        emit(capture, &sub(&p.module, conv::VALUE_STATES), &value)?;
        emit(capture, &sub(&p.module, conv::K_ROT), &k_rot)?;

        // Contiguous operands: cuBLAS' batched GEMM takes no arbitrary strides (the CPU gemm does).
        let (query, key) = (query.contiguous()?, key.contiguous()?);
        let scores = query.matmul(&key.t()?)?; // [H, T, T]
        let probs = masked_softmax(&scores, self.scale, allowed)?; // [H, T, T], dtype
        let out = probs.matmul(&value)?; // [H, T, v]
        let out = heads_to_tokens(&out, t, h * self.v_dim)?; // [T, H·v]
        let out = self.o.forward(&out)?; // [T, hidden]
        emit(capture, &p.o, &out)?;
        emit(capture, &p.module, &out)?;
        emit(capture, &sub(&p.module, "1"), &probs)?;
        if let Some(ids) = &topk {
            emit_with(capture, &p.topk, || ids.to_dtype(DType::I64))?;
        }
        Ok(AttnOut { hidden: out, topk })
    }
}

/// Attention's per-head output `[H, T, v]` as o_proj's input `[T, H·v]` (on CUDA one launch of
/// 16-byte copies, `fused_cuda::heads_to_tokens`; the same bits as the transpose copy).
fn heads_to_tokens(out: &Tensor, t: usize, hv: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(y) = super::fused_cuda::heads_to_tokens(out)? {
        return Ok(y);
    }
    out.transpose(0, 1)?.reshape((t, hv))
}
