//! Simulated tensor parallel: the GLM-5 forward computed as vLLM's `tp` ranks compute it, in one
//! process.
//!
//! Every rank holds its shards (cut from the GGUF by [`ShardPlan`], or read from a per-rank dump
//! `rank<r>.safetensors` under vLLM names, as `glmcheck inject` writes and a deployment can dump):
//! column-parallel `q_b_proj`/`kv_b_proj` (its heads), row-parallel `o_proj` (those heads' input
//! columns), merged column-parallel `gate_up_proj` and row-parallel `down_proj` for the dense MLP and
//! the shared experts, FusedMoE `w13` (gate rows r, up rows r) and `w2` (input columns r) for the
//! routed experts, vocab-parallel `embed_tokens` and `lm_head` (vocab padded to ×64); norms, the
//! latent projections, the indexer and the router are replicated. Each rank runs the model's own
//! modules ([`Mla`], [`Mlp`], [`Moe`]) on its shards with its share of the heads; partial results are
//! summed where vLLM all-reduces (after `o_proj`, after the MLP / MoE), the embedding's masked
//! lookups are summed and the lm_head's vocab slices gathered.
//!
//! The capture holds what the unsharded model would hold: column-parallel outputs concatenated over
//! ranks, row-parallel and MoE outputs summed, replicated outputs from rank 0, so that it compares
//! key by key with a transformers dump or the unsharded forward.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Tensor};

use crate::arch::glm_dsa::{self, Idx, Role, TpStyle, HF_TABLE, VLLM_TABLE};
use crate::dump::{DumpTensor, RankDump};
use crate::model::capture::{emit, emit_with};
use crate::model::names::{conv, sub, LayerPaths, MlpKind, ModelPaths};
use crate::model::{
    Capture, Experts, FeedForward, Glm5, Linear, Mla, Mlp, ModelError, Moe, VecCapture,
};
use crate::plan::ShardPlan;
use crate::weights::Weights;

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(transparent)]
    Model(Box<ModelError>),
    #[error("{0}")]
    Plan(String),
    #[error(transparent)]
    Weight(Box<crate::weights::WeightError>),
    #[error(transparent)]
    Dump(Box<crate::dump::DumpError>),
    #[error("{param} (rank {rank}): {err}")]
    Candle {
        param: String,
        rank: usize,
        err: Box<candle_core::Error>,
    },
    #[error("{param} (rank {rank}): the dump holds shape {got:?}, rank {rank} of tp={tp} needs {want:?}")]
    Shape {
        param: String,
        rank: usize,
        tp: usize,
        got: Vec<usize>,
        want: Vec<usize>,
    },
}

impl From<ModelError> for TpError {
    fn from(e: ModelError) -> Self {
        TpError::Model(Box::new(e))
    }
}

impl From<crate::weights::WeightError> for TpError {
    fn from(e: crate::weights::WeightError) -> Self {
        TpError::Weight(Box::new(e))
    }
}

impl From<crate::dump::DumpError> for TpError {
    fn from(e: crate::dump::DumpError) -> Self {
        TpError::Dump(Box::new(e))
    }
}

/// One rank's modules.
#[derive(Debug, Clone)]
struct Rank {
    layers: Vec<(Mla, FeedForward)>,
    /// `[V_pad / tp, hidden]` (this rank's vocab rows)
    embed: Tensor,
    lm_head: Tensor,
    /// Replicated parameters, possibly from the dump.
    input_norms: Vec<crate::model::RmsNorm>,
    post_norms: Vec<crate::model::RmsNorm>,
    norm: crate::model::RmsNorm,
}

/// The model as `tp` ranks run it.
#[derive(Debug, Clone)]
pub struct TpModel {
    base: Glm5,
    tp: usize,
    ranks: Vec<Rank>,
    /// vLLM's vocab rows per rank (padded vocab / tp).
    per_rank_vocab: usize,
    /// vLLM parameters the per-rank dump lacked (taken from the GGUF's cut instead).
    pub missing_from_dump: Vec<String>,
}

