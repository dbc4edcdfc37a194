//! The DSA (DeepSeek Sparse Attention) lightning indexer: picks, per query, the `index_topk` keys the
//! attention may look at. transformers 5.23 `GlmMoeDsaIndexer`.

use candle_core::{DType, Result, Tensor};

use super::capture::{emit, emit_with, Capture};
use super::linear::Linear;
use super::names::{conv, sub, IndexerPaths};
use super::ops::{topk_indices, CausalMask, LayerNorm, Rope, RopeLayout, RopeTables};
use super::source::{Params, WeightSource};
use super::ModelError;
use crate::arch::glm_dsa::Role;
use crate::arch::Config;

/// transformers builds `k_norm` as `nn.LayerNorm(head_dim, eps=1e-6)` (vLLM's `Indexer` too); the
/// GGUF carries no eps for it. llama.cpp's glm-dsa graph normalises with `LLM_NORM`, i.e.
/// `hparams.f_norm_eps`, which its glm-dsa loader never reads (the file has no
/// `attention.layer_norm_epsilon`), so llama.cpp most likely runs this LayerNorm with eps 0.
pub const K_NORM_EPS: f64 = 1e-6;

#[derive(Debug, Clone)]
pub struct Indexer {
    /// `[n_heads·head_dim, q_lora]`
    pub wq_b: Linear,
    /// `[head_dim, hidden]`
    pub wk: Linear,
    /// LayerNorm `[head_dim]` with bias, eps 1e-6
    pub k_norm: LayerNorm,
    /// `[n_heads, hidden]`, kept in f32 (transformers' `_keep_in_fp32_modules`)
    pub weights_proj: Linear,
    pub n_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub topk: usize,
    /// The RoPE layout of the rope part (interleaved; half-split only under `indexer-rope-neox`).
    pub rope_layout: RopeLayout,
    pub(crate) paths: IndexerPaths,
}

impl Indexer {
    /// Whether the top-k of `t` keys is every key (`t ≤ index_topk`): then the attention mask is the
    /// causal one whatever the scores (transformers scatters all T keys into the mask).
    pub fn selects_all(&self, t: usize) -> bool {
        self.topk >= t
    }

    /// Whether `capture` reads anything this indexer computes: its module outputs, its internals
    /// (q, k, head weights, scores) or `ids_path`, where the attention hands its top-k on.
    pub fn read_by(&self, capture: &dyn Capture, ids_path: &str) -> bool {
        let p = &self.paths;
        [
            &p.module,
            &p.wq_b,
            &p.wk,
            &p.k_norm,
            &p.weights_proj,
            ids_path,
        ]
        .into_iter()
        .any(|path| capture.wants(path))
            || [
                conv::IDX_Q,
                conv::IDX_K,
                conv::IDX_HEAD_WEIGHTS,
                conv::IDX_SCORES,
            ]
            .into_iter()
            .any(|s| capture.wants(&sub(&p.module, s)))
    }

    /// Layer `l`'s indexer. Replicated: every rank holds all of it.
    pub(crate) fn new<S: WeightSource + ?Sized>(
        c: &Config,
        l: usize,
        vb: &mut Params<S>,
        paths: IndexerPaths,
    ) -> std::result::Result<Self, ModelError> {
        let li = Some(l);
        Ok(Indexer {
            wq_b: vb.linear(Role::IndexerQB, li)?,
            wk: vb.linear(Role::IndexerK, li)?,
            k_norm: LayerNorm::new(
                vb.get(Role::IndexerKNorm, li)?,
                vb.get(Role::IndexerKNormBias, li)?,
                K_NORM_EPS,
            )
            .fused(vb.fused_norms()),
            weights_proj: Linear::new(vb.f32(Role::IndexerWeights, li)?),
            n_heads: c.index_n_heads,
            head_dim: c.index_head_dim,
            rope_dim: c.qk_rope_head_dim,
            topk: c.index_topk,
            rope_layout: RopeLayout::Interleaved,
            paths,
        })
    }

