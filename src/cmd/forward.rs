//! `glmcheck forward`: run GLM-5 from the GGUF on a prompt (optionally as simulated vLLM tensor
//! parallel) and, given a reference dump, compare its activations module by module.

use std::path::{Path, PathBuf};

use anyhow::Context;

use super::args::{DeviceArg, DsaArg, ForwardDtype, MatmulArg, TolFlags};
use super::output::emit_hf;
use super::{hf_config_check, open, CmdError, Ctx, Loaded, Outcome};
use crate::compare::{Activations, ComputeDtype, ReferenceWeights, Tolerances};
use crate::dump::RankDump;
use crate::faults::Behaviour::Fp16Compute;
use crate::forward::{self as fwd, ForwardSpec};
use crate::gguf::{GgmlType, GgufModel};
use crate::model::{Glm5, MatmulMode, ModelOptions};
use crate::plan::ShardPlan;
use crate::report;
use crate::tokenizer::GgufTokenizer;
use crate::weights::Weights;

/// `forward -h`'s epilogue: examples, inputs, exit codes.
const FORWARD_HELP: &str = "Examples:
  glmcheck forward fixtures/tiny/tiny-F32.gguf --prompt 'What is 2+2?'
  glmcheck forward fixtures/tiny/tiny-F32.gguf --tokens 294,266,220,17,10,17,30 --max-new-tokens 4
  P='What is 2+2? Please answer the question. The answer is'
  glmcheck forward fixtures/tiny/tiny-Q4_K_M.gguf --prompt \"$P\" \\
      --reference fixtures/tiny/activations/prompt0.safetensors --json | jq .first_divergence
  glmcheck forward model.gguf --prompt 'Hello' --dsa dense --dump /tmp/dense.safetensors
  glmcheck forward model.gguf --prompt 'Hello' --hf-config /models/GLM-5/config.json
  glmcheck inject --fault kvb-concat --layer 1 --tp 8 --out /tmp/bad fixtures/tiny/tiny-F32.gguf
  glmcheck forward fixtures/tiny/tiny-F32.gguf --prompt 'What is 2+2?' --tp 8 --weights-from /tmp/bad
  glmcheck diff /tmp/sparse.safetensors /tmp/dense.safetensors
  glmcheck forward fixtures/tiny/tiny-F32.gguf --prompt \"$P\" --fault router-softmax@1
  glmcheck forward fixtures/tiny/tiny-F32.gguf --prompt \"$P\" --fault mla-scale-latent \
      --reference fixtures/tiny/activations/prompt0.safetensors

--prompt is tokenized with the GGUF's own tokenizer, nothing added (no [gMASK]<sop>; type it if
wanted). With --reference the token ids must be the reference's (its `token_ids` metadata).

Exit codes: 0 within tolerance (or no --reference), 1 diverged, 2 unreadable input or bad arguments.";

/// `forward --help`'s: the same, then the environment settings (`model::knobs`).
fn forward_long_help() -> String {
    format!("{FORWARD_HELP}\n\n{}", report::notes::settings_help())
}

