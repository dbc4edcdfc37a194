//! `inspect`: what a GGUF holds, under GLM-5's names, and whether it agrees with its own config.
//! Reads headers only; its time does not grow with file size.

use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use crate::arch::config::{ConfigReader, Source};
use crate::arch::glm_dsa::{self, Idx, Rebuild};
use crate::arch::{Config, ARCH};
use crate::gguf::{GgmlType, GgufError, GgufModel, Value};

#[derive(Debug, Clone, Serialize)]
pub struct FileSummary {
    pub path: String,
    pub bytes: u64,
    pub gguf_version: u32,
    pub tensors: usize,
    pub alignment: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct TypeSummary {
    pub dtype: GgmlType,
    pub tensors: usize,
    pub elements: u64,
    pub bytes: u64,
    pub dequantizable: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct TensorRow {
    pub name: String,
    pub dtype: GgmlType,
    /// PyTorch order (outermost first).
    pub shape: Vec<usize>,
    /// ggml order (innermost first), as stored.
    pub ne: Vec<u64>,
    pub bytes: u64,
    /// The HF parameter(s) this tensor becomes, when it is one of GLM-5's.
    pub hf: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TokenizerSummary {
    pub model: Option<String>,
    pub pre: Option<String>,
    pub tokens: usize,
    pub merges: usize,
    pub special: BTreeMap<String, SpecialToken>,
    pub chat_template: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct SpecialToken {
    pub id: u64,
    pub text: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProblemKind {
    Arch,
    /// A metadata key that disagrees with the tensors (the tensors decide).
    Metadata,
    Missing,
    Unexpected,
    WrongShape,
}

/// What one problem is, with its numbers; [`crate::report::inspect_problem`] says it in words
/// (the JSON's `message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// A file of another architecture: inventoried only.
    ForeignArch { arch: String },
    /// No `general.architecture`: read as glm-dsa.
    NoArch,
    /// `nextn_predict_layers` disagrees with the trailing blocks holding nextn tensors.
    MtpKey {
        key_says: usize,
        blocks: Vec<usize>,
        decoder_layers: usize,
    },
    /// nextn tensors in blocks that are not trailing MTP blocks.
    StrayNextn {
        blocks: Vec<usize>,
        block_count: usize,
    },
    /// An expected tensor is absent (for this HF parameter).
    Missing { for_param: String },
    /// A tensor's shape is not the config's (for this HF parameter).
    WrongShape { for_param: String },
    /// A run of layers with no tensor at all, and how many the config expects there.
    AbsentLayers {
        first: usize,
        last: usize,
        expected: usize,
    },
    /// A tensor of a block past the file's block count.
    PastBlockCount {
        block: usize,
        block_count: usize,
        decoder_layers: usize,
        mtp_layers: usize,
    },
    /// A tensor name no table knows.
    Unknown,
}

#[derive(Debug, Clone)]
pub struct Problem {
    pub kind: ProblemKind,
    pub tensor: Option<String>,
    pub expected: Option<Vec<usize>>,
    pub found: Option<Vec<usize>>,
    pub cause: Cause,
}

#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    pub files: Vec<FileSummary>,
    pub arch: String,
    /// The GLM-5 config read from `glm-dsa.*` keys; None for a file of another architecture (its
    /// tensors are inventoried, nothing of GLM-5 is assumed of it).
    pub config: Option<Config>,
    /// Config fields whose metadata key is missing: GLM-5's default was used.
    pub defaulted: Vec<String>,
    pub config_sources: BTreeMap<String, Source>,
    pub tensor_count: usize,
    pub total_bytes: u64,
    pub types: Vec<TypeSummary>,
    pub tokenizer: Option<TokenizerSummary>,
    pub tensors: Vec<TensorRow>,
    pub problems: Vec<Problem>,
    /// Things worth knowing that are not wrong (ignored MTP tensors, undecodable types).
    pub notes: Vec<String>,
}

impl InspectReport {
    pub fn build(model: &GgufModel) -> Result<Self, GgufError> {
        let (arch, mut problems) = architecture(model)?;
        let foreign = !arch.is_empty() && arch != ARCH;
        let cr = if foreign {
            None
        } else {
            Some(ConfigReader::read(model, ARCH)?)
        };
        let config = cr.as_ref().map(|c| c.config.clone());
        let defaulted = cr
            .as_ref()
            .map(|c| {
                c.defaulted()
                    .iter()
                    .map(|(f, k)| format!("{f} ({k})"))
                    .collect()
            })
            .unwrap_or_default();
        let config_sources = cr
            .as_ref()
            .map(|c| c.sources.iter().cloned().collect())
            .unwrap_or_default();
        let (types, tensors, total_bytes) = inventory(model, foreign);
        let notes = types
            .iter()
            .filter(|t| !t.dequantizable)
            .map(|ts| {
                format!(
                    "{} tensor(s) of type {} are inventoried but cannot be dequantized by glmcheck",
                    ts.tensors, ts.dtype
                )
            })
            .collect();
        let mut report = InspectReport {
            files: file_summaries(model),
            arch,
            config: config.clone(),
            defaulted,
            config_sources,
            tensor_count: model.tensor_count(),
            total_bytes,
            types,
            tokenizer: tokenizer_summary(model),
            tensors,
            problems: Vec::new(),
            notes,
        };
        if let Some((cr, config)) = cr.zip(config) {
            problems.extend(mtp_problems(&cr, &config));
            let (shape_problems, shape_notes) = check_tensors(model, &config);
            problems.extend(shape_problems);
            report.notes.extend(shape_notes);
        }
        report.problems = problems;
        Ok(report)
    }
}

/// `general.architecture` (empty when absent), with the problem it makes when it is not glm-dsa.
fn architecture(model: &GgufModel) -> Result<(String, Vec<Problem>), GgufError> {
    let arch = match model.value("general.architecture") {
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            let e = model.get_meta("general.architecture");
            return Err(GgufError::invalid(
                model.path(),
                "metadata `general.architecture`",
                e.map_or(0, |e| e.offset),
                format!("must be a string, found {}", v.type_name()),
            ));
        }
        None => String::new(),
    };
    let mut problems = Vec::new();
    let foreign = !arch.is_empty() && arch != ARCH;
    if foreign {
        problems.push(Problem {
            kind: ProblemKind::Arch,
            tensor: None,
            expected: None,
            found: None,
            cause: Cause::ForeignArch { arch: arch.clone() },
        });
    } else if arch.is_empty() {
        problems.push(Problem {
            kind: ProblemKind::Arch,
            tensor: None,
            expected: None,
            found: None,
            cause: Cause::NoArch,
        });
    }
    Ok((arch, problems))
}

fn file_summaries(model: &GgufModel) -> Vec<FileSummary> {
    model
        .parts
        .iter()
        .map(|p| FileSummary {
            path: p.path.display().to_string(),
            bytes: p.file_size,
            gguf_version: p.version,
            tensors: p.tensors.len(),
            alignment: p.alignment,
        })
        .collect()
}

/// Per-type totals, one row per tensor (with its HF name for a glm-dsa file), and the bytes.
fn inventory(model: &GgufModel, foreign: bool) -> (Vec<TypeSummary>, Vec<TensorRow>, u64) {
    let mut by_type: BTreeMap<u32, TypeSummary> = BTreeMap::new();
    let mut tensors = Vec::with_capacity(model.tensor_count());
    let mut total_bytes = 0;
    for t in model.tensors() {
        let i = t.info;
        let ts = by_type.entry(i.dtype.id).or_insert(TypeSummary {
            dtype: i.dtype,
            tensors: 0,
            elements: 0,
            bytes: 0,
            dequantizable: i.dtype.dequantizable(),
        });
        ts.tensors += 1;
        ts.elements += i.n_elements();
        ts.bytes += i.n_bytes;
        total_bytes += i.n_bytes;
        let hf = if foreign {
            None
        } else {
            glm_dsa::lookup_gguf(&i.name)
                .map(|(d, _, idx)| match d.rebuild {
                    Rebuild::ExpertSlice => glm_dsa::name(d.hf, idx).replace("{E}", "*"),
                    _ => glm_dsa::name(d.hf, idx),
                })
                .or_else(|| glm_dsa::lookup_mtp(&i.name).map(|(d, idx)| glm_dsa::name(d.hf, idx)))
        };
        tensors.push(TensorRow {
            name: i.name.clone(),
            dtype: i.dtype,
            shape: i.torch_shape(),
            ne: i.ne.clone(),
            bytes: i.n_bytes,
            hf,
        });
    }
    (by_type.into_values().collect(), tensors, total_bytes)
}

/// The MTP block count the metadata states against the one the tensors show, and stray nextn
/// tensors.
fn mtp_problems(cr: &crate::arch::config::ConfigReport, config: &Config) -> Vec<Problem> {
    let mut problems = Vec::new();
    if let Some(k) = cr.mtp.key_disagrees() {
        problems.push(Problem {
            kind: ProblemKind::Metadata,
            tensor: None,
            expected: None,
            found: None,
            cause: Cause::MtpKey {
                key_says: k,
                blocks: cr.mtp.blocks.clone(),
                decoder_layers: config.num_hidden_layers,
            },
        });
    }
    if !cr.mtp.stray.is_empty() {
        problems.push(Problem {
            kind: ProblemKind::Unexpected,
            tensor: None,
            expected: None,
            found: None,
            cause: Cause::StrayNextn {
                blocks: cr.mtp.stray.clone(),
                block_count: config.gguf_block_count(),
            },
        });
    }
    problems
}

/// Every tensor against the config: missing, unexpected, wrong shape.
pub fn check_tensors(model: &GgufModel, c: &Config) -> (Vec<Problem>, Vec<String>) {
    let mut check = TensorCheck {
        model,
        c,
        problems: Vec::new(),
        expected: HashSet::new(),
    };
    // Layers with no tensor at all (a block_count that overstates the file, a part of a split set
    // made for another model) are one problem per run of layers, not one per tensor.
    let present_layers: HashSet<usize> = model
        .tensors()
        .filter_map(|t| glm_dsa::gguf_layer(&t.info.name))
        .collect();
    let mut absent: Option<(usize, usize, usize)> = None; // (first, last, tensors expected)
    let layers = std::iter::once(None).chain((0..c.gguf_block_count()).map(Some));
    for layer in layers {
        if let Some(l) = layer.filter(|l| !present_layers.contains(l)) {
            let n: usize = glm_dsa::HF_TABLE
                .iter()
                .filter(|d| check.applies(d, layer))
                .map(|d| d.gguf.len())
                .sum();
            absent = match absent {
                Some((a, _, m)) => Some((a, l, m + n)),
                None => Some((l, l, n)),
            };
            continue;
        }
        check.problems.extend(absent.take().map(absent_layers));
        check.layer(layer);
    }
    check.problems.extend(absent.take().map(absent_layers));
    let mut problems = check.problems;
    problems.extend(unexpected_tensors(model, c, &check.expected));
    let mut notes = Vec::new();
    if c.num_nextn_predict_layers > 0 {
        let blocks: Vec<usize> = (c.num_hidden_layers..c.gguf_block_count()).collect();
        let n = model
            .tensors()
            .filter(|t| glm_dsa::gguf_layer(&t.info.name).is_some_and(|l| c.is_mtp_layer(l)))
            .count();
        notes.push(format!(
            "block(s) {} hold the MTP (nextn) layer ({n} tensors): inventoried and shape-checked, \
             not part of the served model or the forward",
            block_list(&blocks)
        ));
    }
    (problems, notes)
}

/// The expected tensors checked so far, and what was wrong with them.
struct TensorCheck<'m> {
    model: &'m GgufModel,
    c: &'m Config,
    problems: Vec<Problem>,
    expected: HashSet<String>,
}

impl TensorCheck<'_> {
    /// Whether the name table's parameter `d` exists in `layer` (None: the globals).
    fn applies(&self, d: &glm_dsa::HfDef, layer: Option<usize>) -> bool {
        let in_scope = match layer {
            None => d.scope == glm_dsa::Scope::Global,
            Some(l) => d.scope.has_layer(self.c, l),
        };
        in_scope && !(d.role == glm_dsa::Role::LmHead && self.c.tie_word_embeddings)
    }

