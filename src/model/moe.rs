//! The MoE block: sigmoid router with group-limited top-k (`noaux_tc`), routed SwiGLU experts and a
//! shared expert. transformers 5.23 `GlmMoeDsaTopkRouter`, `GlmMoeDsaExperts` (eager),
//! `GlmMoeDsaMoE`.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor, D};

use super::capture::{emit, emit_with, Capture};
use super::grouping::routed_rows;
use super::host_ids::HostIds;
use super::linear::{Blocks, Linear, MatmulMode};
use super::mlp::Mlp;
use super::names::SwiGluPaths;
use super::names::{conv, nth_call, sub};
use super::ops::{one_hot_rows, topk_indices};
use super::source::{Params, WeightSource};
use super::ModelError;
use crate::arch::glm_dsa::Role;
use crate::arch::Config;

#[derive(Debug, Clone)]
pub struct Router {
    /// `[E, hidden]` f32 (transformers runs the router in f32 whatever the model dtype)
    pub weight: Linear,
    /// `e_score_correction_bias` `[E]` f32
    pub bias: Tensor,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    pub gating: Gating,
    pub(crate) path: String,
}

/// How the router turns its logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// GLM-5's (transformers' `GlmMoeDsaTopkRouter`): sigmoid per expert.
    Sigmoid,
    /// Softmax over the experts (`router-softmax`: a loader that drops `expert_gating_func`).
    Softmax,
}

/// The router's three outputs.
#[derive(Debug, Clone)]
pub struct Routing {
    /// `[T, E]` f32, pre-sigmoid
    pub logits: Tensor,
    /// `[T, top_k]` f32: unbiased sigmoid scores of the chosen experts, normalised, × scaling
    pub weights: Tensor,
    /// `[T, top_k]` U32 expert ids, best (biased score) first
    pub indices: Tensor,
}

impl Router {
    /// Layer `l`'s router (replicated): the weight rounded to the compute dtype and run in f32, the
    /// correction bias in f32.
    pub(crate) fn new<S: WeightSource + ?Sized>(
        c: &Config,
        l: usize,
        vb: &mut Params<S>,
        path: String,
    ) -> std::result::Result<Self, ModelError> {
        Ok(Router {
            weight: Linear::new(vb.rounded_f32(Role::Router, Some(l))?),
            bias: vb.f32(Role::RouterBias, Some(l))?,
            top_k: c.num_experts_per_tok,
            n_group: c.n_group,
            topk_group: c.topk_group,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor,
            gating: Gating::Sigmoid,
            path,
        })
    }

    /// `[T, hidden]` → routing.
    ///
    /// scores = sigmoid(x·Wᵀ) (f32); choice = scores + e_score_correction_bias (for the choice
    /// only); group score = sum of the top-2 choice scores in each of n_group groups; keep the
    /// topk_group best groups, mask the rest to −inf; top_k experts by choice score; weights =
    /// the unbiased scores of those experts, / (Σ + 1e-20) if norm_topk_prob, × routed_scaling_factor.
    pub fn forward(&self, x: &Tensor) -> Result<Routing> {
        let (t, _) = x.dims2()?;
        let logits = self.weight.forward(&x.to_dtype(DType::F32)?)?; // [T, E]
        let e = logits.dim(1)?;
        let per_group = e / self.n_group;
        let scores = match self.gating {
            Gating::Sigmoid => candle_nn::ops::sigmoid(&logits)?,
            Gating::Softmax => candle_nn::ops::softmax_last_dim(&logits)?,
        };
        let choice = scores.broadcast_add(&self.bias)?;

        // [T, G, E/G] → top-2 per group, summed → [T, G]
        let (sorted, _) = choice
            .reshape((t, self.n_group, per_group))?
            .contiguous()?
            .sort_last_dim(false)?;
        let group_scores = sorted.narrow(D::Minus1, 0, 2)?.sum(D::Minus1)?;
        let groups = topk_indices(&group_scores, self.topk_group)?; // [T, topk_group]
        let group_mask = one_hot_rows(&groups, self.n_group)?; // [T, G] U8
        let expert_mask = group_mask
            .unsqueeze(2)?
            .broadcast_as((t, self.n_group, per_group))?
            .reshape((t, e))?;
        let neg_inf = Tensor::full(f32::NEG_INFINITY, (t, e), x.device())?;
        let choice = expert_mask.where_cond(&choice, &neg_inf)?;
        let indices = topk_indices(&choice, self.top_k)?; // [T, k] U32
        let mut weights = scores.gather(&indices, 1)?; // [T, k]
        if self.norm_topk_prob {
            let denom = (weights.sum_keepdim(1)? + 1e-20)?;
            weights = weights.broadcast_div(&denom)?;
        }
        let weights = (weights * self.routed_scaling_factor)?;
        Ok(Routing {
            logits,
            weights,
            indices,
        })
    }
}

