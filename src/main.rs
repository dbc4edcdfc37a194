//! The `glmcheck` binary: parse flags, call the library's stages, map outcomes to exit codes
//! (0 ok, 1 finding, 2 unreadable or malformed input).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, CommandFactory, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use glmcheck::activations::{self, forward as fwd, Activations, ComputeDtype, Tolerances};
use glmcheck::arch::config::ConfigReader;
use glmcheck::arch::hf_config::{self, HfConfig, HfConfigCheck};
use glmcheck::dump::RankDump;
use glmcheck::faults::Fault;
use glmcheck::gguf::GgufModel;
use glmcheck::inspect::InspectReport;
use glmcheck::model::{DsaMode, Glm5, ModelOptions};
use glmcheck::plan::{ParamPlan, ShardPlan};
use glmcheck::tokenizer::GgufTokenizer;
use glmcheck::weights::Weights;
use glmcheck::{report, scan, shards};

const AFTER_HELP: &str = "\
Exit codes: 0 ok, 1 a finding (problems, corruption), 2 unreadable or malformed input.

Examples:
  glmcheck inspect fixtures/tiny/tiny-Q4_K_M.gguf
  glmcheck inspect GLM-5-UD-Q4_K_XL-00001-of-00010.gguf --json
  glmcheck inspect model.gguf --hf-config config.json   # what vLLM builds from the deployment's config
  glmcheck dequant fixtures/tiny/tiny-Q8_0.gguf --tensor 'blk.1.*'
  glmcheck shards model-00001-of-00010.gguf --tp 8 --verify
  glmcheck inject --fault kvb-concat --layer 1 --tp 8 --out /tmp/bad fixtures/tiny/tiny-F32.gguf
  glmcheck shards fixtures/tiny/tiny-F32.gguf --tp 8 --against /tmp/bad
  glmcheck forward fixtures/tiny/tiny-F32.gguf --prompt 'What is 2+2?'
  glmcheck diff ref.safetensors cand.safetensors
  glmcheck completions bash > /etc/bash_completion.d/glmcheck";

