//! `glmcheck gate`: every check the inputs allow, one verdict for a CI job or `git bisect run`.

use std::path::{Path, PathBuf};

use super::args::{ForwardDtype, TolFlags};
use super::forward::parse_tokens;
use super::output::{emit, write_output};
use super::{open, CmdError, Ctx, Loaded, Outcome};
use crate::compare::Tolerances;
use crate::compare::{compare, Activations, CompareOptions, ComputeDtype, ReferenceWeights};
use crate::dump::RankDump;
use crate::forward::{self as fwd, ForwardSpec};
use crate::gate::{comparison_suite, weights_suite, GateReport, GateVerdict, Suite, SuiteResult};
use crate::model::{Glm5, ModelOptions};
use crate::report;

/// Run every check the given inputs allow and give one verdict: a regression gate for a serving
/// stack's CI ("this loader still gives GLM-5 the right weights and activations").
///
/// Checks: --against DIR (a deployment's per-rank weights against vLLM's cut of the GGUF, one
/// case per parameter), --reference ACTS (glmcheck's forward against a reference dump, one case
/// per layer and one for the logits), --candidate ACTS (a deployment's activations against
/// glmcheck's forward of the same GGUF), --weights-from DIR (the simulated-TP forward from a rank
/// dump's weights against the unsharded forward). Thresholds: the measured defaults of each check,
/// overridden by --config gate.toml, overridden by the flags.
#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:
  glmcheck gate fixtures/tiny/tiny-F32.gguf \\
      --reference fixtures/tiny/activations/prompt0.safetensors --junit gate.xml
  glmcheck inject --fault kvb-concat --layer 1 --tp 4 --out /tmp/bad fixtures/tiny/tiny-F32.gguf
  glmcheck gate fixtures/tiny/tiny-F32.gguf --tp 4 --against /tmp/bad --weights-from /tmp/bad \\
      --tokens 294,266,220,17,10,17,30
  git bisect run glmcheck gate model.gguf --candidate acts.safetensors   # 125 skips a commit

gate.toml:
  [tolerances]
  kl_mean = 0.05
  kl_max = 0.2
  top1_min = 0.9
  rel_l2 = 0.1
  [tolerances.rel_l2_by_class]   # module path without model.layers.N. (glob); first match wins
  \"mlp.experts*\" = 0.3

Token ids: --tokens or --prompt, else the reference's (or candidate's) `token_ids` metadata.

Exit codes: 0 every check passed, 1 a check failed (or checked less than it was given),
125 cannot evaluate (the model or a dump missing or unreadable, a tensor type glmcheck cannot
decode), 2 bad arguments.")]
pub struct GateArgs {
    /// The GGUF file (or any part of a split set).
    pub model: PathBuf,
    /// A reference activation dump (transformers hooks, another glmcheck --dump) for glmcheck's
    /// forward.
    #[arg(long, value_name = "ACTS.safetensors")]
    pub reference: Option<PathBuf>,
    /// A deployment's activation dump, checked against glmcheck's forward of the same GGUF.
    #[arg(long, value_name = "ACTS.safetensors")]
    pub candidate: Option<PathBuf>,
    /// A deployment's per-rank weights (DIR/rank<r>.safetensors, vLLM names), checked shard by
    /// shard against vLLM's cut of the GGUF.
    #[arg(long, value_name = "DIR")]
    pub against: Option<PathBuf>,
    /// The simulated-TP forward with the ranks' weights from DIR/rank<r>.safetensors, against the
    /// unsharded forward of the GGUF.
    #[arg(long, value_name = "DIR")]
    pub weights_from: Option<PathBuf>,
    /// Tensor-parallel degree of --against and --weights-from.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub tp: u16,
    /// Token ids, comma-separated.
    #[arg(long, value_name = "IDS", conflicts_with = "prompt")]
    pub tokens: Option<String>,
    /// Text to tokenize with the GGUF's tokenizer.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Compute dtype of glmcheck's forward.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ForwardDtype,
    /// Thresholds ([tolerances] kl_mean, kl_max, top1_min, rel_l2, score_noise, router_flips).
    #[arg(long, value_name = "gate.toml")]
    pub config: Option<PathBuf>,
    /// Write JUnit XML: one testsuite per check, one testcase per parameter / layer / logits.
    #[arg(long, value_name = "OUT.xml")]
    pub junit: Option<PathBuf>,
    #[command(flatten)]
    pub tol: TolFlags,
    /// Print JSON: {"model", "verdict", "cannot_evaluate", "suites": [{"suite", "verdict",
    /// "cases": [{"name", "result", "detail"}]}]}.
    #[arg(long)]
    pub json: bool,
}