    /// `x` `[T, hidden]`, `q_resid` `[T, q_lora]` (= q_a_layernorm(q_a_proj(x))) → top-k key ids
    /// `[T, min(index_topk, T)]` U32, best first.
    ///
    /// Semantics (transformers): q = wq_b(q_resid) per head `[rope | pass]` (the rope part comes
    /// FIRST here, unlike MLA's `[nope | rope]`); k = LayerNorm(wk(x)), single head, same split;
    /// interleaved RoPE on both rope parts; scores_h = relu(q_h·k · head_dim^-½) in f32;
    /// w = weights_proj(x) · n_heads^-½ in f32; index = Σ_h w_h·scores_h + causal mask
    /// (`finfo.min` on future keys); top-k over ALL T keys. For query i < k−1 the top-k therefore
    /// holds masked future keys too; the attention mask is intersected with the causal mask, so
    /// they are never attended.
    ///
    /// Elsewhere: transformers' GlmMoeDsa always uses interleaved RoPE here; llama.cpp's glm-dsa
    /// graph agrees (`LLAMA_ROPE_TYPE_NORM`, adjacent pairs), while vLLM and SGLang choose
    /// `is_neox_style = not config.indexer_rope_interleave` (default false: half-split), so a
    /// config.json without `indexer_rope_interleave: true` gets a different indexer there.
    /// llama.cpp also folds head_dim^-½ into the head weights (1/√(dI·nI), valid since a positive
    /// scale commutes with relu) and applies a Hadamard rotation to q and k (orthogonal, so the
    /// scores are unchanged up to rounding).
    pub fn forward(
        &self,
        x: &Tensor,
        q_resid: &Tensor,
        rope: &Rope,
        tables: &RopeTables,
        causal: &CausalMask,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        #[cfg(test)]
        tests::RUNS.with(|r| r.set(r.get() + 1));
        let p = &self.paths;
        let (t, _) = x.dims2()?;

        let q = self.wq_b.forward(q_resid)?; // [T, nI·dI]
        emit(capture, &p.wq_b, &q)?;
        let q = q.reshape((t, self.n_heads, self.head_dim))?; // [T, nI, dI]

        let k = self.wk.forward(x)?; // [T, dI]
        emit(capture, &p.wk, &k)?;
        let k = self.k_norm.forward(&k)?;
        emit(capture, &p.k_norm, &k)?;

        // `[rope(x_rot) | x_pass]`, tokens on axis 0 of both (transformers unsqueezes q's head dim
        // into cos/sin).
        let q = rope.rotate_part(self.rope_layout, &q, tables, 0, false)?; // [T, nI, dI]
        let k = rope
            .rotate_part(self.rope_layout, &k.unsqueeze(1)?, tables, 0, false)?
            .squeeze(1)?; // [T, dI]
        emit(capture, &sub(&p.module, conv::IDX_Q), &q)?;
        emit(capture, &sub(&p.module, conv::IDX_K), &k)?;

        // [T, nI, dI] · [dI, T] → [T, nI, T], f32.
        let scale = (self.head_dim as f64).powf(-0.5);
        let scores = q
            .to_dtype(DType::F32)?
            .contiguous()?
            .broadcast_matmul(&k.to_dtype(DType::F32)?.contiguous()?.t()?)?;
        let scores = (scores * scale)?.relu()?;

        let w = self.weights_proj.forward(&x.to_dtype(DType::F32)?)?; // [T, nI] f32
        emit(capture, &p.weights_proj, &w)?;
        let w = (w * (self.n_heads as f64).powf(-0.5))?;
        emit(capture, &sub(&p.module, conv::IDX_HEAD_WEIGHTS), &w)?;

        // [T, 1, nI] · [T, nI, T] → [T, T]
        let index = w.unsqueeze(1)?.matmul(&scores)?.squeeze(1)?;
        let index = index.broadcast_add(&causal.additive)?;
        emit(capture, &sub(&p.module, conv::IDX_SCORES), &index)?;

        let k = self.topk.min(t);
        let ids = topk_indices(&index, k)?; // [T, k] U32
        emit_with(capture, &p.module, || ids.to_dtype(DType::I64))?;
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use crate::arch::config::ConfigReader;
    use crate::gguf::GgufModel;
    use crate::model::{Capture, DsaMode, Glm5, ModelOptions, NoCapture, VecCapture};
    use crate::weights::Weights;
    use candle_core::Device;

    thread_local! {
        /// Indexer forwards run on this thread (each test runs on its own).
        pub(super) static RUNS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// How many indexer forwards one model forward of `n` tokens runs with `capture`.
    fn runs(model: &Glm5, n: usize, capture: &mut dyn Capture) -> usize {
        let tokens: Vec<u32> = (0..n as u32).map(|i| 17 + 3 * i).collect();
        RUNS.with(|r| r.set(0));
        model.forward(&tokens, capture).expect("forward");
        RUNS.with(|r| r.get())
    }

    /// The tiny model (index_topk 8, 3 layers) skips its indexers up to 8 tokens when nothing reads
    /// them, runs all three from 9 tokens on (the top-k then picks keys), and runs them at any
    /// length for a sink that reads them; so does its simulated tensor-parallel form (2 ranks, each
    /// running the replicated indexer: twice the runs). (`tests/forward_cli.rs` has the logits bit
    /// for bit.)
    #[test]
    fn the_indexer_is_skipped_exactly_where_every_key_is_selected_and_nothing_reads_it() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q8_0.gguf");
        let m = GgufModel::open(&path).expect("fixture");
        let c = ConfigReader::read(&m, "glm-dsa").expect("config").config;
        assert_eq!(c.index_topk, 8, "the fixture this test was written for");
        let layers = c.num_hidden_layers;
        let w = Weights::new(&m, &c, Device::Cpu);
        let opts = ModelOptions {
            dsa: DsaMode::Sparse,
            ..ModelOptions::default()
        };
        let model = Glm5::load_with(&w, opts).expect("load");
        let plan = crate::plan::ShardPlan::new(&m, &c, 2);
        let tp = Glm5::sharded(&w, &plan, None, opts).expect("tp load");
        for (model, ranks) in [(&model, 1), (&tp, 2)] {
            for (n, want) in [(1, 0), (7, 0), (8, 0), (9, layers), (12, layers)] {
                assert_eq!(
                    runs(model, n, &mut NoCapture),
                    ranks * want,
                    "{ranks} rank(s), {n} tokens, nothing read"
                );
                assert_eq!(
                    runs(model, n, &mut VecCapture::new()),
                    ranks * layers,
                    "{ranks} rank(s), {n} tokens, all read"
                );
            }
        }
    }
}