#[derive(Parser)]
#[command(
    name = "glmcheck",
    version,
    about = "Find out why a GLM-5 (glm-dsa) deployment that loads fine still produces garbage",
    long_about = "glmcheck reads a GLM-5 GGUF exactly as llama.cpp wrote it, rebuilds every Hugging Face \
weight from it, reproduces vLLM's tensor-parallel cut of every parameter, runs a GLM-5 forward that \
matches transformers module by module, and diffs what a deployment's ranks hold (shards --against) \
and compute (forward --reference, diff) against that, naming the first bad tensor, layer and rank.",
    after_help = AFTER_HELP
)]
struct Cli {
    /// More diagnostics on stderr (repeat for more).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors on stderr; no progress bars.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Also write the command's JSON report to FILE (via a temp file and rename; never over an
    /// input, a GGUF or a safetensors file).
    #[arg(long, global = true, value_name = "FILE")]
    report: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Architecture, config (HF names), tensor inventory, tokenizer and a consistency check of a GGUF.
    ///
    /// Reads headers only: as fast on a 400 GB split set as on a fixture. Given any part of a
    /// `-NNNNN-of-NNNNN.gguf` split set, reads all parts.
    #[command(after_help = "Examples:
  glmcheck inspect fixtures/tiny/tiny-Q4_K_M.gguf
  glmcheck inspect GLM-5-UD-Q4_K_XL-00001-of-00010.gguf --json | jq .problems
  glmcheck inspect model.gguf --all-tensors
  glmcheck inspect model.gguf --hf-config /models/GLM-5/config.json   # the deployment's config

Exit codes: 0 consistent, 1 problems found (missing, unexpected or mis-shaped tensors), 2 unreadable.")]
    Inspect {
        /// The GGUF file (or any part of a split set).
        file: PathBuf,
        /// Print JSON: {"arch", "config", "tensors": [{"name", "dtype", "shape"}], "problems", ...}.
        #[arg(long)]
        json: bool,
        /// List every tensor (default: globals, layer 0 and the first MoE layer).
        #[arg(long)]
        all_tensors: bool,
        /// The deployment's config.json: check every field vLLM 0.33 reads for GLM-5 against this
        /// GGUF and name those that change what vLLM computes (a finding exits 1).
        #[arg(long, value_name = "config.json")]
        hf_config: Option<PathBuf>,
    },
    /// Dequantize tensors to f32 and report per-tensor statistics and decode throughput.
    ///
    /// Memory stays bounded by the largest selected tensor. A tensor whose type glmcheck cannot decode
    /// is reported, and the rest are still decoded.
    #[command(after_help = "Examples:
  glmcheck dequant fixtures/tiny/tiny-Q4_K_M.gguf
  glmcheck dequant model.gguf --tensor 'blk.3.attn_*' --tensor output.weight --json
  glmcheck dequant bench.gguf --repeat 5 --json   # best-of-5 decode timing

Exit codes: 0 all decoded and finite, 1 NaN/Inf values or undecodable tensors, 2 unreadable.")]
    Dequant {
        /// The GGUF file (or any part of a split set).
        file: PathBuf,
        /// Only tensors matching this glob (`*`, `?`); repeatable.
        #[arg(long = "tensor", value_name = "GLOB")]
        tensors: Vec<String>,
        /// Decode each tensor this many times and report the best time.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Decode straight into the statistics in cache-sized chunks, never holding the f32 tensor
        /// (how `shards --verify` scans experts), instead of into one reused f32 buffer.
        #[arg(long)]
        stream: bool,
        /// Print JSON: {"tensors": [{"name", "dtype", "shape", "absmax", "mean", "std", "nan", "inf", "seconds", "out_gbps"}]}.
        #[arg(long)]
        json: bool,
    },
    /// vLLM's tensor-parallel cut of every GLM-5 parameter; verify it; diagnose what ranks hold.
    ///
    /// Without --verify/--against, reads headers only: one row per vLLM parameter with its GGUF
    /// source(s), quant type, full shape, TP style, shard dim and per-rank shard shape, flagging cuts
    /// that cannot be made (divisibility, head alignment) or that split quant blocks.
    #[command(after_help = "Examples:
  glmcheck shards model.gguf                          # the tp=8 plan
  glmcheck shards model.gguf --tp 4 --layer 3 --json
  glmcheck shards model.gguf --tensor '*kv_b_proj*' --verify
  glmcheck shards model.gguf --tp 8 --against /dumps/weights   # rank0.safetensors … rank7.safetensors
  glmcheck shards model.gguf --tp 8 --hf-config /models/GLM-5/config.json --json | jq .hf_config

With --against, what cannot be compared (a non-float dump tensor, an undecodable GGUF tensor, an
unreadable rank file) is reported and the rest still checked.

Exit codes: 0 sound / pass, 1 problems, a corrupt finding or something not checked, 2 unreadable or
malformed input (with --against: no rank file readable).")]
    Shards {
        /// The GGUF file (or any part of a split set).
        file: PathBuf,
        /// Tensor-parallel degree.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=4096))]
        tp: u16,
        /// Only this layer's parameters.
        #[arg(long)]
        layer: Option<usize>,
        /// Only parameters whose vLLM name or GGUF source matches this glob; repeatable.
        #[arg(long = "tensor", value_name = "GLOB")]
        tensors: Vec<String>,
        /// Dequantize every parameter: finite values, statistics, shards reassemble, kv_b layout.
        #[arg(long, conflicts_with = "against")]
        verify: bool,
        /// Compare the per-rank dump in DIR (rank<r>.safetensors, vLLM names) with the expected shards.
        #[arg(long, value_name = "DIR")]
        against: Option<PathBuf>,
        /// With --against: only these ranks are expected (e.g. `0,1,2`); by default every rank of
        /// 0..tp is, and a missing rank file makes the run incomplete.
        #[arg(long, requires = "against", value_delimiter = ',', value_name = "LIST")]
        ranks: Option<Vec<usize>>,
        /// With --against: tensor names glmcheck does not know are listed but do not make the run
        /// incomplete.
        #[arg(long, requires = "against")]
        allow_unexpected: bool,
        /// With --against: where the dump's values came from. gguf: a deployment that loaded this
        /// GGUF (its dequantized values, exact up to the dump's dtype); originals: the unquantized
        /// checkpoint (within the quant type's noise). Default: decided from the dump.
        #[arg(long, requires = "against", value_enum)]
        provenance: Option<ProvenanceArg>,
        /// The deployment's config.json: check every field vLLM 0.33 reads for GLM-5 against this
        /// GGUF and name those that change what vLLM computes (a finding exits 1).
        #[arg(long, value_name = "config.json")]
        hf_config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write the per-rank dump that a loader with a known bug would hold (or the correct one).
    #[command(
        after_help = "Faults: none, kvb-concat, kvb-untransposed, rank-swap:A,B, merged-rank0,
  merged-midsplit, param-zeroed:GLOB, wrong-dim, vocab-unpadded, bf16-as-f16

Examples:
  glmcheck inject --fault kvb-concat --layer 1 --tp 8 --out /tmp/bad fixtures/tiny/tiny-F32.gguf
  glmcheck shards fixtures/tiny/tiny-F32.gguf --tp 8 --against /tmp/bad
  glmcheck inject --fault none --tp 2 --dtype bf16 --out /tmp/good model.gguf"
    )]
    Inject {
        /// The GGUF file (or any part of a split set).
        file: PathBuf,
        /// The loader bug to reproduce.
        #[arg(long)]
        fault: String,
        /// Only this layer's parameters get the bug.
        #[arg(long)]
        layer: Option<usize>,
        /// Only parameters matching this glob get the bug (default: the ones the bug hits); repeatable.
        #[arg(long = "param", value_name = "GLOB")]
        params: Vec<String>,
        /// Tensor-parallel degree.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=4096))]
        tp: u16,
        /// Output directory (created; rank<r>.safetensors are written into it).
        #[arg(long)]
        out: PathBuf,
        /// dtype of the dumped tensors.
        #[arg(long, default_value = "f32", value_parser = ["f32", "bf16", "f16"])]
        dtype: String,
        /// Parameter names as this vLLM version writes them (0.33: routed experts under
        /// `mlp.experts.routed_experts.*`; legacy: `mlp.experts.w13_weight`).
        #[arg(long, value_enum, default_value = "0.33")]
        vllm_names: VllmNamesArg,
    },
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
    #[command(after_help = "Examples:
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

