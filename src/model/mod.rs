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
pub mod capture;
pub mod indexer;
pub mod layer;
pub mod mlp;
pub mod moe;
pub(crate) mod names;
pub mod ops;

use candle_core::{DType, Device, Tensor};

use crate::arch::Config;
use crate::weights::{WeightError, Weights};

pub use attention::{AttnOut, Mla};
pub use capture::{Capture, NoCapture, VecCapture};
pub use indexer::Indexer;
pub use layer::{DecoderLayer, FeedForward};
pub use mlp::Mlp;
pub use moe::{Experts, Moe, Router, Routing};
pub use ops::{LayerNorm, Linear, RmsNorm, Rope, RopeLayout};

use crate::arch::glm_dsa::Role;
use names::{conv, sub, LayerPaths, MlpKind, ModelPaths};

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
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            dtype: DType::F32,
            dsa: DsaMode::Sparse,
        }
    }
}

/// `GlmMoeDsaForCausalLM`.
#[derive(Debug, Clone)]
pub struct Glm5 {
    /// `[V, hidden]`
    pub embed: Tensor,
    pub layers: Vec<DecoderLayer>,
    /// RMSNorm `[hidden]`, rms_norm_eps
    pub norm: RmsNorm,
    /// `[V, hidden]`
    pub lm_head: Linear,
    pub rope: Rope,
    config: Config,
    options: ModelOptions,
    paths: ModelPaths,
    device: Device,
}

/// Loads parameters in the compute dtype.
struct Loader<'w, 'a> {
    w: &'w Weights<'a>,
    dtype: DType,
}

impl Loader<'_, '_> {
    fn get(&self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        let name = p.name(layer)?;
        let t = self.w.hf(&name)?;
        t.to_dtype(self.dtype).map_err(|e| ModelError::Candle {
            module: name,
            source: e,
        })
    }

    /// Kept in f32 whatever the compute dtype.
    fn f32(&self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        Ok(self.w.hf(&p.name(layer)?)?)
    }