/// One projection of every routed expert.
#[derive(Debug, Clone)]
pub enum ExpertStack {
    /// `[E, out, in]` in the compute dtype.
    Dense(Tensor),
    /// The GGUF's blocks as stored, one `[out, in]` quantized tensor per expert on the device,
    /// dequantized into `dtype` only when the expert has tokens (or, in q8 mode, multiplied by
    /// the quantized kernels): a layer's experts stay at their quantized size.
    Blocks {
        experts: Vec<Blocks>,
        dtype: DType,
        mode: MatmulMode,
    },
    /// The whole `[E, out, in]` stack as one quantized tensor on a CUDA device. q8 mode: the
    /// grouped MoE kernel (`q8_cuda`), every expert that has tokens in one launch, its weights
    /// read once. Dequant mode: the experts that have tokens decoded in one launch and multiplied
    /// in one batched GEMM per projection.
    Stacked {
        q: Arc<QTensor>,
        dtype: DType,
        mode: MatmulMode,
    },
}

impl ExpertStack {
    pub fn len(&self) -> Result<usize> {
        match self {
            ExpertStack::Dense(t) => t.dim(0),
            ExpertStack::Blocks { experts, .. } => Ok(experts.len()),
            ExpertStack::Stacked { q, .. } => q.shape().dims().first().copied().ok_or_else(|| {
                candle_core::Error::Msg("an expert stack with no expert dimension".into())
            }),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len().is_ok_and(|n| n == 0)
    }

    /// Expert `e`'s weight `[out, in]` in the compute dtype.
    pub fn expert(&self, e: usize) -> Result<Tensor> {
        match self {
            ExpertStack::Dense(t) => t.get(e),
            ExpertStack::Blocks { dtype, .. } => self.block(e)?.dequantize(*dtype),
            // Only the fused kernel reads a stacked tensor; decoding the whole stack for one
            // expert would hold it in f32 (a GLM-5 stack: 12.9 GB).
            ExpertStack::Stacked { .. } => {
                candle_core::bail!("expert {e} of a stacked tensor: only the fused kernel reads it")
            }
        }
    }

    fn block(&self, e: usize) -> Result<&Blocks> {
        match self {
            ExpertStack::Blocks { experts, .. } => experts
                .get(e)
                .ok_or_else(|| candle_core::Error::Msg(format!("expert {e} of {}", experts.len()))),
            _ => candle_core::bail!("expert {e} is not held as its own blocks"),
        }
    }

    /// Expert `e` applied to its tokens: `xs` `[n, in]` → `[n, out]` in `xs`'s dtype.
    pub fn apply(&self, e: usize, xs: &Tensor) -> Result<Tensor> {
        match self {
            ExpertStack::Blocks { dtype, mode, .. } => self.block(e)?.matmul(xs, *dtype, *mode),
            _ => xs.matmul(&self.expert(e)?.t()?),
        }
    }
}

/// The routed experts, stacked.
#[derive(Debug, Clone)]
pub struct Experts {
    /// `[E, moe_inter, hidden]`
    pub gate: ExpertStack,
    /// `[E, moe_inter, hidden]`
    pub up: ExpertStack,
    /// `[E, hidden, moe_inter]`
    pub down: ExpertStack,
    pub(crate) path: String,
}

impl Experts {
    /// Layer `l`'s routed experts, stacked; per rank `moe_inter / tp` of every expert (vLLM's
    /// FusedMoE `w13` rows and `w2` columns).
    pub(crate) fn new<S: WeightSource + ?Sized>(
        l: usize,
        vb: &mut Params<S>,
        path: String,
    ) -> std::result::Result<Self, ModelError> {
        let roles = [Role::ExpertGate, Role::ExpertUp, Role::ExpertDown];
        let mut stacks = roles
            .iter()
            .map(|&r| vb.experts(r, l))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // The fused kernel needs all three stacks; a layer where one type cannot be fused holds
        // all three per expert (a stack is never dequantized whole).
        let fused = |s: &ExpertStack| matches!(s, ExpertStack::Stacked { .. });
        if stacks.iter().any(fused) && !stacks.iter().all(fused) {
            for (s, &r) in stacks.iter_mut().zip(&roles) {
                if fused(s) {
                    *s = vb.experts_as(r, l, None)?;
                }
            }
        }
        let [gate, up, down]: [ExpertStack; 3] = stacks
            .try_into()
            .map_err(|_| ModelError::NameTable("three expert stacks".into()))?;
        Ok(Experts {
            gate,
            up,
            down,
            path,
        })
    }

