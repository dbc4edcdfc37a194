//! Where a module's weights come from. Every module is built by `Module::new(cfg, …, params)` from a
//! [`WeightSource`] (candle-transformers' `VarBuilder` pattern; candle-nn's sharded var-builder is the
//! model for tensor parallel): the unsharded model is one [`FullSource`], simulated tensor parallel
//! is `tp` [`ShardSource`]s — rank r's cut of the GGUF by the shard plan, or rank r of a per-rank
//! dump — and both build the very same module structs.
//!
//! A source hands out one HF parameter (for the routed experts: the stack `[E, …]`) in f32, as this
//! source's rank holds it; [`Params`] converts to the compute dtype.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

use crate::arch::glm_dsa::{self, Idx, Rebuild, Role};
use crate::arch::Config;
use crate::dump::{RankDump, RankFile};
use crate::plan::ShardPlan;
use crate::weights::Weights;

use super::linear::{Blocks, Linear, MappedBlocks, MatmulMode, Weight};
use super::moe::ExpertStack;
use super::ModelError;

/// Which rank of how many a source serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub tp: usize,
}

impl Shard {
    pub const WHOLE: Shard = Shard { rank: 0, tp: 1 };
}

/// Hands out parameters for the modules of one rank.
pub trait WeightSource {
    fn config(&self) -> &Config;
    fn device(&self) -> &Device;
    fn shard(&self) -> Shard;
    /// This rank's piece of HF parameter `p` of `layer` in f32 (routed experts: all experts
    /// stacked, `[E, …]`).
    fn param(&mut self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError>;
    /// HF parameter `p` of `layer` as the GGUF's quantized blocks on this source's device, when
    /// this source keeps it so (the unsharded GGUF, a parameter stored as it is in a quantized
    /// type); None: the model takes [`Self::param`]'s f32 tensor.
    fn blocks(&mut self, _p: Role, _layer: Option<usize>) -> Result<Option<Blocks>, ModelError> {
        Ok(None)
    }
    /// Layer `layer`'s routed experts of `p` as the GGUF's blocks on this source's device, when
    /// this source keeps them so (the unsharded GGUF, a quantized type): one `[out, in]` tensor
    /// per expert, or with `stack` (and a type and shape that mode's grouped kernel takes, see
    /// [`stackable`]) the whole `[E, out, in]` stack as one. None: the model takes
    /// [`Self::param`]'s f32 stack.
    fn expert_blocks(
        &mut self,
        _p: Role,
        _layer: usize,
        _stack: Option<MatmulMode>,
    ) -> Result<Option<QuantExperts>, ModelError> {
        Ok(None)
    }
    /// Parameters this source lacked and took from elsewhere (a rank dump's gaps).
    fn fallbacks(&self) -> &[String] {
        &[]
    }
}

fn candle(name: String) -> impl FnOnce(candle_core::Error) -> ModelError {
    move |source| ModelError::Candle {
        module: name,
        source,
    }
}

/// The whole model from the GGUF (dequantized, rebuilt under HF names).
pub struct FullSource<'w, 'a> {
    pub w: &'w Weights<'a>,
}

impl WeightSource for FullSource<'_, '_> {
    fn config(&self) -> &Config {
        self.w.config
    }

    fn device(&self) -> &Device {
        &self.w.device
    }

    fn shard(&self) -> Shard {
        Shard::WHOLE
    }

    fn param(&mut self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        let def = p.def()?;
        match (def.rebuild, layer) {
            (Rebuild::ExpertSlice, Some(l)) => Ok(self.w.hf_stacked(def.hf, l)?),
            _ => Ok(self.w.hf(&p.name(layer)?)?),
        }
    }

    fn blocks(&mut self, p: Role, layer: Option<usize>) -> Result<Option<Blocks>, ModelError> {
        let Some(t) = self.w.direct(&p.name(layer)?)? else {
            return Ok(None);
        };
        let shape = t.info.torch_shape();
        let b = blocks(
            &t.info.name,
            t.info.dtype,
            t.shared(),
            &shape,
            &self.w.device,
        )?;
        if matches!(b, Some(Blocks::OnDevice(_))) {
            t.release();
        }
        Ok(b)
    }

