//! `shards --verify` (the GGUF's own shards are sound) and `shards --against DIR` (what a deployment's
//! ranks hold, diagnosed). No printing: reports are values for `report`.

use std::collections::{BTreeMap, BTreeSet};

use candle_core::Tensor;
use serde::Serialize;

use crate::arch::glm_dsa::TpStyle;
use crate::compare::{diff, dump_dtype_rel_l2, quant_rel_l2_bound};
use crate::dump::{is_float, DumpError, DumpTensor, RankDump, RankFile};
use crate::faults::{explain, Evidence, Explanation, Fault};
use crate::plan::{check_ranges, check_reassembly, per_expert, ParamPlan, ShardPlan};
use crate::scan::{stream_stats, Stats};
use crate::weights::{WeightError, Weights};

fn values(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

// ---------------------------------------------------------------------------------------------
// --verify

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

// ---------------------------------------------------------------------------------------------
// --against

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub param: String,
    pub layer: Option<usize>,
    pub ranks: Vec<usize>,
    pub cause: String,
    pub detail: String,
    /// Of the worst rank.
    pub rel_l2: f64,
    pub cosine: f64,
}

/// How a (param, rank) compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Match,
    Quantization,
    Corrupt,
}

#[derive(Debug, Clone, Serialize)]
pub struct Checked {
    pub param: String,
    pub rank: usize,
    pub class: Class,
    pub rel_l2: f64,
    pub tol_match: f64,
    pub tol_quant: f64,
    /// The rank holds the whole vocab table (VLLM_REPLICATE_EMBED), not its vocab-parallel shard.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub replicated: bool,
}

/// The outcome of `shards --against`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Every expected parameter on every expected rank was checked, and none is corrupt.
    Pass,
    /// At least one corrupt parameter (or one that could not be compared).
    Fail,
    /// Nothing corrupt among what was checked, but not everything expected was checked (missing
    /// rank files or parameters, names glmcheck does not know).
    Incomplete,
}

/// Where a dump's values came from, which decides how far they may be from the GGUF's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Provenance {
    /// A deployment that loaded this GGUF: its dequantized values, up to the dump's dtype rounding.
    Gguf,
    /// The unquantized originals (an HF checkpoint loaded as is): within the quant type's noise.
    Originals,
}

/// The provenance a check used, and what decided it.
#[derive(Debug, Clone, Serialize)]
pub struct ProvenanceBasis {
    pub provenance: Provenance,
    /// Forced by `--provenance`; else decided from the shards of quantized parameters.
    pub forced: bool,
    /// Shards of parameters whose GGUF type is quantized (their quant bound is above the dtype's).
    pub quantized_shards: usize,
    /// How many of those equal the dequantized values up to the dump's dtype.
    pub equal_to_dequantized: usize,
}