    /// `x` `[T, hidden]` → `Σ_k w_k · expert_{id_k}(x)` `[T, hidden]`.
    ///
    /// Like transformers' eager loop: experts in ascending id order, each on the tokens that chose
    /// it, results accumulated in that order. `ids` is the routing on its way to the host
    /// ([`HostIds`], started by the caller), from which the per-expert token lists are built.
    /// `act_fn` of the n-th expert that got tokens is captured as `experts.act_fn#n` with its rows
    /// in ascending token order.
    /// transformers' rows follow `torch.where` over `[slot, token]`, i.e. slot-major with slots in
    /// `topk(sorted=False)` order, which depends on torch's top-k internals; compare per token.
    pub fn forward(
        &self,
        x: &Tensor,
        r: &Routing,
        ids: HostIds,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        let (ids, k) = ids.wait()?;
        #[cfg(feature = "cuda")]
        if let (
            ExpertStack::Stacked { q: g, mode, .. },
            ExpertStack::Stacked { q: u, .. },
            ExpertStack::Stacked { q: d, .. },
        ) = (&self.gate, &self.up, &self.down)
        {
            let grouping =
                super::grouping::Grouping::from_host(&ids, k, self.gate.len()?, x.device())?;
            return match mode {
                MatmulMode::Q8 => self.fused([g, u, d], x, r, &grouping, capture),
                MatmulMode::Dequant => {
                    if [g, u, d]
                        .iter()
                        .all(|q| super::moe_cuda::tiled_dequant(q, x.dtype()))
                    {
                        self.tiled([g, u, d], x, r, &grouping, capture)
                    } else {
                        self.batched([g, u, d], x, r, &grouping, capture)
                    }
                }
            };
        }
        let (t, hidden) = x.dims2()?;
        let per_expert = routed_rows(&ids, k, self.gate.len()?)?;
        let act_path = sub(&self.path, conv::ACT);
        let (mut tokens_all, mut slots_all, mut contribs) = (Vec::new(), Vec::new(), Vec::new());
        let mut hit = 0;
        for (e, list) in per_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let toks: Vec<u32> = list.iter().map(|&(tok, _)| tok).collect();
            let flat: Vec<u32> = list.iter().map(|&(_, f)| f).collect();
            let n = toks.len();
            let toks = Tensor::from_vec(toks, n, x.device())?;
            let xs = x.index_select(&toks, 0)?; // [n, hidden]
            let gate = self.gate.apply(e, &xs)?; // [n, inter]
            let act = gate.silu()?;
            emit(capture, &nth_call(&act_path, hit), &act)?;
            hit += 1;
            let up = self.up.apply(e, &xs)?;
            contribs.push(self.down.apply(e, &(act * up)?)?); // [n, hidden]
            tokens_all.push(toks);
            slots_all.push(Tensor::from_vec(flat, n, x.device())?);
        }
        if contribs.is_empty() {
            return Tensor::zeros((t, hidden), x.dtype(), x.device());
        }
        let cat = |v: &[Tensor]| Tensor::cat(v, 0);
        weighted_sum(
            t,
            &cat(&contribs)?,
            &cat(&tokens_all)?,
            &cat(&slots_all)?,
            &r.weights,
        )
    }
}