/// Where rank weights come from.
struct Source<'a> {
    w: &'a Weights<'a>,
    plan: &'a ShardPlan,
    dump: Option<Vec<BTreeMap<String, DumpTensor>>>,
    dtype: DType,
    missing: Vec<String>,
    cache: HashMap<String, Tensor>,
}

impl Source<'_> {
    /// Rank r's tensor of a vLLM parameter.
    fn vllm_rank(&mut self, vname: &str, r: usize) -> Result<Tensor, TpError> {
        let err = |err| TpError::Candle {
            param: vname.to_string(),
            rank: r,
            err: Box::new(err),
        };
        let plan = self
            .plan
            .params
            .iter()
            .find(|p| p.param == vname)
            .ok_or_else(|| TpError::Plan(format!("{vname}: not in the shard plan")))?;
        let want = plan
            .cuts
            .get(r)
            .map(|c| {
                let mut s = plan.full_shape.clone();
                if let Some(d) = s.get_mut(c.dim) {
                    *d = c.len();
                }
                s
            })
            .unwrap_or_else(|| plan.full_shape.clone());
        if let Some(dump) = &self.dump {
            if let Some(t) = dump.get(r).and_then(|m| m.get(vname)) {
                if t.shape != want {
                    return Err(TpError::Shape {
                        param: vname.to_string(),
                        rank: r,
                        tp: self.plan.tp,
                        got: t.shape.clone(),
                        want,
                    });
                }
                return Tensor::from_vec(t.to_f32(), t.shape.as_slice(), &self.w.device)
                    .map_err(err);
            }
            if !self.missing.iter().any(|m| m == vname) {
                self.missing.push(vname.to_string());
            }
        }
        if !self.cache.contains_key(vname) {
            let full = self.w.vllm(vname)?;
            self.cache.insert(vname.to_string(), full);
        }
        let full = &self.cache[vname];
        plan.shard(full, r).map_err(err)
    }

    /// Rank r's piece of one HF parameter (a part of a fused vLLM parameter split back out), in
    /// `dtype`.
    fn hf_rank(
        &mut self,
        p: Role,
        layer: Option<usize>,
        r: usize,
        dtype: DType,
    ) -> Result<Tensor, TpError> {
        let def = p.def()?;
        let (vdef, part) = VLLM_TABLE
            .iter()
            .find_map(|v| v.parts.iter().position(|x| *x == def.hf).map(|i| (v, i)))
            .ok_or_else(|| TpError::Plan(format!("{}: no vLLM parameter holds it", def.hf)))?;
        let vname = glm_dsa::name(
            vdef.vllm,
            Idx {
                layer,
                expert: None,
            },
        );
        let t = self.vllm_rank(&vname, r)?;
        let err = |err| TpError::Candle {
            param: vname.clone(),
            rank: r,
            err: Box::new(err),
        };
        let t = if vdef.parts.len() == 1 {
            t
        } else {
            let sharded = matches!(vdef.style, TpStyle::MergedColumn | TpStyle::MoeW13);
            let dim = if vdef.style == TpStyle::MoeW13 {
                1
            } else {
                vdef.cat_dim
            };
            let sizes: Vec<usize> = vdef
                .parts
                .iter()
                .map(|part| {
                    HF_TABLE
                        .iter()
                        .find(|d| d.hf == *part)
                        .map(|d| glm_dsa::resolve(d.shape, self.w.config)[0])
                        .unwrap_or(0)
                })
                .map(|n| if sharded { n / self.plan.tp } else { n })
                .collect();
            let start: usize = sizes[..part].iter().sum();
            t.narrow(dim, start, sizes[part]).map_err(err)?
        };
        t.to_dtype(dtype).map_err(err)
    }

    fn linear(&mut self, p: Role, l: usize, r: usize) -> Result<Linear, TpError> {
        Ok(Linear::new(self.hf_rank(p, Some(l), r, self.dtype)?))
    }
}

