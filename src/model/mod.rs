//! GLM-5 (`GlmMoeDsaForCausalLM`) forward in candle, module by module as transformers 5.23 runs it,
//! with every module output sent to a [`Capture`] under its Hugging Face module path.
//!
//! One struct per module ([`Mla`], [`Indexer`], [`Router`], [`Experts`], [`Moe`], [`Mlp`],
//! [`DecoderLayer`]); activations are `[T, …]` (no batch dimension). Only candle tensor ops are
//! used (the MoE reads its routing back to build per-expert token lists), so the same code runs on
//! any candle device. Compute dtype F32 (default), BF16 or F16; the router, the indexer's
//! `weights_proj` and its scores stay in f32 as in transformers.
//!
//! Where transformers, llama.cpp and vLLM disagree, this follows transformers; the differences are
//! noted at the place they matter ([`attention::LATENT_NORM_EPS`], [`indexer::K_NORM_EPS`],
//! [`Experts::forward`]).

pub mod attention;
pub mod behaviour;
pub mod capture;
pub mod clock;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_ffi;
#[cfg(test)]
pub(crate) mod fma_decode_tests;
#[cfg(feature = "cuda")]
pub(crate) mod fused_cuda;
pub mod grouping;
pub mod host_ids;
pub mod indexer;
pub mod knobs;
pub mod layer;
pub mod linear;
pub mod mlp;
pub mod moe;
#[cfg(feature = "cuda")]
pub mod moe_cuda;
pub(crate) mod names;
pub mod ops;
pub mod parallel;
#[cfg(feature = "cuda")]
pub mod q8_cuda;
#[cfg(feature = "cuda")]
pub(crate) mod q8_dense_cuda;
#[cfg(feature = "cuda")]
pub mod rope_cuda;
pub mod source;
#[cfg(feature = "cuda")]
pub(crate) mod wgmma_cuda;

use candle_core::{DType, Device, Tensor};

use crate::arch::Config;
use crate::weights::{WeightError, Weights};

pub use attention::{AttnOut, Mla};
pub use capture::{Capture, NoCapture, VecCapture};
pub use indexer::Indexer;
pub use layer::{DecoderLayer, FeedForward};
pub use linear::{Linear, MatmulMode, Weight};
pub use mlp::Mlp;
pub use moe::{Experts, Moe, Router, Routing};
pub use ops::{LayerNorm, RmsNorm, Rope, RopeLayout};

use crate::arch::glm_dsa::Role;
use crate::dump::RankDump;
use crate::plan::ShardPlan;
use names::{conv, sub, ModelPaths};
pub use source::{FullSource, Params, Shard, ShardSource, WeightSource};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Weight(#[from] WeightError),
    #[error("name table: {0}")]
    NameTable(String),
    #[error("unsupported configuration: {0}")]
    Unsupported(String),
    #[error("empty prompt: the forward needs at least one token")]
    EmptyPrompt,
    #[error("token {id} at position {pos} is outside the vocabulary of {vocab}")]
    Token { id: u32, pos: usize, vocab: usize },
    /// The shard plan cannot serve this model (tp does not divide a dimension, a parameter no
    /// vLLM parameter holds).
    #[error("{0}")]
    Plan(String),
    #[error(transparent)]
    Dump(#[from] crate::dump::DumpError),
    #[error("{param} (rank {rank}): the dump holds shape {got:?}, rank {rank} of tp={tp} needs {want:?}")]
    Shape {
        param: String,
        rank: usize,
        tp: usize,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{module}: {source}")]
    Candle {
        module: String,
        #[source]
        source: candle_core::Error,
    },
}

fn at(module: &str) -> impl FnOnce(candle_core::Error) -> ModelError + '_ {
    move |source| ModelError::Candle {
        module: module.to_string(),
        source,
    }
}

/// Whether the DSA indexer restricts attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DsaMode {
    /// transformers' behaviour: each query attends only to its indexer's top-k keys (∩ causal).
    #[default]
    Sparse,
    /// The indexer is not run; plain causal attention over all keys. Equal to `Sparse` while the
    /// prompt has at most `index_topk` tokens.
    Dense,
}

