//! `shards --verify`: every planned parameter dequantized, scanned, and its shards checked to
//! reassemble it (and kv_b_proj's layout against attn_k_b / attn_v_b).

use candle_core::Tensor;
use serde::Serialize;

use super::values;
use crate::arch::glm_dsa::TpStyle;
use crate::compare::diff;
use crate::gguf::stats::{stream_stats, Stats};
use crate::plan::{check_ranges, check_reassembly, ParamPlan, ShardPlan};
use crate::weights::Weights;

#[derive(Debug, Clone, Serialize)]
pub struct VerifyRow {
    pub param: String,
    pub dtype: String,
    pub full_shape: Vec<usize>,
    pub absmax: f64,
    pub mean: f64,
    pub std: f64,
    pub nan: u64,
    pub inf: u64,
    /// Shards concatenate back to the full tensor (and padding is zero).
    pub reassembles: bool,
    pub reassembly_check: ReassemblyCheck,
    #[serde(serialize_with = "crate::report::shards::verify_problems")]
    pub problems: Vec<Problem>,
}

/// How the shards were checked to reassemble their tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReassemblyCheck {
    /// Cut, concatenated and compared.
    Data,
    /// The cuts tile the tensor exactly once (stacked experts and tensors too large to copy).
    Ranges,
}

/// What is wrong with a parameter or its shards. Its words are `report::shards`'.
#[derive(Debug, Clone, PartialEq)]
pub enum Problem {
    /// The plan cannot cut this parameter at this tp.
    Cut(crate::plan::PlanProblem),
    /// The plan's cuts not tiling the tensor, or the shards not reassembling it (the plan's
    /// reading).
    Plan(String),
    /// Some of its GGUF source tensors are not in the file.
    SourcesMissing,
    /// A tensor could not be read, decoded or rebuilt (the error).
    Unreadable(String),
    /// The decoded values hold NaN or Inf.
    NonFinite { nan: u64, inf: u64 },
    /// kv_b_proj read as vLLM's MLA absorption does gives other per-head rows than the GGUF's.
    KvbLayout { part: KvbPart, rel_l2: f64 },
    /// The kv_b_proj layout check failed to run (the error).
    KvbLayoutUnchecked(String),
}

/// Which half of kv_b_proj's per-head rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvbPart {
    /// The k_nope rows (the GGUF's attn_k_b, transposed).
    KNope,
    /// The v rows (the GGUF's attn_v_b).
    V,
}

#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    pub tp: usize,
    pub params: Vec<VerifyRow>,
    pub bytes: u64,
    pub seconds: f64,
    pub ok: bool,
}

/// Above this many values a tensor is scanned in streaming chunks and its shards are checked from
/// their ranges, not by cutting and comparing copies (which costs more than the decode itself and
/// re-checks candle's narrow/cat rather than the plan). The fixtures are data-checked throughout.
const DATA_CHECK_MAX: usize = 1 << 22;

/// Dequantizes every planned parameter and checks it. Stacked experts and very large tensors are
/// decoded in cache-sized chunks straight into the statistics (never materialised), so memory stays
/// bounded by the largest other tensor; the next parameter's bytes are read ahead meanwhile.
/// `tick(bytes)` reports progress.
pub fn verify(
    w: &Weights<'_>,
    plan: &ShardPlan,
    tick: &mut dyn FnMut(&ParamPlan, u64),
) -> VerifyReport {
    let start = std::time::Instant::now();
    let mut rows = Vec::with_capacity(plan.params.len());
    let mut bytes = 0;
    let sources = |p: &ParamPlan| -> Vec<crate::gguf::TensorRef<'_>> {
        p.gguf.iter().filter_map(|n| w.model.tensor(n)).collect()
    };
    for (i, p) in plan.params.iter().enumerate() {
        if let Some(next) = plan.params.get(i + 1) {
            sources(next).iter().for_each(|t| t.prefetch());
        }
        let src = sources(p);
        let src_bytes: u64 = src.iter().map(|t| t.info.n_bytes).sum();
        let n_values: usize = p.full_shape.iter().product();
        let mut problems: Vec<Problem> = p.problems.iter().cloned().map(Problem::Cut).collect();
        if let Err(e) = check_ranges(p) {
            problems.push(Problem::Plan(e));
        }
        let mut stats = Stats::default();
        let streamed =
            p.style == TpStyle::MoeW13 || p.style == TpStyle::MoeW2 || n_values > DATA_CHECK_MAX;
        if streamed {
            // The vLLM tensor's values are exactly its GGUF sources' values.
            if src.len() != p.gguf.len() {
                problems.push(Problem::SourcesMissing);
            }
            for t in &src {
                match stream_stats(*t) {
                    Ok(s) => stats.merge(&s),
                    Err(e) => problems.push(Problem::Unreadable(e.to_string())),
                }
            }
            if p.def.role() == Some(crate::arch::glm_dsa::Role::AttnKvB) {
                match w.vllm(&p.param) {
                    Ok(full) => {
                        if let Err(e) = check_kvb_layout(w, p, &full) {
                            problems.push(e);
                        }
                    }
                    Err(e) => problems.push(Problem::Unreadable(e.to_string())),
                }
            }
        } else {
            match w.vllm(&p.param) {
                Err(e) => problems.push(Problem::Unreadable(e.to_string())),
                Ok(full) => {
                    match values(&full) {
                        Ok(v) => stats.add(&v),
                        Err(e) => problems.push(Problem::Unreadable(e.to_string())),
                    }
                    if let Err(e) = check_reassembly(p, &full, plan.tp) {
                        problems.push(Problem::Plan(e));
                    }
                    if p.def.role() == Some(crate::arch::glm_dsa::Role::AttnKvB) {
                        if let Err(e) = check_kvb_layout(w, p, &full) {
                            problems.push(e);
                        }
                    }
                }
            }
        }
        if stats.nan + stats.inf > 0 {
            problems.push(Problem::NonFinite {
                nan: stats.nan,
                inf: stats.inf,
            });
        }
        src.iter().for_each(|t| t.release());
        bytes += src_bytes;
        tick(p, src_bytes);
        rows.push(VerifyRow {
            param: p.param.clone(),
            dtype: p.dtype.clone(),
            full_shape: p.full_shape.clone(),
            absmax: stats.absmax,
            mean: stats.mean(),
            std: stats.std(),
            nan: stats.nan,
            inf: stats.inf,
            reassembles: problems.is_empty(),
            reassembly_check: if streamed {
                ReassemblyCheck::Ranges
            } else {
                ReassemblyCheck::Data
            },
            problems,
        });
    }
    let ok = rows.iter().all(|r| r.problems.is_empty());
    VerifyReport {
        tp: plan.tp,
        params: rows,
        bytes,
        seconds: start.elapsed().as_secs_f64(),
        ok,
    }
}

