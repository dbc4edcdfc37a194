//! `glmcheck bisect`: which of a pile of loader patches breaks the forward.

use std::path::{Path, PathBuf};

use super::args::ForwardDtype;
use super::forward::parse_tokens;
use super::output::emit;
use super::{open, CmdError, Ctx, Loaded, Outcome};
use crate::bisect::{bisect, BisectSpec, Patch};
use crate::compare::ComputeDtype;
use crate::report;

/// Find which of the loader patches applied together make the forward diverge.
///
/// PATCHES.toml lists the patches, each a fault of glmcheck's table (a weight fault, written into
/// the simulated ranks' weights, or a behaviour fault, injected into the forward), optionally
/// limited to layers. The simulated-TP forward with a set of patches is compared with the
/// unpatched forward of the same GGUF at the bounds of bf16 weights; delta debugging (ddmin) finds
/// each minimal set that diverges, and every other patch is run alone to prove it harmless.
#[derive(clap::Args, Debug)]
#[command(after_help = "PATCHES.toml:
  [[patch]]
  fault = \"force-dequant:*\"
  [[patch]]
  fault = \"dsa-dense\"
  [[patch]]
  fault = \"kvb-concat\"   # any fault name (glmcheck inject --help, forward --help)
  layers = [1]           # optional; default every layer

Examples:
  glmcheck bisect fixtures/tiny/tiny-F32.gguf --patches patches.toml --tokens 294,266,220,17,10
  glmcheck bisect model.gguf --patches patches.toml --prompt 'What is 2+2?' --tp 8 --json

Exit codes: 0 no culprit, 1 a culprit found, 2 bad arguments or unreadable input.")]
pub struct BisectArgs {
    /// The GGUF file (or any part of a split set).
    pub model: PathBuf,
    /// The patches (TOML: [[patch]] fault = NAME, layers = [..]).
    #[arg(long, value_name = "PATCHES.toml")]
    pub patches: PathBuf,
    /// Token ids, comma-separated.
    #[arg(
        long,
        value_name = "IDS",
        conflicts_with = "prompt",
        required_unless_present = "prompt"
    )]
    pub tokens: Option<String>,
    /// Text to tokenize with the GGUF's tokenizer.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Simulated tensor-parallel degree.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub tp: u16,
    /// Compute dtype.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ForwardDtype,
    /// Print JSON: {"culprits": [{"fault", "layers", "patches", "first_divergence"}],
    /// "harmless": [{"fault", "layers", "why"}], "forwards"}.
    #[arg(long)]
    pub json: bool,
}

impl BisectArgs {
    pub fn inputs(&self) -> Vec<PathBuf> {
        vec![self.model.clone(), self.patches.clone()]
    }
}

/// PATCHES.toml's patches, each fault parsed and checked against the tp and the model's layers.
pub fn read_patches(path: &Path, tp: usize, layers: usize) -> anyhow::Result<Vec<Patch>> {
    let bad = |why: String| CmdError::Patches {
        file: path.to_path_buf(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    Ok(crate::bisect::parse_patches(&text, tp, layers).map_err(bad)?)
}

pub fn run(a: &BisectArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let l = Loaded::new(open(&a.model)?)?;
    let patches = read_patches(&a.patches, a.tp as usize, l.cfg.num_hidden_layers)?;
    let ids = match (&a.tokens, &a.prompt) {
        (Some(t), _) => parse_tokens(t)?,
        (None, Some(p)) => crate::tokenizer::GgufTokenizer::from_gguf(&l.model)?.encode(p)?,
        (None, None) => return Err(CmdError::NoPrompt.into()),
    };
    if ids.is_empty() {
        return Err(CmdError::EmptyPrompt.into());
    }
    let plan = l.plan(a.tp as usize);
    let scratch = tempfile_dir()?;
    let w = l.weights();
    let r = bisect(
        &w,
        &plan,
        &patches,
        &BisectSpec {
            tokens: &ids,
            dtype: ComputeDtype::from(a.dtype),
            weights: crate::compare::weight_class(&l.model),
            scratch: &scratch.0,
        },
    );
    drop(scratch);
    let r = r?;
    emit(ctx, a.json, &report::bisect::bisect_json(&r), || {
        report::bisect::bisect_text(&r)
    })?;
    super::output::emit_extras(
        ctx,
        &[
            ("report.html", report::bisect::bisect_html(&r)),
            ("findings.jsonl", report::bisect::bisect_jsonl(&r)),
        ],
    )?;
    Ok(Outcome::finding_if(!r.culprits.is_empty()))
}

/// A private scratch directory for the trials' rank files, removed when dropped.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> anyhow::Result<Scratch> {
    let base = std::env::temp_dir().join(format!(
        "glmcheck-bisect-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&base)?;
    Ok(Scratch(base))
}
