//! `glmcheck synth`: write a random-weight GLM-5 GGUF (real or tiny dimensions).

use std::path::PathBuf;

use clap::ValueEnum;

use super::output::{emit, progress};
use super::{CmdError, Ctx, Outcome};
use crate::report;
use crate::synth::{self, Dims, Mix, SynthSpec};

/// Write a random-weight GGUF with GLM-5's exact tensor names, shapes and metadata (llama.cpp's
/// glm-dsa layout, a byte-level BPE tokenizer included), to run and time the forward at GLM-5's
/// real size without downloading it.
///
/// Values are approximately normal with std 0.02 (transformers' initializer_range), norm weights 1;
/// blocks are made by candle's quantizers; q4_k_m gives each tensor the type llama-quantize's
/// Q4_K_M gives it (checked against the fixture llama.cpp made). The same seed writes the same
/// bytes on any machine. Written to a temp file and renamed into place.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck synth --dims tiny --layers 3 --qtype q4_k_m --out /tmp/tiny.gguf
  glmcheck synth --dims glm5 --layers 3 --qtype q4_k_m --out /scratch/glm5-3l.gguf   # 1 dense + 2 MoE, ~13 GB
  glmcheck forward /scratch/glm5-3l.gguf --tokens 1,2,3,4 --device cuda --bench 5

Exit codes: 0 written, 2 bad arguments or a write that failed (nothing is left behind).")]
pub struct SynthArgs {
    /// GLM-5's dimensions (hidden 6144, 256 experts, vocab 154880) or the fixtures' tiny ones.
    #[arg(long, value_enum, default_value = "glm5")]
    pub dims: DimsArg,
    /// Decoder layers.
    #[arg(long, default_value_t = 3)]
    pub layers: usize,
    /// Leading dense layers (default: the dims' own 3, at most a third of --layers, at least one
    /// when --layers > 1: 3 layers → 1 dense + 2 MoE).
    #[arg(long)]
    pub dense: Option<usize>,
    /// Weight types.
    #[arg(long, value_enum, default_value = "q4_k_m")]
    pub qtype: QtypeArg,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The GGUF to write (refused if it is an existing file, unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
    /// Print JSON: {"dims", "mix", "seed", "layers", "dense_layers", "tensors", "bytes", "types"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DimsArg {
    Glm5,
    Tiny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QtypeArg {
    #[value(name = "q4_k_m")]
    Q4KM,
    #[value(name = "q8_0")]
    Q8_0,
    Bf16,
    F32,
}

impl From<DimsArg> for Dims {
    fn from(a: DimsArg) -> Self {
        match a {
            DimsArg::Glm5 => Dims::Glm5,
            DimsArg::Tiny => Dims::Tiny,
        }
    }
}

impl From<QtypeArg> for Mix {
    fn from(a: QtypeArg) -> Self {
        match a {
            QtypeArg::Q4KM => Mix::Q4KM,
            QtypeArg::Q8_0 => Mix::Q8_0,
            QtypeArg::Bf16 => Mix::Bf16,
            QtypeArg::F32 => Mix::F32,
        }
    }
}

pub fn run(a: &SynthArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    if a.out.exists() && !a.force {
        return Err(CmdError::OutputExists(a.out.clone()).into());
    }
    let spec = SynthSpec {
        dims: a.dims.into(),
        layers: a.layers,
        dense: a.dense,
        mix: a.qtype.into(),
        seed: a.seed,
    };
    let bar = progress(ctx.quiet, 0);
    let r = synth::synth(&spec, &a.out, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    emit(ctx, a.json, &r, || report::synth_text(&r, &a.out))?;
    Ok(Outcome::Ok)
}