/// kv_b_proj read as vLLM's MLA absorption does (`W.T.view(kv_lora, H, nope + v)`, split [nope, v])
/// must give, per head, attn_k_b transposed back and attn_v_b.
fn check_kvb_layout(w: &Weights<'_>, p: &ParamPlan, kvb: &Tensor) -> Result<(), Problem> {
    let c = w.config;
    let [k_name, v_name] = p.gguf.as_slice() else {
        return Ok(()); // legacy single attn_kv_b tensor: nothing to cross-check
    };
    let err = |e: candle_core::Error| Problem::KvbLayoutUnchecked(e.to_string());
    let h = c.num_attention_heads;
    let (nope, vd, l) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
    let view = kvb
        .t()
        .and_then(|t| t.reshape((l, h, nope + vd)))
        .map_err(err)?;
    let unreadable = |e: crate::weights::WeightError| Problem::Unreadable(e.to_string());
    let k_b = w.gguf_tensor(&p.param, k_name, None).map_err(unreadable)?; // [H, L, nope]
    let v_b = w.gguf_tensor(&p.param, v_name, None).map_err(unreadable)?; // [H, v, L]
    let k_view = view
        .narrow(2, 0, nope)
        .and_then(|t| t.permute((1, 0, 2)))
        .map_err(err)?; // [H, L, nope]
    let v_view = view
        .narrow(2, nope, vd)
        .and_then(|t| t.permute((1, 2, 0)))
        .map_err(err)?; // [H, v, L]
    for (part, a, b) in [(KvbPart::KNope, &k_view, &k_b), (KvbPart::V, &v_view, &v_b)] {
        let a = a.contiguous().and_then(|t| values(&t)).map_err(err)?;
        let b = values(b).map_err(err)?;
        if a != b {
            return Err(Problem::KvbLayout {
                part,
                rel_l2: diff(&a, &b).rel_l2,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::ConfigReader;
    use crate::gguf::GgufModel;

    fn tiny() -> GgufModel {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-F32.gguf");
        GgufModel::open(&path).expect("the tiny fixture opens")
    }

    #[test]
    fn the_tiny_fixture_verifies_and_a_scaled_kv_b_does_not() {
        let model = tiny();
        let cfg = ConfigReader::read(&model, crate::arch::ARCH)
            .expect("config")
            .config;
        let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
        let plan = ShardPlan::new(&model, &cfg, 2);
        let mut ticks = 0;
        let r = verify(&w, &plan, &mut |_, _| ticks += 1);
        assert!(
            r.ok,
            "{:?}",
            r.params.iter().find(|p| !p.problems.is_empty())
        );
        assert_eq!(
            (r.params.len(), ticks),
            (plan.params.len(), plan.params.len())
        );
        assert!(r.params.iter().all(|p| p.reassembles && p.nan + p.inf == 0));
        let p = plan
            .params
            .iter()
            .find(|p| p.param == "model.layers.0.self_attn.kv_b_proj.weight")
            .expect("planned");
        let kvb = w.vllm(&p.param).expect("rebuilt");
        assert_eq!(check_kvb_layout(&w, p, &kvb), Ok(()));
        let doubled = (&kvb * 2.0).expect("scaled");
        match check_kvb_layout(&w, p, &doubled) {
            Err(Problem::KvbLayout { part, rel_l2 }) => {
                assert_eq!(part, KvbPart::KNope, "the k_nope rows are checked first");
                assert!(
                    (rel_l2 - 1.0).abs() < 1e-6,
                    "twice the values: rel-L2 1, got {rel_l2}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
