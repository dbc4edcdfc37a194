//! `glmcheck diff`: compare two activation dumps module by module.

use std::path::{Path, PathBuf};

use super::args::{DiffDtype, TolFlags};
use super::output::emit;
use super::{CmdError, Ctx, Outcome};
use crate::compare::{self, Activations, CompareOptions, ReferenceWeights, Tolerances};
use crate::gguf::GgmlType;
use crate::report;

/// Compare two activation dumps module by module and name the first divergence.
///
/// REF and CAND are safetensors dumps under HF module paths: glmcheck's (forward --dump) or
/// transformers forward hooks' (the fixtures' layout). Same comparison as forward --reference:
/// per-module rel-L2/cosine/max-abs, indexer top-k with ties told apart, router choices, logits
/// KL/top-1/entropy. Without replay, positions after a differing tie-break are left out of later
/// modules (the model is causal), and the output says which. Tolerances come from CAND's
/// metadata (glmcheck.dtype, glmcheck.weights; else f32 / F32) unless --dtype/--weights say.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck diff fixtures/tiny/activations/prompt0.safetensors /tmp/glmcheck-prompt0.safetensors
  glmcheck diff ref.safetensors cand.safetensors --weights Q4_K --dtype bf16 --json
  glmcheck diff ref.safetensors cand.safetensors --rel-l2 1e-3

Exit codes: 0 within tolerance, 1 diverged, 2 unreadable input or dumps of different tokens.")]
pub struct DiffArgs {
    /// The reference dump (taken as the truth).
    pub reference: PathBuf,
    /// The candidate dump.
    pub candidate: PathBuf,
    /// Compute dtype the candidate ran in (for the tolerances).
    #[arg(long, value_enum)]
    pub dtype: Option<DiffDtype>,
    /// Coarsest weight type of the candidate's model (F32, BF16, Q8_0, Q4_K, …).
    #[arg(long, value_name = "TYPE")]
    pub weights: Option<String>,
    #[command(flatten)]
    pub tol: TolFlags,
    /// List every compared capture, auxiliary ones included.
    #[arg(long)]
    pub all: bool,
    /// Print JSON: {"verdict", "modules", "logits", "first_divergence", "exclusions", ...}.
    #[arg(long)]
    pub json: bool,
}

impl DiffArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        vec![self.reference.clone(), self.candidate.clone()]
    }
}

pub fn run(a: &DiffArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let r = Activations::load(&a.reference)?;
    let c = Activations::load(&a.candidate)?;
    let (meta_dtype, meta_weights) = compare::profile_of(&c);
    let dtype = a.dtype.map_or(meta_dtype, Into::into);
    let weights = match &a.weights {
        Some(w) => GgmlType::from_name(w).ok_or_else(|| CmdError::UnknownWeightType(w.clone()))?,
        None => meta_weights,
    };
    // Two glmcheck dumps of the same GGUF hold the same weights; anything else is taken as the
    // originals unless the flag says otherwise.
    let ref_kind = match (a.tol.reference_weights, c.metadata.get(compare::meta::GGUF)) {
        (Some(k), _) => k.into(),
        (None, Some(g)) => ReferenceWeights::of_dump(&r, Path::new(g), weights),
        (None, None) => ReferenceWeights::Original,
    };
    let opts = CompareOptions {
        tolerances: a
            .tol
            .apply(Tolerances::for_reference(dtype, weights, ref_kind)),
        index_topk: None,
        facts: None,
    };
    let mut cmp = compare::compare(&r, &c, &opts)?;
    cmp.allow_incomparable = a.tol.allow_incomparable;
    super::forward::report_extras(ctx, "diff", &cmp)?;
    emit(ctx, a.json, &report::forward::diff_json(&cmp), || {
        report::forward::comparison_text(&cmp, a.all)
    })?;
    Ok(cmp.verdict().into())
}