/// Run GLM-5 from the GGUF on a prompt: tokens, top-5 next tokens, a greedy continuation, and
/// (with --reference) where its activations part from a reference dump, module by module.
///
/// The forward follows transformers 5.23's GlmMoeDsaForCausalLM (MLA, DSA indexer, sigmoid
/// router with group limit). With --reference, every captured module is compared with the
/// reference's (rel-L2, cosine, max-abs), the indexer's top-k as sets with exact ties and
/// near-ties told apart from divergence (at a tie the reference's choice is replayed so that
/// later modules stay comparable), the logits by KL, top-1 agreement and entropy, and the first
/// module above tolerance is named with its inputs' status and a reading. Tolerances depend on
/// --dtype and the GGUF's coarsest weight type (measured on the fixtures); flags override them.
#[derive(clap::Args, Debug)]
#[command(after_help = FORWARD_HELP, after_long_help = forward_long_help())]
pub struct ForwardArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// Text to tokenize with the GGUF's tokenizer.
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    pub prompt: Option<String>,
    /// Token ids, comma-separated (bypasses the tokenizer).
    #[arg(long, value_name = "IDS")]
    pub tokens: Option<String>,
    /// An activation dump to compare with (fixtures/tiny/activations/prompt0.safetensors, a
    /// transformers hook dump, or another glmcheck --dump).
    #[arg(long, value_name = "ACTS.safetensors")]
    pub reference: Option<PathBuf>,
    /// Write every captured module output (safetensors; execution order, token ids and prompt
    /// in the metadata). Written to a temp file and renamed; never over an input.
    #[arg(long, value_name = "OUT.safetensors")]
    pub dump: Option<PathBuf>,
    /// sparse: the DSA indexer restricts attention (GLM-5, transformers); dense: plain causal
    /// attention, as a deployment with the indexer disabled.
    #[arg(long, value_enum, default_value = "sparse")]
    pub dsa: DsaArg,
    /// Compute dtype.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ForwardDtype,
    /// How the GGUF's quantized weights (kept as blocks, on the device) are multiplied:
    /// dequant (decoded into the compute dtype right before each GEMM: equal to a reference from
    /// the same dequantized weights) or q8 (candle's llama.cpp-derived kernels, activations
    /// quantized to 8 bits as llama.cpp and vLLM's GGUF kernels compute; compared at
    /// other-engine bounds). Simulated --tp always dequantizes.
    #[arg(long, value_enum, default_value = "dequant", conflicts_with = "tp")]
    pub matmul: MatmulArg,
    /// Run with a behaviour fault (every weight right, the forward computing what a known loader
    /// or kernel bug computes), on LAYERS only if given (`router-softmax@1`, `dsa-dense@0,2-3`);
    /// repeatable. Without --reference the run is compared with the same forward unfaulted, so
    /// the comparison shows the fault's signature. Faults: dsa-dense, indexer-rope-neox,
    /// mla-rope-neox, router-softmax, router-no-bias, bias-bf16, mla-scale-latent, no-norm-topk,
    /// routed-scale-missing (`glmcheck inject --help` lists the weight faults).
    #[arg(long, value_name = "NAME[@LAYERS]")]
    pub fault: Vec<String>,
    /// Tokens of greedy continuation (the full forward is recomputed per token).
    #[arg(long, default_value_t = 8)]
    pub max_new_tokens: usize,
    /// Time N extra plain forwards of the prompt (no capture; the device synchronized at the end
    /// of each) and report the best and the median ("bench" in --json).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub bench: usize,
    /// With --bench: one more forward with the device synchronized after every module, its time
    /// split by module kind ("bench.profile" in --json). That forward captures every module, so
    /// it runs the DSA indexer where the timed forwards skip it (prompts up to index_topk, where
    /// the top-k is every key). Then one more, not synchronized, marked at module boundaries
    /// (CUDA events): where the GPU waited on the host ("bench.timeline").
    #[arg(long, requires = "bench")]
    pub profile: bool,
    /// Simulate vLLM tensor parallel over N ranks (each rank its column/row-parallel shards,
    /// partial sums all-reduced, vocab-parallel embedding and lm_head gathered). Without
    /// --reference it is compared with the unsharded forward of the same file: at same-weights
    /// bounds for the GGUF's own cut; for --weights-from at the bounds of what separates the
    /// dump's weights from the GGUF's (their storage dtype, plus the GGUF's quantization when a
    /// sampled layer shows they are the originals), said in a note.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub tp: Option<u16>,
    /// With --tp: the ranks' weights from DIR/rank<r>.safetensors (vLLM parameter names, as a
    /// deployment holds them or `glmcheck inject` writes them) instead of the GGUF's cut.
    #[arg(long, value_name = "DIR", requires = "tp")]
    pub weights_from: Option<PathBuf>,
    /// Where the forward runs: cpu, cuda (GPU 0) or cuda:N. CUDA needs a build with
    /// `--features cuda` (tools/build-cuda.sh); module outputs are copied off the GPU only to be
    /// compared or dumped.
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: DeviceArg,
    #[command(flatten)]
    pub tol: TolFlags,
    /// List every compared capture, auxiliary ones (tuple elements, aliases) included.
    #[arg(long)]
    pub all: bool,
    /// The deployment's config.json: check every field vLLM 0.33 reads for GLM-5 against this
    /// GGUF and name those that change what vLLM computes (a finding exits 1).
    #[arg(long, value_name = "config.json")]
    pub hf_config: Option<PathBuf>,
    /// Print JSON: {"tokens", "top", "continuation", "modules": [{"name", "rel_l2", "cosine",
    /// "max_abs", ...}], "logits": {"kl_mean", "kl_max", "top1_agree", "max_abs", ...},
    /// "first_divergence": null | {"module", "layer", "inputs", "reading"}, "verdict", ...}.
    #[arg(long)]
    pub json: bool,
}

