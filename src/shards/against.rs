//! `shards --against DIR`: what a deployment's ranks hold, each rank's copy of each parameter
//! against the shard the plan cuts from the GGUF, classified and (when corrupt) diagnosed.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::diagnose::{check_present, Cause};
use crate::dump::{is_float, DumpError, RankDump, RankFile};
use crate::plan::{ParamPlan, ShardPlan};
use crate::weights::{WeightError, Weights};

/// Ranks holding the same corrupt parameter for the same cause. Its JSON (`cause` and `detail`
/// words) is written by `report::shards`.
#[derive(Debug, Clone)]
pub struct Finding {
    pub param: String,
    pub layer: Option<usize>,
    pub ranks: Vec<usize>,
    pub cause: Cause,
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
    #[serde(serialize_with = "crate::report::shards::unchecked_reason")]
    pub reason: UncheckedReason,
}

/// Why a parameter the dump holds was not compared.
#[derive(Debug, Clone, PartialEq)]
pub enum UncheckedReason {
    /// The rank file holds it in a non-float dtype.
    NotFloat {
        file: std::path::PathBuf,
        dtype: safetensors::Dtype,
    },
    /// Its expected shard could not be rebuilt from the GGUF (the error).
    NotRebuilt(String),
}

#[derive(Debug, thiserror::Error)]
pub enum AgainstError {
    #[error(transparent)]
    Dump(#[from] DumpError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

/// The expected rank files opened, and what their tensor names said.
struct Opened {
    /// One entry per rank `0..tp`: None when not expected, absent or unreadable.
    ranks: Vec<Option<RankFile>>,
    unreadable: Vec<UnreadableRank>,
    unexpected: BTreeSet<String>,
    aliases: BTreeMap<String, usize>,
    buffers: usize,
}

/// Opens the expected ranks' files. One broken rank file (a crashed worker's half-written dump) is
/// reported and the other ranks are still checked; only when no rank file can be read is it an
/// error.
fn open_ranks(
    w: &Weights<'_>,
    plan: &ShardPlan,
    dump: &RankDump,
    expected_ranks: &[usize],
) -> Result<Opened, AgainstError> {
    let mut o = Opened {
        ranks: Vec::with_capacity(plan.tp),
        unreadable: Vec::new(),
        unexpected: BTreeSet::new(),
        aliases: BTreeMap::new(),
        buffers: 0,
    };
    let mut first_error = None;
    let planned: BTreeSet<&str> = plan.params.iter().map(|p| p.param.as_str()).collect();
    for r in 0..plan.tp {
        if !expected_ranks.contains(&r) {
            o.ranks.push(None);
            continue;
        }
        match dump.open_rank(r) {
            Ok(Some(mut f)) => {
                note_names(w, &mut f, r, &planned, &mut o);
                o.ranks.push(Some(f));
            }
            Ok(None) => o.ranks.push(None),
            Err(e) => {
                o.unreadable.push(UnreadableRank {
                    rank: r,
                    error: e.to_string(),
                });
                first_error.get_or_insert(e);
                o.ranks.push(None);
            }
        }
    }
    if let Some(e) = first_error.filter(|_| o.ranks.iter().all(Option::is_none)) {
        return Err(e.into());
    }
    for (r, path) in &dump.files {
        if *r >= plan.tp {
            o.unexpected
                .insert(format!("{} (rank {r} ≥ tp {})", path.display(), plan.tp));
        }
    }
    Ok(o)
}

/// Names of other vLLM versions and state_dict() aliases resolve to the plan's names (counted per
/// alias template); a name no table knows is unexpected (the dump may come from a layout glmcheck
/// cannot check), unless it is a vLLM buffer. Known parameters outside the --layer/--tensor
/// selection are simply not part of this check.
fn note_names(
    w: &Weights<'_>,
    f: &mut RankFile,
    r: usize,
    planned: &BTreeSet<&str>,
    o: &mut Opened,
) {
    use crate::arch::glm_dsa::{canonical_vllm, is_vllm_buffer, lookup_vllm, match_template};
    let (known, unknown) = f.resolve_aliases(|n| canonical_vllm(n, w.config));
    for (stored, canonical) in known {
        if stored != canonical && planned.contains(canonical.as_str()) {
            if let Some((d, _)) = lookup_vllm(&stored) {
                let t = d
                    .all_names()
                    .find(|t| match_template(t, &stored).is_some())
                    .unwrap_or(d.vllm);
                *o.aliases.entry(t.to_string()).or_default() += 1;
            }
        }
    }
    for name in unknown {
        if is_vllm_buffer(&name) {
            o.buffers += 1;
        } else {
            o.unexpected.insert(format!("{name}@rank{r}"));
        }
    }
}

/// What comparing the plan's parameters with the ranks found.
#[derive(Default)]
struct Compared<'a> {
    findings: Vec<Finding>,
    missing: Vec<String>,
    checked: Vec<Checked>,
    unchecked: Vec<Unchecked>,
    /// The parameters compared, with the ranks holding them (to judge again once the dump's
    /// provenance is known).
    compared: Vec<(&'a ParamPlan, Vec<(usize, &'a RankFile)>)>,
}