    /// The GGUF's expert blocks as they are (uploaded as is; dequantized into the compute dtype,
    /// or multiplied by the quantized kernels, when an expert is used).
    fn expert_blocks(
        &mut self,
        p: Role,
        layer: usize,
        stack: Option<MatmulMode>,
    ) -> Result<Option<QuantExperts>, ModelError> {
        let def = p.def()?;
        if def.rebuild != Rebuild::ExpertSlice {
            return Ok(None);
        }
        let b = self.w.expert_blocks(def.hf, layer)?;
        let device = self.w.device.clone();
        let fused = stack.is_some_and(|mode| stackable(mode, b.dtype, &b.expert_shape));
        let out = if fused {
            let mut shape = vec![b.experts];
            shape.extend_from_slice(&b.expert_shape);
            crate::gguf::dequant::qtensor(&b.tensor, b.dtype, b.bytes(), &shape, &device)
                .map_err(crate::weights::WeightError::from)?
                .map(|q| QuantExperts::Stacked(Arc::new(q)))
        } else {
            (0..b.experts)
                .map(|e| {
                    let bytes = b.expert(e).map_err(crate::weights::WeightError::from)?;
                    let name = format!("{} expert {e}", b.tensor);
                    blocks(&name, b.dtype, bytes, &b.expert_shape, &device)
                })
                .collect::<Result<Option<Vec<_>>, ModelError>>()?
                .map(QuantExperts::PerExpert)
        };
        if device.is_cuda() && out.is_some() {
            b.release();
        }
        Ok(out)
    }
}

/// Routed experts kept as the GGUF's blocks.
#[derive(Debug, Clone)]
pub enum QuantExperts {
    /// One `[out, in]` matrix per expert.
    PerExpert(Vec<Blocks>),
    /// The `[E, out, in]` stack as one tensor (the grouped MoE kernel, CUDA only).
    Stacked(Arc<QTensor>),
}

/// The types glmcheck's grouped MoE kernels (`model::q8_cuda`) multiply as one stack: the
/// types llama.cpp's MMQ covers. (candle 0.11.1's own `indexed_moe_forward`, used before it, strode
/// from one expert to the next by `n·k / QK_K` blocks whatever the type, wrong for Q8_0's 32-element
/// blocks: its Q8_0 experts diverged (rel-L2 1.4) on an H200.) Other types stay per expert.
pub(crate) fn fused_moe_type(t: candle_core::quantized::GgmlDType) -> bool {
    #[cfg(feature = "cuda")]
    return super::moe_cuda::grouped_type(t);
    #[cfg(not(feature = "cuda"))]
    return {
        let _ = t;
        false
    };
}

/// Whether `mode`'s grouped kernel takes a stack of `[out, in]` experts of type `t` (CUDA only):
/// q8's MMQ tiles step through 256 inputs at a time; dequant's decoder
/// (`cuda/dequant_experts.cu`) needs each expert to be whole 256-element blocks.
pub(crate) fn stackable(
    mode: MatmulMode,
    t: crate::gguf::GgmlType,
    expert_shape: &[usize],
) -> bool {
    let typed = crate::gguf::dequant::candle_dtype(t).is_some_and(fused_moe_type);
    let elems: usize = expert_shape.iter().product();
    typed
        && match mode {
            MatmulMode::Q8 => expert_shape.get(1).is_some_and(|&inputs| inputs % 256 == 0),
            MatmulMode::Dequant => elems > 0 && elems.is_multiple_of(256),
        }
}

/// A quantized matrix `[rows, cols]` kept as blocks: on a CUDA device uploaded as they are
/// (resident), on the CPU left in the GGUF's mapping and decoded when used. None for float types
/// and those candle would decode on the host (handed out dense instead).
fn blocks(
    name: &str,
    dtype: crate::gguf::GgmlType,
    bytes: crate::gguf::SharedBytes,
    shape: &[usize],
    device: &Device,
) -> Result<Option<Blocks>, ModelError> {
    if device.is_cuda() {
        let q = crate::gguf::dequant::qtensor(name, dtype, bytes.bytes(), shape, device)
            .map_err(crate::weights::WeightError::from)?;
        return Ok(q.map(|q| Blocks::OnDevice(Arc::new(q))));
    }
    let (Some(_), &[rows, cols]) = (crate::gguf::dequant::device_blocks(dtype), shape) else {
        return Ok(None);
    };
    // Whole blocks, checked once here (without the aligned copy decoding would make).
    crate::gguf::dequant::check(name, dtype, bytes.bytes())
        .map_err(crate::weights::WeightError::from)?;
    Ok(Some(Blocks::Mapped(Box::new(MappedBlocks {
        name: name.to_string(),
        bytes,
        dtype,
        shape: [rows, cols],
        chunk: super::linear::CHUNK_F32_BYTES,
    }))))
}

/// Rank `rank` of simulated tensor parallel: every parameter as vLLM's rank holds it — cut from the
/// GGUF by the shard plan, or read from a per-rank dump (`rank<r>.safetensors`, vLLM names) — and
/// each HF parameter split back out of its fused vLLM parameter where the plan says it lies.
pub struct ShardSource<'w, 'a> {
    w: &'w Weights<'a>,
    plan: &'w ShardPlan,
    rank: usize,
    /// Whether the weights come from a per-rank dump (every parameter it lacks is a fallback).
    from_dump: bool,
    /// This rank's file of that dump (None: the dump has no file for this rank), its vLLM-version
    /// and `state_dict()` aliases resolved to the canonical names as `shards --against` reads it;
    /// read one parameter at a time.
    dump: Option<RankFile>,
    missing: Vec<String>,
    cache: Rc<RefCell<UnshardedCache>>,
}

/// The unsharded vLLM tensors of one layer, shared by the ranks' sources: the model is built layer
/// by layer, every rank in turn, so each tensor is dequantized once and memory stays bounded by a
/// layer.
#[derive(Default)]
struct UnshardedCache {
    layer: Option<Option<usize>>,
    tensors: HashMap<String, Tensor>,
}

impl<'w, 'a> ShardSource<'w, 'a> {
    /// Every rank's source: the plan's cut of `w`, or (with `dump`) the dump's rank files with the
    /// plan's cut filling their gaps.
    pub fn ranks(
        w: &'w Weights<'a>,
        plan: &'w ShardPlan,
        dump: Option<&RankDump>,
    ) -> Result<Vec<Self>, ModelError> {
        if let Some(p) = plan.params.iter().find(|p| !p.problems.is_empty()) {
            return Err(ModelError::Plan(format!(
                "{} cannot be sharded at tp={}: {}",
                p.param,
                plan.tp,
                p.problems
                    .iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            )));
        }
        let cache = Rc::new(RefCell::new(UnshardedCache::default()));
        (0..plan.tp)
            .map(|rank| {
                let file = match dump.map(|d| d.open_rank(rank)).transpose()?.flatten() {
                    Some(mut f) => {
                        f.resolve_aliases(|n| glm_dsa::canonical_vllm(n, w.config));
                        Some(f)
                    }
                    None => None,
                };
                Ok(ShardSource {
                    w,
                    plan,
                    rank,
                    from_dump: dump.is_some(),
                    dump: file,
                    missing: Vec::new(),
                    cache: Rc::clone(&cache),
                })
            })
            .collect()
    }

