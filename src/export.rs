//! `glmcheck export`: the GGUF's logical tensors, dequantized, as a Hugging Face checkpoint that
//! transformers' `GlmMoeDsaForCausalLM.from_pretrained` loads — so that transformers can be run (and
//! timed) on exactly the weights glmcheck's forward runs.
//!
//! What is written, in a directory:
//! - `model-0000i-of-0000N.safetensors`: every parameter of [`glm_dsa::hf_params`] under its
//!   checkpoint name (routed experts per expert, as zai-org's release stores them; transformers 5.23
//!   fuses them at load: `conversion_mapping.py` maps `glm_moe_dsa` to `qwen2_moe`'s converters,
//!   `mlp.experts.*.{gate,up}_proj.weight` → `experts.gate_up_proj`, `*.down_proj.weight` →
//!   `experts.down_proj`). Values are [`Weights::hf`]'s f32, rounded to bf16 (round to nearest even,
//!   as torch's `.to(torch.bfloat16)`) or kept as f32; `e_score_correction_bias` stays f32 whatever
//!   the dtype (the hub checkpoint stores it so, transformers keeps it in f32 —
//!   `_keep_in_fp32_modules_strict` — and glmcheck's forward routes with it in f32).
//! - `model.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map"}`) and
//!   `config.json` ([`config_json`]).
//!
//! The MTP (nextn) layers are not exported (transformers' main model never runs them). Memory is
//! bounded by one tensor: parameters are rebuilt one at a time, routed experts one expert at a time
//! (never a layer's stack in f32), and every shard's header is computed from the shapes first so
//! the values stream to disk in order. The directory is built beside the output under a temp name and
//! renamed into place at the end; the input is only read.

mod config_json;
mod safetensors_out;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use safetensors::Dtype;
use serde::Serialize;

pub use config_json::{config_json, SpecialIds};

use crate::arch::glm_dsa::{self, Idx, Role};
use crate::arch::Config;
use crate::gguf::GgufModel;
use crate::weights::{WeightError, Weights};

/// transformers' default `max_shard_size` ("5GB").
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The index file transformers looks for beside the shards.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The dtype of the exported weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportDtype {
    Bf16,
    F32,
}

impl ExportDtype {
    pub fn safetensors(self) -> Dtype {
        match self {
            ExportDtype::Bf16 => Dtype::BF16,
            ExportDtype::F32 => Dtype::F32,
        }
    }

    /// config.json's `dtype` (torch's name).
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::Bf16 => "bfloat16",
            ExportDtype::F32 => "float32",
        }
    }
}

/// Decoder layers `first..=last` of the GGUF (`--layers A..B`, both ends included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerRange {
    pub first: usize,
    pub last: usize,
}

impl LayerRange {
    pub fn count(self) -> usize {
        self.last + 1 - self.first
    }
}

impl FromStr for LayerRange {
    type Err = ExportError;

    /// `A..B` (inclusive) or a single layer `A`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ExportError::LayerSyntax(s.to_string());
        let num = |t: &str| t.trim().parse::<usize>().map_err(|_| bad());
        let (first, last) = match s.split_once("..") {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(s)?, num(s)?),
        };
        if first > last {
            return Err(bad());
        }
        Ok(LayerRange { first, last })
    }
}

/// What to export.
#[derive(Debug, Clone)]
pub struct ExportSpec {
    /// None: every decoder layer.
    pub layers: Option<LayerRange>,
    pub dtype: ExportDtype,
    /// Most tensor bytes in one shard (a larger single tensor gets a shard of its own).
    pub max_shard_bytes: u64,
    /// Replace an existing output.
    pub force: bool,
}

/// What was written (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    pub out: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of every file written (shards, index, config.json).
    pub bytes: u64,
    /// The files written, shards first.
    pub files: Vec<String>,
    pub dtype: ExportDtype,
    pub layers: LayersReport,
    pub seconds: f64,
}

