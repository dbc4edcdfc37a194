//! Known silent loader bugs. Each is one value with `inject` (what a loader with that bug leaves in a
//! rank's memory) and `explains` (does a rank's corrupt tensor carry this bug's signature). `shards
//! --against` and `inject` both use these, so a demo, a test and a diagnosis mean the same thing.
//! Names, parameter syntax and descriptions live in one table ([`FAULTS`], in `faults/table.rs`).

use candle_core::{DType, Tensor};
use safetensors::Dtype;

use crate::arch::glm_dsa::{Role, TpStyle};
use crate::arch::Config;
use crate::compare::diff;
use crate::dump::{encode, DumpTensor};
use crate::gguf::stats::glob_match;
use crate::plan::{Cut, ParamPlan};
use crate::weights::{WeightError, Weights};

mod table;
pub use table::{fault_list, FaultError, FaultSpec, Hits, Injection, Make, FAULTS};

/// Loader or kernel bugs that leave every weight right and change what the forward computes
/// (publicly reported on GLM-5 / DeepSeek-V3.2 deployments). [`crate::model::Glm5::inject`] applies
/// one to chosen layers; [`crate::compare`] recognizes each by its signature in activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Behaviour {
    /// The DSA indexer is off: every query attends to all earlier keys (index_topk ignored).
    DsaDense,
    /// The indexer's RoPE rotated half-split (NeoX) instead of interleaved (vLLM #28968,
    /// sglang #13495).
    IndexerRopeNeox,
    /// MLA's RoPE rotated half-split instead of interleaved.
    MlaRopeNeox,
    /// Softmax expert gating instead of sigmoid (a missing `expert_gating_func`, llama.cpp #18980).
    RouterSoftmax,
    /// `e_score_correction_bias` not added to the choice scores.
    RouterNoBias,
    /// `e_score_correction_bias` rounded to bf16 (sglang #37133).
    BiasBf16,
    /// The attention softmax scale taken from the latent dim, (kv_lora_rank + qk_rope_head_dim)^-½,
    /// instead of qk_head_dim^-½ (vLLM #41569).
    MlaScaleLatent,
    /// The chosen experts' weights not renormalized (norm_topk_prob ignored).
    NoNormTopk,
    /// `routed_scaling_factor` not applied to the routed experts' weights.
    RoutedScaleMissing,
    /// The whole forward computed in fp16 (GGUF kernels' fp16 paths, vLLM #30090): activations
    /// beyond fp16's range (65504) overflow where bf16 would not. Applied when the model is built.
    Fp16Compute,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The correct dump.
    None,
    /// kv_b_proj rebuilt as all heads' k_nope rows, then all heads' v rows (instead of per head).
    KvbConcat,
    /// kv_b_proj built from attn_k_b reshaped instead of transposed back.
    KvbUntransposed,
    /// Ranks A and B hold each other's shards.
    RankSwap(usize, usize),
    /// Every rank holds shard 0 of merged layers (tp rank ignored while loading).
    MergedRank0,
    /// A merged gate/up cut at the midpoint of the concatenation instead of per sub-matrix.
    MergedMidsplit,
    /// Parameters matching the glob left at zero (the "skip unknown parameter names" patch).
    ParamZeroed(String),
    /// Cut along the wrong dimension.
    WrongDim,
    /// Vocab shards sized unpadded/tp (no padding to ×64).
    VocabUnpadded,
    /// bf16 bits stored (and read) as fp16.
    Bf16AsF16,
    /// Parameters matching the glob dequantized to bf16 before sharding (the "force-dequantize
    /// some tensors" patch): right values, rounded to bf16.
    ForceDequant(String),
    /// Every weight right; the forward computes something else ([`Behaviour`]).
    Behaviour(Behaviour),
}

impl Fault {
    /// The parameters this bug touches by default.
    /// (The table's [`Hits`] of this fault.)
    pub fn targets(&self, p: &ParamPlan) -> bool {
        match self.spec().hits {
            Hits::Nothing => false,
            Hits::Role(r) => p.def.role() == Some(r),
            Hits::Styles(styles) => styles.contains(&p.style),
            Hits::Glob => match self {
                Fault::ParamZeroed(g) | Fault::ForceDequant(g) => glob_match(g, &p.param),
                _ => false,
            },
            Hits::All => true,
            Hits::Forward => false,
        }
    }