    /// This rank's tensor of a vLLM parameter.
    fn vllm_rank(&mut self, plan_index: usize) -> Result<Tensor, ModelError> {
        let (r, tp) = (self.rank, self.plan.tp);
        let plan = &self.plan.params[plan_index];
        let vname = plan.param.clone();
        let want = match plan.cuts.get(r) {
            Some(c) => {
                let mut s = plan.full_shape.clone();
                if let Some(d) = s.get_mut(c.dim) {
                    *d = c.len();
                }
                s
            }
            None => plan.full_shape.clone(),
        };
        if self.from_dump {
            if let Some(t) = self.dump.as_ref().and_then(|f| f.get(&vname)) {
                if t.shape != want {
                    return Err(ModelError::Shape {
                        param: vname,
                        rank: r,
                        tp,
                        got: t.shape.clone(),
                        want,
                    });
                }
                return Tensor::from_vec(t.to_f32(), t.shape.as_slice(), &self.w.device)
                    .map_err(candle(format!("{vname} (rank {r})")));
            }
            if !self.missing.contains(&vname) {
                self.missing.push(vname.clone());
            }
        }
        let mut cache = self.cache.borrow_mut();
        if cache.layer != Some(plan.layer) {
            cache.layer = Some(plan.layer);
            cache.tensors.clear();
        }
        if !cache.tensors.contains_key(&vname) {
            let full = self.w.vllm(&vname)?;
            cache.tensors.insert(vname.clone(), full);
        }
        plan.shard(&cache.tensors[&vname], r)
            .map_err(candle(format!("{vname} (rank {r})")))
    }
}

impl WeightSource for ShardSource<'_, '_> {
    fn config(&self) -> &Config {
        self.w.config
    }

