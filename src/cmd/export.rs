//! `glmcheck export`: the GGUF's dequantized weights as a Hugging Face checkpoint directory.

use std::path::PathBuf;

use clap::ValueEnum;

use super::output::{emit, progress};
use super::{open, CmdError, Ctx, Loaded, Outcome};
use crate::export::{self, ExportDtype, ExportSpec, LayerRange, Progress, MAX_SHARD_BYTES};
use crate::report;

/// Write the GGUF's weights, dequantized, as a Hugging Face checkpoint that transformers'
/// `GlmMoeDsaForCausalLM.from_pretrained(OUTDIR)` loads: the same weights glmcheck's forward runs,
/// to run or time transformers on them (at GLM-5's real size too).
///
/// OUTDIR gets `model-0000i-of-0000N.safetensors` shards (at most --max-shard-bytes each) under the
/// zai-org/GLM-5 checkpoint's names (routed experts per expert, `mlp.experts.{E}.gate_proj.weight`;
/// transformers fuses them at load), `model.safetensors.index.json` and a complete `config.json`
/// (every `GlmMoeDsaConfig` field, plus `topk_method`, `scoring_func` and `indexer_rope_interleave`
/// for vLLM). Values are glmcheck's dequantized f32, rounded to bf16 (round to nearest even, as
/// torch) or kept f32; `mlp.gate.e_score_correction_bias` stays f32 in either case, as in the hub
/// checkpoint. The MTP (nextn) layers stored last in the GGUF are not exported (transformers
/// ignores them; config.json says num_nextn_predict_layers 0). No tokenizer files are written.
///
/// Memory holds one tensor at a time (routed experts one expert at a time); the shards' headers are
/// computed from the shapes first and the values streamed to disk. OUTDIR is built under a temp name
/// beside it and renamed into place at the end (Ctrl-C or an error leaves nothing); the GGUF is only
/// read.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck export fixtures/tiny/tiny-F32.gguf --hf /tmp/tiny-hf --dtype f32
  glmcheck export /scratch/glm5-3l.gguf --hf /scratch/glm5-3l-hf   # synth's 3 layers: ~44 GB
  glmcheck export GLM-5-Q4_K_M-00001-of-00010.gguf --hf /scratch/glm5-l3-4 --layers 3..4 --json
  python3 -c 'import transformers as t; t.GlmMoeDsaForCausalLM.from_pretrained(\"/tmp/tiny-hf\")'
  python3 tools/check_export.py /tmp/tiny-hf    # transformers' logits against the fixture's

Exit codes: 0 written, 2 bad input or arguments (an existing OUTDIR without --force, an OUTDIR that
holds the input, a --layers outside the model), or a write that failed (nothing is left behind).")]
pub struct ExportArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// The checkpoint directory to write (refused if it exists, unless --force).
    #[arg(long = "hf", value_name = "OUTDIR")]
    pub hf: PathBuf,
    /// Only decoder layers A to B, both included (a single layer: A), renumbered from 0 in the
    /// checkpoint; config.json's num_hidden_layers, first_k_dense_replace, mlp_layer_types and
    /// layer_types follow, so transformers builds the same kinds of layers. The embedding, final
    /// norm and lm_head are always written. Default: every decoder layer.
    #[arg(long, value_name = "A..B", value_parser = parse_layers)]
    pub layers: Option<LayerRange>,
    /// dtype of the written weights (and config.json's `dtype`).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DtypeArg,
    /// Most tensor bytes per shard (transformers' default max_shard_size, 5 GB).
    #[arg(long, value_name = "BYTES", default_value_t = MAX_SHARD_BYTES)]
    pub max_shard_bytes: u64,
    /// Replace an existing OUTDIR (whole, once the new one is complete).
    #[arg(long)]
    pub force: bool,
    /// Print JSON: {"out", "tensors", "bytes", "files", "dtype", "layers": {"first", "last",
    /// "count", "of"}, "seconds"} (bytes: of every file written).
    #[arg(long)]
    pub json: bool,
}

fn parse_layers(s: &str) -> Result<LayerRange, String> {
    s.parse().map_err(|e: export::ExportError| e.to_string())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    Bf16,
    F32,
}

impl From<DtypeArg> for ExportDtype {
    fn from(a: DtypeArg) -> Self {
        match a {
            DtypeArg::Bf16 => ExportDtype::Bf16,
            DtypeArg::F32 => ExportDtype::F32,
        }
    }
}

impl ExportArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        vec![self.file.clone()]
    }
}

pub fn run(a: &ExportArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    if a.hf.exists() && !a.force {
        return Err(CmdError::OutputExists(a.hf.clone()).into());
    }
    let l = Loaded::new(open(&a.file)?)?;
    let spec = ExportSpec {
        layers: a.layers,
        dtype: a.dtype.into(),
        max_shard_bytes: a.max_shard_bytes,
        force: a.force,
    };
    let bar = progress(ctx.quiet, 0);
    let verbose = ctx.verbose > 0 && !ctx.quiet;
    let r = export::export(&l.model, &l.cfg, &spec, &a.hf, &mut |p| match p {
        Progress::Tensor {
            done,
            total,
            tensor,
        } => {
            bar.set_length(total);
            bar.set_position(done);
            bar.set_message(tensor.to_string());
        }
        Progress::File { name, bytes } => {
            if verbose {
                bar.suspend(|| eprintln!("{}", report::export_file_note(name, bytes)));
            }
        }
    })?;
    bar.finish_and_clear();
    emit(ctx, a.json, &r, || report::export_text(&r))?;
    Ok(Outcome::Ok)
}