    /// What rank `rank` holds of `p` under this bug (`full` is the correct unsharded vLLM tensor).
    pub fn inject(
        &self,
        p: &ParamPlan,
        full: &Tensor,
        w: &Weights<'_>,
        tp: usize,
        rank: usize,
        dtype: Dtype,
    ) -> Result<DumpTensor, WeightError> {
        let candle = |err| WeightError::Candle {
            param: p.param.clone(),
            err,
        };
        let out = |t: Tensor, dtype: Dtype| -> Result<DumpTensor, WeightError> {
            let shape = t.dims().to_vec();
            let v = t
                .flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(candle)?;
            Ok(DumpTensor {
                dtype,
                shape,
                data: encode(dtype, &v),
            })
        };
        if !matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            // Every value is encoded from f32: any other dtype would be f32 bytes under its label.
            return Err(candle(candle_core::Error::Msg(format!(
                "cannot write a {dtype:?} dump: glmcheck writes F32, BF16 or F16"
            ))));
        }
        if !self.targets(p) {
            return out(p.shard(full, rank).map_err(candle)?, dtype);
        }
        let shard = match self {
            // A behaviour fault hits no parameter (`targets` is false): never reached.
            Fault::None | Fault::Behaviour(_) => p.shard(full, rank).map_err(candle)?,
            Fault::KvbConcat => p.shard(&kvb_concat(w, p)?, rank).map_err(candle)?,
            Fault::KvbUntransposed => p.shard(&kvb_untransposed(w, p)?, rank).map_err(candle)?,
            Fault::RankSwap(a, b) => {
                let src = if rank == *a {
                    *b
                } else if rank == *b {
                    *a
                } else {
                    rank
                };
                p.shard(full, src).map_err(candle)?
            }
            Fault::MergedRank0 => p.shard(full, 0).map_err(candle)?,
            Fault::MergedMidsplit => midsplit_cut(p, tp, rank).apply(full).map_err(candle)?,
            Fault::ParamZeroed(_) => p
                .shard(full, rank)
                .map_err(candle)?
                .zeros_like()
                .map_err(candle)?,
            Fault::WrongDim => match wrong_dim_cut(p, full.dims(), tp, rank) {
                Some(c) => c.apply(full).map_err(candle)?,
                None => p.shard(full, rank).map_err(candle)?,
            },
            Fault::VocabUnpadded => unpadded_vocab_cut(full.dims()[0], tp, rank)
                .apply(full)
                .map_err(candle)?,
            Fault::ForceDequant(_) => {
                return out(p.shard(full, rank).map_err(candle)?, Dtype::BF16);
            }
            Fault::Bf16AsF16 => {
                let t = p.shard(full, rank).map_err(candle)?;
                let mut d = out(t, Dtype::BF16)?;
                d.dtype = Dtype::F16;
                return Ok(d);
            }
        };
        out(shard, dtype)
    }
}

/// kv_b_proj with every head's k_nope rows first, then every head's v rows.
pub fn kvb_concat(w: &Weights<'_>, p: &ParamPlan) -> Result<Tensor, WeightError> {
    kvb_wrong(w, p, |k_b, v_b, c| {
        let h = c.num_attention_heads;
        let k = k_b
            .transpose(1, 2)?
            .reshape((h * c.qk_nope_head_dim, c.kv_lora_rank))?;
        let v = v_b.reshape((h * c.v_head_dim, c.kv_lora_rank))?;
        Tensor::cat(&[&k, &v], 0)
    })
}