/// The routed experts' outputs `ys` `[R, hidden]` (rows in expert order: experts ascending, tokens
/// ascending within one; row j is token `tokens[j]`'s slot `slots[j] = token·k + slot`) weighted
/// and summed into `[T, hidden]`. As transformers: each output (compute dtype) × its f32 routing
/// weight, back to the compute dtype, then one `index_add` in row order = the sequential
/// per-expert sums of its eager loop.
fn weighted_sum(
    t: usize,
    ys: &Tensor,
    tokens: &Tensor,
    slots: &Tensor,
    weights: &Tensor,
) -> Result<Tensor> {
    let (dtype, hidden) = (ys.dtype(), ys.dim(1)?);
    let w = weights
        .flatten_all()?
        .index_select(slots, 0)?
        .unsqueeze(1)?; // [R, 1] f32
    let ys = ys
        .to_dtype(DType::F32)?
        .broadcast_mul(&w)?
        .to_dtype(dtype)?;
    Tensor::zeros((t, hidden), dtype, ys.device())?.index_add(tokens, &ys, 0)
}

#[cfg(feature = "cuda")]
impl Experts {
    /// q8 mode on CUDA: every expert that has tokens runs once over all of them, in one grouped
    /// launch per projection (`q8_cuda`: the int8 kernel or llama.cpp's MMQ, activations
    /// quantized to Q8_1 as llama.cpp's kernels do (from bf16 as they are), f32 out); the
    /// outputs are weighted in f32 and summed over the k slots. The routing is read back to group
    /// the rows (a device sync per MoE layer).
    fn fused(
        &self,
        [g, u, d]: [&Arc<QTensor>; 3],
        x: &Tensor,
        r: &Routing,
        grouping: &super::grouping::Grouping,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        let (t, hidden) = x.dims2()?;
        let xq = super::q8_cuda::q8_input(x)?; // [T, hidden], bf16 or f32
        let act = grouping.matmul(g, &xq, true)?.silu()?; // [T·k, inter]
        let up = grouping.matmul(u, &xq, true)?;
        let y = grouping.matmul(d, &(&act * up)?, false)?; // [T·k, hidden]
        let k = r.indices.dim(1)?;
        let act_path = sub(&self.path, conv::ACT);
        if capture.wants(&nth_call(&act_path, 0)) {
            // The per-expert captures of the eager loop: experts ascending, tokens ascending.
            let flat_act = act.to_dtype(x.dtype())?;
            for (hit, rows) in grouping.by_expert.iter().enumerate() {
                let rows = Tensor::from_slice(rows, rows.len(), x.device())?;
                emit(
                    capture,
                    &nth_call(&act_path, hit),
                    &flat_act.index_select(&rows, 0)?,
                )?;
            }
        }
        let y = y.reshape((t, k, hidden))?;
        // One launch for candle's multiply → sum → cast, same roundings (`fused_cuda`).
        if let Some(out) = super::fused_cuda::slot_sum(&y, &r.weights, x.dtype())? {
            return Ok(out);
        }
        y.broadcast_mul(&r.weights.unsqueeze(2)?)?
            .sum(1)?
            .to_dtype(x.dtype())
    }
}

#[cfg(feature = "cuda")]
impl Experts {
    /// Dequant mode on CUDA in bf16/f16: [`Experts::batched`]'s arithmetic (weights decoded into
    /// the compute dtype, products summed in f32, each projection rounded to the compute dtype,
    /// SiLU and the gate·up product in the compute dtype) in one tiled kernel per projection that
    /// decodes the blocks in shared memory (`cuda/dequant_gemm.cu`): the decoded weights never
    /// reach device memory, and no row is padded.
    fn tiled(
        &self,
        [g, u, d]: [&Arc<QTensor>; 3],
        x: &Tensor,
        r: &Routing,
        grouping: &super::grouping::Grouping,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let x = x.contiguous()?;
        let act = grouping.dequant_matmul(g, &x, true)?.silu()?; // [R, inter], grouped order
        let up = grouping.dequant_matmul(u, &x, true)?;
        let y = grouping.dequant_matmul(d, &(&act * up)?, false)?; // [R, hidden]
        let act_path = sub(&self.path, conv::ACT);
        if capture.wants(&nth_call(&act_path, 0)) {
            emit_grouped_acts(capture, &act_path, grouping, &act)?;
        }
        grouped_sum(t, grouping, &y, &r.weights)
    }
}

/// The decoded expert weights one batch of dequant mode's batched GEMMs holds at once, per
/// projection, and separately its padded activations: 2 GiB each (a GLM-5 bf16 expert projection
/// is 25 MB: ~80 experts per batch).
#[cfg(feature = "cuda")]
const DECODE_BUDGET_BYTES: usize = 2 << 30;

