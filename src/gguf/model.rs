//! A whole model: one GGUF file, or every part of a llama.cpp split set (`name-00001-of-00010.gguf`),
//! merged into one tensor index.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::dequant;
use super::error::{DequantError, GgufError};
use super::reader::{GgufFile, MetaEntry, TensorInfo};
use super::value::Value;

pub const KEY_SPLIT_NO: &str = "split.no";
pub const KEY_SPLIT_COUNT: &str = "split.count";
pub const KEY_SPLIT_TENSORS: &str = "split.tensors.count";

/// A model's files and the tensors they hold.
#[derive(Debug)]
pub struct GgufModel {
    /// Parts in split order; part 0 carries the model's metadata.
    pub parts: Vec<GgufFile>,
    /// (part, index into that part's tensors), in file order.
    order: Vec<(usize, usize)>,
    by_name: HashMap<String, usize>,
}

/// A tensor of the model and the file it lives in.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub info: &'a TensorInfo,
    pub part: usize,
    pub file: &'a GgufFile,
}

impl<'a> TensorRef<'a> {
    pub fn bytes(&self) -> &'a [u8] {
        self.file.tensor_bytes(self.info)
    }

    /// The bytes as a handle that outlives the model's borrow.
    pub fn shared(&self) -> crate::gguf::SharedBytes {
        self.file.shared_bytes(self.info)
    }

    /// Unmaps this tensor's whole pages from the process (they stay in the page cache).
    pub fn release(&self) {
        self.file.release(self.info)
    }

    /// Starts reading this tensor's bytes in the background (madvise WILLNEED).
    pub fn prefetch(&self) {
        self.file.prefetch(self.info)
    }

    /// The tensor as f32 values in ggml memory order (ne0 fastest).
    pub fn dequantize(&self) -> Result<Vec<f32>, DequantError> {
        let mut out = vec![0f32; self.info.n_elements() as usize];
        self.dequantize_into(&mut out)?;
        Ok(out)
    }

    /// The tensor's bytes, checked to be all there.
    fn whole_bytes(&self) -> Result<&'a [u8], DequantError> {
        let bytes = self.bytes();
        if bytes.len() as u64 != self.info.n_bytes {
            return Err(DequantError::Bad {
                tensor: self.info.name.clone(),
                reason: format!(
                    "{} bytes expected at offset {} of {}, {} readable",
                    self.info.n_bytes,
                    self.info.abs_offset,
                    self.file.path.display(),
                    bytes.len()
                ),
            });
        }
        Ok(bytes)
    }

    /// Decodes into a caller's buffer (of exactly `n_elements`), so a scan can reuse one allocation.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<(), DequantError> {
        dequant::dequantize_into(&self.info.name, self.info.dtype, self.whole_bytes()?, out)
    }

    /// Decodes in cache-sized chunks on all cores, folding values into per-thread accumulators
    /// without materialising the tensor (see [`dequant::fold_chunks`]).
    pub fn fold_chunks<R: Send>(
        &self,
        init: impl Fn() -> R + Sync,
        fold: impl Fn(&mut R, &[f32]) + Sync,
    ) -> Result<Vec<R>, DequantError> {
        dequant::fold_chunks(
            &self.info.name,
            self.info.dtype,
            self.whole_bytes()?,
            init,
            fold,
        )
    }

    /// Rows `start..start + len` of the outermost dimension (`ne[last]`) as f32: one expert of a
    /// stacked expert tensor, say, without decoding the others.
    pub fn dequantize_outer(&self, start: u64, len: u64) -> Result<Vec<f32>, DequantError> {
        let bad = |reason: String| DequantError::Bad {
            tensor: self.info.name.clone(),
            reason,
        };
        let outer = self.info.ne.last().copied().unwrap_or(1);
        if start.checked_add(len).is_none_or(|end| end > outer) {
            return Err(bad(format!(
                "rows {start}..+{len} outside the outer dimension of {outer}"
            )));
        }
        let row_bytes = self.info.n_bytes / outer;
        let bytes = self.bytes();
        let lo = (start * row_bytes) as usize;
        let hi = ((start + len) * row_bytes) as usize;
        let slice = bytes
            .get(lo..hi)
            .ok_or_else(|| bad(format!("bytes {lo}..{hi} not readable")))?;
        dequant::dequantize(&self.info.name, self.info.dtype, slice)
    }
}

/// The `-NNNNN-of-NNNNN.gguf` suffix llama.cpp's `llama_split_path` writes.
fn split_suffix(no: u32, count: u32) -> String {
    format!("-{no:05}-of-{count:05}.gguf")
}

fn meta_u32(file: &GgufFile, key: &str) -> Result<Option<u32>, GgufError> {
    let Some(MetaEntry { value, offset, .. }) = file.get(key) else {
        return Ok(None);
    };
    match value.as_u64().and_then(|v| u32::try_from(v).ok()) {
        Some(v) => Ok(Some(v)),
        None => Err(GgufError::invalid(
            &file.path,
            format!("metadata `{key}`"),
            *offset,
            format!(
                "must be a non-negative integer, found {}",
                value.type_name()
            ),
        )),
    }
}

