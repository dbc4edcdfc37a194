//! `glmcheck dequant`: decode tensors to f32, per-tensor statistics and decode throughput.

use std::path::PathBuf;

use super::args::DeviceArg;
use super::output::{emit, progress};
use super::{open, CmdError, Ctx, Outcome};
use crate::gguf::{device_decode, stats};
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
  glmcheck dequant model.gguf --device cuda --repeat 5 --json   # GPU decode vs GPU copy

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
    /// Decode on this device instead (cuda, cuda:N): each tensor's blocks uploaded as they are,
    /// decoded to f32 there, best of --repeat, against a device copy of the result in the same
    /// run (both GB/s as bytes read + written). No statistics; float tensors are listed as not
    /// decoded.
    #[arg(long, value_name = "DEVICE")]
    pub device: Option<DeviceArg>,
    /// Print JSON: {"tensors": [{"name", "dtype", "shape", "absmax", "mean", "std", "nan", "inf", "seconds", "out_gbps"}]};
    /// with --device: {"device", "tensors": [{"name", "dtype", "bytes_in", "bytes_out", "seconds", "gbps", "copy_gbps", "error"}], "types": [{"dtype", "gbps", "copy_gbps", "tensors"}]}.
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
    if let Some(d) = a.device {
        return on_device(a, ctx, d, &selected, total);
    }
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

/// `--device`: decode throughput on the device against its copy throughput.
fn on_device(
    a: &DequantArgs,
    ctx: &Ctx,
    d: DeviceArg,
    selected: &[crate::gguf::TensorRef<'_>],
    total: u64,
) -> anyhow::Result<Outcome> {
    let device = d.open()?;
    let bar = progress(ctx.quiet, total);
    let mut rows = Vec::with_capacity(selected.len());
    for &t in selected {
        bar.set_message(t.info.name.clone());
        rows.push(device_decode::decode_on(&device, t, a.repeat));
        bar.inc(t.info.n_bytes);
    }
    bar.finish_and_clear();
    let types = device_decode::by_type(&rows);
    emit(
        ctx,
        a.json,
        &serde_json::json!({ "file": a.file, "device": d.to_string(), "tensors": rows, "types": types }),
        || report::device_decode_text(&d.to_string(), &types),
    )?;
    Ok(Outcome::Ok)
}
