//! `glmcheck inspect`: architecture, config, tensor inventory, tokenizer and a consistency check.

use std::path::PathBuf;

use super::output::emit_hf;
use super::{hf_config_check, open, Ctx, Outcome};
use crate::inspect::InspectReport;
use crate::report;

/// Architecture, config (HF names), tensor inventory, tokenizer and a consistency check of a GGUF.
///
/// Reads headers only: as fast on a 400 GB split set as on a fixture. Given any part of a
/// `-NNNNN-of-NNNNN.gguf` split set, reads all parts.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck inspect fixtures/tiny/tiny-Q4_K_M.gguf
  glmcheck inspect GLM-5-UD-Q4_K_XL-00001-of-00010.gguf --json | jq .problems
  glmcheck inspect model.gguf --all-tensors
  glmcheck inspect model.gguf --hf-config /models/GLM-5/config.json   # the deployment's config

Exit codes: 0 consistent, 1 problems found (missing, unexpected or mis-shaped tensors), 2 unreadable.")]
pub struct InspectArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// Print JSON: {"arch", "config", "tensors": [{"name", "dtype", "shape"}], "problems", ...}.
    #[arg(long)]
    pub json: bool,
    /// List every tensor (default: globals, layer 0 and the first MoE layer).
    #[arg(long)]
    pub all_tensors: bool,
    /// The deployment's config.json: check every field vLLM 0.33 reads for GLM-5 against this
    /// GGUF and name those that change what vLLM computes (a finding exits 1).
    #[arg(long, value_name = "config.json")]
    pub hf_config: Option<PathBuf>,
}

impl InspectArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        std::iter::once(self.file.clone())
            .chain(self.hf_config.clone())
            .collect()
    }
}

pub fn run(a: &InspectArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let model = open(&a.file)?;
    let hf = hf_config_check(a.hf_config.as_deref(), &model)?;
    let r = InspectReport::build(&model)?;
    emit_hf(ctx, a.json, &r, hf.as_ref(), || {
        report::inspect_text(&r, a.all_tensors)
    })?;
    if ctx.verbose > 0 {
        for p in &model.parts {
            eprintln!("{}", report::gguf_part_line(p));
        }
    }
    Ok(Outcome::finding_if(!r.problems.is_empty()).with_hf(hf.as_ref()))
}