/// Which decoder layers of the GGUF were exported (renumbered from 0 in the checkpoint).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LayersReport {
    pub first: usize,
    pub last: usize,
    pub count: usize,
    /// The GGUF's decoder layers (its MTP layers are never exported).
    pub of: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("expected A..B (decoder layers A to B, both included) or one layer A, found `{0}`")]
    LayerSyntax(String),
    #[error(
        "--layers {first}..{last}: the model has decoder layers 0..{} (both included; its MTP \
         layers are not exported)",
        .layers.saturating_sub(1)
    )]
    LayerRange {
        first: usize,
        last: usize,
        layers: usize,
    },
    #[error("{} exists (--force replaces it)", .0.display())]
    Exists(PathBuf),
    #[error("--hf {}: refusing to replace {}, an input of this command", .out.display(), .input.display())]
    OverInput { out: PathBuf, input: PathBuf },
    #[error("--max-shard-bytes must be at least 1")]
    ZeroShard,
    #[error(transparent)]
    Weight(#[from] WeightError),
    #[error("{param}: rebuilt as {found:?}, the checkpoint needs {expected:?}")]
    Shape {
        param: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{param}: {err}")]
    Values {
        param: String,
        err: candle_core::Error,
    },
    #[error("{}: {err}", .path.display())]
    Io { path: PathBuf, err: std::io::Error },
}

fn io_at(path: &Path) -> impl Fn(std::io::Error) -> ExportError + '_ {
    move |err| ExportError::Io {
        path: path.to_path_buf(),
        err,
    }
}

/// One tensor of the checkpoint: its name there, the model's HF parameter it holds (and the GGUF
/// tensors that parameter is rebuilt from), shape, dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub name: String,
    pub source: String,
    pub gguf: Vec<String>,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
}

impl Planned {
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * (self.dtype.bitsize() / 8) as u64
    }
}

/// One file of tensors.
#[derive(Debug, Clone)]
pub struct Shard {
    pub file: String,
    pub tensors: Vec<Planned>,
}

impl Shard {
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(Planned::bytes).sum()
    }
}

/// Everything that will be written, decided from the config alone.
#[derive(Debug, Clone)]
pub struct ExportPlan {
    /// The exported model's config (the layer subset, renumbered from 0, no MTP layers).
    pub config: Config,
    pub layers: LayerRange,
    pub shards: Vec<Shard>,
}

impl ExportPlan {
    pub fn tensors(&self) -> impl Iterator<Item = &Planned> {
        self.shards.iter().flat_map(|s| s.tensors.iter())
    }

    pub fn data_bytes(&self) -> u64 {
        self.shards.iter().map(Shard::data_bytes).sum()
    }
}

/// The config of decoder layers `r` of `c`, renumbered from 0: the same kinds of layers (the
/// leading dense ones stay a prefix) and no MTP layers.
pub fn subset_config(c: &Config, r: LayerRange) -> Config {
    let dense = c.first_k_dense_replace.clamp(r.first, r.last + 1) - r.first;
    Config {
        num_hidden_layers: r.count(),
        first_k_dense_replace: dense,
        num_nextn_predict_layers: 0,
        ..c.clone()
    }
}

