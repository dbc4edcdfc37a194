//! The `glmcheck` binary: parse flags, call the library's stages, map outcomes to exit codes
//! (0 ok, 1 finding, 2 unreadable or malformed input).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use glmcheck::gguf::GgufModel;
use glmcheck::inspect::InspectReport;
use glmcheck::{report, scan};

const AFTER_HELP: &str = "\
Exit codes: 0 ok, 1 a finding (problems, corruption), 2 unreadable or malformed input.

Examples:
  glmcheck inspect fixtures/tiny/tiny-Q4_K_M.gguf
  glmcheck inspect GLM-5-UD-Q4_K_XL-00001-of-00010.gguf --json
  glmcheck dequant fixtures/tiny/tiny-Q8_0.gguf --tensor 'blk.1.*'
  glmcheck completions bash > /etc/bash_completion.d/glmcheck";

#[derive(Parser)]
#[command(
    name = "glmcheck",
    version,
    about = "Find out why a GLM-5 (glm-dsa) deployment that loads fine still produces garbage",
    long_about = "glmcheck reads a GLM-5 GGUF exactly as llama.cpp wrote it, rebuilds every Hugging Face \
weight from it, and checks it against its own config: the ground floor for diffing what a deployment's \
ranks hold and compute.",
    after_help = AFTER_HELP
)]
struct Cli {
    /// More diagnostics on stderr (repeat for more).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors on stderr; no progress bars.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
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
        /// Print JSON: {"tensors": [{"name", "dtype", "shape", "absmax", "mean", "std", "nan", "inf", "seconds", "out_gbps"}]}.
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

/// What a command found, mapped to the exit code.
enum Outcome {
    Ok,
    Finding,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Finding) => ExitCode::from(1),
        Err(e) => {
            eprintln!("glmcheck: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value).context("writing JSON to stdout")?;
    writeln!(out).context("writing to stdout")?;
    Ok(())
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

fn run(cli: &Cli) -> anyhow::Result<Outcome> {
    match &cli.command {
        Command::Inspect {
            file,
            json,
            all_tensors,
        } => {
            let model = open(file)?;
            let report = InspectReport::build(&model)?;
            if *json {
                print_json(&report)?;
            } else {
                print_text(&report::inspect_text(&report, *all_tensors))?;
            }
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
            Ok(if report.problems.is_empty() {
                Outcome::Ok
            } else {
                Outcome::Finding
            })
        }
        Command::Dequant {
            file,
            tensors,
            repeat,
            json,
        } => {
            let model = open(file)?;
            let selected = scan::select(&model, tensors);
            if selected.is_empty() {
                anyhow::bail!("no tensor of {} matches {:?}", file.display(), tensors);
            }
            let total: u64 = selected.iter().map(|t| t.info.n_bytes).sum();
            let bar = progress(cli.quiet, total);
            let mut rows = Vec::with_capacity(selected.len());
            let mut buf = Vec::new();
            for t in selected {
                bar.set_message(t.info.name.clone());
                rows.push(scan::scan_tensor(t, *repeat, &mut buf));
                bar.inc(t.info.n_bytes);
            }
            bar.finish_and_clear();
            if *json {
                print_json(&serde_json::json!({ "file": file, "tensors": rows }))?;
            } else {
                print_text(&report::dequant_text(&rows))?;
            }
            let bad = rows
                .iter()
                .any(|r| r.error.is_some() || r.nan > 0 || r.inf > 0);
            Ok(if bad { Outcome::Finding } else { Outcome::Ok })
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