impl TpModel {
    /// Builds the ranks' modules from `base` (the unsharded model, for its structure and
    /// replicated settings) with every parameter from the plan's cut of `w`, or from `dump`.
    pub fn new(
        base: &Glm5,
        w: &Weights,
        plan: &ShardPlan,
        dump: Option<&RankDump>,
    ) -> Result<Self, TpError> {
        let tp = plan.tp;
        let c = base.config();
        if let Some(p) = plan.params.iter().find(|p| !p.problems.is_empty()) {
            return Err(TpError::Plan(format!(
                "{} cannot be sharded at tp={tp}: {}",
                p.param,
                p.problems.join("; ")
            )));
        }
        let dump = match dump {
            Some(d) => Some(
                (0..tp)
                    .map(|r| d.load_rank(r).map(Option::unwrap_or_default))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
        let dtype = base.options().dtype;
        let mut src = Source {
            w,
            plan,
            dump,
            dtype,
            missing: Vec::new(),
            cache: HashMap::new(),
        };
        let heads = c.num_attention_heads / tp;
        let mut ranks = Vec::with_capacity(tp);
        for r in 0..tp {
            let mut layers = Vec::with_capacity(base.layers.len());
            let mut input_norms = Vec::new();
            let mut post_norms = Vec::new();
            for (l, layer) in base.layers.iter().enumerate() {
                let li = Some(l);
                let mut a = layer.attn.clone();
                a.q_a = Linear::new(src.hf_rank(Role::AttnQA, li, r, dtype)?);
                a.kv_a = Linear::new(src.hf_rank(Role::AttnKvA, li, r, dtype)?);
                a.q_a_norm.weight = src.hf_rank(Role::QANorm, li, r, dtype)?;
                a.kv_a_norm.weight = src.hf_rank(Role::KvANorm, li, r, dtype)?;
                a.q_b = src.linear(Role::AttnQB, l, r)?;
                a.kv_b = src.linear(Role::AttnKvB, l, r)?;
                a.o = src.linear(Role::AttnOut, l, r)?;
                a.n_heads = heads;
                a.indexer.wq_b = src.linear(Role::IndexerQB, l, r)?;
                a.indexer.wk = src.linear(Role::IndexerK, l, r)?;
                a.indexer.weights_proj =
                    Linear::new(src.hf_rank(Role::IndexerWeights, li, r, DType::F32)?);
                a.indexer.k_norm.weight = src.hf_rank(Role::IndexerKNorm, li, r, dtype)?;
                a.indexer.k_norm.bias = src.hf_rank(Role::IndexerKNormBias, li, r, dtype)?;
                let ffn = match &layer.ffn {
                    FeedForward::Dense(m) => FeedForward::Dense(Mlp {
                        gate: src.linear(Role::FfnGate, l, r)?,
                        up: src.linear(Role::FfnUp, l, r)?,
                        down: src.linear(Role::FfnDown, l, r)?,
                        paths: m.paths.clone(),
                    }),
                    FeedForward::Moe(m) => {
                        let mut router = m.router.clone();
                        let rw = src.hf_rank(Role::Router, li, r, dtype)?;
                        router.weight = Linear::new(rw.to_dtype(DType::F32).map_err(|err| {
                            TpError::Candle {
                                param: "router".into(),
                                rank: r,
                                err: Box::new(err),
                            }
                        })?);
                        router.bias = src.hf_rank(Role::RouterBias, li, r, DType::F32)?;
                        FeedForward::Moe(Moe {
                            router,
                            experts: Experts {
                                gate: src.hf_rank(Role::ExpertGate, li, r, dtype)?,
                                up: src.hf_rank(Role::ExpertUp, li, r, dtype)?,
                                down: src.hf_rank(Role::ExpertDown, li, r, dtype)?,
                                path: m.experts.path.clone(),
                            },
                            shared: Mlp {
                                gate: src.linear(Role::SharedGate, l, r)?,
                                up: src.linear(Role::SharedUp, l, r)?,
                                down: src.linear(Role::SharedDown, l, r)?,
                                paths: m.shared.paths.clone(),
                            },
                            path: m.path.clone(),
                        })
                    }
                };
                let mut inorm = layer.input_norm.clone();
                inorm.weight = src.hf_rank(Role::InputNorm, li, r, dtype)?;
                let mut pnorm = layer.post_norm.clone();
                pnorm.weight = src.hf_rank(Role::PostAttnNorm, li, r, dtype)?;
                input_norms.push(inorm);
                post_norms.push(pnorm);
                layers.push((a, ffn));
            }
            let mut norm = base.norm.clone();
            norm.weight = src.hf_rank(Role::FinalNorm, None, r, dtype)?;
            ranks.push(Rank {
                layers,
                embed: src.hf_rank(Role::Embedding, None, r, dtype)?,
                lm_head: src.hf_rank(Role::LmHead, None, r, dtype)?,
                input_norms,
                post_norms,
                norm,
            });
        }
        Ok(TpModel {
            base: base.clone(),
            tp,
            ranks,
            per_rank_vocab: crate::plan::padded_vocab(c.vocab_size) / tp,
            missing_from_dump: src.missing,
        })
    }

    pub fn tp(&self) -> usize {
        self.tp
    }

    pub fn base(&self) -> &Glm5 {
        &self.base
    }

    /// Token ids `[T]` → logits `[T, V]`, the merged outputs of every module sent to `capture` in
    /// execution order.
    pub fn forward(&self, tokens: &[u32], capture: &mut dyn Capture) -> Result<Tensor, ModelError> {
        let c = self.base.config();
        let vocab = c.vocab_size;
        crate::model::check_tokens(tokens, vocab)?;
        let p = ModelPaths::new()?;
        let at = |m: &str| {
            let m = m.to_string();
            move |source| ModelError::Candle { module: m, source }
        };
        let dev = self.base.device();
        let dtype = self.base.options().dtype;
        let t = tokens.len();
        let ids = Tensor::new(tokens, dev).map_err(at(conv::INPUT_IDS))?;
        emit_with(capture, conv::INPUT_IDS, || ids.to_dtype(DType::I64))
            .map_err(at(conv::INPUT_IDS))?;
        emit_with(capture, conv::POSITION_IDS, || {
            Tensor::arange(0i64, t as i64, dev)
        })
        .map_err(at(conv::POSITION_IDS))?;

        // Vocab-parallel embedding: each rank looks up the ids in its rows, zero elsewhere; summed.
        let mut x: Option<Tensor> = None;
        for (r, rank) in self.ranks.iter().enumerate() {
            let lo = r * self.per_rank_vocab;
            let rows = rank.embed.dim(0).map_err(at(&p.embed))?;
            let local: Vec<u32> = tokens
                .iter()
                .map(|&id| {
                    (id as usize)
                        .checked_sub(lo)
                        .filter(|&i| i < rows)
                        .unwrap_or(0) as u32
                })
                .collect();
            let mask: Vec<f32> = tokens
                .iter()
                .map(|&id| {
                    let ok = (id as usize).checked_sub(lo).is_some_and(|i| i < rows);
                    if ok {
                        1.0
                    } else {
                        0.0
                    }
                })
                .collect();
            let e = (|| {
                let local = Tensor::new(local.as_slice(), dev)?;
                let mask = Tensor::from_vec(mask, (t, 1), dev)?.to_dtype(dtype)?;
                rank.embed.index_select(&local, 0)?.broadcast_mul(&mask)
            })()
            .map_err(at(&p.embed))?;
            x = Some(match x {
                None => e,
                Some(s) => (s + e).map_err(at(&p.embed))?,
            });
        }
        let mut x = x.ok_or(ModelError::EmptyPrompt)?;
        emit(capture, &p.embed, &x).map_err(at(&p.embed))?;

        let rope = &self.base.rope;
        let tables = rope.tables(t).map_err(at(&p.rotary))?;
        emit_with(capture, &p.rotary, || {
            Tensor::cat(&[&tables.cos, &tables.cos], 1)?.to_dtype(dtype)
        })
        .map_err(at(&p.rotary))?;
        emit_with(capture, &sub(&p.rotary, "1"), || {
            Tensor::cat(&[&tables.sin, &tables.sin], 1)?.to_dtype(dtype)
        })
        .map_err(at(&p.rotary))?;
        let causal = crate::model::ops::CausalMask::new(t, dtype, dev).map_err(at(&p.model))?;
        let mode = self.base.dsa_mode();

        for (l, base_layer) in self.base.layers.iter().enumerate() {
            let path = base_layer.path.clone();
            let lp = LayerPaths::new(l, matches!(base_layer.ffn, FeedForward::Moe(_)))?;
            let h = self.ranks[0].input_norms[l]
                .forward(&x)
                .map_err(at(&path))?;
            emit(capture, &base_layer.input_norm_path, &h).map_err(at(&path))?;

            // Attention: every rank its heads; o_proj partial sums all-reduced.
            let mut caps: Vec<RankCapture> = (0..self.tp).map(|_| RankCapture::default()).collect();
            let mut attn: Option<Tensor> = None;
            let mut topk = None;
            for r in 0..self.tp {
                let (mla, _) = &self.ranks[r].layers[l];
                if r > 0 {
                    let decided = caps[0].decided.clone();
                    caps[r].decided = decided;
                }
                let cap = &mut caps[r];
                cap.outer_replace = r == 0;
                let mut bridge = Bridge {
                    rank: cap,
                    outer: &mut *capture,
                };
                let out = mla
                    .forward(&h, rope, &tables, &causal, mode, &mut bridge)
                    .map_err(at(&path))?;
                topk = out.topk;
                attn = Some(match attn {
                    None => out.hidden,
                    Some(s) => (s + out.hidden).map_err(at(&path))?,
                });
            }
            merge(&caps, &lp, capture).map_err(at(&path))?;
            let attn = attn.ok_or(ModelError::EmptyPrompt)?;
            x = (x + attn).map_err(at(&path))?;
            let h = self.ranks[0].post_norms[l].forward(&x).map_err(at(&path))?;
            emit(capture, &base_layer.post_norm_path, &h).map_err(at(&path))?;

            // Feed-forward: partial sums all-reduced once (routed + shared, as vLLM's MoE).
            let mut caps: Vec<RankCapture> = (0..self.tp).map(|_| RankCapture::default()).collect();
            let mut y: Option<Tensor> = None;
            for (r, cap) in caps.iter_mut().enumerate() {
                let (_, ffn) = &self.ranks[r].layers[l];
                let part = match ffn {
                    FeedForward::Dense(m) => m.forward(&h, cap),
                    FeedForward::Moe(m) => m.forward(&h, cap),
                }
                .map_err(at(&path))?;
                y = Some(match y {
                    None => part,
                    Some(s) => (s + part).map_err(at(&path))?,
                });
            }
            merge(&caps, &lp, capture).map_err(at(&path))?;
            let y = y.ok_or(ModelError::EmptyPrompt)?;
            x = (x + y).map_err(at(&path))?;
            emit(capture, &path, &x).map_err(at(&path))?;
            if let Some(ids) = &topk {
                emit_with(capture, &sub(&path, "1"), || ids.to_dtype(DType::I64))
                    .map_err(at(&path))?;
            }
        }

        let h = self.ranks[0].norm.forward(&x).map_err(at(&p.norm))?;
        emit(capture, &p.norm, &h).map_err(at(&p.norm))?;
        emit(capture, &p.model, &h).map_err(at(&p.model))?;
        // Parallel lm_head: each rank its vocab rows; gathered, padding dropped.
        let parts = self
            .ranks
            .iter()
            .map(|rank| h.matmul(&rank.lm_head.t()?))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(at(&p.lm_head))?;
        let logits = Tensor::cat(&parts, 1)
            .and_then(|l| l.narrow(1, 0, vocab))
            .map_err(at(&p.lm_head))?;
        emit(capture, &p.lm_head, &logits).map_err(at(&p.lm_head))?;
        emit(capture, conv::LOGITS, &logits).map_err(at(conv::LOGITS))?;
        Ok(logits)
    }
}

/// One rank's captures of one layer half, and the top-k replacement decided for all ranks.
#[derive(Default)]
struct RankCapture {
    entries: VecCapture,
    decided: HashMap<String, Option<Tensor>>,
    outer_replace: bool,
}

impl Capture for RankCapture {
    fn capture(&mut self, path: &str, tensor: &Tensor) -> candle_core::Result<()> {
        self.entries.capture(path, tensor)
    }
}

/// Rank 0 asks the outer capture whether to replace the indexer's top-k (a reference replay) and
/// every other rank applies the same decision: the indexer is replicated.
struct Bridge<'a> {
    rank: &'a mut RankCapture,
    outer: &'a mut dyn Capture,
}

impl Capture for Bridge<'_> {
    fn capture(&mut self, path: &str, tensor: &Tensor) -> candle_core::Result<()> {
        self.rank.capture(path, tensor)
    }