--prompt is tokenized with the GGUF's own tokenizer, nothing added (no [gMASK]<sop>; type it if
wanted). With --reference the token ids must be the reference's (its `token_ids` metadata).

Exit codes: 0 within tolerance (or no --reference), 1 diverged, 2 unreadable input or bad arguments.")]
    Forward {
        /// The GGUF file (or any part of a split set).
        file: PathBuf,
        /// Text to tokenize with the GGUF's tokenizer.
        #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
        prompt: Option<String>,
        /// Token ids, comma-separated (bypasses the tokenizer).
        #[arg(long, value_name = "IDS")]
        tokens: Option<String>,
        /// An activation dump to compare with (fixtures/tiny/activations/prompt0.safetensors, a
        /// transformers hook dump, or another glmcheck --dump).
        #[arg(long, value_name = "ACTS.safetensors")]
        reference: Option<PathBuf>,
        /// Write every captured module output (safetensors; execution order, token ids and prompt
        /// in the metadata). Written to a temp file and renamed; never over an input.
        #[arg(long, value_name = "OUT.safetensors")]
        dump: Option<PathBuf>,
        /// sparse: the DSA indexer restricts attention (GLM-5, transformers); dense: plain causal
        /// attention, as a deployment with the indexer disabled.
        #[arg(long, default_value = "sparse", value_parser = ["sparse", "dense"])]
        dsa: String,
        /// Compute dtype.
        #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
        dtype: String,
        /// Tokens of greedy continuation (the full forward is recomputed per token).
        #[arg(long, default_value_t = 8)]
        max_new_tokens: usize,
        /// Time N extra plain forwards of the prompt (no capture) and report the best
        /// ("forward_seconds" in --json).
        #[arg(long, value_name = "N", default_value_t = 0)]
        bench: usize,
        /// Simulate vLLM tensor parallel over N ranks (each rank its column/row-parallel shards,
        /// partial sums all-reduced, vocab-parallel embedding and lm_head gathered). Without
        /// --reference it is compared with the unsharded forward of the same file.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=4096))]
        tp: Option<u16>,
        /// With --tp: the ranks' weights from DIR/rank<r>.safetensors (vLLM parameter names, as a
        /// deployment holds them or `glmcheck inject` writes them) instead of the GGUF's cut.
        #[arg(long, value_name = "DIR", requires = "tp")]
        weights_from: Option<PathBuf>,
        #[command(flatten)]
        tol: TolFlags,
        /// List every compared capture, auxiliary ones (tuple elements, aliases) included.
        #[arg(long)]
        all: bool,
        /// The deployment's config.json: check every field vLLM 0.33 reads for GLM-5 against this
        /// GGUF and name those that change what vLLM computes (a finding exits 1).
        #[arg(long, value_name = "config.json")]
        hf_config: Option<PathBuf>,
        /// Print JSON: {"tokens", "top", "continuation", "modules": [{"name", "rel_l2", "cosine",
        /// "max_abs", ...}], "logits": {"kl_mean", "kl_max", "top1_agree", "max_abs", ...},
        /// "first_divergence": null | {"module", "layer", "inputs", "reading"}, "verdict", ...}.
        #[arg(long)]
        json: bool,
    },
    /// Compare two activation dumps module by module and name the first divergence.
    ///
    /// REF and CAND are safetensors dumps under HF module paths: glmcheck's (forward --dump) or
    /// transformers forward hooks' (the fixtures' layout). Same comparison as forward --reference:
    /// per-module rel-L2/cosine/max-abs, indexer top-k with ties told apart, router choices, logits
    /// KL/top-1/entropy. Without replay, positions after a differing tie-break are left out of later
    /// modules (the model is causal), and the output says which. Tolerances come from CAND's
    /// metadata (glmcheck.dtype, glmcheck.weights; else f32 / F32) unless --dtype/--weights say.
    #[command(after_help = "Examples:
  glmcheck diff fixtures/tiny/activations/prompt0.safetensors /tmp/glmcheck-prompt0.safetensors
  glmcheck diff ref.safetensors cand.safetensors --weights Q4_K --dtype bf16 --json
  glmcheck diff ref.safetensors cand.safetensors --rel-l2 1e-3

Exit codes: 0 within tolerance, 1 diverged, 2 unreadable input or dumps of different tokens.")]
    Diff {
        /// The reference dump (taken as the truth).
        reference: PathBuf,
        /// The candidate dump.
        candidate: PathBuf,
        /// Compute dtype the candidate ran in (for the tolerances).
        #[arg(long, value_parser = ["f32", "bf16", "f16"])]
        dtype: Option<String>,
        /// Coarsest weight type of the candidate's model (F32, BF16, Q8_0, Q4_K, …).
        #[arg(long, value_name = "TYPE")]
        weights: Option<String>,
        #[command(flatten)]
        tol: TolFlags,
        /// List every compared capture, auxiliary ones included.
        #[arg(long)]
        all: bool,
        /// Print JSON: {"verdict", "modules", "logits", "first_divergence", "exclusions", ...}.
        #[arg(long)]
        json: bool,
    },
    /// Print a shell completion script.
    #[command(after_help = "Example:
  glmcheck completions zsh > ~/.zfunc/_glmcheck")]
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