/// kv_b_proj built from attn_k_b's memory reshaped to [H, nope, kv_lora] instead of transposed.
pub fn kvb_untransposed(w: &Weights<'_>, p: &ParamPlan) -> Result<Tensor, WeightError> {
    kvb_wrong(w, p, |k_b, v_b, c| {
        let h = c.num_attention_heads;
        let k = k_b.reshape((h, c.qk_nope_head_dim, c.kv_lora_rank))?;
        Tensor::cat(&[&k, v_b], 1)?
            .reshape((h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
    })
}

/// A wrongly rebuilt kv_b_proj: `build(k_b, v_b, config)` from the GGUF's stored tensors.
fn kvb_wrong(
    w: &Weights<'_>,
    p: &ParamPlan,
    build: impl Fn(&Tensor, &Tensor, &Config) -> candle_core::Result<Tensor>,
) -> Result<Tensor, WeightError> {
    let (k_b, v_b) = kvb_sources(w, p)?;
    build(&k_b, &v_b, w.config).map_err(|err| WeightError::Candle {
        param: p.param.clone(),
        err,
    })
}

/// attn_k_b [H, kv_lora, nope] and attn_v_b [H, v, kv_lora] as stored.
fn kvb_sources(w: &Weights<'_>, p: &ParamPlan) -> Result<(Tensor, Tensor), WeightError> {
    let [k, v] = p.gguf.as_slice() else {
        return Err(WeightError::Unknown(format!(
            "{} (no attn_k_b/attn_v_b pair in this file)",
            p.param
        )));
    };
    Ok((
        w.gguf_tensor(&p.param, k, None)?,
        w.gguf_tensor(&p.param, v, None)?,
    ))
}

/// A merged [gate; up] cut into tp contiguous blocks of the concatenation.
pub fn midsplit_cut(p: &ParamPlan, tp: usize, rank: usize) -> Cut {
    let d = p.shard_dim.unwrap_or(0);
    let n = p.full_shape[d];
    let per = n / tp;
    Cut {
        dim: d,
        ranges: vec![(rank * per, (rank + 1) * per)],
        pad: 0,
    }
}

/// The same-size block cut along another dimension (the first other dim divisible by tp).
pub fn wrong_dim_cut(p: &ParamPlan, dims: &[usize], tp: usize, rank: usize) -> Option<Cut> {
    if tp < 2 {
        return None; // at tp=1 every cut is the whole tensor
    }
    let right = p.shard_dim?;
    let d = (0..dims.len()).rev().find(|&d| {
        d != right && dims[d].is_multiple_of(tp) && dims[d] >= tp && !(dims.len() == 3 && d == 0)
    })?;
    let per = dims[d] / tp;
    Some(Cut {
        dim: d,
        ranges: vec![(rank * per, (rank + 1) * per)],
        pad: 0,
    })
}

/// Vocab rows cut as ceil(V/tp) per rank from the unpadded table (short last rank zero-filled).
pub fn unpadded_vocab_cut(v: usize, tp: usize, rank: usize) -> Cut {
    let per = v.div_ceil(tp);
    let (a, b) = ((rank * per).min(v), ((rank + 1) * per).min(v));
    Cut {
        dim: 0,
        ranges: if b > a { vec![(a, b)] } else { Vec::new() },
        pad: per - (b - a),
    }
}

/// What a fault's signature saw in a rank's tensor (worded by `crate::report::shards`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sign {
    /// Cut along `dim` instead of the plan's `shard_dim`.
    WrongDim {
        dim: usize,
        shard_dim: usize,
    },
    /// `rows` rows per rank (vocab / tp) instead of `padded_rows` (vocab padded to `padded` / tp).
    VocabUnpadded {
        rows: usize,
        vocab: usize,
        padded_rows: usize,
        padded: usize,
    },
    AllZeros,
    AllOnes,
    /// Declared F16, the bits are the expected values in bf16.
    Bf16Bits,
    /// A contiguous block of the [gate; up] concatenation instead of gate shard r then up shard r.
    MidsplitBlock,
    /// All heads' k_nope then all heads' v, not [k_nope; v] per head.
    KvbConcat,
    /// attn_k_b reshaped, not transposed back.
    KvbUntransposed,
}

/// What one corrupt rank's tensor is explained by.
#[derive(Debug, Clone, PartialEq)]
pub enum Explanation {
    Fault(Fault, Sign),
    /// Holds rank `0`'s shard (resolved into rank-swap or merged-rank0 across ranks).
    HoldsShardOf(usize),
    ShapeMismatch {
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    Unexplained,
}

/// Everything a signature needs about one parameter at one rank.
pub struct Evidence<'a> {
    pub p: &'a ParamPlan,
    pub full: &'a Tensor,
    pub w: &'a Weights<'a>,
    pub tp: usize,
    pub rank: usize,
    pub actual: &'a DumpTensor,
    /// rel-L2 up to which two tensors count as the same (quantization and dump-dtype noise).
    pub tol: f64,
}

impl Evidence<'_> {
    fn same_as(&self, t: &Tensor) -> bool {
        if t.dims() != self.actual.shape.as_slice() {
            return false;
        }
        let Ok(v) = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
        else {
            return false;
        };
        diff(&self.actual.to_f32(), &v).rel_l2 <= self.tol
    }

    fn same_as_cut(&self, c: &Cut, of: &Tensor) -> bool {
        c.apply(of).is_ok_and(|t| self.same_as(&t))
    }
}

/// The wrong-dimension signature: the rank holds its block of another dimension.
fn wrong_dim(e: &Evidence<'_>) -> Option<Explanation> {
    let p = e.p;
    let c = wrong_dim_cut(p, e.full.dims(), e.tp, e.rank)?;
    e.same_as_cut(&c, e.full).then(|| {
        Explanation::Fault(
            Fault::WrongDim,
            Sign::WrongDim {
                dim: c.dim,
                shard_dim: p.shard_dim.unwrap_or(0),
            },
        )
    })
}