/// The checkpoint's tensors for `spec`, in model order, cut into shards of at most
/// `spec.max_shard_bytes` (transformers' rule: a tensor that would overflow a shard starts the next).
pub fn plan(c: &Config, spec: &ExportSpec) -> Result<ExportPlan, ExportError> {
    if spec.max_shard_bytes == 0 {
        return Err(ExportError::ZeroShard);
    }
    let all = LayerRange {
        first: 0,
        last: c.num_hidden_layers.saturating_sub(1),
    };
    let r = spec.layers.unwrap_or(all);
    if c.num_hidden_layers == 0 || r.last >= c.num_hidden_layers {
        return Err(ExportError::LayerRange {
            first: r.first,
            last: r.last,
            layers: c.num_hidden_layers,
        });
    }
    let sub = subset_config(c, r);
    let mut groups: Vec<Vec<Planned>> = vec![Vec::new()];
    let mut filled = 0u64;
    for p in glm_dsa::hf_params(&sub) {
        let idx = Idx {
            layer: p.idx.layer.map(|l| l + r.first),
            expert: p.idx.expert,
        };
        let source = glm_dsa::name(p.def.hf, idx);
        let gguf = (p.def.gguf.iter().chain(p.def.legacy.iter()))
            .map(|s| glm_dsa::name(s.name, idx))
            .collect();
        // The router's correction bias stays f32 (see the module docs).
        let dtype = if p.def.role == Role::RouterBias {
            Dtype::F32
        } else {
            spec.dtype.safetensors()
        };
        let t = Planned {
            shape: p.shape(&sub),
            name: p.name,
            source,
            gguf,
            dtype,
        };
        let n = t.bytes();
        let open = groups.last().is_some_and(|g| !g.is_empty());
        if open && filled + n > spec.max_shard_bytes {
            groups.push(Vec::new());
            filled = 0;
        }
        filled += n;
        if let Some(g) = groups.last_mut() {
            g.push(t);
        }
    }
    let n = groups.len();
    let shards = groups
        .into_iter()
        .enumerate()
        .map(|(i, tensors)| Shard {
            file: format!("model-{:05}-of-{n:05}.safetensors", i + 1),
            tensors,
        })
        .collect();
    Ok(ExportPlan {
        config: sub,
        layers: r,
        shards,
    })
}

/// Where the export is in its work (for a progress display).
#[derive(Debug, Clone, Copy)]
pub enum Progress<'a> {
    /// `done` of `total` tensor bytes written; `tensor` is the one just written.
    Tensor {
        done: u64,
        total: u64,
        tensor: &'a str,
    },
    /// A file was completed.
    File { name: &'a str, bytes: u64 },
}