impl<'a> Compared<'a> {
    /// Compares `p` on every rank whose file holds it.
    fn param(
        &mut self,
        w: &Weights<'_>,
        p: &'a ParamPlan,
        ranks: &'a [Option<RankFile>],
        opts: &AgainstOptions,
        tick: &mut dyn FnMut(&ParamPlan),
    ) {
        let tp = ranks.len();
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
            self.missing.push(p.param.clone());
            return;
        }
        if !absent.is_empty() {
            self.missing
                .push(format!("{}@rank{}", p.param, rank_list(&absent)));
        }
        let (present, not_float): (Vec<_>, Vec<_>) =
            present.into_iter().partition(|(.., d)| is_float(*d));
        for (r, f, dtype) in not_float {
            self.unchecked.push(Unchecked {
                param: p.param.clone(),
                ranks: vec![r],
                reason: UncheckedReason::NotFloat {
                    file: f.path.clone(),
                    dtype,
                },
            });
        }
        let present: Vec<(usize, &RankFile)> =
            present.into_iter().map(|(r, f, _)| (r, f)).collect();
        if present.is_empty() {
            return;
        }
        tick(p);
        let quant = (opts.provenance == Some(Provenance::Gguf)).then_some(0.0);
        match check_present(w, p, &present, tp, quant) {
            Ok((c, f)) => {
                self.checked.extend(c);
                self.findings.extend(f);
                self.compared.push((p, present));
            }
            // One parameter that cannot be rebuilt (an undecodable GGUF tensor) is reported; the
            // rest are still checked.
            Err(e) => self.unchecked.push(Unchecked {
                param: p.param.clone(),
                ranks: present.iter().map(|(r, _)| *r).collect(),
                reason: UncheckedReason::NotRebuilt(e.to_string()),
            }),
        }
    }

    /// Where the dump's values came from decides what a difference may be. A deployment that
    /// loaded this GGUF holds its dequantized values, exact up to the dump's dtype; only a dump of
    /// the unquantized originals may differ by the quant type's noise. Decided (unless forced)
    /// from the shards of quantized parameters: gguf when at least half equal the dequantized
    /// values.
    fn provenance(&self, forced: Option<Provenance>) -> ProvenanceBasis {
        let quantized: Vec<&Checked> = self
            .checked
            .iter()
            .filter(|c| c.tol_quant > 2.0 * c.tol_match)
            .collect();
        let equal = quantized.iter().filter(|c| c.class == Class::Match).count();
        let decided = if !quantized.is_empty() && 2 * equal >= quantized.len() {
            Provenance::Gguf
        } else {
            Provenance::Originals
        };
        ProvenanceBasis {
            provenance: forced.unwrap_or(decided),
            forced: forced.is_some(),
            quantized_shards: quantized.len(),
            equal_to_dequantized: equal,
        }
    }

    /// Provenance decided after the fact: parameters that passed only as "quantization noise" are
    /// judged again at the dump-dtype bound (and explained when corrupt).
    fn rejudge_at_dtype_bound(&mut self, w: &Weights<'_>, tp: usize) -> Result<(), WeightError> {
        let noisy: BTreeSet<String> = self
            .checked
            .iter()
            .filter(|c| c.class == Class::Quantization)
            .map(|c| c.param.clone())
            .collect();
        let again: Vec<_> = self
            .compared
            .iter()
            .filter(|(p, _)| noisy.contains(&p.param))
            .cloned()
            .collect();
        for (p, present) in again {
            let (c, f) = check_present(w, p, &present, tp, Some(0.0))?;
            self.checked.retain(|x| x.param != p.param);
            self.findings.retain(|x| x.param != p.param);
            self.checked.extend(c);
            self.findings.extend(f);
        }
        Ok(())
    }
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
    let opened = open_ranks(w, plan, dump, &expected_ranks)?;
    let missing_ranks: Vec<usize> = expected_ranks
        .iter()
        .copied()
        .filter(|r| !dump.files.contains_key(r))
        .collect();
    let mut c = Compared::default();
    for p in &plan.params {
        c.param(w, p, &opened.ranks, opts, tick);
    }
    let provenance = c.provenance(opts.provenance);
    if provenance.provenance == Provenance::Gguf && opts.provenance.is_none() {
        c.rejudge_at_dtype_bound(w, tp)?;
    }
    let mut findings = c.findings;
    findings.sort_by_key(|f| {
        (
            f.layer.map_or(-1, |l| l as i64),
            f.ranks.first().copied(),
            f.param.clone(),
        )
    });
    let checked_shards = c
        .checked
        .iter()
        .map(|c| (c.param.as_str(), c.rank))
        .collect::<BTreeSet<_>>()
        .len();
    let expected_shards = plan.params.len() * expected_ranks.len();
    let fail = !findings.is_empty() || !c.unchecked.is_empty() || !opened.unreadable.is_empty();
    let incomplete = !c.missing.is_empty()
        || !missing_ranks.is_empty()
        || checked_shards < expected_shards
        || (!opts.allow_unexpected && !opened.unexpected.is_empty());
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
        aliases: opened.aliases,
        allow_unexpected: opts.allow_unexpected,
        buffers_ignored: opened.buffers,
        findings,
        missing: c.missing,
        unexpected: opened.unexpected.into_iter().collect(),
        missing_ranks,
        checked: c.checked,
        unchecked: c.unchecked,
        unreadable_ranks: opened.unreadable,
    })
}

/// Ranks as `0,3,5`.
pub fn rank_list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
