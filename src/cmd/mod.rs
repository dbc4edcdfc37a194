//! The commands: each file parses nothing (clap did), calls the library's stages and returns a
//! typed [`Outcome`]; the binary maps it to the exit code (0 ok, 1 finding, 2 unreadable or
//! malformed input, which is every `Err`).
//!
//! How to add a command: a file here with a `#[derive(clap::Args)]` struct (its doc comment is the
//! command's help; `after_help` its examples and exit codes), an `inputs()` listing what it reads
//! (a `--report` is never written over those), and `run(&Args, &Ctx) -> anyhow::Result<Outcome>`
//! that calls the stages, hands the result to [`output::emit`] with a renderer from
//! `crate::report`, and turns the stage's typed verdict into an [`Outcome`]; then one variant in
//! the binary's `Command` enum and one arm in its dispatch.

// The Args structs' doc comments are clap's --help text, where `rank<r>.safetensors` is literal.
#![allow(rustdoc::invalid_html_tags)]

pub mod args;
pub mod bisect;
pub mod completions;
pub mod dequant;
pub mod diff;
mod error;
pub mod export;
pub mod forward;
pub mod gate;
pub mod inject;
pub mod inspect;
pub mod output;
pub mod shards;
pub mod synth;

use std::path::{Path, PathBuf};

pub use error::CmdError;

use crate::arch::config::ConfigReader;
use crate::arch::hf_config::{self, HfConfig, HfConfigCheck};
use crate::arch::Config;
use crate::compare::CmpVerdict;
use crate::gguf::GgufModel;
use crate::plan::ShardPlan;
use crate::weights::Weights;

/// What a command found; [`Outcome::exit_code`] is the one place it becomes an exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing wrong (exit 0).
    Ok,
    /// A finding: problems, corruption, divergence, a config that changes what vLLM computes (exit 1).
    Finding,
    /// `gate` could not evaluate its inputs (exit 125: `git bisect run` skips the commit).
    CannotEvaluate,
}

impl Outcome {
    /// The process exit code of this outcome (an error, exit 2, never reaches an `Outcome`).
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::Ok => 0,
            Outcome::Finding => 1,
            Outcome::CannotEvaluate => 125,
        }
    }

    /// `Finding` when `found`, else `Ok`.
    pub fn finding_if(found: bool) -> Self {
        if found {
            Outcome::Finding
        } else {
            Outcome::Ok
        }
    }

    /// This outcome, made a finding by an `--hf-config` check that fails.
    pub fn with_hf(self, hf: Option<&HfConfigCheck>) -> Self {
        if hf.is_some_and(HfConfigCheck::fails) {
            Outcome::Finding
        } else {
            self
        }
    }
}

impl From<crate::shards::Verdict> for Outcome {
    fn from(v: crate::shards::Verdict) -> Self {
        Outcome::finding_if(v != crate::shards::Verdict::Pass)
    }
}

impl From<CmpVerdict> for Outcome {
    fn from(v: CmpVerdict) -> Self {
        Outcome::finding_if(v != CmpVerdict::WithinTolerance)
    }
}

/// What every command gets from the global flags.
#[derive(Debug, Clone, Default)]
pub struct Ctx {
    pub verbose: u8,
    /// Only errors on stderr; no progress bars.
    pub quiet: bool,
    /// `--report FILE`: also write the JSON report there.
    pub report: Option<PathBuf>,
    /// The files and directories the command reads (a report is never written over one).
    pub inputs: Vec<PathBuf>,
}

/// Opens a GGUF (or a split set from any of its parts).
pub fn open(file: &Path) -> anyhow::Result<GgufModel> {
    Ok(GgufModel::open(file)?)
}

/// A GGUF with its GLM-5 config read: the start of the chain config → plan → weights that
/// `shards`, `inject` and `forward` share.
pub struct Loaded {
    pub model: GgufModel,
    pub cfg: Config,
}

impl Loaded {
    /// Reads the GLM-5 config of `model` (an error for a file of another architecture).
    pub fn new(model: GgufModel) -> anyhow::Result<Self> {
        let cfg = ConfigReader::read(&model, crate::arch::ARCH)?.config;
        Ok(Loaded { model, cfg })
    }

    /// vLLM's tensor-parallel cut of every parameter at `tp`.
    pub fn plan(&self, tp: usize) -> ShardPlan {
        ShardPlan::new(&self.model, &self.cfg, tp)
    }

    /// The logical (HF) weights, dequantized on the CPU on demand.
    pub fn weights(&self) -> Weights<'_> {
        self.weights_on(candle_core::Device::Cpu)
    }

    /// The logical (HF) weights, dequantized on the CPU and placed on `device`.
    pub fn weights_on(&self, device: candle_core::Device) -> Weights<'_> {
        Weights::new(&self.model, &self.cfg, device)
    }

    /// The files of the GGUF (every part of a split set).
    pub fn parts(&self) -> Vec<&Path> {
        self.model.parts.iter().map(|p| p.path.as_path()).collect()
    }
}

/// `--hf-config`: the deployment's config.json against this GGUF's config (None without the flag).
pub fn hf_config_check(
    path: Option<&Path>,
    model: &GgufModel,
) -> anyhow::Result<Option<HfConfigCheck>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let hf = HfConfig::read(path)?;
    let cr = ConfigReader::read(model, crate::arch::ARCH)?;
    Ok(Some(hf_config::check(&hf, &cr.config, &cr.sources)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_map_to_exit_codes() {
        assert_eq!(Outcome::Ok.exit_code(), 0);
        assert_eq!(Outcome::Finding.exit_code(), 1);
        assert_eq!(Outcome::CannotEvaluate.exit_code(), 125);
        assert_eq!(Outcome::finding_if(true), Outcome::Finding);
        assert_eq!(Outcome::finding_if(false), Outcome::Ok);
    }

    #[test]
    fn only_a_pass_or_within_tolerance_is_ok() {
        use crate::shards::Verdict;
        assert_eq!(Outcome::from(Verdict::Pass), Outcome::Ok);
        assert_eq!(Outcome::from(Verdict::Fail), Outcome::Finding);
        assert_eq!(Outcome::from(Verdict::Incomplete), Outcome::Finding);
        assert_eq!(Outcome::from(CmpVerdict::WithinTolerance), Outcome::Ok);
        assert_eq!(Outcome::from(CmpVerdict::Diverged), Outcome::Finding);
        assert_eq!(Outcome::from(CmpVerdict::Incomplete), Outcome::Finding);
    }

    #[test]
    fn no_hf_check_leaves_the_outcome() {
        assert_eq!(Outcome::Ok.with_hf(None), Outcome::Ok);
        assert_eq!(Outcome::Finding.with_hf(None), Outcome::Finding);
    }

    #[test]
    fn the_chain_reads_a_glm5_file_and_refuses_a_missing_one() {
        let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-F32.gguf");
        let l = Loaded::new(open(&f).expect("fixture")).expect("glm-dsa");
        assert_eq!(l.plan(2).tp, 2);
        assert_eq!(l.parts(), vec![f.as_path()]);
        assert!(open(Path::new("/nonexistent/x.gguf")).is_err());
    }
}