    /// One expected tensor: present, with the shape the config implies.
    fn check(&mut self, tensor: String, shape: Vec<usize>, for_param: &dyn Fn() -> String) {
        match self.model.tensor(&tensor) {
            None => self.problems.push(Problem {
                kind: ProblemKind::Missing,
                cause: Cause::Missing {
                    for_param: for_param(),
                },
                tensor: Some(tensor.clone()),
                expected: Some(shape),
                found: None,
            }),
            Some(t) => {
                let found = t.info.torch_shape();
                if found != shape {
                    self.problems.push(Problem {
                        kind: ProblemKind::WrongShape,
                        cause: Cause::WrongShape {
                            for_param: for_param(),
                        },
                        tensor: Some(tensor.clone()),
                        expected: Some(shape),
                        found: Some(found),
                    });
                }
            }
        }
        self.expected.insert(tensor);
    }

    /// Every tensor of one layer (None: the globals); an MTP block is a full MoE layer plus its
    /// nextn.* tensors (the optional ones checked when present).
    fn layer(&mut self, layer: Option<usize>) {
        let (model, c) = (self.model, self.c);
        let idx = Idx {
            layer,
            expert: None,
        };
        let mtp = layer.is_some_and(|l| c.is_mtp_layer(l));
        if mtp {
            for d in glm_dsa::MTP_TABLE {
                let tensor = glm_dsa::name(d.gguf, idx);
                if d.optional && model.tensor(&tensor).is_none() {
                    continue;
                }
                self.check(tensor, glm_dsa::resolve(d.shape, c), &|| {
                    format!("{} of the MTP layer", glm_dsa::name(d.hf, idx))
                });
            }
        }
        for d in glm_dsa::HF_TABLE.iter() {
            if !self.applies(d, layer) {
                continue;
            }
            let param = || {
                let p = glm_dsa::name(d.hf, idx).replace("{E}", "*");
                if mtp {
                    format!("{p} of the MTP layer")
                } else {
                    p
                }
            };
            let use_legacy = d.legacy.filter(|lg| {
                model.tensor(&glm_dsa::name(d.gguf[0].name, idx)).is_none()
                    && model.tensor(&glm_dsa::name(lg.name, idx)).is_some()
            });
            let sources: Vec<_> = match use_legacy {
                Some(lg) => vec![lg],
                None => d.gguf.to_vec(),
            };
            for s in sources {
                self.check(
                    glm_dsa::name(s.name, idx),
                    glm_dsa::resolve(s.shape, c),
                    &param,
                );
            }
        }
    }
}

