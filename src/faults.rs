//! Known silent loader bugs. Each is one value with `inject` (what a loader with that bug leaves in a
//! rank's memory) and `explains` (does a rank's corrupt tensor carry this bug's signature). `shards
//! --against` and `inject` both use these, so a demo, a test and a diagnosis mean the same thing.

use std::str::FromStr;

use candle_core::{DType, Tensor};
use safetensors::Dtype;

use crate::arch::glm_dsa::{Role, TpStyle};
use crate::arch::Config;
use crate::compare::diff;
use crate::dump::{encode, DumpTensor};
use crate::plan::{Cut, ParamPlan};
use crate::scan::glob_match;
use crate::weights::{WeightError, Weights};

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
}

pub const FAULT_NAMES: &[&str] = &[
    "none",
    "kvb-concat",
    "kvb-untransposed",
    "rank-swap:A,B",
    "merged-rank0",
    "merged-midsplit",
    "param-zeroed:GLOB",
    "wrong-dim",
    "vocab-unpadded",
    "bf16-as-f16",
];

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "none" => Fault::None,
            "kvb-concat" => Fault::KvbConcat,
            "kvb-untransposed" => Fault::KvbUntransposed,
            "merged-rank0" => Fault::MergedRank0,
            "merged-midsplit" => Fault::MergedMidsplit,
            "wrong-dim" => Fault::WrongDim,
            "vocab-unpadded" => Fault::VocabUnpadded,
            "bf16-as-f16" => Fault::Bf16AsF16,
            _ => {
                if let Some(ab) = s.strip_prefix("rank-swap:") {
                    let (a, b) = ab
                        .split_once(',')
                        .ok_or_else(|| format!("`{s}`: expected rank-swap:A,B"))?;
                    let parse = |x: &str| {
                        x.trim()
                            .parse::<usize>()
                            .map_err(|_| format!("`{s}`: `{x}` is not a rank number"))
                    };
                    let (a, b) = (parse(a)?, parse(b)?);
                    if a == b {
                        return Err(format!("`{s}`: the two ranks must differ"));
                    }
                    Fault::RankSwap(a, b)
                } else if let Some(g) = s.strip_prefix("param-zeroed:") {
                    if g.is_empty() {
                        return Err(format!("`{s}`: expected param-zeroed:GLOB"));
                    }
                    Fault::ParamZeroed(g.to_string())
                } else {
                    return Err(format!(
                        "unknown fault `{s}`; known: {}",
                        FAULT_NAMES.join(", ")
                    ));
                }
            }
        })
    }
}

impl Fault {
    /// The cause name reported by `--against` (the fault's name without arguments).
    pub fn cause(&self) -> &'static str {
        match self {
            Fault::None => "none",
            Fault::KvbConcat => "kvb-concat",
            Fault::KvbUntransposed => "kvb-untransposed",
            Fault::RankSwap(..) => "rank-swap",
            Fault::MergedRank0 => "merged-rank0",
            Fault::MergedMidsplit => "merged-midsplit",
            Fault::ParamZeroed(_) => "param-zeroed",
            Fault::WrongDim => "wrong-dim",
            Fault::VocabUnpadded => "vocab-unpadded",
            Fault::Bf16AsF16 => "bf16-as-f16",
        }
    }

    /// The parameters this bug touches by default.
    pub fn targets(&self, p: &ParamPlan) -> bool {
        let role = p.def.role();
        match self {
            Fault::None => false,
            Fault::KvbConcat | Fault::KvbUntransposed => role == Some(Role::AttnKvB),
            Fault::RankSwap(..) | Fault::WrongDim => role == Some(Role::AttnOut),
            Fault::MergedRank0 | Fault::MergedMidsplit => {
                matches!(p.style, TpStyle::MergedColumn | TpStyle::MoeW13)
            }
            Fault::ParamZeroed(g) => glob_match(g, &p.param),
            Fault::VocabUnpadded => p.style == TpStyle::Vocab,
            Fault::Bf16AsF16 => true,
        }
    }

    /// Refuses a fault that would change nothing (or is impossible) at this tp.
    pub fn check_tp(&self, tp: usize) -> Result<(), String> {
        match self {
            Fault::RankSwap(a, b) if *a >= tp || *b >= tp => {
                Err(format!("rank-swap:{a},{b} needs tp > {}", a.max(b)))
            }
            Fault::MergedRank0 | Fault::MergedMidsplit | Fault::WrongDim if tp < 2 => Err(format!(
                "{} changes nothing at tp=1 (one rank holds the whole tensor)",
                self.cause()
            )),
            _ => Ok(()),
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
        if !self.targets(p) {
            return out(p.shard(full, rank).map_err(candle)?, dtype);
        }
        let shard = match self {
            Fault::None => p.shard(full, rank).map_err(candle)?,
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

/// What one corrupt rank's tensor is explained by.
#[derive(Debug, Clone, PartialEq)]
pub enum Explanation {
    Fault(Fault, String),
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
            format!(
                "cut along dim {} instead of dim {}",
                c.dim,
                p.shard_dim.unwrap_or(0)
            ),
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
                    format!(
                        "{} rows per rank (vocab {}/tp) instead of {} (vocab padded to {}/tp)",
                        c.len(),
                        p.full_shape[0],
                        expected.first().copied().unwrap_or(0),
                        crate::plan::padded_vocab(p.full_shape[0])
                    ),
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
        return Explanation::Fault(
            Fault::ParamZeroed(p.param.clone()),
            "all zeros (an init value: the parameter was never loaded)".into(),
        );
    }
    if !a.is_empty() && a.iter().all(|&x| x == 1.0) {
        return Explanation::Fault(
            Fault::ParamZeroed(p.param.clone()),
            "all ones (an init value: the parameter was never loaded)".into(),
        );
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
            return Explanation::Fault(
                Fault::Bf16AsF16,
                "declared F16, but the bits are the expected values in bf16".into(),
            );
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
            return Explanation::Fault(
                Fault::MergedMidsplit,
                "holds a contiguous block of the [gate; up] concatenation instead of gate shard r then up shard r".into(),
            );
        }
        if let Some(x) = wrong_dim(e) {
            return x;
        }
    }
    if p.def.role() == Some(Role::AttnKvB) {
        if let Ok(t) = kvb_concat(e.w, p) {
            if p.shard(&t, e.rank).is_ok_and(|s| e.same_as(&s)) {
                return Explanation::Fault(
                    Fault::KvbConcat,
                    "rows are all heads' k_nope then all heads' v, not [k_nope; v] per head: this rank computes with the wrong heads".into(),
                );
            }
        }
        if let Ok(t) = kvb_untransposed(e.w, p) {
            if p.shard(&t, e.rank).is_ok_and(|s| e.same_as(&s)) {
                return Explanation::Fault(
                    Fault::KvbUntransposed,
                    "k rows are attn_k_b reshaped, not transposed back ([H, kv_lora, nope] read as [H, nope, kv_lora])".into(),
                );
            }
        }
    }
    Explanation::Unexplained
}