/// Tests the signatures of the known bugs against one corrupt rank tensor, most specific first.
pub fn explain(e: &Evidence<'_>, _c: &Config) -> Explanation {
    let p = e.p;
    let expected = p
        .shard(e.full, e.rank)
        .map(|t| t.dims().to_vec())
        .unwrap_or_default();
    let found = e.actual.shape.clone();
    if found != expected {
        if p.style == TpStyle::Vocab {
            let c = unpadded_vocab_cut(p.full_shape[0], e.tp, e.rank);
            if e.same_as_cut(&c, e.full) {
                return Explanation::Fault(
                    Fault::VocabUnpadded,
                    Sign::VocabUnpadded {
                        rows: c.len(),
                        vocab: p.full_shape[0],
                        padded_rows: expected.first().copied().unwrap_or(0),
                        padded: crate::plan::padded_vocab(p.full_shape[0]),
                    },
                );
            }
        }
        if let Some(x) = wrong_dim(e) {
            return x;
        }
        return Explanation::ShapeMismatch { expected, found };
    }
    let a = e.actual.to_f32();
    if !a.is_empty() && a.iter().all(|&x| x == 0.0) {
        return Explanation::Fault(Fault::ParamZeroed(p.param.clone()), Sign::AllZeros);
    }
    if !a.is_empty() && a.iter().all(|&x| x == 1.0) {
        return Explanation::Fault(Fault::ParamZeroed(p.param.clone()), Sign::AllOnes);
    }
    if e.actual.dtype == Dtype::F16 {
        let as_bf16 = DumpTensor {
            dtype: Dtype::BF16,
            ..e.actual.clone()
        };
        // The bits are bf16: allow bf16's rounding on top of the tolerance already granted.
        let re = Evidence {
            actual: &as_bf16,
            tol: e.tol + crate::compare::dump_dtype_rel_l2(Dtype::BF16),
            ..*e
        };
        if p.shard(e.full, e.rank).is_ok_and(|t| re.same_as(&t)) {
            return Explanation::Fault(Fault::Bf16AsF16, Sign::Bf16Bits);
        }
    }
    if !p.cuts.is_empty() {
        for other in (0..e.tp).filter(|&o| o != e.rank) {
            if p.shard(e.full, other).is_ok_and(|t| e.same_as(&t)) {
                return Explanation::HoldsShardOf(other);
            }
        }
        if matches!(p.style, TpStyle::MergedColumn | TpStyle::MoeW13)
            && e.same_as_cut(&midsplit_cut(p, e.tp, e.rank), e.full)
        {
            return Explanation::Fault(Fault::MergedMidsplit, Sign::MidsplitBlock);
        }
        if let Some(x) = wrong_dim(e) {
            return x;
        }
    }
    if p.def.role() == Some(Role::AttnKvB) {
        if let Ok(t) = kvb_concat(e.w, p) {
            if p.shard(&t, e.rank).is_ok_and(|s| e.same_as(&s)) {
                return Explanation::Fault(Fault::KvbConcat, Sign::KvbConcat);
            }
        }
        if let Ok(t) = kvb_untransposed(e.w, p) {
            if p.shard(&t, e.rank).is_ok_and(|s| e.same_as(&s)) {
                return Explanation::Fault(Fault::KvbUntransposed, Sign::KvbUntransposed);
            }
        }
    }
    Explanation::Unexplained
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ConfigReader;
    use crate::gguf::GgufModel;
    use crate::plan::ShardPlan;

    #[test]
    fn an_unpadded_vocab_cut_zero_fills_the_short_last_rank() {
        let full = Tensor::arange(0f32, 20., &candle_core::Device::Cpu)
            .and_then(|t| t.reshape((10, 2)))
            .expect("tensor");
        let rows = |rank| {
            unpadded_vocab_cut(10, 4, rank)
                .apply(&full)
                .and_then(|t| t.to_vec2::<f32>())
                .expect("cut")
        };
        assert_eq!(rows(1), vec![vec![6., 7.], vec![8., 9.], vec![10., 11.]]);
        assert_eq!(rows(3), vec![vec![18., 19.], vec![0., 0.], vec![0., 0.]]);
    }

    fn tiny() -> GgufModel {
        let f =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-F32.gguf");
        GgufModel::open(&f).expect("fixture")
    }

    #[test]
    fn injected_faults_hold_what_the_bug_leaves_and_are_explained() {
        let model = tiny();
        let cfg = ConfigReader::read(&model, crate::arch::ARCH)
            .expect("config")
            .config;
        let plan = ShardPlan::new(&model, &cfg, 2);
        let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
        let o_proj = plan
            .params
            .iter()
            .find(|p| p.def.role() == Some(Role::AttnOut))
            .expect("an o_proj");
        let full = w.vllm(&o_proj.param).expect("o_proj");
        let shard = |r| {
            o_proj
                .shard(&full, r)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .expect("shard")
        };
        let inject = |f: &Fault, rank| {
            f.inject(o_proj, &full, &w, 2, rank, Dtype::F32)
                .expect("inject")
        };

        let swapped = inject(&Fault::RankSwap(0, 1), 0);
        assert_eq!(swapped.to_f32(), shard(1));
        let e = Evidence {
            p: o_proj,
            full: &full,
            w: &w,
            tp: 2,
            rank: 0,
            actual: &swapped,
            tol: 1e-6,
        };
        assert_eq!(explain(&e, &cfg), Explanation::HoldsShardOf(1));

        let zeroed = inject(&Fault::ParamZeroed(o_proj.param.clone()), 1);
        assert!(zeroed.to_f32().iter().all(|&x| x == 0.0));
        assert_eq!(zeroed.to_f32().len(), shard(1).len());

        let good = inject(&Fault::None, 1);
        assert_eq!(good.to_f32(), shard(1));
        let e = Evidence {
            rank: 1,
            actual: &good,
            ..e
        };
        assert_eq!(
            explain(&e, &cfg),
            Explanation::Unexplained,
            "the right shard carries no bug"
        );

        let mixed = Fault::Bf16AsF16
            .inject(o_proj, &full, &w, 2, 0, Dtype::F32)
            .expect("inject");
        assert_eq!(mixed.dtype, Dtype::F16);
        assert_eq!(
            mixed.data,
            encode(Dtype::BF16, &shard(0)),
            "bf16 bits under an F16 label"
        );
    }

    #[test]
    fn each_fault_hits_the_parameters_its_table_entry_names() {
        let model = tiny();
        let cfg = ConfigReader::read(&model, crate::arch::ARCH)
            .expect("config")
            .config;
        let plan = ShardPlan::new(&model, &cfg, 2);
        let hit = |f: &str| -> Vec<String> {
            let f: Fault = f.parse().expect("fault");
            plan.params
                .iter()
                .filter(|p| f.targets(p))
                .map(|p| p.param.clone())
                .collect()
        };
        let all_end = |names: &[String], suffixes: &[&str]| {
            !names.is_empty()
                && names
                    .iter()
                    .all(|n| suffixes.iter().any(|s| n.ends_with(s)))
        };
        assert!(hit("none").is_empty());
        assert!(all_end(&hit("kvb-concat"), &["self_attn.kv_b_proj.weight"]));
        assert_eq!(hit("kvb-concat"), hit("kvb-untransposed"));
        assert!(all_end(&hit("rank-swap:0,1"), &["self_attn.o_proj.weight"]));
        assert_eq!(hit("rank-swap:0,1"), hit("wrong-dim"));
        assert!(all_end(
            &hit("merged-rank0"),
            &[
                "gate_up_proj.weight",
                "w13_weight",
                "routed_experts.w13_weight"
            ]
        ));
        assert_eq!(
            hit("vocab-unpadded"),
            ["model.embed_tokens.weight", "lm_head.weight"]
        );
        assert!(all_end(
            &hit("param-zeroed:*.mlp.gate.weight"),
            &[".mlp.gate.weight"]
        ));
        assert_eq!(hit("bf16-as-f16").len(), plan.params.len());
    }

    #[test]
    fn a_dump_dtype_that_cannot_be_encoded_is_an_error_not_f32_bytes() {
        let model = tiny();
        let cfg = ConfigReader::read(&model, crate::arch::ARCH)
            .expect("config")
            .config;
        let plan = ShardPlan::new(&model, &cfg, 1);
        let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
        let p = &plan.params[0];
        let full = w.vllm(&p.param).expect("param");
        for dtype in [Dtype::F64, Dtype::I32, Dtype::F8_E4M3] {
            let e = Fault::None.inject(p, &full, &w, 1, 0, dtype).unwrap_err();
            assert!(
                e.to_string().contains("glmcheck writes F32, BF16 or F16"),
                "{e}"
            );
        }
        for dtype in [Dtype::F32, Dtype::BF16, Dtype::F16] {
            let d = Fault::None
                .inject(p, &full, &w, 1, 0, dtype)
                .expect("encodes");
            assert_eq!(d.dtype, dtype);
            let width = if dtype == Dtype::F32 { 4 } else { 2 };
            let n = p.shard(&full, 0).expect("shard").elem_count();
            assert_eq!(
                d.data.len(),
                n * width,
                "the vocab shard is padded, then encoded"
            );
        }
    }
}