/// What `shards --against` checks beyond the plan's parameters.
#[derive(Debug, Clone, Default)]
pub struct AgainstOptions {
    /// Where the dump's values came from (None: decided from the dump: gguf when at least half of
    /// the quantized parameters' shards equal the dequantized values).
    pub provenance: Option<Provenance>,
    /// Only these ranks are expected (None: all `0..tp`).
    pub ranks: Option<Vec<usize>>,
    /// Names glmcheck does not know are listed but do not make the run incomplete.
    pub allow_unexpected: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct AgainstReport {
    pub verdict: Verdict,
    pub tp: usize,
    pub provenance: ProvenanceBasis,
    /// The ranks expected (all of `0..tp` unless narrowed).
    pub ranks: Vec<usize>,
    /// (param, rank) pairs the plan expects on the expected ranks, and how many were compared.
    pub expected_shards: usize,
    pub checked_shards: usize,
    /// Alias templates the dump used instead of the plan's names (another vLLM version's names,
    /// `state_dict()` aliases), each with how many tensors were found under it.
    pub aliases: BTreeMap<String, usize>,
    /// With --allow-unexpected, unknown names were listed but did not make the run incomplete.
    pub allow_unexpected: bool,
    /// vLLM buffers (attention scales, RoPE caches) a `state_dict()` dump holds: not weights.
    pub buffers_ignored: usize,
    pub findings: Vec<Finding>,
    /// Parameters in the plan absent from the dump (param@rank for partial absences).
    pub missing: Vec<String>,
    /// Dump tensors the plan does not know.
    pub unexpected: Vec<String>,
    pub missing_ranks: Vec<usize>,
    pub checked: Vec<Checked>,
    /// Parameters present in the dump that could not be compared (fail the check).
    pub unchecked: Vec<Unchecked>,
    /// Rank files present but unreadable (fail the check; the other ranks are still compared).
    pub unreadable_ranks: Vec<UnreadableRank>,
}

#[derive(Debug, Clone, Serialize)]
pub struct UnreadableRank {
    pub rank: usize,
    pub error: String,
}

/// A parameter the dump holds but `--against` could not compare, and why: a non-float dtype in the
/// dump, or a GGUF source tensor that cannot be dequantized.
#[derive(Debug, Clone, Serialize)]
pub struct Unchecked {
    pub param: String,
    pub ranks: Vec<usize>,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum AgainstError {
    #[error(transparent)]
    Dump(#[from] DumpError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

/// One rank's tensor against its expected shard: the class, the diff, and (when corrupt) what
/// explains it.
struct RankVerdict {
    class: Class,
    replicated: bool,
    rel_l2: f64,
    cosine: f64,
    tol_match: f64,
    tol_quant: f64,
    explanation: Option<Explanation>,
}

/// For an expert stack: how many of its experts were corrupt on a rank (the verdict is the first
/// corrupt expert's, or the worst diff when none is).
struct ExpertCount {
    corrupt: usize,
    of: usize,
}

/// Compares `actual` (rank `rank`'s copy) with `p`'s shard of `full`.
fn judge(
    w: &Weights<'_>,
    p: &ParamPlan,
    full: &Tensor,
    rank: usize,
    actual: &DumpTensor,
    quant: f64,
) -> Result<RankVerdict, WeightError> {
    let candle = |err| WeightError::Candle {
        param: p.param.clone(),
        err,
    };
    let tol_match = dump_dtype_rel_l2(actual.dtype);
    let tol_quant = tol_match + quant;
    let mut shard = p.shard(full, rank).map_err(candle)?;
    // VLLM_REPLICATE_EMBED=1: every rank holds the whole (padded or unpadded) vocab table, a valid
    // alternative to the vocab-parallel cut.
    let replicated = p.style == TpStyle::Vocab
        && p.cuts.len() > 1
        && shard.dims() != actual.shape.as_slice()
        && full.dims().len() == 2
        && actual.shape.len() == 2
        && actual.shape[1] == full.dims()[1]
        && (actual.shape[0] == full.dims()[0]
            || actual.shape[0] == crate::plan::padded_vocab(full.dims()[0]));
    if replicated {
        shard = full
            .pad_with_zeros(0, 0, actual.shape[0] - full.dims()[0])
            .map_err(candle)?;
    }
    let (class, rel_l2, cosine) = if shard.dims() == actual.shape.as_slice() {
        let d = diff(&actual.to_f32(), &values(&shard).map_err(candle)?);
        let class = if d.rel_l2 <= tol_match {
            Class::Match
        } else if d.rel_l2 <= tol_quant {
            Class::Quantization
        } else {
            Class::Corrupt
        };
        (class, d.rel_l2, d.cosine)
    } else {
        (Class::Corrupt, f64::NAN, f64::NAN)
    };
    let explanation = (class == Class::Corrupt).then(|| {
        let ev = Evidence {
            p,
            full,
            w,
            tp: p.cuts.len().max(1),
            rank,
            actual,
            tol: tol_quant,
        };
        explain(&ev, w.config)
    });
    Ok(RankVerdict {
        class,
        replicated,
        rel_l2,
        cosine,
        tol_match,
        tol_quant,
        explanation,
    })
}

/// Compares every parameter present in the dump with its expected shard from the GGUF. Rank files
/// stay memory-mapped and are read one parameter at a time; stacked experts one expert at a time, so
/// memory is bounded by one parameter's shards (one expert's, for expert stacks).
pub fn against(
    w: &Weights<'_>,
    plan: &ShardPlan,
    dump: &RankDump,
    opts: &AgainstOptions,
    tick: &mut dyn FnMut(&ParamPlan),
) -> Result<AgainstReport, AgainstError> {
    let tp = plan.tp;
    let expected_ranks: Vec<usize> = match &opts.ranks {
        Some(r) => r.iter().copied().filter(|&r| r < tp).collect(),
        None => (0..tp).collect(),
    };
    let mut ranks: Vec<Option<RankFile>> = Vec::with_capacity(tp);
    let mut unreadable_ranks = Vec::new();
    let mut first_error = None;
    let mut unexpected = BTreeSet::new();
    let mut aliases: BTreeMap<String, usize> = BTreeMap::new();
    let mut buffers = 0;
    let planned: BTreeSet<&str> = plan.params.iter().map(|p| p.param.as_str()).collect();
    for r in 0..tp {
        if !expected_ranks.contains(&r) {
            ranks.push(None);
            continue;
        }
        match dump.open_rank(r) {
            Ok(Some(mut f)) => {
                // Names of other vLLM versions and state_dict() aliases resolve to the plan's
                // names; a name no table knows is unexpected (the dump may come from a layout
                // glmcheck cannot check). Known parameters outside the --layer/--tensor selection
                // are simply not part of this check.
                let (known, unknown) =
                    f.resolve_aliases(|n| crate::arch::glm_dsa::canonical_vllm(n, w.config));
                for (stored, canonical) in known {
                    if stored != canonical && planned.contains(canonical.as_str()) {
                        if let Some((d, _)) = crate::arch::glm_dsa::lookup_vllm(&stored) {
                            let t = d
                                .all_names()
                                .find(|t| {
                                    crate::arch::glm_dsa::match_template(t, &stored).is_some()
                                })
                                .unwrap_or(d.vllm);
                            *aliases.entry(t.to_string()).or_default() += 1;
                        }
                    }
                }
                for name in unknown {
                    if crate::arch::glm_dsa::is_vllm_buffer(&name) {
                        buffers += 1;
                    } else {
                        unexpected.insert(format!("{name}@rank{r}"));
                    }
                }
                ranks.push(Some(f));
            }
            Ok(None) => ranks.push(None),
            // One broken rank file (a crashed worker's half-written dump) is reported; the other
            // ranks are still checked. Only when no rank file can be read is it an error.
            Err(e) => {
                unreadable_ranks.push(UnreadableRank {
                    rank: r,
                    error: e.to_string(),
                });
                first_error.get_or_insert(e);
                ranks.push(None);
            }
        }
    }
    if let Some(e) = first_error.filter(|_| ranks.iter().all(Option::is_none)) {
        return Err(e.into());
    }
    let missing_ranks: Vec<usize> = expected_ranks
        .iter()
        .copied()
        .filter(|r| !dump.files.contains_key(r))
        .collect();
    for (r, path) in &dump.files {
        if *r >= tp {
            unexpected.insert(format!("{} (rank {r} ≥ tp {tp})", path.display()));
        }
    }

    let mut findings = Vec::new();
    let mut missing = Vec::new();
    let mut checked = Vec::new();
    let mut unchecked = Vec::new();
    // The parameters compared, with the ranks holding them (to judge again once the dump's
    // provenance is known).
    let mut compared: Vec<(&ParamPlan, Vec<(usize, &RankFile)>)> = Vec::new();
    for p in &plan.params {
        // (rank, its file, the parameter's dtype there) for the ranks whose file holds it.
        let present: Vec<(usize, &RankFile, safetensors::Dtype)> = ranks
            .iter()
            .enumerate()
            .filter_map(|(r, f)| {
                let f = f.as_ref()?;
                f.dtype(&p.param).map(|d| (r, f, d))
            })
            .collect();
        let absent: Vec<usize> = (0..tp)
            .filter(|&r| ranks[r].is_some() && !present.iter().any(|(pr, ..)| *pr == r))
            .collect();
        if present.is_empty() {
            missing.push(p.param.clone());
            continue;
        }
        if !absent.is_empty() {
            missing.push(format!("{}@rank{}", p.param, rank_list(&absent)));
        }
        let (present, not_float): (Vec<_>, Vec<_>) =
            present.into_iter().partition(|(.., d)| is_float(*d));
        for (r, f, dtype) in not_float {
            unchecked.push(Unchecked {
                param: p.param.clone(),
                ranks: vec![r],
                reason: format!(
                    "{} holds it as {dtype:?}, not a float tensor: not compared",
                    f.path.display()
                ),
            });
        }
        let present: Vec<(usize, &RankFile)> =
            present.into_iter().map(|(r, f, _)| (r, f)).collect();
        if present.is_empty() {
            continue;
        }
        tick(p);
        let quant = (opts.provenance == Some(Provenance::Gguf)).then_some(0.0);
        match check_present(w, p, &present, tp, quant) {
            Ok((c, f)) => {
                checked.extend(c);
                findings.extend(f);
                compared.push((p, present));
            }
            Err(e) => {
                // One parameter that cannot be rebuilt (an undecodable GGUF tensor) is reported;
                // the rest are still checked.
                unchecked.push(Unchecked {
                    param: p.param.clone(),
                    ranks: present.iter().map(|(r, _)| *r).collect(),
                    reason: e.to_string(),
                });
            }
        }
    }
    // Where the dump's values came from decides what a difference may be. A deployment that
    // loaded this GGUF holds its dequantized values, exact up to the dump's dtype; only a dump of
    // the unquantized originals may differ by the quant type's noise.
    let quantized: Vec<&Checked> = checked
        .iter()
        .filter(|c| c.tol_quant > 2.0 * c.tol_match)
        .collect();
    let equal = quantized.iter().filter(|c| c.class == Class::Match).count();
    let provenance =
        opts.provenance
            .unwrap_or(if !quantized.is_empty() && 2 * equal >= quantized.len() {
                Provenance::Gguf
            } else {
                Provenance::Originals
            });
    let provenance = ProvenanceBasis {
        provenance,
        forced: opts.provenance.is_some(),
        quantized_shards: quantized.len(),
        equal_to_dequantized: equal,
    };
    if provenance.provenance == Provenance::Gguf && opts.provenance.is_none() {
        // Decided after the fact: parameters that passed only as "quantization noise" are judged
        // again at the dump-dtype bound (and explained when corrupt).
        let noisy: BTreeSet<String> = checked
            .iter()
            .filter(|c| c.class == Class::Quantization)
            .map(|c| c.param.clone())
            .collect();
        for (p, present) in compared.iter().filter(|(p, _)| noisy.contains(&p.param)) {
            let (c, f) = check_present(w, p, present, tp, Some(0.0))?;
            checked.retain(|x| x.param != p.param);
            findings.retain(|x| x.param != p.param);
            checked.extend(c);
            findings.extend(f);
        }
    }
    findings.sort_by(|a, b| {
        (
            a.layer.map_or(-1, |l| l as i64),
            a.ranks.first().copied(),
            &a.param,
        )
            .cmp(&(
                b.layer.map_or(-1, |l| l as i64),
                b.ranks.first().copied(),
                &b.param,
            ))
    });
    let checked_shards = checked
        .iter()
        .map(|c| (c.param.as_str(), c.rank))
        .collect::<BTreeSet<_>>()
        .len();
    let expected_shards = plan.params.len() * expected_ranks.len();
    let fail = !findings.is_empty() || !unchecked.is_empty() || !unreadable_ranks.is_empty();
    let incomplete = !missing.is_empty()
        || !missing_ranks.is_empty()
        || checked_shards < expected_shards
        || (!opts.allow_unexpected && !unexpected.is_empty());
    let verdict = if fail {
        Verdict::Fail
    } else if incomplete {
        Verdict::Incomplete
    } else {
        Verdict::Pass
    };
    Ok(AgainstReport {
        verdict,
        tp,
        provenance,
        ranks: expected_ranks,
        expected_shards,
        checked_shards,
        aliases,
        allow_unexpected: opts.allow_unexpected,
        buffers_ignored: buffers,
        findings,
        missing,
        unexpected: unexpected.into_iter().collect(),
        missing_ranks,
        checked,
        unchecked,
        unreadable_ranks,
    })
}

/// Compares one parameter's present ranks (`quant`: the quantization bound to allow, None: the GGUF
/// type's) and groups the corrupt ones into findings.
fn check_present(
    w: &Weights<'_>,
    p: &ParamPlan,
    present: &[(usize, &RankFile)],
    tp: usize,
    quant: Option<f64>,
) -> Result<(Vec<Checked>, Vec<Finding>), WeightError> {
    let verdicts = compare_param(w, p, present, tp, quant)?;
    let mut checked = Vec::new();
    let mut per_rank: Vec<(usize, Explanation, f64, f64)> = Vec::new();
    for (r, v, experts) in verdicts {
        checked.push(Checked {
            param: p.param.clone(),
            rank: r,
            class: v.class,
            rel_l2: v.rel_l2,
            tol_match: v.tol_match,
            tol_quant: v.tol_quant,
            replicated: v.replicated,
        });
        if let Some(x) = v.explanation {
            let x = match (x, experts) {
                (Explanation::Fault(f, d), Some(n)) if n.corrupt < n.of => {
                    Explanation::Fault(f, format!("{d} (in {} of {} experts)", n.corrupt, n.of))
                }
                (x, _) => x,
            };
            per_rank.push((r, x, v.rel_l2, v.cosine));
        }
    }
    Ok((checked, group(p, &per_rank, tp)))
}

/// Ranks as `0,3,5`.
pub fn rank_list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Every present rank's copy of `p` against its expected shard: one verdict per rank (per rank, the
/// first corrupt expert's for an expert stack, with the count of corrupt experts).
fn compare_param(
    w: &Weights<'_>,
    p: &ParamPlan,
    present: &[(usize, &RankFile)],
    tp: usize,
    quant: Option<f64>,
) -> Result<Vec<(usize, RankVerdict, Option<ExpertCount>)>, WeightError> {
    let quant = quant.unwrap_or_else(|| {
        p.dtypes
            .iter()
            .map(|t| quant_rel_l2_bound(*t))
            .fold(0.0, f64::max)
    });
    let mut verdicts: Vec<(usize, RankVerdict, Option<ExpertCount>)> = Vec::new();
    let n_experts = w.config.n_routed_experts;
    let experts = per_expert(p).filter(|_| {
        present
            .iter()
            .all(|(_, f)| f.shape(&p.param).and_then(|s| s.first().copied()) == Some(n_experts))
    });
    match (experts, p.idx.layer) {
        (Some(q), Some(layer)) => {
            let mut worst: Vec<Option<RankVerdict>> = (0..tp).map(|_| None).collect();
            let mut bad = vec![0usize; tp];
            for e in 0..n_experts {
                let full = expert_slice(w, p, layer, e)?;
                for (r, f) in present {
                    let Some(actual) = f.get_outer(&p.param, e) else {
                        continue;
                    };
                    let v = judge(w, &q, &full, *r, &actual, quant)?;
                    if v.class == Class::Corrupt {
                        bad[*r] += 1;
                    }
                    let keep = match &worst[*r] {
                        None => true,
                        // The first corrupt expert explains the rank; until then the worst diff.
                        Some(old) => {
                            old.class != Class::Corrupt
                                && (v.class == Class::Corrupt || v.rel_l2 > old.rel_l2)
                        }
                    };
                    if keep {
                        worst[*r] = Some(v);
                    }
                }
            }
            for (r, v) in worst.into_iter().enumerate() {
                if let Some(v) = v {
                    verdicts.push((
                        r,
                        v,
                        Some(ExpertCount {
                            corrupt: bad[r],
                            of: n_experts,
                        }),
                    ));
                }
            }
        }
        _ => {
            let full = w.vllm(&p.param)?;
            for (r, f) in present {
                let Some(actual) = f.get(&p.param) else {
                    continue;
                };
                verdicts.push((*r, judge(w, p, &full, *r, &actual, quant)?, None));
            }
        }
    }
    Ok(verdicts)
}

/// One expert's slice of a stacked vLLM expert parameter: its HF parts concatenated ([2I, H] for
/// w13, [H, I] for w2).
fn expert_slice(
    w: &Weights<'_>,
    p: &ParamPlan,
    layer: usize,
    e: usize,
) -> Result<Tensor, WeightError> {
    let idx = crate::arch::glm_dsa::Idx {
        layer: Some(layer),
        expert: Some(e),
    };
    let parts = p
        .def
        .parts
        .iter()
        .map(|t| w.hf(&crate::arch::glm_dsa::name(t, idx)))
        .collect::<Result<Vec<_>, _>>()?;
    Tensor::cat(&parts, p.def.cat_dim.saturating_sub(1)).map_err(|err| WeightError::Candle {
        param: p.param.clone(),
        err,
    })
}

/// Turns per-rank explanations into findings: ranks with the same cause are one finding; ranks
/// holding another rank's shard become rank-swap or merged-rank0.
fn group(p: &ParamPlan, per_rank: &[(usize, Explanation, f64, f64)], tp: usize) -> Vec<Finding> {
    let mut out: Vec<Finding> = Vec::new();
    let mut add = |cause: &str, detail: String, rank: usize, rel: f64, cos: f64| {
        if let Some(f) = out
            .iter_mut()
            .find(|f| f.cause == cause && f.detail == detail)
        {
            f.ranks.push(rank);
            if rel > f.rel_l2 || f.rel_l2.is_nan() {
                f.rel_l2 = rel;
                f.cosine = cos;
            }
        } else {
            out.push(Finding {
                param: p.param.clone(),
                layer: p.layer,
                ranks: vec![rank],
                cause: cause.into(),
                detail,
                rel_l2: rel,
                cosine: cos,
            });
        }
    };
    let holders: Vec<(usize, usize)> = per_rank
        .iter()
        .filter_map(|(r, x, ..)| match x {
            Explanation::HoldsShardOf(o) => Some((*r, *o)),
            _ => None,
        })
        .collect();
    let all_hold_zero =
        tp > 1 && holders.len() == tp - 1 && holders.iter().all(|&(r, o)| r != 0 && o == 0);
    for (r, x, rel, cos) in per_rank {
        match x {
            Explanation::Fault(f, detail) => add(f.cause(), detail.clone(), *r, *rel, *cos),
            Explanation::HoldsShardOf(o) if all_hold_zero => add(
                Fault::MergedRank0.cause(),
                format!("every rank holds shard {o} (the tp rank was ignored while loading)"),
                *r,
                *rel,
                *cos,
            ),
            Explanation::HoldsShardOf(o) => {
                let swapped = holders.iter().any(|&(a, b)| a == *o && b == *r);
                let detail = if swapped {
                    let (a, b) = ((*r).min(*o), (*r).max(*o));
                    format!("ranks {a} and {b} hold each other's shards")
                } else {
                    format!("rank {r} holds rank {o}'s shard")
                };
                add("rank-swap", detail, *r, *rel, *cos)
            }
            Explanation::ShapeMismatch { expected, found } => add(
                "shape-mismatch",
                format!("shape {found:?}, expected {expected:?}"),
                *r,
                *rel,
                *cos,
            ),
            Explanation::Unexplained => add(
                "unexplained",
                format!("rel-L2 {rel:.3e}, cosine {cos:.4}: no known loader bug's signature fits"),
                *r,
                *rel,
                *cos,
            ),
        }
    }
    out
}

/// Which bug to inject, where, and in what dtype.
pub struct InjectSpec<'a> {
    pub fault: &'a Fault,
    /// Only this layer's parameters get the bug.
    pub layer: Option<usize>,
    /// Only parameters matching one of these globs get the bug (empty: the bug's default targets).
    pub params: &'a [String],
    pub dtype: safetensors::Dtype,
    /// Which vLLM version's parameter names the dump uses.
    pub names: crate::arch::glm_dsa::VllmNames,
}

/// Writes the dump a loader with the bug would hold into `out`, never over one of `inputs`.
/// Returns the files written.
pub fn inject(
    w: &Weights<'_>,
    plan: &ShardPlan,
    spec: &InjectSpec<'_>,
    out: &std::path::Path,
    inputs: &[&std::path::Path],
) -> Result<Vec<std::path::PathBuf>, AgainstError> {
    let (fault, layer, only, dtype) = (spec.fault, spec.layer, spec.params, spec.dtype);
    let tp = plan.tp;
    let mut per_rank: Vec<BTreeMap<String, DumpTensor>> = vec![BTreeMap::new(); tp];
    for p in &plan.params {
        let full = w.vllm(&p.param)?;
        let in_scope = layer.is_none_or(|l| p.layer == Some(l))
            && (only.is_empty() || only.iter().any(|g| crate::scan::glob_match(g, &p.param)));
        let f = if in_scope { fault.clone() } else { Fault::None };
        let name = crate::arch::glm_dsa::name(p.def.name_in(spec.names), p.idx);
        for (r, slot) in per_rank.iter_mut().enumerate() {
            slot.insert(name.clone(), f.inject(p, &full, w, tp, r, dtype)?);
        }
    }
    let mut written = Vec::new();
    let mut meta = std::collections::HashMap::new();
    meta.insert("glmcheck.fault".to_string(), format!("{fault:?}"));
    meta.insert("glmcheck.tp".to_string(), tp.to_string());
    meta.insert(
        "glmcheck.vllm_names".to_string(),
        serde_json::to_value(spec.names)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
    );
    for (r, tensors) in per_rank.iter().enumerate() {
        let path = out.join(format!("rank{r}.safetensors"));
        crate::dump::write_file(&path, tensors, Some(meta.clone()), inputs)?;
        written.push(path);
    }
    Ok(written)
}