/// Writes the checkpoint of `model` to the directory `out` (see the module docs).
pub fn export(
    model: &GgufModel,
    cfg: &Config,
    spec: &ExportSpec,
    out: &Path,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<ExportReport, ExportError> {
    let start = Instant::now();
    let inputs: Vec<&Path> = model.parts.iter().map(|p| p.path.as_path()).collect();
    check_output(out, &inputs, spec.force)?;
    let plan = plan(cfg, spec)?;
    let config = config_json(&plan.config, spec.dtype, &SpecialIds::read(model));
    let weights = Weights::new(model, cfg, candle_core::Device::Cpu);
    let mut files = Vec::new();
    let mut bytes = 0u64;
    write_dir_atomically(out, spec.force, |dir| {
        let total = plan.data_bytes();
        let mut done = 0u64;
        for shard in &plan.shards {
            let path = dir.join(&shard.file);
            let n = write_shard(&path, shard, &weights, &mut |t: &Planned| {
                done += t.bytes();
                progress(Progress::Tensor {
                    done,
                    total,
                    tensor: &t.name,
                });
            })?;
            progress(Progress::File {
                name: &shard.file,
                bytes: n,
            });
            files.push(shard.file.clone());
            bytes += n;
        }
        for (name, value) in [
            (INDEX_FILE, safetensors_out::index_json(&plan)),
            ("config.json", config),
        ] {
            let path = dir.join(name);
            let mut text = serde_json::to_string_pretty(&value).map_err(|e| ExportError::Io {
                path: path.clone(),
                err: e.into(),
            })?;
            text.push('\n');
            std::fs::write(&path, &text).map_err(io_at(&path))?;
            progress(Progress::File {
                name,
                bytes: text.len() as u64,
            });
            files.push(name.to_string());
            bytes += text.len() as u64;
        }
        Ok(())
    })?;
    Ok(ExportReport {
        out: out.to_path_buf(),
        tensors: plan.tensors().count(),
        bytes,
        files,
        dtype: spec.dtype,
        layers: LayersReport {
            first: plan.layers.first,
            last: plan.layers.last,
            count: plan.layers.count(),
            of: cfg.num_hidden_layers,
        },
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Refuses an output that is (or holds) one of the input files, and an existing one without
/// `force`.
pub fn check_output(out: &Path, inputs: &[&Path], force: bool) -> Result<(), ExportError> {
    if let Ok(target) = std::fs::canonicalize(out) {
        for i in inputs {
            if std::fs::canonicalize(i).is_ok_and(|c| c.starts_with(&target)) {
                return Err(ExportError::OverInput {
                    out: out.to_path_buf(),
                    input: i.to_path_buf(),
                });
            }
        }
    }
    if std::fs::symlink_metadata(out).is_ok() && !force {
        return Err(ExportError::Exists(out.to_path_buf()));
    }
    Ok(())
}

/// Builds the directory under a temp name beside `out` (removed on failure or Ctrl-C), then renames
/// it into place, replacing an existing `out` only with `force`.
fn write_dir_atomically(
    out: &Path,
    force: bool,
    write: impl FnOnce(&Path) -> Result<(), ExportError>,
) -> Result<(), ExportError> {
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io_at(parent))?;
    }
    let tmp = crate::outputs::temp_for(out);
    crate::outputs::add_pending(&tmp);
    let result = std::fs::create_dir(&tmp)
        .map_err(io_at(&tmp))
        .and_then(|()| write(&tmp))
        .and_then(|()| replace(&tmp, out, force));
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    crate::outputs::forget_pending(&tmp);
    result
}

/// Renames `tmp` to `out`; an existing `out` (with `force`) is first moved aside, then removed.
fn replace(tmp: &Path, out: &Path, force: bool) -> Result<(), ExportError> {
    let Ok(meta) = std::fs::symlink_metadata(out) else {
        return std::fs::rename(tmp, out).map_err(io_at(out));
    };
    if !force {
        return Err(ExportError::Exists(out.to_path_buf()));
    }
    let mut old = crate::outputs::temp_for(out).into_os_string();
    old.push(".old");
    let old = PathBuf::from(old);
    std::fs::rename(out, &old).map_err(io_at(out))?;
    if let Err(err) = std::fs::rename(tmp, out) {
        let _ = std::fs::rename(&old, out);
        return Err(ExportError::Io {
            path: out.to_path_buf(),
            err,
        });
    }
    let removed = if meta.is_dir() {
        std::fs::remove_dir_all(&old)
    } else {
        std::fs::remove_file(&old)
    };
    removed.map_err(io_at(&old))
}

/// Writes one shard: its header from the planned shapes, then every tensor's values in order.
/// Returns the file's size.
fn write_shard(
    path: &Path,
    shard: &Shard,
    w: &Weights<'_>,
    written: &mut dyn FnMut(&Planned),
) -> Result<u64, ExportError> {
    let io = io_at(path);
    let header = safetensors_out::header(&shard.tensors);
    let file = std::fs::File::create(path).map_err(&io)?;
    let mut out = std::io::BufWriter::with_capacity(8 << 20, file);
    out.write_all(&header).map_err(&io)?;
    let mut buf = Vec::new();
    for t in &shard.tensors {
        let x = w.hf(&t.source)?;
        if x.dims() != t.shape.as_slice() {
            return Err(ExportError::Shape {
                param: t.source.clone(),
                expected: t.shape.clone(),
                found: x.dims().to_vec(),
            });
        }
        // Encoded a chunk at a time: the f32 tensor is the only whole copy held.
        safetensors_out::with_values(&x, |v| {
            v.chunks(safetensors_out::CHUNK_VALUES).try_for_each(|c| {
                safetensors_out::encode_into(t.dtype, c, &mut buf);
                out.write_all(&buf)
            })
        })
        .map_err(|err| ExportError::Values {
            param: t.source.clone(),
            err,
        })?
        .map_err(&io)?;
        written(t);
        // The GGUF's pages go as soon as they are decoded (a stack's after each expert: the next
        // expert's are not mapped yet), so the process holds one tensor, not the file.
        for g in &t.gguf {
            if let Some(src) = w.model.tensor(g) {
                src.release();
            }
        }
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    let size = file.metadata().map_err(&io)?.len();
    let planned = header.len() as u64 + shard.data_bytes();
    if size != planned {
        return Err(io(std::io::Error::other(format!(
            "{size} bytes written, {planned} planned"
        ))));
    }
    Ok(size)
}

#[cfg(test)]
mod tests;