/// How to build the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelOptions {
    /// Compute dtype: F32, BF16 or F16.
    pub dtype: DType,
    pub dsa: DsaMode,
    /// How weights kept as quantized blocks are multiplied.
    pub matmul: MatmulMode,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            dtype: DType::F32,
            dsa: DsaMode::Sparse,
            matmul: MatmulMode::Dequant,
        }
    }
}

/// A replicated parameter (norm, latent projection, indexer, router) whose copy on `rank` is not
/// rank 0's. vLLM gives every rank its own copy; the simulated forward runs the replicated modules
/// with rank 0's, so a rank whose copy differs is not simulated faithfully and must be reported.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaMismatch {
    pub rank: usize,
    /// The HF module path (`model.layers.1.input_layernorm`).
    pub module: String,
    pub rel_l2: f64,
}

/// Copies that differ by more than this rel-L2 differ (a bf16 dump against the GGUF's f32 cut
/// differs by ~4e-3 from rounding alone).
const REPLICA_REL_L2: f64 = 2e-2;

impl RankModel {
    /// The replicated parameters of this rank, keyed by HF module path.
    fn replicated(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let mut v: Vec<(String, Tensor)> = Vec::new();
        let mut push = |m: &String, t: &Tensor| v.push((m.clone(), t.clone()));
        let mut v_lin: Vec<(String, &Weight)> = Vec::new();
        for l in &self.layers {
            let (p, a, i) = (&l.paths, &l.attn, &l.attn.indexer);
            let ip = &p.attn.indexer;
            push(&p.input_norm, &l.input_norm.weight);
            push(&p.post_norm, &l.post_norm.weight);
            v_lin.push((p.attn.q_a.clone(), &a.q_a.weight));
            push(&p.attn.q_a_norm, &a.q_a_norm.weight);
            v_lin.push((p.attn.kv_a.clone(), &a.kv_a.weight));
            push(&p.attn.kv_a_norm, &a.kv_a_norm.weight);
            v_lin.push((ip.wq_b.clone(), &i.wq_b.weight));
            v_lin.push((ip.wk.clone(), &i.wk.weight));
            push(&ip.k_norm, &i.k_norm.weight);
            push(&ip.k_norm, &i.k_norm.bias);
            v_lin.push((ip.weights_proj.clone(), &i.weights_proj.weight));
            if let FeedForward::Moe(m) = &l.ffn {
                v_lin.push((m.router.path.clone(), &m.router.weight.weight));
                push(&m.router.path, &m.router.bias);
            }
        }
        push(
            &Role::FinalNorm.module(None).unwrap_or_default(),
            &self.norm.weight,
        );
        for (m, w) in v_lin {
            let t = w.dense().map_err(at(&m))?;
            v.push((m, t));
        }
        Ok(v)
    }
}

/// Rank r ≥ 1's replicated copies against rank 0's.
fn replica_mismatches(ranks: &[RankModel]) -> Result<Vec<ReplicaMismatch>, ModelError> {
    let Some((first, rest)) = ranks.split_first() else {
        return Ok(Vec::new());
    };
    let values = |t: &Tensor, m: &str| {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(at(m))
    };
    // Rank 0's copies read back once, not once per other rank.
    let want = first
        .replicated()?
        .into_iter()
        .map(|(m, t)| Ok((values(&t, &m)?, m)))
        .collect::<Result<Vec<_>, ModelError>>()?;
    let mut out = Vec::new();
    for (r, rank) in rest.iter().enumerate() {
        for ((a, module), (m, b)) in want.iter().zip(rank.replicated()?) {
            debug_assert_eq!(module, &m);
            let d = crate::compare::diff(&values(&b, module)?, a);
            if (d.rel_l2.is_nan() || d.rel_l2 > REPLICA_REL_L2)
                && !out
                    .iter()
                    .any(|m: &ReplicaMismatch| m.rank == r + 1 && m.module == *module)
            {
                out.push(ReplicaMismatch {
                    rank: r + 1,
                    module: module.clone(),
                    rel_l2: d.rel_l2,
                });
            }
        }
    }
    Ok(out)
}