/// A run of layers `a..=b` with no tensor in the file, where the config expects `n`.
fn absent_layers((first, last, expected): (usize, usize, usize)) -> Problem {
    Problem {
        kind: ProblemKind::Missing,
        cause: Cause::AbsentLayers {
            first,
            last,
            expected,
        },
        tensor: None,
        expected: None,
        found: None,
    }
}

/// Tensors of the file that no expected name accounts for.
fn unexpected_tensors(model: &GgufModel, c: &Config, expected: &HashSet<String>) -> Vec<Problem> {
    let mut problems = Vec::new();
    for t in model.tensors() {
        let n = &t.info.name;
        if expected.contains(n) {
            continue;
        }
        let layer = glm_dsa::gguf_layer(n);
        problems.push(Problem {
            kind: ProblemKind::Unexpected,
            tensor: Some(n.clone()),
            expected: None,
            found: Some(t.info.torch_shape()),
            cause: match layer {
                Some(block) if block >= c.gguf_block_count() => Cause::PastBlockCount {
                    block,
                    block_count: c.gguf_block_count(),
                    decoder_layers: c.num_hidden_layers,
                    mtp_layers: c.num_nextn_predict_layers,
                },
                _ => Cause::Unknown,
            },
        });
    }
    problems
}

/// Blocks as `78` or `76, 77, 78`.
pub fn block_list(blocks: &[usize]) -> String {
    if blocks.is_empty() {
        return "none".into();
    }
    blocks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn tokenizer_summary(model: &GgufModel) -> Option<TokenizerSummary> {
    let s = |k: &str| model.value(k).and_then(Value::as_str).map(str::to_string);
    let tokens = model
        .value("tokenizer.ggml.tokens")
        .and_then(Value::as_array);
    let model_name = s("tokenizer.ggml.model");
    if tokens.is_none() && model_name.is_none() {
        return None;
    }
    let merges = model
        .value("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .map_or(0, <[Value]>::len);
    // Every `tokenizer.ggml.*_token_id` llama.cpp writes (llama-arch.cpp's LLM_KV_TOKENIZER_*_ID;
    // "seperator" is its spelling).
    let mut special = BTreeMap::new();
    for key in [
        "bos",
        "eos",
        "eot",
        "eom",
        "unknown",
        "padding",
        "seperator",
        "cls",
        "mask",
        "fim_pre",
        "fim_suf",
        "fim_mid",
        "fim_pad",
        "fim_rep",
        "fim_sep",
    ] {
        if let Some(id) = model
            .value(&format!("tokenizer.ggml.{key}_token_id"))
            .and_then(Value::as_u64)
        {
            let text = tokens
                .and_then(|t| t.get(id as usize))
                .and_then(Value::as_str)
                .map(str::to_string);
            special.insert(key.to_string(), SpecialToken { id, text });
        }
    }
    Some(TokenizerSummary {
        model: model_name,
        pre: s("tokenizer.ggml.pre"),
        tokens: tokens.map_or(0, <[Value]>::len),
        merges,
        special,
        chat_template: model.value("tokenizer.chat_template").is_some(),
    })
}
