//! `glmcheck dequant`: decode tensors to f32, per-tensor statistics and decode throughput.

use std::path::PathBuf;

use super::output::{emit, progress};
use super::{open, CmdError, Ctx, Outcome};
use crate::gguf::stats;
use crate::report;

/// Dequantize tensors to f32 and report per-tensor statistics and decode throughput.
///
/// Memory stays bounded by the largest selected tensor. A tensor whose type glmcheck cannot decode
/// is reported, and the rest are still decoded.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck dequant fixtures/tiny/tiny-Q4_K_M.gguf
  glmcheck dequant model.gguf --tensor 'blk.3.attn_*' --tensor output.weight --json
  glmcheck dequant bench.gguf --repeat 5 --json   # best-of-5 decode timing

Exit codes: 0 all decoded and finite, 1 NaN/Inf values or undecodable tensors, 2 unreadable.")]
pub struct DequantArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// Only tensors matching this glob (`*`, `?`); repeatable.
    #[arg(long = "tensor", value_name = "GLOB")]
    pub tensors: Vec<String>,
    /// Decode each tensor this many times and report the best time.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Decode straight into the statistics in cache-sized chunks, never holding the f32 tensor
    /// (how `shards --verify` scans experts), instead of into one reused f32 buffer.
    #[arg(long)]
    pub stream: bool,
    /// Print JSON: {"tensors": [{"name", "dtype", "shape", "absmax", "mean", "std", "nan", "inf", "seconds", "out_gbps"}]}.
    #[arg(long)]
    pub json: bool,
}

impl DequantArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        vec![self.file.clone()]
    }
}

pub fn run(a: &DequantArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let model = open(&a.file)?;
    let selected = stats::select(&model, &a.tensors);
    if model.tensor_count() == 0 {
        return Err(CmdError::NoTensors {
            file: a.file.clone(),
        }
        .into());
    }
    if selected.is_empty() {
        return Err(CmdError::NoTensorMatches {
            file: a.file.clone(),
            globs: a.tensors.clone(),
        }
        .into());
    }
    let total: u64 = selected.iter().map(|t| t.info.n_bytes).sum();
    let bar = progress(ctx.quiet, total);
    let mut rows = Vec::with_capacity(selected.len());
    let mut buf = Vec::new();
    for t in selected {
        bar.set_message(t.info.name.clone());
        rows.push(stats::scan_tensor(t, a.repeat, a.stream, &mut buf));
        bar.inc(t.info.n_bytes);
    }
    bar.finish_and_clear();
    emit(
        ctx,
        a.json,
        &serde_json::json!({ "file": a.file, "tensors": rows }),
        || report::dequant_text(&rows),
    )?;
    let bad = rows
        .iter()
        .any(|r| r.error.is_some() || r.nan > 0 || r.inf > 0);
    Ok(Outcome::finding_if(bad))
}