impl GateArgs {
    pub fn inputs(&self) -> Vec<PathBuf> {
        std::iter::once(self.model.clone())
            .chain(self.reference.clone())
            .chain(self.candidate.clone())
            .chain(self.against.clone())
            .chain(self.weights_from.clone())
            .chain(self.config.clone())
            .collect()
    }
}

/// gate.toml's thresholds under the flags': a flag given wins.
fn under(t: &crate::gate::GateTolerances, flags: &TolFlags) -> TolFlags {
    TolFlags {
        rel_l2: flags.rel_l2.or(t.rel_l2),
        kl_mean: flags.kl_mean.or(t.kl_mean),
        kl_max: flags.kl_max.or(t.kl_max),
        top1_min: flags.top1_min.or(t.top1_min),
        score_noise: flags.score_noise.or(t.score_noise),
        router_flips: flags.router_flips.or(t.router_flips),
        allow_incomparable: flags.allow_incomparable,
        reference_weights: flags.reference_weights,
    }
}

fn read_config(path: &Path) -> anyhow::Result<crate::gate::GateTolerances> {
    let bad = |why: String| CmdError::GateConfig {
        file: path.to_path_buf(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    Ok(crate::gate::parse_config(&text).map_err(bad)?)
}

pub fn run(a: &GateArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    if a.reference.is_none()
        && a.candidate.is_none()
        && a.against.is_none()
        && a.weights_from.is_none()
    {
        return Err(CmdError::NothingToGate.into());
    }
    let config = match &a.config {
        Some(p) => read_config(p)?,
        None => Default::default(),
    };
    let flags = under(&config, &a.tol);
    let by_class: Vec<(String, f64)> = config.rel_l2_by_class.into_iter().collect();
    let model = a.model.display().to_string();
    let tune = |t: Tolerances| {
        let mut t = flags.apply(t);
        if !by_class.is_empty() {
            t.rel_l2_by_class = by_class.clone();
            t.basis.overridden.push("rel-l2-by-class");
        }
        t
    };
    let r = match checks(a, &flags, &tune) {
        Ok(suites) => GateReport::new(model, suites),
        // No token ids for a forward: the arguments' fault, not the inputs'.
        Err(e) if matches!(e.downcast_ref::<CmdError>(), Some(CmdError::NoPrompt)) => {
            return Err(e)
        }
        Err(e) => GateReport::cannot_evaluate(model, format!("{e:#}")),
    };
    if let Some(out) = &a.junit {
        write_output(out, report::gate::gate_junit(&r).as_bytes(), &a.inputs())?;
    }
    emit(ctx, a.json, &r, || report::gate::gate_text(&r))?;
    super::output::emit_extras(
        ctx,
        &[
            ("report.html", report::gate::gate_html(&r)),
            ("findings.jsonl", report::gate::gate_jsonl(&r)),
        ],
    )?;
    Ok(match r.verdict {
        GateVerdict::Pass => Outcome::Ok,
        GateVerdict::Fail => Outcome::Finding,
        GateVerdict::CannotEvaluate => Outcome::CannotEvaluate,
    })
}

/// Every check the inputs allow; an `Err` is an input the gate cannot evaluate.
fn checks(
    a: &GateArgs,
    flags: &TolFlags,
    tune: &dyn Fn(Tolerances) -> Tolerances,
) -> anyhow::Result<Vec<SuiteResult>> {
    let l = Loaded::new(open(&a.model)?)?;
    let tp = a.tp as usize;
    let dtype = ComputeDtype::from(a.dtype);
    let reference = a.reference.as_deref().map(Activations::load).transpose()?;
    let candidate = a.candidate.as_deref().map(Activations::load).transpose()?;
    let forwards = reference.is_some() || candidate.is_some() || a.weights_from.is_some();
    let ids = if forwards {
        token_ids(a, &l, reference.as_ref().or(candidate.as_ref()))?
    } else {
        Vec::new()
    };
    let w = l.weights();
    let weights = crate::compare::weight_class(&l.model);
    let options = ModelOptions {
        dtype: dtype.candle(),
        ..ModelOptions::default()
    };
    let spec = |tol: Tolerances| ForwardSpec {
        dtype,
        weights,
        max_new_tokens: 0,
        top: 5,
        gguf: a.model.display().to_string(),
        prompt: a.prompt.clone(),
        tolerances: Some(tune(tol)),
        bench: 0,
        profile: false,
        index_topk: l.cfg.index_topk,
    };
    let mut suites = Vec::new();
    if let Some(dir) = &a.against {
        let plan = l.plan(tp);
        let dump = RankDump::open(dir)?;
        let r = crate::shards::against(&w, &plan, &dump, &Default::default(), &mut |_| {})?;
        let params: Vec<String> = plan.params.iter().map(|p| p.param.clone()).collect();
        suites.push(weights_suite(
            &params,
            &r,
            dir.display().to_string(),
            a.model.display().to_string(),
        ));
    }
    let model = if forwards {
        Some(Glm5::load_with(&w, options)?)
    } else {
        None
    };
    if let (Some(r), Some(m)) = (&reference, &model) {
        let kind = flags.reference_weights.map_or_else(
            || ReferenceWeights::of_dump(r, &a.model, weights),
            Into::into,
        );
        let o = fwd::run(
            m,
            None,
            &ids,
            Some(r),
            &spec(Tolerances::for_reference(dtype, weights, kind)),
        )?;
        if let Some(c) = &o.comparison {
            suites.push(comparison_suite(Suite::Forward, c));
        }
    }
    let ours = match (&model, candidate.is_some() || a.weights_from.is_some()) {
        (Some(m), true) => {
            let mut acts = fwd::capture(m, &ids, a.prompt.as_deref())?;
            acts.source = report::unsharded_source(&a.model);
            Some(acts)
        }
        _ => None,
    };
    if let (Some(c), Some(ours)) = (&candidate, &ours) {
        // A deployment runs the same GGUF with its own kernels.
        let kind = flags
            .reference_weights
            .map_or(ReferenceWeights::SameGguf, Into::into);
        let tol = tune(Tolerances::for_reference(dtype, weights, kind));
        let cmp = compare(
            ours,
            c,
            &CompareOptions {
                tolerances: tol,
                index_topk: Some(l.cfg.index_topk),
                facts: model.as_ref().map(Glm5::facts).transpose()?,
            },
        )?;
        suites.push(comparison_suite(Suite::Candidate, &cmp));
    }
    if let (Some(dir), Some(ours)) = (&a.weights_from, &ours) {
        let plan = l.plan(tp);
        let dump = RankDump::open(dir)?;
        let sharded = Glm5::sharded(&w, &plan, Some(&dump), options)?;
        let dw = crate::shards::dump_weights(&w, &plan, &dump, weights)?;
        let tol = Tolerances::for_reference(dtype, dw.class(), ReferenceWeights::Original);
        let o = fwd::run(&sharded, None, &ids, Some(ours), &spec(tol))?;
        if let Some(c) = &o.comparison {
            suites.push(comparison_suite(Suite::Simulated, c));
        }
    }
    Ok(suites)
}

/// --tokens, --prompt (the GGUF's tokenizer), else the dump's own token ids.
fn token_ids(a: &GateArgs, l: &Loaded, dump: Option<&Activations>) -> anyhow::Result<Vec<u32>> {
    if let Some(t) = &a.tokens {
        return Ok(parse_tokens(t)?);
    }
    if let Some(p) = &a.prompt {
        return Ok(crate::tokenizer::GgufTokenizer::from_gguf(&l.model)?.encode(p)?);
    }
    match dump.and_then(|d| d.tokens.clone()) {
        Some(ids) if !ids.is_empty() => Ok(ids),
        _ => Err(CmdError::NoPrompt.into()),
    }
}