    fn device(&self) -> &Device {
        &self.w.device
    }

    fn shard(&self) -> Shard {
        Shard {
            rank: self.rank,
            tp: self.plan.tp,
        }
    }

    fn param(&mut self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        let hf = p.def()?.hf;
        let (index, part) = self
            .plan
            .holder(hf, layer)
            .map(|(pp, part)| {
                let i = self
                    .plan
                    .params
                    .iter()
                    .position(|q| std::ptr::eq(q, pp))
                    .unwrap_or(0);
                (i, part)
            })
            .ok_or_else(|| {
                let name = glm_dsa::name(
                    hf,
                    Idx {
                        layer,
                        expert: None,
                    },
                );
                ModelError::Plan(format!("{name}: no vLLM parameter of the plan holds it"))
            })?;
        let t = self.vllm_rank(index)?;
        let plan = &self.plan.params[index];
        match plan.part_slice(part, self.plan.tp) {
            Some(s) => t.narrow(s.dim, s.start, s.len),
            None => Ok(t),
        }
        // Contiguous: a row-parallel shard or a part of a fused tensor is a strided view, which
        // cuBLAS will not take (the CPU gemm does).
        .and_then(|t| t.contiguous())
        .map_err(candle(format!("{} (rank {})", plan.param, self.rank)))
    }

    fn fallbacks(&self) -> &[String] {
        &self.missing
    }
}

/// A source's parameters in the model's compute dtype (candle-transformers' `VarBuilder` role).
pub struct Params<'s, S: WeightSource + ?Sized> {
    pub src: &'s mut S,
    pub dtype: DType,
    /// How weights the source keeps quantized are multiplied.
    pub mode: MatmulMode,
}