impl ForwardArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        std::iter::once(self.file.clone())
            .chain(self.reference.clone())
            .chain(self.weights_from.clone())
            .chain(self.hf_config.clone())
            .collect()
    }
}

pub fn run(a: &ForwardArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let dtype = ComputeDtype::from(a.dtype);
    // The architecture first: a file of another model is named as such before its tokenizer,
    // the tokens or a reference are looked at.
    let l = Loaded::new(open(&a.file)?)?;
    let hf = hf_config_check(a.hf_config.as_deref(), &l.model)?;
    let tokenizer = tokenizer(a, ctx, &l.model)?;
    let ids = token_ids(a, tokenizer.as_ref())?;
    let ref_acts = match &a.reference {
        Some(r) => Some(load_reference(r, &ids)?),
        None => None,
    };
    let w = l.weights_on(a.device.open()?);
    let options = ModelOptions {
        dtype: dtype.candle(),
        dsa: a.dsa.into(),
        matmul: a.matmul.into(),
    };
    let injections = injections(&a.fault)?;
    let weights = crate::compare::weight_class(&l.model);
    let mut notes = Vec::new();
    let dump = rank_dump(a)?;
    let plan = a.tp.map(|tp| l.plan(tp as usize));
    // One model: the unsharded one, or `tp` ranks of the same modules (simulated TP).
    let model = build(&w, plan.as_ref(), dump.as_ref(), options)?;
    if plan.is_some() {
        notes.push(report::tp_note(
            model.tp(),
            a.weights_from.as_deref(),
            model.fallbacks(),
        ));
        notes.extend(model.replica_mismatches().iter().map(report::replica_note));
    }
    // With --fault and nothing to compare with, the same model's forward before the faults are
    // injected is the reference (one model in memory).
    let unfaulted = if injections.is_empty() || a.reference.is_some() || plan.is_some() {
        None
    } else {
        Some(&model)
    };
    let truth = truth(
        a,
        ref_acts,
        unfaulted,
        plan.as_ref(),
        dump.as_ref(),
        &w,
        options,
        &ids,
        weights,
    )?;
    notes.extend(truth.note.clone());
    let (mut model, dtype) = in_f16_if_faulted(model, dtype, &injections, |o| {
        build(&w, plan.as_ref(), dump.as_ref(), o)
    })?;
    inject(&mut model, &injections, &mut notes)?;
    let spec = ForwardSpec {
        dtype,
        weights,
        max_new_tokens: a.max_new_tokens,
        top: 5,
        gguf: a.file.display().to_string(),
        prompt: a.prompt.clone(),
        tolerances: Some(a.tol.apply(Tolerances::for_reference(
            dtype,
            truth.weights,
            kernel_kind(truth.kind, options.matmul),
        ))),
        bench: a.bench,
        profile: a.profile,
        index_topk: l.cfg.index_topk,
    };
    let mut outcome = fwd::run(&model, tokenizer.as_ref(), &ids, truth.acts.as_ref(), &spec)?;
    outcome.notes = notes;
    if let Some(c) = outcome.comparison.as_mut() {
        c.allow_incomparable = a.tol.allow_incomparable;
    }
    if let Some(out) = &a.dump {
        let mut inputs = l.parts();
        inputs.extend(a.reference.as_deref());
        outcome.capture.save(out, &inputs)?;
        if !ctx.quiet {
            eprintln!(
                "{}",
                report::captures_written(outcome.capture.tensors.len(), out)
            );
        }
    }
    emit_hf(
        ctx,
        a.json,
        &report::forward::forward_json(&outcome),
        hf.as_ref(),
        || report::forward::forward_text(&outcome, a.all),
    )?;
    if let Some(c) = &outcome.comparison {
        report_extras(ctx, "forward", c)?;
    }
    let o = match &outcome.comparison {
        Some(c) => Outcome::from(c.verdict()),
        None => Outcome::Ok,
    };
    // A rank whose replicated copy differs is a finding even when rank 0's copies compare clean.
    let o = if model.replica_mismatches().is_empty() {
        o
    } else {
        Outcome::Finding
    };
    Ok(o.with_hf(hf.as_ref()))
}

