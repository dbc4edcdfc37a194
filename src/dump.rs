//! Per-rank weight dumps: `rank<r>.safetensors` files holding what each rank of a deployment holds,
//! under vLLM parameter names, any float dtype. Read memory-mapped and read-only; written to a temp
//! file and renamed, never over an input.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    #[error("{file}: cannot read: {err}")]
    Io { file: PathBuf, err: std::io::Error },
    #[error("{file}: not a valid safetensors file: {reason}")]
    Format { file: PathBuf, reason: String },
    #[error("{dir}: no rank<r>.safetensors files")]
    Empty { dir: PathBuf },
    #[error("{file}: tensor `{tensor}` has dtype {dtype:?}; glmcheck compares float tensors only")]
    Dtype {
        file: PathBuf,
        tensor: String,
        dtype: Dtype,
    },
    #[error("{file}: cannot write: {err}")]
    Write { file: PathBuf, err: String },
}

/// One tensor of a dump, with its raw bytes kept (so a dtype mix-up can be diagnosed from the bits).
#[derive(Debug, Clone)]
pub struct DumpTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl DumpTensor {
    /// Values as f32, read as the dtype the file declares.
    pub fn to_f32(&self) -> Vec<f32> {
        decode(self.dtype, &self.data)
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Decodes little-endian float bytes of `dtype` to f32 (unknown dtypes give no values).
pub fn decode(dtype: Dtype, data: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32)
            .collect(),
        _ => Vec::new(),
    }
}

/// The rank files of a dump directory.
#[derive(Debug)]
pub struct RankDump {
    pub dir: PathBuf,
    /// rank → file, for the rank files that exist.
    pub files: BTreeMap<usize, PathBuf>,
}

impl RankDump {
    /// Finds `rank<r>.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self, DumpError> {
        if dir.is_file() {
            return Err(DumpError::Io {
                file: dir.to_path_buf(),
                err: std::io::Error::other(
                    "is a file; --against takes the directory holding rank<r>.safetensors",
                ),
            });
        }
        let rd = std::fs::read_dir(dir).map_err(|err| DumpError::Io {
            file: dir.to_path_buf(),
            err,
        })?;
        let mut files = BTreeMap::new();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(r) = name
                .strip_prefix("rank")
                .and_then(|s| s.strip_suffix(".safetensors"))
                .and_then(|s| s.parse::<usize>().ok())
            {
                files.insert(r, e.path());
            }
        }
        if files.is_empty() {
            return Err(DumpError::Empty {
                dir: dir.to_path_buf(),
            });
        }
        Ok(RankDump {
            dir: dir.to_path_buf(),
            files,
        })
    }

    /// The tp degree the files suggest (highest rank + 1).
    pub fn tp(&self) -> usize {
        self.files.keys().next_back().map_or(0, |r| r + 1)
    }

    /// Opens one rank's file (header parsed, data left in the map), if it exists.
    pub fn open_rank(&self, rank: usize) -> Result<Option<RankFile>, DumpError> {
        match self.files.get(&rank) {
            Some(path) => RankFile::open(path).map(Some),
            None => Ok(None),
        }
    }

    /// Loads every float tensor of one rank into memory.
    pub fn load_rank(
        &self,
        rank: usize,
    ) -> Result<Option<BTreeMap<String, DumpTensor>>, DumpError> {
        let Some(path) = self.files.get(&rank) else {
            return Ok(None);
        };
        load_file(path).map(Some)
    }
}

/// One safetensors file, memory-mapped read-only; tensors are copied out one at a time (or one slice
/// of the outermost dimension at a time), so a 50 GB rank file costs what one parameter costs.
pub struct RankFile {
    pub path: PathBuf,
    map: Bytes,
    data_start: usize,
    meta: safetensors::tensor::Metadata,
    /// Canonical name → the name the file stores it under, for parameters stored under an alias
    /// (see [`RankFile::resolve_aliases`]); lookups by canonical name go through it.
    stored_as: std::collections::HashMap<String, String>,
}