/// One rank's modules; the whole model when there is one rank.
#[derive(Debug, Clone)]
pub struct RankModel {
    /// `[V, hidden]`, or under tensor parallel this rank's rows of the padded table
    /// `[V_pad / tp, hidden]`
    pub embed: Weight,
    pub layers: Vec<DecoderLayer>,
    /// RMSNorm `[hidden]`, rms_norm_eps (replicated)
    pub norm: RmsNorm,
    /// `[V, hidden]`, or this rank's `[V_pad / tp, hidden]`
    pub lm_head: Linear,
}

/// `GlmMoeDsaForCausalLM`, as `tp` ranks run it: one rank is the plain model; several are vLLM's
/// tensor-parallel ranks simulated in one process ([`parallel`]). Every rank is built from a
/// [`WeightSource`] by the same module constructors.
#[derive(Debug, Clone)]
pub struct Glm5 {
    pub ranks: Vec<RankModel>,
    pub rope: Rope,
    config: Config,
    options: ModelOptions,
    paths: ModelPaths,
    device: Device,
    /// Embedding / lm_head rows per rank (the padded vocab / tp; the vocab itself for one rank).
    per_rank_vocab: usize,
    /// Parameters a rank dump lacked, taken from the plan's cut of the GGUF instead.
    fallbacks: Vec<String>,
    /// Built by [`Glm5::sharded`]: simulated tensor parallel of this degree (1 included).
    simulated_tp: Option<usize>,
    /// Ranks whose replicated copies are not rank 0's.
    replica_mismatches: Vec<ReplicaMismatch>,
    /// [`Glm5::facts`] as loaded, kept by the first behaviour fault injected.
    loaded_facts: Option<crate::compare::ModelFacts>,
}

/// Checks the config describes a model this forward implements exactly.
fn validate(c: &Config) -> Result<(), ModelError> {
    let bad = |m: String| Err(ModelError::Unsupported(m));
    if c.scoring_func != "sigmoid" {
        // transformers' GlmMoeDsaTopkRouter always uses sigmoid; a file that says otherwise was not
        // made for this architecture's reference.
        return bad(format!(
            "expert gating `{}`: GlmMoeDsa routes with sigmoid",
            c.scoring_func
        ));
    }
    if !c.qk_rope_head_dim.is_multiple_of(2) || c.qk_rope_head_dim == 0 {
        return bad(format!(
            "qk_rope_head_dim {} must be even and positive",
            c.qk_rope_head_dim
        ));
    }
    if c.index_head_dim < c.qk_rope_head_dim {
        return bad(format!(
            "index_head_dim {} is smaller than qk_rope_head_dim {}",
            c.index_head_dim, c.qk_rope_head_dim
        ));
    }
    if c.num_hidden_layers > c.first_k_dense_replace {
        if c.n_group == 0 || !c.n_routed_experts.is_multiple_of(c.n_group) {
            return bad(format!(
                "{} experts do not split into {} groups",
                c.n_routed_experts, c.n_group
            ));
        }
        if c.n_routed_experts / c.n_group < 2 {
            return bad(
                "the router sums the top-2 scores of each group: groups need ≥ 2 experts".into(),
            );
        }
        if c.topk_group == 0 || c.topk_group > c.n_group {
            return bad(format!(
                "topk_group {} not in 1..={}",
                c.topk_group, c.n_group
            ));
        }
        let reachable = c.topk_group * (c.n_routed_experts / c.n_group);
        if c.num_experts_per_tok == 0 || c.num_experts_per_tok > reachable {
            return bad(format!(
                "num_experts_per_tok {} not in 1..={reachable} (topk_group groups)",
                c.num_experts_per_tok
            ));
        }
    }
    if c.index_topk == 0 {
        return bad("index_topk is 0".into());
    }
    Ok(())
}

impl Glm5 {
    /// Loads in F32 with the sparse (DSA) attention.
    pub fn load(w: &Weights) -> Result<Self, ModelError> {
        Self::load_with(w, ModelOptions::default())
    }

    /// The unsharded model from the GGUF.
    pub fn load_with(w: &Weights, options: ModelOptions) -> Result<Self, ModelError> {
        Self::from_sources(vec![FullSource { w }], options)
    }