impl<S: WeightSource + ?Sized> Params<'_, S> {
    pub fn config(&self) -> &Config {
        self.src.config()
    }

    /// Whether norms run as one fused kernel ([`super::ops::RmsNorm::fused`]): q8 mode on CUDA.
    pub fn fused_norms(&self) -> bool {
        self.mode == MatmulMode::Q8 && self.src.device().is_cuda()
    }

    pub fn shard(&self) -> Shard {
        self.src.shard()
    }

    /// In the compute dtype.
    pub fn get(&mut self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        let t = self.src.param(p, layer)?;
        t.to_dtype(self.dtype).map_err(candle(module_of(p, layer)))
    }

    /// Kept in f32 whatever the compute dtype.
    pub fn f32(&mut self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        self.src.param(p, layer)
    }

    /// Stored in the compute dtype but computed in f32 (transformers loads the router weight in the
    /// model dtype and upcasts it in forward).
    pub fn rounded_f32(&mut self, p: Role, layer: Option<usize>) -> Result<Tensor, ModelError> {
        let t = self.src.param(p, layer)?;
        t.to_dtype(self.dtype)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(candle(module_of(p, layer)))
    }

    /// Layer `l`'s routed experts of `p`: the source's quantized blocks when it keeps them (each
    /// expert dequantized into the compute dtype when used, or multiplied by the quantized
    /// kernels), else the f32 stack in the compute dtype. On CUDA the stack is one tensor for the
    /// mode's grouped kernel when it takes the type (q8: the MMQ tiles; dequant: the batched
    /// decode and GEMMs).
    pub fn experts(&mut self, p: Role, l: usize) -> Result<ExpertStack, ModelError> {
        let stack = self.src.device().is_cuda().then_some(self.mode);
        self.experts_as(p, l, stack)
    }

    /// Layer `l`'s routed experts of `p`, as one stack for `stack`'s grouped kernel if given.
    pub fn experts_as(
        &mut self,
        p: Role,
        l: usize,
        stack: Option<MatmulMode>,
    ) -> Result<ExpertStack, ModelError> {
        let (dtype, mode) = (self.dtype, self.mode);
        Ok(match self.src.expert_blocks(p, l, stack)? {
            Some(QuantExperts::PerExpert(experts)) => ExpertStack::Blocks {
                experts,
                dtype,
                mode,
            },
            Some(QuantExperts::Stacked(q)) => ExpertStack::Stacked { q, dtype, mode },
            None => ExpertStack::Dense(self.get(p, Some(l))?),
        })
    }

    /// A weight matrix: the source's quantized blocks when it keeps them, else dense in the compute
    /// dtype.
    pub fn weight(&mut self, p: Role, layer: Option<usize>) -> Result<Weight, ModelError> {
        Ok(match self.src.blocks(p, layer)? {
            Some(blocks) => Weight::Blocks {
                blocks,
                dtype: self.dtype,
                mode: self.mode,
            },
            None => Weight::Dense(self.get(p, layer)?),
        })
    }

    pub fn linear(&mut self, p: Role, layer: Option<usize>) -> Result<Linear, ModelError> {
        Ok(Linear {
            weight: self.weight(p, layer)?,
        })
    }
}