impl GgufModel {
    /// Opens a GGUF model. Given any part of a split set, opens every part.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let first = GgufFile::open(path)?;
        let count = meta_u32(&first, KEY_SPLIT_COUNT)?.unwrap_or(1);
        if count <= 1 {
            return Self::from_parts(vec![first]);
        }
        let no = meta_u32(&first, KEY_SPLIT_NO)?.unwrap_or(0);
        if no >= count {
            let offset = first.get(KEY_SPLIT_NO).map_or(0, |e| e.offset);
            return Err(GgufError::invalid(
                path,
                format!("metadata `{KEY_SPLIT_NO}`"),
                offset,
                format!("part number {no} is not below split.count {count}"),
            ));
        }
        let name = path.to_string_lossy();
        let suffix = split_suffix(no + 1, count);
        let Some(prefix) = name.strip_suffix(&suffix) else {
            return Err(GgufError::invalid(
                path,
                format!("metadata `{KEY_SPLIT_COUNT}`"),
                first.get(KEY_SPLIT_COUNT).map_or(0, |e| e.offset),
                format!(
                    "file is part {} of {count} but its name does not end in `{suffix}` (llama.cpp's split naming), so the other parts cannot be found",
                    no + 1
                ),
            ));
        };
        let prefix = prefix.to_string();
        let mut parts = Vec::with_capacity(count as usize);
        let mut given = Some(first);
        for i in 0..count {
            let part_path = PathBuf::from(format!("{prefix}{}", split_suffix(i + 1, count)));
            let part = if i == no {
                given.take().ok_or_else(|| {
                    GgufError::invalid(path, KEY_SPLIT_NO, 0, "internal: part taken twice")
                })?
            } else {
                if !part_path.exists() {
                    return Err(GgufError::MissingPart {
                        file: path.to_path_buf(),
                        part: i + 1,
                        count,
                        expected: part_path,
                    });
                }
                GgufFile::open(&part_path)?
            };
            let foreign = |reason: String| GgufError::ForeignPart {
                file: part_path.clone(),
                first: path.to_path_buf(),
                reason,
            };
            let pc = meta_u32(&part, KEY_SPLIT_COUNT)?;
            if pc != Some(count) {
                return Err(foreign(format!(
                    "its split.count is {pc:?}, expected {count}"
                )));
            }
            let pn = meta_u32(&part, KEY_SPLIT_NO)?;
            if pn != Some(i) {
                return Err(foreign(format!("its split.no is {pn:?}, expected {i}")));
            }
            parts.push(part);
        }
        let model = Self::from_parts(parts)?;
        let declared = meta_u32(&model.parts[0], KEY_SPLIT_TENSORS)?;
        if let Some(declared) = declared {
            if declared as usize != model.order.len() {
                return Err(GgufError::ForeignPart {
                    file: model.parts[0].path.clone(),
                    first: path.to_path_buf(),
                    reason: format!(
                        "split.tensors.count says {declared} tensors, the {count} parts hold {}",
                        model.order.len()
                    ),
                });
            }
        }
        Ok(model)
    }

    /// A model of one already-parsed file (e.g. from [`GgufFile::parse_bytes`]); no split parts are
    /// looked for. Duplicate tensor names are errors, as for [`GgufModel::open`].
    pub fn from_file(file: GgufFile) -> Result<Self, GgufError> {
        Self::from_parts(vec![file])
    }

    fn from_parts(parts: Vec<GgufFile>) -> Result<Self, GgufError> {
        let mut order = Vec::new();
        let mut by_name = HashMap::new();
        for (p, file) in parts.iter().enumerate() {
            for (i, t) in file.tensors.iter().enumerate() {
                if let Some(&prev) = by_name.get(&t.name) {
                    let (pp, _): (usize, usize) = order[prev];
                    return Err(GgufError::invalid(
                        &file.path,
                        format!("tensor_info[{i}].name"),
                        t.info_offset,
                        format!(
                            "tensor `{}` is also in {}",
                            t.name,
                            parts[pp].path.display()
                        ),
                    ));
                }
                by_name.insert(t.name.clone(), order.len());
                order.push((p, i));
            }
        }
        Ok(GgufModel {
            parts,
            order,
            by_name,
        })
    }

    /// The path the user gave (part 0 for split sets).
    pub fn path(&self) -> &Path {
        &self.parts[0].path
    }

    pub fn get_meta(&self, key: &str) -> Option<&MetaEntry> {
        self.parts.iter().find_map(|p| p.get(key))
    }

    pub fn value(&self, key: &str) -> Option<&Value> {
        self.get_meta(key).map(|e| &e.value)
    }

    /// All metadata entries of part 0 (split parts after it carry only split keys).
    pub fn metadata(&self) -> &[MetaEntry] {
        &self.parts[0].metadata
    }

    pub fn tensor(&self, name: &str) -> Option<TensorRef<'_>> {
        self.by_name.get(name).map(|&i| self.at(i))
    }

    fn at(&self, i: usize) -> TensorRef<'_> {
        let (p, t) = self.order[i];
        TensorRef {
            info: &self.parts[p].tensors[t],
            part: p,
            file: &self.parts[p],
        }
    }

    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> + '_ {
        (0..self.order.len()).map(|i| self.at(i))
    }

    pub fn tensor_count(&self) -> usize {
        self.order.len()
    }

    /// The file the metadata key lives in, for messages.
    pub fn file_of_meta(&self, key: &str) -> &Path {
        self.parts
            .iter()
            .find(|p| p.get(key).is_some())
            .map_or(self.path(), |p| p.path.as_path())
    }
}