    /// Stored in the compute dtype but computed in f32 (transformers loads the router weight in
    /// the model dtype and upcasts it in forward).
    fn rounded_f32(&self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        let name = p.name(layer)?;
        let t = self.w.hf(&name)?;
        t.to_dtype(self.dtype)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| ModelError::Candle {
                module: name,
                source: e,
            })
    }

    fn stacked(&self, p: Role, layer: usize) -> Result<Tensor, ModelError> {
        let t = self.w.hf_stacked(p.template()?, layer)?;
        t.to_dtype(self.dtype).map_err(|e| ModelError::Candle {
            module: p.module(Some(layer)).unwrap_or_default(),
            source: e,
        })
    }

    fn linear(&self, p: Role, layer: Option<usize>) -> Result<Linear, ModelError> {
        Ok(Linear::new(self.get(p, layer)?))
    }

    fn swiglu(
        &self,
        gate: Role,
        up: Role,
        down: Role,
        l: usize,
        paths: names::SwiGluPaths,
    ) -> Result<Mlp, ModelError> {
        Ok(Mlp {
            gate: self.linear(gate, Some(l))?,
            up: self.linear(up, Some(l))?,
            down: self.linear(down, Some(l))?,
            paths,
        })
    }
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

    pub fn load_with(w: &Weights, options: ModelOptions) -> Result<Self, ModelError> {
        let c = w.config;
        validate(c)?;
        if !matches!(options.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(ModelError::Unsupported(format!(
                "compute dtype {:?} (F32, BF16 or F16)",
                options.dtype
            )));
        }
        let ld = Loader {
            w,
            dtype: options.dtype,
        };
        let eps = c.rms_norm_eps;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let moe = c.is_moe_layer(l);
            let paths = LayerPaths::new(l, moe)?;
            let li = Some(l);
            let indexer = Indexer {
                wq_b: ld.linear(Role::IndexerQB, li)?,
                wk: ld.linear(Role::IndexerK, li)?,
                k_norm: LayerNorm::new(
                    ld.get(Role::IndexerKNorm, li)?,
                    ld.get(Role::IndexerKNormBias, li)?,
                    indexer::K_NORM_EPS,
                ),
                weights_proj: Linear::new(ld.f32(Role::IndexerWeights, li)?),
                n_heads: c.index_n_heads,
                head_dim: c.index_head_dim,
                rope_dim: c.qk_rope_head_dim,
                topk: c.index_topk,
                paths: paths.attn.indexer.clone(),
            };
            let attn = Mla {
                q_a: ld.linear(Role::AttnQA, li)?,
                q_a_norm: RmsNorm::new(ld.get(Role::QANorm, li)?, attention::LATENT_NORM_EPS),
                q_b: ld.linear(Role::AttnQB, li)?,
                kv_a: ld.linear(Role::AttnKvA, li)?,
                kv_a_norm: RmsNorm::new(ld.get(Role::KvANorm, li)?, attention::LATENT_NORM_EPS),
                kv_b: ld.linear(Role::AttnKvB, li)?,
                o: ld.linear(Role::AttnOut, li)?,
                indexer,
                n_heads: c.num_attention_heads,
                nope: c.qk_nope_head_dim,
                rope_dim: c.qk_rope_head_dim,
                v_dim: c.v_head_dim,
                kv_lora: c.kv_lora_rank,
                // Default RoPE: no yarn mscale (transformers applies it only for rope_type != default
                // with mscale_all_dim; the GGUF config carries no rope scaling).
                scale: (c.qk_head_dim() as f64).powf(-0.5),
                paths: paths.attn.clone(),
            };
            let ffn = match paths.mlp.kind.clone() {
                MlpKind::Dense(p) => FeedForward::Dense(ld.swiglu(
                    Role::FfnGate,
                    Role::FfnUp,
                    Role::FfnDown,
                    l,
                    p,
                )?),
                MlpKind::Moe {
                    gate,
                    experts,
                    shared,
                } => FeedForward::Moe(Moe {
                    router: Router {
                        weight: Linear::new(ld.rounded_f32(Role::Router, li)?),
                        bias: ld.f32(Role::RouterBias, li)?,
                        top_k: c.num_experts_per_tok,
                        n_group: c.n_group,
                        topk_group: c.topk_group,
                        norm_topk_prob: c.norm_topk_prob,
                        routed_scaling_factor: c.routed_scaling_factor,
                        path: gate,
                    },
                    experts: Experts {
                        gate: ld.stacked(Role::ExpertGate, l)?,
                        up: ld.stacked(Role::ExpertUp, l)?,
                        down: ld.stacked(Role::ExpertDown, l)?,
                        path: experts,
                    },
                    shared: ld.swiglu(
                        Role::SharedGate,
                        Role::SharedUp,
                        Role::SharedDown,
                        l,
                        shared,
                    )?,
                    path: paths.mlp.module.clone(),
                }),
            };
            layers.push(DecoderLayer {
                input_norm: RmsNorm::new(ld.get(Role::InputNorm, li)?, eps),
                attn,
                post_norm: RmsNorm::new(ld.get(Role::PostAttnNorm, li)?, eps),
                ffn,
                path: paths.layer,
                input_norm_path: paths.input_norm,
                post_norm_path: paths.post_norm,
            });
        }
        let embed = ld.get(Role::Embedding, None)?;
        let lm_head = if c.tie_word_embeddings {
            Linear::new(embed.clone())
        } else {
            ld.linear(Role::LmHead, None)?
        };
        let paths = ModelPaths::new()?;
        let rope = Rope::new(
            c.qk_rope_head_dim,
            c.rope_theta,
            RopeLayout::Interleaved,
            &w.device,
        )
        .map_err(at(&paths.rotary))?;
        Ok(Glm5 {
            embed,
            layers,
            norm: RmsNorm::new(ld.get(Role::FinalNorm, None)?, eps),
            lm_head,
            rope,
            config: c.clone(),
            options,
            paths,
            device: w.device.clone(),
        })
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

        let mut x = self.embed.index_select(&ids, 0).map_err(at(&p.embed))?; // [T, hidden]
        capture::emit(capture, &p.embed, &x).map_err(at(&p.embed))?;

        let tables = self.rope.tables(t).map_err(at(&p.rotary))?;
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
        for layer in &self.layers {
            x = layer
                .forward(&x, &self.rope, &tables, &causal, self.options.dsa, capture)
                .map_err(at(&layer.path))?;
        }

        let h = self.norm.forward(&x).map_err(at(&p.norm))?;
        capture::emit(capture, &p.norm, &h).map_err(at(&p.norm))?;
        capture::emit(capture, &p.model, &h).map_err(at(&p.model))?;
        let logits = self.lm_head.forward(&h).map_err(at(&p.lm_head))?; // [T, V]
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
