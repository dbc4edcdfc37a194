//! The `glmcheck` binary: parse flags, dispatch to a command of [`glmcheck::cmd`], map its typed
//! outcome to the exit code (0 ok, 1 finding, 2 unreadable or malformed input).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use glmcheck::cmd::{self, Ctx, Outcome};

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
  glmcheck gate model.gguf --reference ref.safetensors --junit gate.xml   # 0 pass, 1 fail, 125 cannot evaluate
  glmcheck bisect model.gguf --patches patches.toml --prompt 'What is 2+2?'  # which loader patch broke it
  glmcheck synth --dims glm5 --layers 3 --qtype q4_k_m --out /scratch/glm5-3l.gguf
  glmcheck export fixtures/tiny/tiny-F32.gguf --hf /tmp/tiny-hf --dtype f32
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

/// The commands; each one's flags, help and behaviour live in `glmcheck::cmd::<command>`.
#[derive(Subcommand)]
enum Command {
    Inspect(cmd::inspect::InspectArgs),
    Dequant(cmd::dequant::DequantArgs),
    Shards(cmd::shards::ShardsArgs),
    Inject(cmd::inject::InjectArgs),
    Forward(cmd::forward::ForwardArgs),
    Gate(cmd::gate::GateArgs),
    Bisect(cmd::bisect::BisectArgs),
    Diff(cmd::diff::DiffArgs),
    Synth(cmd::synth::SynthArgs),
    Export(cmd::export::ExportArgs),
    Completions(cmd::completions::CompletionsArgs),
}

impl Command {
    /// The paths the command reads (a `--report` is never written over one).
    fn inputs(&self) -> Vec<PathBuf> {
        match self {
            Command::Inspect(a) => a.inputs(),
            Command::Dequant(a) => a.inputs(),
            Command::Shards(a) => a.inputs(),
            Command::Inject(a) => a.inputs(),
            Command::Forward(a) => a.inputs(),
            Command::Gate(a) => a.inputs(),
            Command::Bisect(a) => a.inputs(),
            Command::Diff(a) => a.inputs(),
            Command::Synth(_) => Vec::new(),
            Command::Export(a) => a.inputs(),
            Command::Completions(_) => Vec::new(),
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<Outcome> {
    let ctx = Ctx {
        verbose: cli.verbose,
        quiet: cli.quiet,
        report: cli.report.clone(),
        inputs: cli.command.inputs(),
    };
    match &cli.command {
        Command::Inspect(a) => cmd::inspect::run(a, &ctx),
        Command::Dequant(a) => cmd::dequant::run(a, &ctx),
        Command::Shards(a) => cmd::shards::run(a, &ctx),
        Command::Inject(a) => cmd::inject::run(a, &ctx),
        Command::Forward(a) => cmd::forward::run(a, &ctx),
        Command::Gate(a) => cmd::gate::run(a, &ctx),
        Command::Bisect(a) => cmd::bisect::run(a, &ctx),
        Command::Diff(a) => cmd::diff::run(a, &ctx),
        Command::Synth(a) => cmd::synth::run(a, &ctx),
        Command::Export(a) => cmd::export::run(a, &ctx),
        Command::Completions(a) => cmd::completions::run(a, Cli::command()),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sample_anon_rss();
    for (name, value, takes) in
        glmcheck::model::knobs::unrecognised(glmcheck::model::knobs::env_var)
    {
        eprintln!(
            "{}",
            glmcheck::report::notes::setting_warning(name, &value, &takes)
        );
    }
    // Ctrl-C: remove the temp files of writes in flight (no partial report or dump is ever left).
    let _ = ctrlc::set_handler(|| {
        glmcheck::outputs::remove_pending();
        eprintln!("glmcheck: interrupted");
        std::process::exit(130);
    });
    let code = match run(&cli) {
        Ok(o) => ExitCode::from(o.exit_code()),
        Err(e) => {
            eprintln!("glmcheck: error: {e:#}");
            ExitCode::from(2)
        }
    };
    report_peak_rss();
    code
}

/// The largest anonymous resident memory (`RssAnon`, KiB) seen by [`sample_anon_rss`].
static PEAK_ANON_KIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn status_kib(status: &str, key: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
}

/// With `GLMCHECK_PEAK_RSS=1`, samples `RssAnon` every 5 ms: the kernel keeps a peak only of the
/// whole RSS, which counts the GGUF's mapped pages too.
fn sample_anon_rss() {
    if std::env::var_os("GLMCHECK_PEAK_RSS").is_none() {
        return;
    }
    std::thread::spawn(|| loop {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        if let Some(kib) = status_kib(&status, "RssAnon:") {
            PEAK_ANON_KIB.fetch_max(kib, std::sync::atomic::Ordering::Relaxed);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    });
}

/// With `GLMCHECK_PEAK_RSS=1`, prints this process's peak resident memory (`VmHWM`) on stderr
/// at exit. A parent's `wait4` cannot measure it: on Linux a spawned child's `ru_maxrss` starts
/// from the spawning process's own peak (the memory-budget tests spawn from a large test runner).
fn report_peak_rss() {
    if std::env::var_os("GLMCHECK_PEAK_RSS").is_none() {
        return;
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if let Some(kib) = status_kib(&status, "VmHWM:") {
        eprintln!("glmcheck: peak RSS {kib} KiB");
    }
    let anon = PEAK_ANON_KIB.load(std::sync::atomic::Ordering::Relaxed);
    if anon > 0 {
        eprintln!(
            "glmcheck: peak anonymous RSS {anon} KiB (sampled every 5 ms; mapped file pages aside)"
        );
    }
}