/// A rank file's bytes: mapped from disk, or held in memory (tests, fuzzing).
enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl RankFile {
    pub fn open(path: &Path) -> Result<Self, DumpError> {
        let io = |err| DumpError::Io {
            file: path.to_path_buf(),
            err,
        };
        Self::validate(path, Bytes::Mapped(map_read_only(path).map_err(io)?))
    }

    /// A rank file held in memory, validated exactly as [`RankFile::open`] validates a file; `path`
    /// is only used in messages.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, DumpError> {
        Self::validate(path, Bytes::Owned(bytes))
    }

    fn validate(path: &Path, map: Bytes) -> Result<Self, DumpError> {
        let format = |e: safetensors::SafeTensorError| DumpError::Format {
            file: path.to_path_buf(),
            reason: e.to_string(),
        };
        // Full validation (header, offsets, sizes) once; then keep only the header.
        SafeTensors::deserialize(&map).map_err(format)?;
        // Non-float tensors are kept: `shards --against` reports them one by one and checks the
        // rest; whole-rank loads ([`load_file`]) refuse them.
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(format)?;
        Ok(RankFile {
            path: path.to_path_buf(),
            map,
            data_start: 8 + n,
            meta,
            stored_as: Default::default(),
        })
    }

    /// Maps every stored name through `canonical` (another version's name or a `state_dict()` alias
    /// → the canonical name, None for a name it does not know). A parameter stored only under an
    /// alias is then found by its canonical name. Returns what each stored name became:
    /// `(stored, canonical)` for the known ones, and the unknown names.
    pub fn resolve_aliases(
        &mut self,
        canonical: impl Fn(&str) -> Option<String>,
    ) -> (Vec<(String, String)>, Vec<String>) {
        let mut known = Vec::new();
        let mut unknown = Vec::new();
        for stored in self.names() {
            match canonical(&stored) {
                Some(c) => known.push((stored, c)),
                None => unknown.push(stored),
            }
        }
        self.stored_as.clear();
        for (stored, c) in &known {
            // The canonical name itself wins over an alias of the same parameter.
            if stored != c && self.meta.info(c).is_none() {
                self.stored_as
                    .entry(c.clone())
                    .or_insert_with(|| stored.clone());
            }
        }
        (known, unknown)
    }

    /// The name the file stores `name` under (itself, or the alias it was found under).
    pub fn stored_name<'n>(&'n self, name: &'n str) -> &'n str {
        self.stored_as.get(name).map_or(name, String::as_str)
    }

    fn info(&self, name: &str) -> Option<&safetensors::tensor::TensorInfo> {
        self.meta.info(self.stored_name(name))
    }

    pub fn names(&self) -> Vec<String> {
        self.meta.offset_keys()
    }

    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.info(name).map(|i| i.shape.clone())
    }

    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.info(name).map(|i| i.dtype)
    }

    fn bytes(&self, name: &str) -> Option<(&safetensors::tensor::TensorInfo, &[u8])> {
        let info = self.info(name)?;
        let (a, b) = info.data_offsets;
        let data = self
            .map
            .get(self.data_start.checked_add(a)?..self.data_start.checked_add(b)?)?;
        Some((info, data))
    }

    /// A whole tensor.
    pub fn get(&self, name: &str) -> Option<DumpTensor> {
        let (info, data) = self.bytes(name)?;
        Some(DumpTensor {
            dtype: info.dtype,
            shape: info.shape.clone(),
            data: data.to_vec(),
        })
    }

    /// Slice `i` of the tensor's outermost dimension (one expert of `[E, …]`).
    pub fn get_outer(&self, name: &str, i: usize) -> Option<DumpTensor> {
        let (info, data) = self.bytes(name)?;
        let outer = *info.shape.first()?;
        if i >= outer {
            return None;
        }
        let per = data.len() / outer;
        Some(DumpTensor {
            dtype: info.dtype,
            shape: info.shape[1..].to_vec(),
            data: data.get(i * per..(i + 1) * per)?.to_vec(),
        })
    }
}

/// Maps a dump file read-only (rank files, activation dumps).
pub fn map_read_only(path: &Path) -> std::io::Result<Mmap> {
    // Say what was given instead of an OS error number (and never block opening a FIFO).
    if let Some(what) = crate::gguf::reader::not_a_regular_file(path) {
        return Err(std::io::Error::other(format!(
            "{what}, not a safetensors file"
        )));
    }
    let f = File::open(path)?;
    // SAFETY: a read-only private map of a file glmcheck never writes while it is mapped.
    unsafe { Mmap::map(&f) }
}

/// Whether glmcheck can read `dtype` as weights or activations (F32, F16, BF16, F64).
pub fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16 | Dtype::F64)
}

/// Reads one safetensors file (memory-mapped, read-only) into memory; a non-float tensor is an
/// error naming it.
pub fn load_file(path: &Path) -> Result<BTreeMap<String, DumpTensor>, DumpError> {
    let f = RankFile::open(path)?;
    let mut out = BTreeMap::new();
    for name in f.names() {
        let Some(t) = f.get(&name) else {
            continue;
        };
        if !is_float(t.dtype) {
            return Err(DumpError::Dtype {
                file: path.to_path_buf(),
                tensor: name,
                dtype: t.dtype,
            });
        }
        out.insert(name, t);
    }
    Ok(out)
}

/// Encodes f32 values as `dtype` bytes (F32, F16 or BF16).
pub fn encode(dtype: Dtype, values: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Writes tensors to `path` atomically (temp file in the same directory, then rename). Refuses to
/// write over any path in `inputs`.
pub fn write_file(
    path: &Path,
    tensors: &BTreeMap<String, DumpTensor>,
    metadata: Option<std::collections::HashMap<String, String>>,
    inputs: &[&Path],
) -> Result<(), DumpError> {
    let werr = |err: String| DumpError::Write {
        file: path.to_path_buf(),
        err,
    };
    for i in inputs {
        if let (Ok(a), Ok(b)) = (std::fs::canonicalize(i), std::fs::canonicalize(path)) {
            if a == b {
                return Err(werr(format!(
                    "refusing to overwrite the input {}",
                    i.display()
                )));
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, t)| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (k.clone(), v))
                .map_err(|e| werr(format!("{k}: {e}")))
        })
        .collect::<Result<_, _>>()?;
    crate::outputs::write_atomically(path, |tmp| {
        safetensors::tensor::serialize_to_file(views, metadata, tmp).map_err(|e| e.to_string())
    })
    .map_err(|e| werr(e.to_string()))
}