/// Overrides of the comparison tolerances.
#[derive(Args, Debug, Clone, Default)]
struct TolFlags {
    /// Largest rel-L2 of a float module.
    #[arg(long, value_name = "X")]
    rel_l2: Option<f64>,
    /// Largest mean KL(ref ‖ cand) of the next-token distributions, nats.
    #[arg(long, value_name = "X")]
    kl_mean: Option<f64>,
    /// Largest per-position KL, nats.
    #[arg(long, value_name = "X")]
    kl_max: Option<f64>,
    /// Smallest fraction of positions whose top-1 token agrees (0..1).
    #[arg(long, value_name = "X")]
    top1_min: Option<f64>,
    /// Index-score noise, relative to a row's largest score: top-k swaps with a smaller margin are near-ties.
    #[arg(long, value_name = "X")]
    score_noise: Option<f64>,
    /// Largest fraction of tokens whose routed experts may differ while the router logits agree.
    #[arg(long, value_name = "X")]
    router_flips: Option<f64>,
    /// Modules whose layouts cannot be matched (shapes that differ beyond singleton dims) are
    /// listed but do not make the run "incomplete" (exit 1).
    #[arg(long)]
    allow_incomparable: bool,
    /// What the reference's weights are: same (glmcheck's --dump of the same GGUF: only the compute
    /// dtype differs), same-gguf (the same GGUF run by another engine, e.g. llama.cpp: its kernel
    /// noise too), original (the unquantized checkpoint, e.g. transformers: the quant type's noise).
    /// Default: same for glmcheck's dump of this GGUF, else original.
    #[arg(long, value_enum, value_name = "KIND")]
    reference_weights: Option<RefWeightsArg>,
}

/// `--reference-weights`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum RefWeightsArg {
    Same,
    SameGguf,
    Original,
}

impl RefWeightsArg {
    fn lib(self) -> activations::ReferenceWeights {
        match self {
            RefWeightsArg::Same => activations::ReferenceWeights::Same,
            RefWeightsArg::SameGguf => activations::ReferenceWeights::SameGguf,
            RefWeightsArg::Original => activations::ReferenceWeights::Original,
        }
    }
}

impl TolFlags {
    fn apply(&self, mut t: Tolerances) -> Tolerances {
        let mut changed = Vec::new();
        let mut set = |slot: &mut f64, v: Option<f64>, name: &str| {
            if let Some(v) = v {
                *slot = v;
                changed.push(name.to_string());
            }
        };
        set(&mut t.rel_l2, self.rel_l2, "rel-l2");
        set(&mut t.kl_mean, self.kl_mean, "kl-mean");
        set(&mut t.kl_max, self.kl_max, "kl-max");
        set(&mut t.top1_min, self.top1_min, "top1-min");
        set(&mut t.score_noise, self.score_noise, "score-noise");
        set(&mut t.router_flip_max, self.router_flips, "router-flips");
        if !changed.is_empty() {
            t.basis
                .push_str(&format!("; overridden: {}", changed.join(", ")));
        }
        t
    }
}

/// `1,2,3` → ids.
fn parse_tokens(s: &str) -> anyhow::Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>()
                .map_err(|_| anyhow::anyhow!("--tokens: `{x}` is not a token id"))
        })
        .collect::<anyhow::Result<Vec<u32>>>()?;
    if ids.is_empty() {
        anyhow::bail!("--tokens: no token ids given");
    }
    Ok(ids)
}

/// What a command found, mapped to the exit code.
enum Outcome {
    Ok,
    Finding,
}

/// `shards --against --provenance`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ProvenanceArg {
    Gguf,
    Originals,
}

/// `inject --vllm-names`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum VllmNamesArg {
    #[value(name = "0.33")]
    V033,
    Legacy,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Ctrl-C: remove the temp files of writes in flight (no partial report or dump is ever left).
    let _ = ctrlc::set_handler(|| {
        glmcheck::outputs::remove_pending();
        eprintln!("glmcheck: interrupted");
        std::process::exit(130);
    });
    let code = match run(&cli) {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Finding) => ExitCode::from(1),
        Err(e) => {
            eprintln!("glmcheck: error: {e:#}");
            ExitCode::from(2)
        }
    };
    report_peak_rss();
    code
}

/// With `GLMCHECK_PEAK_RSS=1`, prints this process's peak resident memory (`VmHWM`) on stderr
/// at exit. A parent's `wait4` cannot measure it: on Linux a spawned child's `ru_maxrss` starts
/// from the spawning process's own peak (the memory-budget tests spawn from a large test runner).
fn report_peak_rss() {
    if std::env::var_os("GLMCHECK_PEAK_RSS").is_none() {
        return;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if let Some(kib) = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    {
        eprintln!("glmcheck: peak RSS {kib} KiB");
    }
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value).context("writing JSON to stdout")?;
    writeln!(out).context("writing to stdout")?;
    Ok(())
}

/// Prints the human or JSON form of a command's result and, with `--report`, writes the JSON form.
fn emit(
    cli: &Cli,
    json: bool,
    value: &impl serde::Serialize,
    text: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if let Some(path) = &cli.report {
        write_report(path, value, &input_paths(&cli.command))?;
    }
    if json {
        print_json(value)
    } else {
        print_text(&text())
    }
}

