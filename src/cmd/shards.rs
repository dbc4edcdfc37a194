//! `glmcheck shards`: vLLM's tensor-parallel cut of every parameter (the plan), `--verify` (decode
//! and check it) and `--against DIR` (diagnose what a deployment's ranks hold).

use std::path::PathBuf;

use super::args::ProvenanceArg;
use super::output::{emit_hf, progress};
use super::{hf_config_check, open, CmdError, Ctx, Loaded, Outcome};
use crate::arch::hf_config::HfConfigCheck;
use crate::dump::RankDump;
use crate::gguf::stats::glob_match;
use crate::plan::{ParamPlan, ShardPlan};
use crate::weights::Weights;
use crate::{report, shards};

/// vLLM's tensor-parallel cut of every GLM-5 parameter; verify it; diagnose what ranks hold.
///
/// Without --verify/--against, reads headers only: one row per vLLM parameter with its GGUF
/// source(s), quant type, full shape, TP style, shard dim and per-rank shard shape, flagging cuts
/// that cannot be made (divisibility, head alignment) or that split quant blocks.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck shards model.gguf                          # the tp=8 plan
  glmcheck shards model.gguf --tp 4 --layer 3 --json
  glmcheck shards model.gguf --tensor '*kv_b_proj*' --verify
  glmcheck shards model.gguf --tp 8 --against /dumps/weights   # rank0.safetensors … rank7.safetensors
  glmcheck shards model.gguf --tp 8 --hf-config /models/GLM-5/config.json --json | jq .hf_config

With --against, what cannot be compared (a non-float dump tensor, an undecodable GGUF tensor, an
unreadable rank file) is reported and the rest still checked.

Exit codes: 0 sound / pass, 1 problems, a corrupt finding or something not checked, 2 unreadable or
malformed input (with --against: no rank file readable).")]
pub struct ShardsArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub tp: u16,
    /// Only this layer's parameters.
    #[arg(long)]
    pub layer: Option<usize>,
    /// Only parameters whose vLLM name or GGUF source matches this glob; repeatable.
    #[arg(long = "tensor", value_name = "GLOB")]
    pub tensors: Vec<String>,
    /// Dequantize every parameter: finite values, statistics, shards reassemble, kv_b layout.
    #[arg(long, conflicts_with = "against")]
    pub verify: bool,
    /// Compare the per-rank dump in DIR (rank<r>.safetensors, vLLM names) with the expected shards.
    #[arg(long, value_name = "DIR")]
    pub against: Option<PathBuf>,
    /// With --against: only these ranks are expected (e.g. `0,1,2`); by default every rank of
    /// 0..tp is, and a missing rank file makes the run incomplete.
    #[arg(long, requires = "against", value_delimiter = ',', value_name = "LIST")]
    pub ranks: Option<Vec<usize>>,
    /// With --against: tensor names glmcheck does not know are listed but do not make the run
    /// incomplete.
    #[arg(long, requires = "against")]
    pub allow_unexpected: bool,
    /// With --against: where the dump's values came from. gguf: a deployment that loaded this
    /// GGUF (its dequantized values, exact up to the dump's dtype); originals: the unquantized
    /// checkpoint (within the quant type's noise). Default: decided from the dump.
    #[arg(long, requires = "against", value_enum)]
    pub provenance: Option<ProvenanceArg>,
    /// The deployment's config.json: check every field vLLM 0.33 reads for GLM-5 against this
    /// GGUF and name those that change what vLLM computes (a finding exits 1).
    #[arg(long, value_name = "config.json")]
    pub hf_config: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

impl ShardsArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        std::iter::once(self.file.clone())
            .chain(self.against.clone())
            .chain(self.hf_config.clone())
            .collect()
    }

    /// Whether `p` passes the --layer/--tensor filters.
    fn keeps(&self, p: &ParamPlan) -> bool {
        self.layer.is_none_or(|l| p.layer == Some(l))
            && (self.tensors.is_empty()
                || self
                    .tensors
                    .iter()
                    .any(|g| glob_match(g, &p.param) || p.gguf.iter().any(|n| glob_match(g, n))))
    }
}

pub fn run(a: &ShardsArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let tp = a.tp as usize;
    let model = open(&a.file)?;
    let hf = hf_config_check(a.hf_config.as_deref(), &model)?;
    let l = Loaded::new(model)?;
    let plan = l.plan(tp);
    let selected = ShardPlan {
        tp,
        params: plan.params.iter().filter(|p| a.keeps(p)).cloned().collect(),
        mtp_blocks: plan.mtp_blocks.clone(),
    };
    if selected.params.is_empty() {
        return Err(CmdError::NoParamMatches.into());
    }
    let w = l.weights();
    let o = if a.verify {
        verify(a, ctx, &w, &selected, hf.as_ref())?
    } else if let Some(dir) = &a.against {
        against(a, ctx, &w, &selected, dir, hf.as_ref())?
    } else {
        emit_hf(ctx, a.json, &selected, hf.as_ref(), || {
            let rows: Vec<&ParamPlan> = selected.params.iter().collect();
            report::shards_text(&selected, &rows)
        })?;
        Outcome::finding_if(selected.params.iter().any(|p| !p.problems.is_empty()))
    };
    Ok(o.with_hf(hf.as_ref()))
}

/// `--verify`: dequantize every selected parameter and check its cut.
fn verify(
    a: &ShardsArgs,
    ctx: &Ctx,
    w: &Weights<'_>,
    selected: &ShardPlan,
    hf: Option<&HfConfigCheck>,
) -> anyhow::Result<Outcome> {
    let total: u64 = selected
        .params
        .iter()
        .flat_map(|p| p.gguf.iter())
        .filter_map(|n| w.model.tensor(n))
        .map(|t| t.info.n_bytes)
        .sum();
    let bar = progress(ctx.quiet, total);
    let r = shards::verify(w, selected, &mut |p, b| {
        bar.set_message(p.param.clone());
        bar.inc(b);
    });
    bar.finish_and_clear();
    emit_hf(ctx, a.json, &r, hf, || report::verify_text(&r))?;
    super::output::emit_extras(
        ctx,
        &[
            ("report.html", report::shards::verify_html(&r)),
            ("findings.jsonl", report::shards::verify_jsonl(&r)),
        ],
    )?;
    Ok(Outcome::finding_if(!r.ok))
}

/// `--against DIR`: every rank file's parameters against the expected shards.
fn against(
    a: &ShardsArgs,
    ctx: &Ctx,
    w: &Weights<'_>,
    selected: &ShardPlan,
    dir: &std::path::Path,
    hf: Option<&HfConfigCheck>,
) -> anyhow::Result<Outcome> {
    let dump = RankDump::open(dir)?;
    if dump.tp() != selected.tp && !ctx.quiet {
        eprintln!(
            "{}",
            report::rank_count_warning(dir, dump.tp(), selected.tp)
        );
    }
    let bar = progress(ctx.quiet, selected.params.len() as u64);
    let opts = shards::AgainstOptions {
        provenance: a.provenance.map(Into::into),
        ranks: a.ranks.clone(),
        allow_unexpected: a.allow_unexpected,
    };
    let r = shards::against(w, selected, &dump, &opts, &mut |p| {
        bar.set_message(p.param.clone());
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    emit_hf(ctx, a.json, &r, hf, || report::against_text(&r))?;
    super::output::emit_extras(
        ctx,
        &[
            ("report.html", report::shards::against_html(&r)),
            ("findings.jsonl", report::shards::against_jsonl(&r)),
        ],
    )?;
    Ok(r.verdict.into())
}