/// q8 kernels against a reference from the same weights are another engine's kernels on the
/// same GGUF (their 8-bit activations are noise the reference does not have).
fn kernel_kind(kind: ReferenceWeights, matmul: MatmulMode) -> ReferenceWeights {
    match (kind, matmul) {
        (ReferenceWeights::Same, MatmulMode::Q8) => ReferenceWeights::SameGguf,
        (k, _) => k,
    }
}

/// The GGUF's tokenizer: required for --prompt; without one, --tokens runs with a warning.
fn tokenizer(
    a: &ForwardArgs,
    ctx: &Ctx,
    model: &GgufModel,
) -> anyhow::Result<Option<GgufTokenizer>> {
    match (GgufTokenizer::from_gguf(model), &a.prompt) {
        (Ok(t), _) => Ok(Some(t)),
        (Err(e), Some(_)) => Err(e).context("--prompt needs the GGUF's tokenizer"),
        (Err(e), None) => {
            if !ctx.quiet {
                eprintln!("{}", report::no_token_texts(&e));
            }
            Ok(None)
        }
    }
}

/// The prompt's token ids: --prompt tokenized, or --tokens parsed.
fn token_ids(a: &ForwardArgs, tokenizer: Option<&GgufTokenizer>) -> anyhow::Result<Vec<u32>> {
    let ids = match (&a.prompt, &a.tokens, tokenizer) {
        (Some(p), _, Some(t)) => t.encode(p)?,
        (_, Some(s), _) => parse_tokens(s)?,
        _ => return Err(CmdError::NoPrompt.into()),
    };
    if ids.is_empty() {
        return Err(CmdError::EmptyPrompt.into());
    }
    Ok(ids)
}

/// `1,2,3` → ids.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>, CmdError> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>()
                .map_err(|_| CmdError::BadTokenId(x.to_string()))
        })
        .collect::<Result<Vec<u32>, CmdError>>()?;
    if ids.is_empty() {
        return Err(CmdError::NoTokenIds);
    }
    Ok(ids)
}

/// With fp16-compute among the faults, `model` is dropped and built again in f16 (the compute
/// dtype is chosen when the weights are converted); else it is kept.
fn in_f16_if_faulted(
    model: Glm5,
    dtype: ComputeDtype,
    injections: &[crate::faults::Injection],
    build: impl FnOnce(ModelOptions) -> Result<Glm5, crate::model::ModelError>,
) -> anyhow::Result<(Glm5, ComputeDtype)> {
    if !injections
        .iter()
        .any(|i| i.fault.behaviour() == Some(Fp16Compute))
    {
        return Ok((model, dtype));
    }
    let options = ModelOptions {
        dtype: ComputeDtype::F16.candle(),
        ..model.options()
    };
    drop(model);
    Ok((build(options)?, ComputeDtype::F16))
}

/// The unsharded model, or `plan`'s simulated ranks (from `dump`'s weights when given).
fn build(
    w: &Weights<'_>,
    plan: Option<&ShardPlan>,
    dump: Option<&RankDump>,
    options: ModelOptions,
) -> Result<Glm5, crate::model::ModelError> {
    match plan {
        Some(plan) => Glm5::sharded(w, plan, dump, options),
        None => Glm5::load_with(w, options),
    }
}

/// Injects --fault's behaviour faults into `model` (noted).
fn inject(
    model: &mut Glm5,
    injections: &[crate::faults::Injection],
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    for i in injections {
        if let Some(b) = i.fault.behaviour() {
            model.inject(b, i.layers.as_deref())?;
        }
    }
    if !injections.is_empty() {
        notes.push(report::fault_note(injections));
    }
    Ok(())
}

/// `--report DIR`: report.html and findings.jsonl of a comparison beside report.json.
pub fn report_extras(ctx: &Ctx, title: &str, c: &crate::compare::Comparison) -> anyhow::Result<()> {
    super::output::emit_extras(
        ctx,
        &[
            ("report.html", report::html::comparison_html(title, c)),
            ("findings.jsonl", report::html::findings_jsonl(c)),
        ],
    )
}