    /// vLLM's `plan.tp` ranks: each rank's shards cut from the GGUF by `plan`, or read from a
    /// per-rank dump (its gaps filled from the plan's cut, listed by [`Glm5::fallbacks`]).
    pub fn sharded(
        w: &Weights,
        plan: &ShardPlan,
        dump: Option<&RankDump>,
        options: ModelOptions,
    ) -> Result<Self, ModelError> {
        let mut m = Self::from_sources(ShardSource::ranks(w, plan, dump)?, options)?;
        m.simulated_tp = Some(plan.tp);
        // Only a dump can give ranks different copies (the plan's cut replicates one tensor).
        if dump.is_some() {
            m.replica_mismatches = replica_mismatches(&m.ranks)?;
        }
        // In the plan's (forward) order, whatever order the modules asked for them.
        m.fallbacks
            .sort_by_key(|f| plan.params.iter().position(|p| p.param == *f));
        Ok(m)
    }

    /// The model built from one source per rank (ranks `0..n` of `tp = n`), layer by layer.
    pub fn from_sources<S: WeightSource>(
        mut sources: Vec<S>,
        options: ModelOptions,
    ) -> Result<Self, ModelError> {
        let first = sources
            .first()
            .ok_or_else(|| ModelError::Plan("no weight source".into()))?;
        let c = first.config().clone();
        let device = first.device().clone();
        let tp = sources.len();
        for (r, s) in sources.iter().enumerate() {
            if s.shard() != (Shard { rank: r, tp }) {
                return Err(ModelError::Plan(format!(
                    "weight source {r} of {tp} serves rank {:?}",
                    s.shard()
                )));
            }
        }
        validate(&c)?;
        if !c.num_attention_heads.is_multiple_of(tp) {
            return Err(ModelError::Plan(format!(
                "{} attention heads do not split over tp={tp}",
                c.num_attention_heads
            )));
        }
        if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(ModelError::Unsupported(format!(
                "compute dtype {:?} (F32, BF16 or F16)",
                options.dtype
            )));
        }
        let (dtype, mode) = (options.dtype, options.matmul);
        let mut layers: Vec<Vec<DecoderLayer>> = (0..tp).map(|_| Vec::new()).collect();
        for l in 0..c.num_hidden_layers {
            for (src, ls) in sources.iter_mut().zip(layers.iter_mut()) {
                ls.push(DecoderLayer::new(&c, l, &mut Params { src, dtype, mode })?);
            }
        }
        let mut ranks = Vec::with_capacity(tp);
        for (src, layers) in sources.iter_mut().zip(layers) {
            let mut vb = Params { src, dtype, mode };
            let embed = vb.weight(Role::Embedding, None)?;
            let lm_head = if c.tie_word_embeddings {
                Linear {
                    weight: embed.clone(),
                }
            } else {
                vb.linear(Role::LmHead, None)?
            };
            ranks.push(RankModel {
                embed,
                layers,
                norm: RmsNorm::new(vb.get(Role::FinalNorm, None)?, c.rms_norm_eps)
                    .fused(vb.fused_norms()),
                lm_head,
            });
        }
        let paths = ModelPaths::new()?;
        let per_rank_vocab = ranks[0].embed.dim(0).map_err(at(&paths.embed))?;
        let rope =
            Rope::new(c.qk_rope_head_dim, c.rope_theta, &device).map_err(at(&paths.rotary))?;
        let mut fallbacks: Vec<String> = Vec::new();
        for s in &sources {
            for f in s.fallbacks() {
                if !fallbacks.contains(f) {
                    fallbacks.push(f.clone());
                }
            }
        }
        Ok(Glm5 {
            ranks,
            rope,
            per_rank_vocab,
            config: c,
            options,
            paths,
            device,
            fallbacks,
            simulated_tp: None,
            replica_mismatches: Vec::new(),
            loaded_facts: None,
        })
    }

    /// The number of ranks (1: the unsharded model).
    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    /// `Some(tp)` when built as simulated tensor parallel ([`Glm5::sharded`], tp = 1 included).
    pub fn simulated_tp(&self) -> Option<usize> {
        self.simulated_tp
    }

    /// Rank 0's layers (all of each layer when tp = 1).
    pub fn layers(&self) -> &[DecoderLayer] {
        self.ranks.first().map_or(&[], |r| r.layers.as_slice())
    }

    /// The final norm (replicated).
    pub fn norm(&self) -> Option<&RmsNorm> {
        self.ranks.first().map(|r| &r.norm)
    }

    /// Ranks whose replicated parameters are not rank 0's (the forward runs rank 0's copies).
    pub fn replica_mismatches(&self) -> &[ReplicaMismatch] {
        &self.replica_mismatches
    }

    /// vLLM parameters a rank dump lacked (taken from the GGUF's cut instead).
    pub fn fallbacks(&self) -> &[String] {
        &self.fallbacks
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn options(&self) -> ModelOptions {
        self.options
    }

    pub fn dsa_mode(&self) -> DsaMode {
        self.options.dsa
    }

    pub fn set_dsa_mode(&mut self, mode: DsaMode) {
        self.options.dsa = mode;
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Token ids `[T]` → logits `[T, V]` (compute dtype), every module output sent to `capture`.
    pub fn forward(&self, tokens: &[u32], capture: &mut dyn Capture) -> Result<Tensor, ModelError> {
        check_tokens(tokens, self.config.vocab_size)?;
        let t = tokens.len();
        let p = &self.paths;
        let dtype = self.options.dtype;

        let ids = Tensor::new(tokens, &self.device).map_err(at(conv::INPUT_IDS))?;
        capture::emit_with(capture, conv::INPUT_IDS, || ids.to_dtype(DType::I64))
            .map_err(at(conv::INPUT_IDS))?;
        capture::emit_with(capture, conv::POSITION_IDS, || {
            Tensor::arange(0i64, t as i64, &self.device)
        })
        .map_err(at(conv::POSITION_IDS))?;

        let embeds: Vec<&Weight> = self.ranks.iter().map(|r| &r.embed).collect();
        let mut x =
            parallel::embed(&embeds, self.per_rank_vocab, tokens, &ids).map_err(at(&p.embed))?; // [T, hidden]
        capture::emit(capture, &p.embed, &x).map_err(at(&p.embed))?;

        // Cast once to the compute dtype (each rotation would cast them again: two launches).
        let tables = self
            .rope
            .tables(t)
            .and_then(|tb| tb.to_dtype(dtype))
            .map_err(at(&p.rotary))?;
        // transformers' rotary_emb returns cat(freqs, freqs).cos() / .sin(), [T, rope].
        capture::emit_with(capture, &p.rotary, || {
            Tensor::cat(&[&tables.cos, &tables.cos], 1)?.to_dtype(dtype)
        })
        .map_err(at(&p.rotary))?;
        capture::emit_with(capture, &sub(&p.rotary, "1"), || {
            Tensor::cat(&[&tables.sin, &tables.sin], 1)?.to_dtype(dtype)
        })
        .map_err(at(&p.rotary))?;

        let causal = ops::CausalMask::new(t, dtype, &self.device).map_err(at(&p.model))?;
        for l in 0..self.config.num_hidden_layers {
            let layer: Vec<&DecoderLayer> = self.ranks.iter().map(|r| &r.layers[l]).collect();
            let path = layer[0].path();
            x = layer::forward_ranks(
                &layer,
                &x,
                &self.rope,
                &tables,
                &causal,
                self.options.dsa,
                capture,
            )
            .map_err(at(path))?;
        }

        let norm = self.norm().ok_or(ModelError::EmptyPrompt)?;
        let h = norm.forward(&x).map_err(at(&p.norm))?;
        capture::emit(capture, &p.norm, &h).map_err(at(&p.norm))?;
        capture::emit(capture, &p.model, &h).map_err(at(&p.model))?;
        let heads: Vec<&Linear> = self.ranks.iter().map(|r| &r.lm_head).collect();
        let logits =
            parallel::lm_head(&heads, &h, self.config.vocab_size).map_err(at(&p.lm_head))?; // [T, V]
        capture::emit(capture, &p.lm_head, &logits).map_err(at(&p.lm_head))?;
        capture::emit(capture, conv::LOGITS, &logits).map_err(at(conv::LOGITS))?;
        Ok(logits)
    }
}

/// A prompt the model can run: not empty, every id inside the vocabulary.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<(), ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::EmptyPrompt);
    }
    match tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= vocab)
    {
        Some((pos, &id)) => Err(ModelError::Token { id, pos, vocab }),
        None => Ok(()),
    }
}