#[cfg(feature = "cuda")]
impl Experts {
    /// Dequant mode on CUDA, the eager loop's arithmetic batched: the experts that have tokens
    /// are decoded into the compute dtype in one launch per projection (in runs whose weights fit
    /// [`DECODE_BUDGET_BYTES`]), each expert's tokens padded to the busiest expert's count of the
    /// run, and multiplied in one batched GEMM; the real rows are then weighted (f32) and summed
    /// in the eager loop's order (experts ascending, tokens ascending) by one `index_add`.
    fn batched(
        &self,
        [g, u, d]: [&Arc<QTensor>; 3],
        x: &Tensor,
        r: &Routing,
        grouping: &super::grouping::Grouping,
        capture: &mut dyn Capture,
    ) -> Result<Tensor> {
        let (t, hidden) = x.dims2()?;
        let (dtype, dev) = (x.dtype(), x.device());
        let k = r.indices.dim(1)?;
        let widest = [g, u, d]
            .iter()
            .map(|q| q.shape().elem_count() / q.shape().dims().first().map_or(1, |&e| e.max(1)))
            .max()
            .unwrap_or(1);
        let act_path = sub(&self.path, conv::ACT);
        let wants_act = capture.wants(&nth_call(&act_path, 0));
        let (mut ys, mut acts) = (Vec::new(), Vec::new());
        // A padded row holds its input, gate, up and their product (hidden + 3·inter at most).
        let row_bytes = (hidden + 3 * widest / hidden.max(1)) * dtype.size_in_bytes();
        let weight_bytes = widest * dtype.size_in_bytes();
        for b in grouping.batches(k, weight_bytes, row_bytes, DECODE_BUDGET_BYTES) {
            let n = b.range.len();
            let src = Tensor::from_vec(b.src, n * b.m, dev)?;
            let xs = x.index_select(&src, 0)?.reshape((n, b.m, hidden))?; // [n, m, hidden]
            let project = |q: &QTensor, input: &Tensor| -> Result<Tensor> {
                let w = grouping.dequantize(q, dtype, b.range.clone())?; // [n, out, in]
                input.matmul(&w.transpose(1, 2)?) // [n, m, out]
            };
            let act = project(g, &xs)?.silu()?;
            let up = project(u, &xs)?;
            let y = project(d, &(&act * up)?)?; // [n, m, hidden]
            let real = b.valid.len();
            let valid = Tensor::from_vec(b.valid, real, dev)?;
            ys.push(y.reshape((n * b.m, hidden))?.index_select(&valid, 0)?);
            if wants_act {
                let inter = act.dim(2)?;
                acts.push(act.reshape((n * b.m, inter))?.index_select(&valid, 0)?);
            }
        }
        if ys.is_empty() {
            return Tensor::zeros((t, hidden), dtype, dev);
        }
        if wants_act {
            emit_grouped_acts(capture, &act_path, grouping, &Tensor::cat(&acts, 0)?)?;
        }
        grouped_sum(t, grouping, &Tensor::cat(&ys, 0)?, &r.weights)
    }
}

/// The eager loop's per-expert captures (experts ascending, tokens ascending) from the activations
/// of the grouped rows `[R, inter]`.
#[cfg(feature = "cuda")]
fn emit_grouped_acts(
    capture: &mut dyn Capture,
    act_path: &str,
    grouping: &super::grouping::Grouping,
    acts: &Tensor,
) -> Result<()> {
    let mut at = 0;
    for (hit, rows) in grouping.by_expert.iter().enumerate() {
        emit(
            capture,
            &nth_call(act_path, hit),
            &acts.narrow(0, at, rows.len())?,
        )?;
        at += rows.len();
    }
    Ok(())
}

/// The grouped rows' outputs `y` `[R, hidden]` weighted and summed per token → `[t, hidden]`; the
/// table's token and slot segments are the rows' order (see `Grouping`).
#[cfg(feature = "cuda")]
fn grouped_sum(
    t: usize,
    grouping: &super::grouping::Grouping,
    y: &Tensor,
    weights: &Tensor,
) -> Result<Tensor> {
    let rows = grouping.rows;
    let k = weights.dim(1)?;
    if super::fused_cuda::enabled() && y.device().is_cuda() && t * k == rows {
        // One launch instead of candle's index_add (same order, same roundings).
        let order = Tensor::from_vec(grouping.token_order(k), 2 * rows, y.device())?;
        if let Some(out) = super::fused_cuda::token_sum(y, weights, &order)? {
            return Ok(out);
        }
    }
    let (tokens, slots) = (
        grouping.table.narrow(0, 0, rows)?,
        grouping.table.narrow(0, rows, rows)?,
    );
    weighted_sum(t, y, &tokens, &slots, weights)
}