/// --fault's behaviour faults; a weight fault is refused with the way to run it.
fn injections(given: &[String]) -> anyhow::Result<Vec<crate::faults::Injection>> {
    given
        .iter()
        .map(|s| {
            let i: crate::faults::Injection = s.parse()?;
            match i.fault.behaviour() {
                Some(_) => Ok(i),
                None => Err(CmdError::WeightFaultInForward(i.fault.to_string()).into()),
            }
        })
        .collect()
}

/// The reference dump, refused when it was made from other tokens.
fn load_reference(r: &Path, ids: &[u32]) -> anyhow::Result<Activations> {
    let acts = Activations::load(r)?;
    if let Some(rt) = &acts.tokens {
        if rt != ids {
            return Err(CmdError::OtherTokens {
                file: r.to_path_buf(),
                reference: rt.clone(),
                run: ids.to_vec(),
            }
            .into());
        }
    }
    Ok(acts)
}

/// --weights-from's rank files, refused when they are not --tp ranks.
fn rank_dump(a: &ForwardArgs) -> anyhow::Result<Option<RankDump>> {
    let (Some(dir), Some(tp)) = (&a.weights_from, a.tp) else {
        return Ok(None);
    };
    let d = RankDump::open(dir)?;
    if d.tp() != tp as usize {
        return Err(CmdError::RankCount {
            dir: dir.clone(),
            ranks: d.tp(),
            tp: tp as usize,
        }
        .into());
    }
    Ok(Some(d))
}

/// What the run is compared with, and what that truth's weights are (for the tolerances).
struct Truth {
    acts: Option<Activations>,
    /// The weight type whose noise the tolerances allow.
    weights: GgmlType,
    kind: ReferenceWeights,
    /// What decided the tolerances, when the user could not have known (a rank dump's weights).
    note: Option<String>,
}

/// The reference: --reference's dump; else, with --fault, the same forward without the faults
/// (same-weights bounds); else, for --tp, the unsharded forward of the same GGUF — held
/// to the same-weights bounds for the GGUF's own cut, and for --weights-from to the noise that
/// separates the dump's weights from the GGUF's (its storage dtype; the quantization too when it
/// holds the originals).
#[allow(clippy::too_many_arguments)]
fn truth(
    a: &ForwardArgs,
    reference: Option<Activations>,
    unfaulted: Option<&Glm5>,
    plan: Option<&ShardPlan>,
    dump: Option<&RankDump>,
    w: &Weights<'_>,
    options: ModelOptions,
    ids: &[u32],
    weights: GgmlType,
) -> anyhow::Result<Truth> {
    // What the reference's weights are: the flag, else the dump's own metadata.
    let kind = match (a.tol.reference_weights, &reference) {
        (Some(k), _) => k.into(),
        (None, Some(r)) => ReferenceWeights::of_dump(r, &a.file, weights),
        (None, None) => ReferenceWeights::Original,
    };
    if let Some(model) = unfaulted {
        let mut acts = fwd::capture(model, ids, a.prompt.as_deref())?;
        acts.source = report::unfaulted_source(&a.file);
        return Ok(Truth {
            acts: Some(acts),
            weights: GgmlType::F32,
            kind: ReferenceWeights::Same,
            note: None,
        });
    }
    let Some(plan) = plan.filter(|_| reference.is_none()) else {
        return Ok(Truth {
            acts: reference,
            weights,
            kind,
            note: None,
        });
    };
    let mut acts = fwd::capture(&Glm5::load_with(w, options)?, ids, a.prompt.as_deref())?;
    acts.source = report::unsharded_source(&a.file);
    let same = Truth {
        acts: Some(acts),
        weights: GgmlType::F32,
        kind: ReferenceWeights::Same,
        note: None,
    };
    match (dump, a.tol.reference_weights) {
        (Some(d), None) => {
            let dw = crate::shards::dump_weights(w, plan, d, weights)?;
            Ok(Truth {
                weights: dw.class(),
                kind: ReferenceWeights::Original,
                note: Some(report::dump_weights_note(&dw)),
                ..same
            })
        }
        _ => Ok(same),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_parse_and_bad_ones_are_refused() {
        assert_eq!(parse_tokens("1, 2,3,").expect("ids"), vec![1, 2, 3]);
        assert_eq!(parse_tokens("1,x"), Err(CmdError::BadTokenId("x".into())));
        assert_eq!(parse_tokens(" , "), Err(CmdError::NoTokenIds));
        assert_eq!(parse_tokens("-1"), Err(CmdError::BadTokenId("-1".into())));
    }
}