    fn replace(&mut self, path: &str, ours: &Tensor) -> candle_core::Result<Option<Tensor>> {
        if self.rank.outer_replace {
            let d = self.outer.replace(path, ours)?;
            self.rank.decided.insert(path.to_string(), d.clone());
            Ok(d)
        } else {
            Ok(self.rank.decided.get(path).cloned().flatten())
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Merge {
    Replicated,
    Sum,
    /// Column-parallel outputs: ranks' pieces concatenated along this dim.
    Cat(usize),
}

fn merge_op(key: &str, lp: &LayerPaths) -> Merge {
    let a = &lp.attn;
    let s = |x: &str| format!("{}.{x}", a.module);
    if key == a.o || key == a.module || key == lp.mlp.module {
        return Merge::Sum;
    }
    if key == a.q_b {
        return Merge::Cat(1);
    }
    if key == a.kv_b {
        return Merge::Cat(2);
    }
    if [
        s(conv::QUERY_STATES),
        s(conv::KEY_STATES),
        s(conv::VALUE_STATES),
        s("1"),
    ]
    .iter()
    .any(|k| k == key)
    {
        return Merge::Cat(0);
    }
    let swiglu = |p: &crate::model::names::SwiGluPaths| {
        if key == p.down || key == p.module {
            Some(Merge::Sum)
        } else if key == p.gate || key == p.up || key == p.act {
            Some(Merge::Cat(1))
        } else {
            None
        }
    };
    match &lp.mlp.kind {
        MlpKind::Dense(p) => swiglu(p).unwrap_or(Merge::Replicated),
        MlpKind::Moe {
            experts, shared, ..
        } => {
            if key == experts {
                Merge::Sum
            } else if key.starts_with(&format!("{experts}.{}", conv::ACT)) {
                Merge::Cat(1)
            } else {
                swiglu(shared).unwrap_or(Merge::Replicated)
            }
        }
    }
}

/// Sends the ranks' captures to `out` as the unsharded model would have them, in rank 0's order.
fn merge(caps: &[RankCapture], lp: &LayerPaths, out: &mut dyn Capture) -> candle_core::Result<()> {
    for (i, (key, t0)) in caps[0].entries.entries.iter().enumerate() {
        let parts: Vec<&Tensor> = caps
            .iter()
            .filter_map(|c| c.entries.entries.get(i).map(|(_, t)| t))
            .collect();
        let merged = match merge_op(key, lp) {
            Merge::Replicated => t0.clone(),
            Merge::Sum => {
                let mut s = t0.clone();
                for p in &parts[1..] {
                    s = (s + *p)?;
                }
                s
            }
            Merge::Cat(d) => Tensor::cat(&parts, d)?,
        };
        emit(out, key, &merged)?;
    }
    Ok(())
}

/// Either forward.
pub enum Runner<'a> {
    Plain(&'a Glm5),
    Tp(&'a TpModel),
}

impl Runner<'_> {
    pub fn forward(&self, tokens: &[u32], capture: &mut dyn Capture) -> Result<Tensor, ModelError> {
        match self {
            Runner::Plain(m) => m.forward(tokens, capture),
            Runner::Tp(m) => m.forward(tokens, capture),
        }
    }

    pub fn base(&self) -> &Glm5 {
        match self {
            Runner::Plain(m) => m,
            Runner::Tp(m) => m.base(),
        }
    }
}