/// The paths a command reads (files, and the files of directories it reads).
fn input_paths(c: &Command) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = match c {
        Command::Inspect { file, .. }
        | Command::Dequant { file, .. }
        | Command::Inject { file, .. } => {
            vec![file.clone()]
        }
        Command::Shards { file, against, .. } => std::iter::once(file.clone())
            .chain(against.clone())
            .collect(),
        Command::Forward {
            file,
            reference,
            weights_from,
            ..
        } => std::iter::once(file.clone())
            .chain(reference.clone())
            .chain(weights_from.clone())
            .collect(),
        Command::Diff {
            reference,
            candidate,
            ..
        } => vec![reference.clone(), candidate.clone()],
        Command::Completions { .. } => Vec::new(),
    };
    if let Command::Inspect {
        hf_config: Some(h), ..
    }
    | Command::Shards {
        hf_config: Some(h), ..
    }
    | Command::Forward {
        hf_config: Some(h), ..
    } = c
    {
        v.push(h.clone());
    }
    let dirs: Vec<PathBuf> = v.iter().filter(|p| p.is_dir()).cloned().collect();
    for d in dirs {
        if let Ok(rd) = std::fs::read_dir(&d) {
            v.extend(rd.flatten().map(|e| e.path()));
        }
    }
    v
}

/// Writes `value` as JSON to `path` atomically. Refuses a path that is one of `inputs`, or an existing
/// GGUF or safetensors file (a report never replaces model or dump data).
fn write_report(
    path: &std::path::Path,
    value: &impl serde::Serialize,
    inputs: &[PathBuf],
) -> anyhow::Result<()> {
    let canon = |p: &std::path::Path| std::fs::canonicalize(p).ok();
    if let Some(target) = canon(path) {
        if inputs.iter().any(|i| canon(i).as_ref() == Some(&target)) {
            anyhow::bail!(
                "--report {}: refusing to overwrite an input of this command",
                path.display()
            );
        }
        let mut head = [0u8; 8];
        if let Ok(mut f) = std::fs::File::open(path) {
            use std::io::Read;
            let n = f.read(&mut head).unwrap_or(0);
            let st_header = n == 8 && u64::from_le_bytes(head) < (1 << 27) && {
                let mut brace = [0u8; 1];
                f.read(&mut brace).unwrap_or(0) == 1 && brace[0] == b'{'
            };
            if (n >= 4 && &head[..4] == b"GGUF") || st_header {
                anyhow::bail!(
                    "--report {}: refusing to overwrite an existing GGUF or safetensors file",
                    path.display()
                );
            }
        }
    }
    let body = serde_json::to_vec_pretty(value).context("encoding the report")?;
    glmcheck::outputs::write_atomically(path, |tmp| std::fs::write(tmp, &body))
        .with_context(|| format!("writing the report {}", path.display()))
}

fn print_text(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .context("writing to stdout")?;
    Ok(())
}

fn open(file: &std::path::Path) -> anyhow::Result<GgufModel> {
    Ok(GgufModel::open(file)?)
}

/// `--hf-config`: the deployment's config.json against this GGUF's config (None without the flag).
fn hf_config_check(
    path: Option<&std::path::Path>,
    model: &GgufModel,
) -> anyhow::Result<Option<HfConfigCheck>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let hf = HfConfig::read(path)?;
    let cr = ConfigReader::read(model, glmcheck::arch::ARCH)?;
    Ok(Some(hf_config::check(&hf, &cr.config, &cr.sources)))
}

/// [`emit`] with the `--hf-config` check, if any, added: its table after the text and
/// `"hf_config"` in the JSON.
fn emit_hf(
    cli: &Cli,
    json: bool,
    value: &impl serde::Serialize,
    hf: Option<&HfConfigCheck>,
    text: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    let Some(hf) = hf else {
        return emit(cli, json, value, text);
    };
    let mut v = serde_json::to_value(value).context("encoding the JSON report")?;
    if !v.is_object() {
        v = serde_json::json!({ "result": v });
    }
    if let Some(m) = v.as_object_mut() {
        m.insert("hf_config".into(), report::hf_config::hf_config_json(hf));
    }
    emit(cli, json, &v, || {
        text() + &report::hf_config::hf_config_text(hf)
    })
}

/// A command's outcome, made a finding by an `--hf-config` finding.
fn hf_outcome(o: Outcome, hf: Option<&HfConfigCheck>) -> Outcome {
    if hf.is_some_and(HfConfigCheck::fails) {
        Outcome::Finding
    } else {
        o
    }
}