fn module_of(p: Role, layer: Option<usize>) -> String {
    p.module(layer).unwrap_or_else(|_| format!("{p:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ConfigReader;
    use crate::gguf::GgufModel;
    use crate::model::{Glm5, Mla, ModelOptions, VecCapture};

    /// One generic builder, instantiated for the whole-model source and for the rank sources.
    fn build<S: WeightSource>(sources: Vec<S>) -> Glm5 {
        Glm5::from_sources(sources, ModelOptions::default()).expect("build")
    }

    #[test]
    fn plain_and_tensor_parallel_are_the_same_modules_from_two_sources() {
        let (m, c) = fixture("tiny-F32");
        let w = Weights::new(&m, &c, Device::Cpu);
        let plain = build(vec![FullSource { w: &w }]);
        let plan = ShardPlan::new(&m, &c, 2);
        let tp = build(ShardSource::ranks(&w, &plan, None).expect("sources"));
        assert_eq!((plain.tp(), tp.tp()), (1, 2));

        // The same struct, holding half the heads on each rank: rank 1's q_b_proj is the second
        // half of the unsharded rows, its o_proj the second half of the input columns.
        let whole: &Mla = &plain.layers()[1].attn;
        let half: &Mla = &tp.ranks[1].layers[1].attn;
        assert_eq!(half.n_heads * 2, whole.n_heads);
        let rows = whole.q_b.weight.dim(0).expect("dim");
        let want = whole
            .q_b
            .weight
            .dense()
            .and_then(|w| w.narrow(0, rows / 2, rows / 2))
            .expect("narrow");
        let diff = (&half.q_b.weight.dense().expect("dense") - &want)
            .and_then(|d| d.abs())
            .and_then(|d| d.max_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("diff");
        assert_eq!(diff, 0.0);
        let cols = whole.o.weight.dim(1).expect("dim");
        assert_eq!(half.o.weight.dims(), &[c.hidden_size, cols / 2]);
        // Replicated modules are whole on every rank.
        assert_eq!(
            tp.ranks[1].layers[1].attn.q_a.weight.dims(),
            whole.q_a.weight.dims()
        );

        // And both run the one forward to the same logits.
        let ids = [3u32, 17, 5, 9];
        let a = plain.forward(&ids, &mut VecCapture::new()).expect("plain");
        let b = tp.forward(&ids, &mut VecCapture::new()).expect("tp");
        let rel = (&a - &b)
            .and_then(|d| d.sqr())
            .and_then(|d| d.sum_all())
            .and_then(|d| d.to_scalar::<f32>())
            .expect("diff")
            .sqrt()
            / a.sqr()
                .and_then(|d| d.sum_all())
                .and_then(|d| d.to_scalar::<f32>())
                .expect("norm")
                .sqrt();
        assert!(rel < 1e-5, "rel-L2 {rel}");
    }

    /// A fixture GGUF and its config.
    fn fixture(stem: &str) -> (GgufModel, Config) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("fixtures/tiny/{stem}.gguf"));
        let m = GgufModel::open(&path).expect("fixture");
        let c = ConfigReader::read(&m, "glm-dsa").expect("config").config;
        (m, c)
    }

    /// The unsharded GGUF source keeps quantized routed experts as the file's blocks; each expert
    /// dequantized on use is exactly the dequantized stack's slice. Float stacks stay dense.
    #[test]
    fn expert_blocks_dequantize_to_the_stack_they_replace() {
        for stem in ["tiny-Q4_K_M", "tiny-Q8_0"] {
            let (m, c) = fixture(stem);
            let w = Weights::new(&m, &c, Device::Cpu);
            let mut src = FullSource { w: &w };
            let l = c.first_k_dense_replace;
            for role in [Role::ExpertGate, Role::ExpertUp, Role::ExpertDown] {
                let Some(QuantExperts::PerExpert(blocks)) =
                    src.expert_blocks(role, l, None).expect("blocks")
                else {
                    panic!("{stem} {role:?}: not kept quantized per expert");
                };
                let stack = src.param(role, Some(l)).expect("stack");
                assert_eq!(blocks.len(), c.n_routed_experts, "{stem}");
                for (e, q) in blocks.iter().enumerate() {
                    let got = q.dequantize(DType::F32).expect("dequantize");
                    let want = stack.get(e).expect("expert");
                    let diff = (&got - &want)
                        .and_then(|d| d.abs())
                        .and_then(|d| d.max_all())
                        .and_then(|d| d.to_scalar::<f32>())
                        .expect("diff");
                    assert_eq!(diff, 0.0, "{stem} {role:?} expert {e}");
                }
            }
            // Not an expert stack: the source hands out f32 instead.
            assert!(src
                .expert_blocks(Role::Router, l, None)
                .expect("ok")
                .is_none());
        }
        for stem in ["tiny-BF16", "tiny-F32"] {
            let (m, c) = fixture(stem);
            let w = Weights::new(&m, &c, Device::Cpu);
            let mut src = FullSource { w: &w };
            let l = c.first_k_dense_replace;
            assert!(
                src.expert_blocks(Role::ExpertGate, l, None)
                    .expect("ok")
                    .is_none(),
                "{stem}"
            );
        }
    }

    #[test]
    fn a_source_for_the_wrong_rank_is_refused() {
        let (m, c) = fixture("tiny-F32");
        let w = Weights::new(&m, &c, Device::Cpu);
        let plan = ShardPlan::new(&m, &c, 2);
        let mut sources = ShardSource::ranks(&w, &plan, None).expect("sources");
        sources.swap(0, 1);
        let err = Glm5::from_sources(sources, ModelOptions::default()).expect_err("refused");
        assert!(matches!(err, ModelError::Plan(_)), "{err}");
    }
}
