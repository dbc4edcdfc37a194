//! `glmcheck inject`: write the per-rank dump a loader with a known bug would hold.

use std::path::PathBuf;

use anyhow::Context;

use super::args::{DumpDtype, VllmNamesArg};
use super::{open, Ctx, Loaded, Outcome};
use crate::faults::Fault;
use crate::{report, shards};

/// Write the per-rank dump that a loader with a known bug would hold (or the correct one).
#[derive(clap::Args, Debug)]
#[command(after_help = after_help())]
pub struct InjectArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// The loader bug to reproduce.
    #[arg(long)]
    pub fault: String,
    /// Only this layer's parameters get the bug.
    #[arg(long)]
    pub layer: Option<usize>,
    /// Only parameters matching this glob get the bug (default: the ones the bug hits); repeatable.
    #[arg(long = "param", value_name = "GLOB")]
    pub params: Vec<String>,
    /// Tensor-parallel degree.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub tp: u16,
    /// Output directory (created; rank<r>.safetensors are written into it).
    #[arg(long)]
    pub out: PathBuf,
    /// dtype of the dumped tensors.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DumpDtype,
    /// Parameter names as this vLLM version writes them (0.33: routed experts under
    /// `mlp.experts.routed_experts.*`; legacy: `mlp.experts.w13_weight`).
    #[arg(long, value_enum, default_value = "0.33")]
    pub vllm_names: VllmNamesArg,
}

/// `inject --help`'s epilogue: the fault table's list, then examples.
fn after_help() -> String {
    format!(
        "{}

Examples:
  glmcheck inject --fault kvb-concat --layer 1 --tp 8 --out /tmp/bad fixtures/tiny/tiny-F32.gguf
  glmcheck shards fixtures/tiny/tiny-F32.gguf --tp 8 --against /tmp/bad
  glmcheck inject --fault none --tp 2 --dtype bf16 --out /tmp/good model.gguf",
        report::fault_list_help()
    )
}

impl InjectArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        vec![self.file.clone()]
    }
}

pub fn run(a: &InjectArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let tp = a.tp as usize;
    let fault: Fault = a.fault.parse()?;
    fault.check_tp(tp)?;
    let l = Loaded::new(open(&a.file)?)?;
    let plan = l.plan(tp);
    if let Some(p) = plan.params.iter().find(|p| !p.problems.is_empty()) {
        anyhow::bail!(
            "{} cannot be sharded at tp={tp}: {}",
            p.param,
            p.problems.join("; ")
        );
    }
    let w = l.weights();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let spec = shards::InjectSpec {
        fault: &fault,
        layer: a.layer,
        params: &a.params,
        dtype: a.dtype.into(),
        names: a.vllm_names.into(),
    };
    let written = shards::inject(&w, &plan, &spec, &a.out, &l.parts())?;
    if !ctx.quiet {
        eprintln!("{}", report::injected(written.len(), &a.out, &fault));
    }
    Ok(Outcome::Ok)
}