fn run(cli: &Cli) -> anyhow::Result<Outcome> {
    match &cli.command {
        Command::Inspect {
            file,
            json,
            all_tensors,
            hf_config,
        } => {
            let model = open(file)?;
            let hf = hf_config_check(hf_config.as_deref(), &model)?;
            let report = InspectReport::build(&model)?;
            emit_hf(cli, *json, &report, hf.as_ref(), || {
                report::inspect_text(&report, *all_tensors)
            })?;
            if cli.verbose > 0 {
                for p in &model.parts {
                    eprintln!(
                        "glmcheck: {}: GGUF v{}, {} metadata entries, {} tensors, data at {}",
                        p.path.display(),
                        p.version,
                        p.metadata.len(),
                        p.tensors.len(),
                        p.data_offset
                    );
                }
            }
            Ok(hf_outcome(
                if report.problems.is_empty() {
                    Outcome::Ok
                } else {
                    Outcome::Finding
                },
                hf.as_ref(),
            ))
        }
        Command::Dequant {
            file,
            tensors,
            repeat,
            stream,
            json,
        } => {
            let model = open(file)?;
            let selected = scan::select(&model, tensors);
            if model.tensor_count() == 0 {
                anyhow::bail!(
                    "{} holds no tensors (a vocab-only GGUF?): nothing to dequantize",
                    file.display()
                );
            }
            if selected.is_empty() {
                anyhow::bail!(
                    "no tensor of {} matches --tensor {}",
                    file.display(),
                    tensors.join(" --tensor ")
                );
            }
            let total: u64 = selected.iter().map(|t| t.info.n_bytes).sum();
            let bar = progress(cli.quiet, total);
            let mut rows = Vec::with_capacity(selected.len());
            let mut buf = Vec::new();
            for t in selected {
                bar.set_message(t.info.name.clone());
                rows.push(scan::scan_tensor(t, *repeat, *stream, &mut buf));
                bar.inc(t.info.n_bytes);
            }
            bar.finish_and_clear();
            emit(
                cli,
                *json,
                &serde_json::json!({ "file": file, "tensors": rows }),
                || report::dequant_text(&rows),
            )?;
            let bad = rows
                .iter()
                .any(|r| r.error.is_some() || r.nan > 0 || r.inf > 0);
            Ok(if bad { Outcome::Finding } else { Outcome::Ok })
        }
        Command::Shards {
            file,
            tp,
            layer,
            tensors,
            verify,
            against,
            ranks,
            allow_unexpected,
            provenance,
            hf_config,
            json,
        } => {
            let tp = *tp as usize;
            let model = open(file)?;
            let hf = hf_config_check(hf_config.as_deref(), &model)?;
            let cfg = ConfigReader::read(&model, glmcheck::arch::ARCH)?.config;
            let plan = ShardPlan::new(&model, &cfg, tp);
            let keep = |p: &ParamPlan| {
                layer.is_none_or(|l| p.layer == Some(l))
                    && (tensors.is_empty()
                        || tensors.iter().any(|g| {
                            scan::glob_match(g, &p.param)
                                || p.gguf.iter().any(|n| scan::glob_match(g, n))
                        }))
            };
            let selected = ShardPlan {
                tp,
                params: plan.params.iter().filter(|p| keep(p)).cloned().collect(),
                mtp_blocks: plan.mtp_blocks.clone(),
            };
            if selected.params.is_empty() {
                anyhow::bail!("no parameter matches the --layer/--tensor filters");
            }
            let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
            if *verify {
                let total: u64 = selected
                    .params
                    .iter()
                    .flat_map(|p| p.gguf.iter())
                    .filter_map(|n| model.tensor(n))
                    .map(|t| t.info.n_bytes)
                    .sum();
                let bar = progress(cli.quiet, total);
                let r = shards::verify(&w, &selected, &mut |p, b| {
                    bar.set_message(p.param.clone());
                    bar.inc(b);
                });
                bar.finish_and_clear();
                emit_hf(cli, *json, &r, hf.as_ref(), || report::verify_text(&r))?;
                let o = if r.ok { Outcome::Ok } else { Outcome::Finding };
                return Ok(hf_outcome(o, hf.as_ref()));
            }
            if let Some(dir) = against {
                let dump = RankDump::open(dir)?;
                if dump.tp() != tp && !cli.quiet {
                    eprintln!(
                        "glmcheck: warning: {} holds rank files up to rank {}, checking at --tp {tp}",
                        dir.display(),
                        dump.tp().saturating_sub(1)
                    );
                }
                let bar = progress(cli.quiet, selected.params.len() as u64);
                let opts = shards::AgainstOptions {
                    provenance: provenance.map(|p| match p {
                        ProvenanceArg::Gguf => shards::Provenance::Gguf,
                        ProvenanceArg::Originals => shards::Provenance::Originals,
                    }),
                    ranks: ranks.clone(),
                    allow_unexpected: *allow_unexpected,
                };
                let r = shards::against(&w, &selected, &dump, &opts, &mut |p| {
                    bar.set_message(p.param.clone());
                    bar.inc(1);
                })?;
                bar.finish_and_clear();
                emit_hf(cli, *json, &r, hf.as_ref(), || report::against_text(&r))?;
                let o = if r.verdict == shards::Verdict::Pass {
                    Outcome::Ok
                } else {
                    Outcome::Finding
                };
                return Ok(hf_outcome(o, hf.as_ref()));
            }
            emit_hf(cli, *json, &selected, hf.as_ref(), || {
                let rows: Vec<&ParamPlan> = selected.params.iter().collect();
                report::shards_text(&selected, &rows)
            })?;
            let problems = selected.params.iter().any(|p| !p.problems.is_empty());
            Ok(hf_outcome(
                if problems {
                    Outcome::Finding
                } else {
                    Outcome::Ok
                },
                hf.as_ref(),
            ))
        }
        Command::Inject {
            file,
            fault,
            layer,
            params,
            tp,
            out,
            dtype,
            vllm_names,
        } => {
            let tp = *tp as usize;
            let fault: Fault = fault.parse().map_err(anyhow::Error::msg)?;
            fault.check_tp(tp).map_err(anyhow::Error::msg)?;
            let model = open(file)?;
            let cfg = ConfigReader::read(&model, glmcheck::arch::ARCH)?.config;
            let plan = ShardPlan::new(&model, &cfg, tp);
            if let Some(p) = plan.params.iter().find(|p| !p.problems.is_empty()) {
                anyhow::bail!(
                    "{} cannot be sharded at tp={tp}: {}",
                    p.param,
                    p.problems.join("; ")
                );
            }
            let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
            let dtype = match dtype.as_str() {
                "bf16" => safetensors::Dtype::BF16,
                "f16" => safetensors::Dtype::F16,
                _ => safetensors::Dtype::F32,
            };
            std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
            let inputs: Vec<&std::path::Path> =
                model.parts.iter().map(|p| p.path.as_path()).collect();
            let spec = shards::InjectSpec {
                fault: &fault,
                layer: *layer,
                params,
                dtype,
                names: match vllm_names {
                    VllmNamesArg::V033 => glmcheck::arch::glm_dsa::VllmNames::V033,
                    VllmNamesArg::Legacy => glmcheck::arch::glm_dsa::VllmNames::Legacy,
                },
            };
            let written = shards::inject(&w, &plan, &spec, out, &inputs)?;
            if !cli.quiet {
                eprintln!(
                    "glmcheck: wrote {} rank files to {} (fault {})",
                    written.len(),
                    out.display(),
                    fault.cause()
                );
            }
            Ok(Outcome::Ok)
        }
        Command::Forward {
            file,
            prompt,
            tokens,
            reference,
            dump,
            dsa,
            dtype,
            max_new_tokens,
            bench,
            tp,
            weights_from,
            tol,
            all,
            hf_config,
            json,
        } => {
            let dtype = ComputeDtype::parse(dtype).unwrap_or(ComputeDtype::F32);
            let dsa = if dsa == "dense" {
                DsaMode::Dense
            } else {
                DsaMode::Sparse
            };
            let model = open(file)?;
            // The architecture first: a file of another model is named as such before its
            // tokenizer, the tokens or a reference are looked at.
            let cfg = ConfigReader::read(&model, glmcheck::arch::ARCH)?.config;
            let hf = hf_config_check(hf_config.as_deref(), &model)?;
            let tokenizer = match (GgufTokenizer::from_gguf(&model), prompt) {
                (Ok(t), _) => Some(t),
                (Err(e), Some(_)) => return Err(e).context("--prompt needs the GGUF's tokenizer"),
                (Err(e), None) => {
                    if !cli.quiet {
                        eprintln!("glmcheck: warning: no token texts: {e}");
                    }
                    None
                }
            };
            let ids = match (prompt, tokens, &tokenizer) {
                (Some(p), _, Some(t)) => t.encode(p)?,
                (_, Some(s), _) => parse_tokens(s)?,
                _ => anyhow::bail!("give --prompt TEXT or --tokens IDS"),
            };
            if ids.is_empty() {
                anyhow::bail!("the prompt gives no tokens");
            }
            let ref_acts = match reference {
                Some(r) => {
                    let acts = Activations::load(r)?;
                    if let Some(rt) = &acts.tokens {
                        if *rt != ids {
                            anyhow::bail!(
                                "{} was made from tokens {:?}, this run has {:?}: pass --tokens {} to compare",
                                r.display(),
                                rt,
                                ids,
                                rt.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
                            );
                        }
                    }
                    Some(acts)
                }
                None => None,
            };
            let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
            let glm = Glm5::load_with(
                &w,
                ModelOptions {
                    dtype: dtype.candle(),
                    dsa,
                },
            )?;
            let weights = activations::weight_class(&model);
            let mut tol_weights = weights;
            let mut notes = Vec::new();
            let tp_model = match tp {
                Some(tp) => {
                    let tp = *tp as usize;
                    let plan = ShardPlan::new(&model, &cfg, tp);
                    let rank_dump = match weights_from {
                        Some(dir) => {
                            let d = RankDump::open(dir)?;
                            if d.tp() != tp {
                                anyhow::bail!(
                                    "{} holds rank files up to rank {}, but --tp is {tp}",
                                    dir.display(),
                                    d.tp().saturating_sub(1)
                                );
                            }
                            Some(d)
                        }
                        None => None,
                    };
                    let m = Glm5::sharded(&w, &plan, rank_dump.as_ref(), glm.options())?;
                    notes.push(match weights_from {
                        Some(dir) => format!(
                            "simulated tp={tp}: the ranks' weights from {}{}",
                            dir.display(),
                            if m.fallbacks().is_empty() {
                                String::new()
                            } else {
                                format!(
                                    " ({} parameter(s) absent there, cut from the GGUF: {})",
                                    m.fallbacks().len(),
                                    m.fallbacks().join(", ")
                                )
                            }
                        ),
                        None => format!(
                            "simulated tp={tp}: the ranks' shards cut from the GGUF as vLLM cuts them"
                        ),
                    });
                    Some(m)
                }
                None => None,
            };
            // What the reference's weights are: the flag, else the dump's own metadata.
            let mut ref_kind = match (tol.reference_weights, &ref_acts) {
                (Some(k), _) => k.lib(),
                (None, Some(a)) => activations::ReferenceWeights::of_dump(a, file, weights),
                (None, None) => activations::ReferenceWeights::Original,
            };
            // --tp without --reference: the truth is the unsharded forward of the same file, so
            // only summation order may differ (the weight noise is the same on both sides).
            let ref_acts = match (ref_acts, &tp_model) {
                (Some(r), _) => Some(r),
                (None, Some(_)) => {
                    let mut cap = glmcheck::model::VecCapture::new();
                    glm.forward(&ids, &mut cap)?;
                    let mut a =
                        Activations::from_capture(&cap, prompt.as_deref(), Default::default())?;
                    a.source = format!("the unsharded forward of {}", file.display());
                    tol_weights = glmcheck::gguf::GgmlType::F32;
                    ref_kind = activations::ReferenceWeights::Same;
                    Some(a)
                }
                (None, None) => None,
            };
            let spec = fwd::ForwardSpec {
                dtype,
                weights,
                max_new_tokens: *max_new_tokens,
                top: 5,
                gguf: file.display().to_string(),
                prompt: prompt.clone(),
                tolerances: Some(tol.apply(Tolerances::for_reference(
                    dtype,
                    tol_weights,
                    ref_kind,
                ))),
                bench: *bench,
                index_topk: cfg.index_topk,
            };
            let runner = tp_model.as_ref().unwrap_or(&glm);
            let mut outcome = fwd::run(runner, tokenizer.as_ref(), &ids, ref_acts.as_ref(), &spec)?;
            outcome.notes = notes;
            if let Some(c) = outcome.comparison.as_mut() {
                c.allow_incomparable = tol.allow_incomparable;
            }
            if let Some(out) = dump {
                let mut inputs: Vec<&std::path::Path> =
                    model.parts.iter().map(|p| p.path.as_path()).collect();
                if let Some(r) = reference {
                    inputs.push(r);
                }
                outcome.capture.save(out, &inputs)?;
                if !cli.quiet {
                    eprintln!(
                        "glmcheck: wrote {} captures to {}",
                        outcome.capture.tensors.len(),
                        out.display()
                    );
                }
            }
            emit_hf(
                cli,
                *json,
                &report::forward::forward_json(&outcome),
                hf.as_ref(),
                || report::forward::forward_text(&outcome, *all),
            )?;
            let o = match &outcome.comparison {
                Some(c) if c.verdict() != activations::CmpVerdict::WithinTolerance => {
                    Outcome::Finding
                }
                _ => Outcome::Ok,
            };
            Ok(hf_outcome(o, hf.as_ref()))
        }
        Command::Diff {
            reference,
            candidate,
            dtype,
            weights,
            tol,
            all,
            json,
        } => {
            let r = Activations::load(reference)?;
            let c = Activations::load(candidate)?;
            let (meta_dtype, meta_weights) = activations::profile_of(&c);
            let dtype = dtype
                .as_deref()
                .and_then(ComputeDtype::parse)
                .unwrap_or(meta_dtype);
            let weights = match weights {
                Some(w) => glmcheck::gguf::GgmlType::from_name(w)
                    .ok_or_else(|| anyhow::anyhow!("--weights: unknown GGML type `{w}`"))?,
                None => meta_weights,
            };
            // Two glmcheck dumps of the same GGUF hold the same weights; anything else is taken
            // as the originals unless the flag says otherwise.
            let ref_kind = tol
                .reference_weights
                .map(RefWeightsArg::lib)
                .unwrap_or_else(|| match c.metadata.get(activations::meta::GGUF) {
                    Some(g) => {
                        activations::ReferenceWeights::of_dump(&r, std::path::Path::new(g), weights)
                    }
                    None => activations::ReferenceWeights::Original,
                });
            let opts = activations::CompareOptions {
                tolerances: tol.apply(Tolerances::for_reference(dtype, weights, ref_kind)),
                index_topk: None,
            };
            let mut cmp = activations::compare(&r, &c, &opts)?;
            cmp.allow_incomparable = tol.allow_incomparable;
            emit(cli, *json, &report::forward::diff_json(&cmp), || {
                report::forward::comparison_text(&cmp, *all)
            })?;
            Ok(
                if cmp.verdict() != activations::CmpVerdict::WithinTolerance {
                    Outcome::Finding
                } else {
                    Outcome::Ok
                },
            )
        }
        Command::Completions { shell } => {
            let mut cmd = Cli::command();
            clap_complete::generate(*shell, &mut cmd, "glmcheck", &mut std::io::stdout());
            Ok(Outcome::Ok)
        }
    }
}

/// A byte-counting progress bar on stderr, hidden when quiet or when stderr is not a terminal.
fn progress(quiet: bool, total: u64) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {wide_msg}",
    ) {
        bar.set_style(style);
    }
    bar
}
