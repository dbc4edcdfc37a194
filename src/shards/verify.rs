//! `shards --verify`: every planned parameter dequantized, scanned, and its shards checked to
//! reassemble it (and kv_b_proj's layout against attn_k_b / attn_v_b).

use candle_core::Tensor;
use serde::Serialize;

use super::values;
use crate::arch::glm_dsa::TpStyle;
use crate::compare::diff;
use crate::plan::{check_ranges, check_reassembly, ParamPlan, ShardPlan};
use crate::scan::{stream_stats, Stats};
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
    /// How that was checked: "data" (cut, concatenated and compared) or "ranges" (the cuts tile the
    /// tensor exactly once; for stacked experts and tensors too large to copy).
    pub reassembly_check: &'static str,
    pub problems: Vec<String>,
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
        let mut problems = p.problems.clone();
        if let Err(e) = check_ranges(p) {
            problems.push(e);
        }
        let mut stats = Stats::default();
        let streamed =
            p.style == TpStyle::MoeW13 || p.style == TpStyle::MoeW2 || n_values > DATA_CHECK_MAX;
        if streamed {
            // The vLLM tensor's values are exactly its GGUF sources' values.
            if src.len() != p.gguf.len() {
                problems.push("GGUF source tensor(s) missing".into());
            }
            for t in &src {
                match stream_stats(*t) {
                    Ok(s) => stats.merge(&s),
                    Err(e) => problems.push(e.to_string()),
                }
            }
            if p.def.role() == Some(crate::arch::glm_dsa::Role::AttnKvB) {
                match w.vllm(&p.param) {
                    Ok(full) => {
                        if let Err(e) = check_kvb_layout(w, p, &full) {
                            problems.push(e);
                        }
                    }
                    Err(e) => problems.push(e.to_string()),
                }
            }
        } else {
            match w.vllm(&p.param) {
                Err(e) => problems.push(e.to_string()),
                Ok(full) => {
                    match values(&full) {
                        Ok(v) => stats.add(&v),
                        Err(e) => problems.push(e.to_string()),
                    }
                    if let Err(e) = check_reassembly(p, &full, plan.tp) {
                        problems.push(e);
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
            problems.push(format!("{} NaN and {} Inf values", stats.nan, stats.inf));
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
            reassembly_check: if streamed { "ranges" } else { "data" },
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
fn check_kvb_layout(w: &Weights<'_>, p: &ParamPlan, kvb: &Tensor) -> Result<(), String> {
    let c = w.config;
    let [k_name, v_name] = p.gguf.as_slice() else {
        return Ok(()); // legacy single attn_kv_b tensor: nothing to cross-check
    };
    let err = |e: candle_core::Error| format!("kv_b_proj layout check: {e}");
    let h = c.num_attention_heads;
    let (nope, vd, l) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
    let view = kvb
        .t()
        .and_then(|t| t.reshape((l, h, nope + vd)))
        .map_err(err)?;
    let k_b = w
        .gguf_tensor(&p.param, k_name, None)
        .map_err(|e| e.to_string())?; // [H, L, nope]
    let v_b = w
        .gguf_tensor(&p.param, v_name, None)
        .map_err(|e| e.to_string())?; // [H, v, L]
    let k_view = view
        .narrow(2, 0, nope)
        .and_then(|t| t.permute((1, 0, 2)))
        .map_err(err)?; // [H, L, nope]
    let v_view = view
        .narrow(2, nope, vd)
        .and_then(|t| t.permute((1, 2, 0)))
        .map_err(err)?; // [H, v, L]
    for (name, a, b) in [("k_nope", &k_view, &k_b), ("v", &v_view, &v_b)] {
        let a = a.contiguous().and_then(|t| values(&t)).map_err(err)?;
        let b = values(b).map_err(err)?;
        if a != b {
            return Err(format!(
                "kv_b_proj's per-head {name} rows do not equal the GGUF's {} (rel-L2 {:.3e})",
                if name == "v" {
                    "attn_v_b"
                } else {
                    "attn_k_b transposed"
                },
                diff(&a, &b).rel_l2
            ));
        }
    }
    Ok(())
}
