//! `glmcheck inject`: write the per-rank dump a loader with a known bug would hold.

use std::path::PathBuf;

use anyhow::Context;

use super::args::{DumpDtype, VllmNamesArg};
use super::{open, CmdError, Ctx, Loaded, Outcome};
use crate::faults::Fault;
use crate::{report, shards};

/// Write the per-rank dump that a loader with a known bug would hold (or the correct one).
#[derive(clap::Args, Debug)]
#[command(after_help = after_help())]
pub struct InjectArgs {
    /// The GGUF file (or any part of a split set).
    pub file: PathBuf,
    /// The loader bug to reproduce.
    #[arg(long, required_unless_present = "patches")]
    pub fault: Option<String>,
    /// Several weight faults at once, as `bisect` reads them ([[patch]] fault = NAME,
    /// layers = [..]): the dump a loader with that pile of patches would hold (the last patch
    /// that hits a parameter gives it its fault).
    #[arg(long, value_name = "PATCHES.toml", conflicts_with_all = ["fault", "layer", "params"])]
    pub patches: Option<PathBuf>,
    /// Only this layer's parameters get the bug.
    #[arg(long)]
    pub layer: Option<usize>,
    /// Only parameters matching this glob get the bug (default: the ones the bug hits); repeatable.
    #[arg(long = "param", value_name = "GLOB")]
    pub params: Vec<String>,
    /// Tensor-parallel degree.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=4096))]
    pub tp: u16,
    /// Output directory (created; rank<r>.safetensors are written into it).
    #[arg(long)]
    pub out: PathBuf,
    /// dtype of the dumped tensors.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DumpDtype,
    /// Parameter names as this vLLM version writes them (0.33: routed experts under
    /// `mlp.experts.routed_experts.*`; legacy: `mlp.experts.w13_weight`).
    #[arg(long, value_enum, default_value = "0.33")]
    pub vllm_names: VllmNamesArg,
}

/// `inject --help`'s epilogue: the fault table's list, then examples.
fn after_help() -> String {
    format!(
        "{}

Examples:
  glmcheck inject --fault kvb-concat --layer 1 --tp 8 --out /tmp/bad fixtures/tiny/tiny-F32.gguf
  glmcheck shards fixtures/tiny/tiny-F32.gguf --tp 8 --against /tmp/bad
  glmcheck inject --fault none --tp 2 --dtype bf16 --out /tmp/good model.gguf
  glmcheck inject --patches patches.toml --tp 4 --out /tmp/patched model.gguf",
        report::fault_list_help()
    )
}

impl InjectArgs {
    /// The paths this command reads.
    pub fn inputs(&self) -> Vec<PathBuf> {
        std::iter::once(self.file.clone())
            .chain(self.patches.clone())
            .collect()
    }
}

pub fn run(a: &InjectArgs, ctx: &Ctx) -> anyhow::Result<Outcome> {
    let tp = a.tp as usize;
    let fault: Fault = a.fault.as_deref().unwrap_or("none").parse()?;
    fault.check_weight()?;
    fault.check_tp(tp)?;
    let l = Loaded::new(open(&a.file)?)?;
    let patches = match &a.patches {
        Some(p) => {
            let ps = super::bisect::read_patches(p, tp, l.cfg.num_hidden_layers)?;
            for x in &ps {
                x.fault.check_weight()?;
            }
            Some(ps)
        }
        None => None,
    };
    let plan = l.plan(tp);
    if let Some(p) = plan.params.iter().find(|p| !p.problems.is_empty()) {
        return Err(CmdError::Unshardable {
            param: p.param.clone(),
            tp,
            problems: p.problems.iter().map(|x| x.to_string()).collect(),
        }
        .into());
    }
    let w = l.weights();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let spec = shards::InjectSpec {
        fault: &fault,
        layer: a.layer,
        params: &a.params,
        dtype: a.dtype.into(),
        names: a.vllm_names.into(),
    };
    let written = match &patches {
        Some(ps) => {
            let refs: Vec<&crate::bisect::Patch> = ps.iter().collect();
            shards::inject_with(&w, &plan, &spec, &a.out, &l.parts(), &|p| {
                crate::bisect::fault_of(&refs, p)
            })?
        }
        None => shards::inject(&w, &plan, &spec, &a.out, &l.parts())?,
    };
    if !ctx.quiet {
        let line = match &patches {
            Some(ps) => report::injected_patches(written.len(), &a.out, ps),
            None => report::injected(written.len(), &a.out, &fault),
        };
        eprintln!("{line}");
    }
    Ok(Outcome::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(fault: &str, tp: u16, dtype: DumpDtype, out: &std::path::Path) -> InjectArgs {
        InjectArgs {
            file: std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("fixtures/tiny/tiny-F32.gguf"),
            fault: Some(fault.into()),
            patches: None,
            layer: None,
            params: Vec::new(),
            tp,
            out: out.to_path_buf(),
            dtype,
            vllm_names: VllmNamesArg::V033,
        }
    }

    fn quiet() -> Ctx {
        Ctx {
            quiet: true,
            ..Ctx::default()
        }
    }

    #[test]
    fn every_dump_dtype_is_honoured() {
        for (arg, want) in [
            (DumpDtype::F32, safetensors::Dtype::F32),
            (DumpDtype::Bf16, safetensors::Dtype::BF16),
            (DumpDtype::F16, safetensors::Dtype::F16),
        ] {
            let dir = tempfile::tempdir().expect("tempdir");
            let out = dir.path().join("dump");
            assert_eq!(
                run(&args("none", 2, arg, &out), &quiet()).expect("inject"),
                Outcome::Ok
            );
            for r in 0..2 {
                let bytes =
                    std::fs::read(out.join(format!("rank{r}.safetensors"))).expect("rank file");
                let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
                assert!(st.len() > 10);
                for (name, t) in st.tensors() {
                    assert_eq!(t.dtype(), want, "{name} at rank {r}");
                }
            }
        }
    }

    #[test]
    fn a_bad_fault_writes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("dump");
        let e = run(&args("rank-swap:0,2", 2, DumpDtype::F32, &out), &quiet()).unwrap_err();
        assert_eq!(e.to_string(), "rank-swap:0,2 needs tp > 2");
        let e = run(&args("kvb", 2, DumpDtype::F32, &out), &quiet()).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("unknown fault `kvb`; known: none, "),
            "{e}"
        );
        assert!(!out.exists());
    }
}