#[derive(Debug, Clone)]
pub struct Moe {
    pub router: Router,
    pub experts: Experts,
    pub shared: Mlp,
    pub(crate) path: String,
}

impl Moe {
    pub(crate) fn new<S: WeightSource + ?Sized>(
        c: &Config,
        l: usize,
        vb: &mut Params<S>,
        [gate, experts, module]: [String; 3],
        shared_paths: SwiGluPaths,
    ) -> std::result::Result<Self, ModelError> {
        Ok(Moe {
            router: Router::new(c, l, vb, gate)?,
            experts: Experts::new(l, vb, experts)?,
            shared: Mlp::new(
                [Role::SharedGate, Role::SharedUp, Role::SharedDown],
                l,
                vb,
                shared_paths,
            )?,
            path: module,
        })
    }

    /// `[T, hidden]` → routed experts + shared experts `[T, hidden]`.
    ///
    /// With the routing read ahead (the CPU; CUDA with `GLMCHECK_ROUTING=ahead`) the routing
    /// starts on its way to the host right after the router, and the shared expert (which needs
    /// none) is enqueued before the experts wait for it ([`HostIds`]): on a GPU it computes the
    /// shared expert while the host groups the tokens. Its captures are handed on after the
    /// experts', in transformers' order.
    pub fn forward(&self, x: &Tensor, capture: &mut dyn Capture) -> Result<Tensor> {
        let r = self.router.forward(x)?;
        // The schedule in transformers' order (the routing read where the experts need it, then
        // the shared expert): for a sink that synchronizes at every capture, and on CUDA unless
        // GLMCHECK_ROUTING=ahead (opt-in until its device test has passed on a GPU). On the CPU
        // the read is the values themselves: either order computes the same.
        let in_order = capture.times_modules()
            || (x.device().is_cuda() && !super::knobs::knobs().routing_ahead);
        let ahead = if in_order {
            None
        } else {
            Some(HostIds::start(&r.indices)?)
        };
        let gate = &self.router.path;
        emit(capture, gate, &r.logits)?;
        emit(capture, &sub(gate, "1"), &r.weights)?;
        emit_with(capture, &sub(gate, "2"), || r.indices.to_dtype(DType::I64))?;
        emit(capture, &sub(gate, conv::TOPK_WEIGHTS), &r.weights)?;
        emit_with(capture, &sub(gate, conv::TOPK_INDICES), || {
            r.indices.to_dtype(DType::I64)
        })?;
        let (routed, shared) = match ahead {
            None => {
                let ids = HostIds::start(&r.indices)?;
                let routed = self.experts.forward(x, &r, ids, capture)?;
                emit(capture, &self.experts.path, &routed)?;
                (routed, self.shared.forward(x, capture)?)
            }
            Some(ids) if !capture.in_transformers_order() => {
                let shared = self.shared.forward(x, capture)?;
                let routed = self.experts.forward(x, &r, ids, capture)?;
                emit(capture, &self.experts.path, &routed)?;
                (routed, shared)
            }
            Some(ids) => {
                let mut later = Later::new(capture);
                let shared = self.shared.forward(x, &mut later)?;
                let later = later.entries;
                let routed = self.experts.forward(x, &r, ids, capture)?;
                emit(capture, &self.experts.path, &routed)?;
                for (path, t) in later {
                    capture.capture(&path, &t)?;
                }
                (routed, shared)
            }
        };
        let y = (routed + shared)?;
        emit(capture, &self.path, &y)?;
        Ok(y)
    }
}

/// Keeps the captures a sink wants, to hand them on later in their order.
struct Later<'c> {
    sink: &'c dyn Capture,
    entries: Vec<(String, Tensor)>,
}

impl<'c> Later<'c> {
    fn new(sink: &'c dyn Capture) -> Self {
        Later {
            sink,
            entries: Vec::new(),
        }
    }
}

impl Capture for Later<'_> {
    fn wants(&self, path: &str) -> bool {
        self.sink.wants(path)
    }

    fn capture(&mut self, path: &str, tensor: &Tensor) -> Result<()> {
        self.entries.push((path.to_string(), tensor.clone()));
        Ok(())
    }
}
