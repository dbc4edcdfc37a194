//! One GGUF file: header, metadata, tensor infos and memory-mapped data.
//!
//! Every count, length, dimension and offset is checked against the bytes that are really there before
//! anything is allocated for it, with overflow-checked arithmetic. A lying header costs an error message,
//! never an allocation of what it claims.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::Serialize;
use std::sync::Arc;

use super::error::GgufError;
use super::storage::{release_range, SharedBytes, Storage};
use super::types::GgmlType;
use super::value::{Value, ValueType};

/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
const MAX_TENSORS: u64 = 1 << 20;
const MAX_KV: u64 = 1 << 20;
const MAX_STRING: u64 = 1 << 28;
const MAX_ARRAY_DEPTH: usize = 3;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata entry and where it sits in the file.
#[derive(Debug, Clone)]
pub struct MetaEntry {
    pub key: String,
    pub value: Value,
    /// Byte offset of the entry's value (after the key and type id).
    pub offset: u64,
}

/// One tensor's info record.
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: innermost (fastest varying) first.
    pub ne: Vec<u64>,
    pub dtype: GgmlType,
    /// Offset of the data relative to the file's data section.
    pub offset: u64,
    /// Absolute byte offset of the data in the file.
    pub abs_offset: u64,
    pub n_bytes: u64,
    /// Byte offset of this tensor's info record in the header, for error messages.
    #[serde(skip)]
    pub info_offset: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Shape in PyTorch order (outermost first).
    pub fn torch_shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Vec<MetaEntry>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub file_size: u64,
    meta_index: HashMap<String, usize>,
    data: Storage,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Why `path` is not a regular file that could hold data (None when it is one, or when it does not
/// exist: opening it then gives the OS's own "not found").
pub fn not_a_regular_file(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    let ft = meta.file_type();
    if ft.is_file() {
        return None;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return Some("is a FIFO (named pipe)".into());
        }
        if ft.is_char_device() {
            return Some("is a character device".into());
        }
        if ft.is_block_device() {
            return Some("is a block device".into());
        }
        if ft.is_socket() {
            return Some("is a socket".into());
        }
    }
    Some(if ft.is_dir() {
        "is a directory".into()
    } else {
        "is not a regular file".into()
    })
}

impl GgufFile {
    /// Opens (read-only) and parses a GGUF file. Only the header pages are touched.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |err| GgufError::Io {
            file: path.to_path_buf(),
            err,
        };
        // What was given, before opening it: opening a FIFO blocks, a directory or a device is no
        // model, and an OS error number says none of that.
        if let Some(what) = not_a_regular_file(path) {
            return Err(GgufError::NotAFile {
                file: path.to_path_buf(),
                what: format!("{what}, not a GGUF file"),
            });
        }
        if !path.exists() {
            return Err(GgufError::NotAFile {
                file: path.to_path_buf(),
                what: "does not exist".into(),
            });
        }
        let file = File::open(path).map_err(io)?;
        let file_size = file.metadata().map_err(io)?.len();
        if file_size == 0 {
            return Err(GgufError::NotAFile {
                file: path.to_path_buf(),
                what: "is empty (0 bytes), not a GGUF file".into(),
            });
        }
        // SAFETY: the map is read-only and private; glmcheck never writes model files. A file truncated by
        // someone else while mapped is outside what any reader can defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse(path, &mmap, file_size)?;
        Ok(header.with_storage(Storage::Mapped(Arc::new(mmap))))
    }

    /// Parses a GGUF image held in memory (used by tests and fuzzing); data access works as for files.
    pub fn parse_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, GgufError> {
        let header = parse(path, &bytes, bytes.len() as u64)?;
        Ok(header.with_storage(Storage::Owned(Arc::new(bytes))))
    }

    pub fn get(&self, key: &str) -> Option<&MetaEntry> {
        self.meta_index.get(key).map(|&i| &self.metadata[i])
    }

    pub fn value(&self, key: &str) -> Option<&Value> {
        self.get(key).map(|e| &e.value)
    }

    /// The raw bytes of a tensor's data. Bounds were checked when the file was parsed.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = t.abs_offset as usize;
        let end = start.saturating_add(t.n_bytes as usize);
        self.data.bytes().get(start..end).unwrap_or(&[])
    }

    /// Asks the kernel to start reading a tensor's bytes now (readahead while other work runs).
    pub fn prefetch(&self, t: &TensorInfo) {
        if let Storage::Mapped(m) = &self.data {
            // Advice only: a failure changes nothing but speed.
            let _ = m.advise_range(
                memmap2::Advice::WillNeed,
                t.abs_offset as usize,
                t.n_bytes as usize,
            );
        }
    }

    /// Drops a tensor's pages from this process's mapping once a scan is done with them (the page
    /// cache keeps them), so a scan of a 400 GB file does not show 400 GB of resident memory.
    pub fn release(&self, t: &TensorInfo) {
        release_range(&self.data, t.abs_offset as usize, t.n_bytes as usize);
    }

    /// A tensor's bytes as a handle that outlives this borrow (bounds checked at parse time).
    pub fn shared_bytes(&self, t: &TensorInfo) -> SharedBytes {
        SharedBytes::new(&self.data, t.abs_offset as usize, t.n_bytes as usize)
    }

    /// Byte ranges of the file that hold tensor data, for read-bandwidth-aware scans.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

/// A bounds-checked little-endian cursor that knows which file it reads, for error messages.
struct Cursor<'a> {
    path: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, field: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                file: self.path.to_path_buf(),
                field: field(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    fn invalid(&self, field: String, offset: u64, reason: impl Into<String>) -> GgufError {
        GgufError::invalid(self.path, field, offset, reason)
    }

    /// A GGUF string: u64 length then bytes. The length is checked against the bytes left first.
    fn string_bytes(&mut self, field: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let at = self.pos as u64;
        let len = self.u64(&|| format!("{}.length", field()))?;
        if len > MAX_STRING {
            return Err(self.invalid(
                format!("{}.length", field()),
                at,
                format!("string length {len} exceeds the limit of {MAX_STRING} bytes"),
            ));
        }
        self.take(len, field)
    }

    fn utf8_string(&mut self, field: &dyn Fn() -> String) -> Result<String, GgufError> {
        let at = self.pos as u64;
        let bytes = self.string_bytes(field)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| self.invalid(field(), at, format!("not valid UTF-8: {e}")))
    }

    fn value(
        &mut self,
        ty: ValueType,
        depth: usize,
        field: &dyn Fn() -> String,
    ) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(field)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(field)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(field)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(field)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            ValueType::Bool => {
                let at = self.pos as u64;
                match self.array::<1>(field)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => {
                        return Err(self.invalid(
                            field(),
                            at,
                            format!("bool byte is {b}, not 0 or 1"),
                        ))
                    }
                }
            }
            ValueType::String => {
                Value::String(String::from_utf8_lossy(self.string_bytes(field)?).into_owned())
            }
            ValueType::Array => {
                let at = self.pos as u64;
                let elem_id = self.u32(&|| format!("{}.element_type", field()))?;
                let elem = ValueType::from_id(elem_id).ok_or_else(|| {
                    self.invalid(
                        format!("{}.element_type", field()),
                        at,
                        format!("unknown value type id {elem_id}"),
                    )
                })?;
                if elem == ValueType::Array && depth >= MAX_ARRAY_DEPTH {
                    return Err(self.invalid(
                        format!("{}.element_type", field()),
                        at,
                        format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    ));
                }
                let count_at = self.pos as u64;
                let count = self.u64(&|| format!("{}.count", field()))?;
                // Every element takes at least min_size bytes: a count the file cannot hold is a lie.
                let min = elem.min_size();
                if count.checked_mul(min).is_none_or(|b| b > self.remaining()) {
                    return Err(self.invalid(
                        format!("{}.count", field()),
                        count_at,
                        format!(
                            "array of {count} {} elements needs at least {} bytes, only {} left in the file",
                            elem.name(),
                            count.saturating_mul(min),
                            self.remaining()
                        ),
                    ));
                }
                let mut items = Vec::with_capacity(count as usize);
                for i in 0..count {
                    items.push(self.value(elem, depth + 1, &|| format!("{}[{i}]", field()))?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// A parsed header waiting for its byte storage.
struct Header {
    path: PathBuf,
    version: u32,
    metadata: Vec<MetaEntry>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
    file_size: u64,
}

impl Header {
    fn with_storage(self, data: Storage) -> GgufFile {
        GgufFile {
            path: self.path,
            version: self.version,
            metadata: self.metadata,
            tensors: self.tensors,
            alignment: self.alignment,
            data_offset: self.data_offset,
            file_size: self.file_size,
            meta_index: self.meta_index,
            data,
        }
    }
}

fn parse(path: &Path, buf: &[u8], file_size: u64) -> Result<Header, GgufError> {
    let mut c = Cursor { path, buf, pos: 0 };
    let version = parse_magic_version(&mut c)?;
    let n_tensors_at = c.pos as u64;
    let n_tensors = c.u64(&|| "header.tensor_count".into())?;
    let n_kv_at = c.pos as u64;
    let n_kv = c.u64(&|| "header.metadata_kv_count".into())?;
    // Hard caps first: a count beyond them is a lie whatever the file size.
    for (n, at, field, cap, what) in [
        (
            n_tensors,
            n_tensors_at,
            "header.tensor_count",
            MAX_TENSORS,
            "tensors",
        ),
        (
            n_kv,
            n_kv_at,
            "header.metadata_kv_count",
            MAX_KV,
            "metadata entries",
        ),
    ] {
        if n > cap {
            return Err(c.invalid(
                field.into(),
                at,
                format!("claims {n} {what}; glmcheck's limit is {cap} (GLM-5 has about 1,800 tensors and 50 entries)"),
            ));
        }
    }
    // Smallest kv: key length (8) + type (4) + a one-byte value; smallest tensor info: name length (8)
    // + n_dims (4) + one dim (8) + type (4) + offset (8). If the rest of the file cannot hold the
    // claimed records, a truncation inside them is blamed on the count.
    let fits = n_kv
        .saturating_mul(13)
        .saturating_add(n_tensors.saturating_mul(32))
        <= c.remaining();
    let kv_count = CountCheck {
        field: "header.metadata_kv_count",
        what: "metadata entries",
        n: n_kv,
        at: n_kv_at,
        fits,
    };
    let tensor_count = CountCheck {
        field: "header.tensor_count",
        what: "tensor infos",
        n: n_tensors,
        at: n_tensors_at,
        fits,
    };

    let mut metadata = Vec::with_capacity(n_kv.min(c.remaining() / 13) as usize);
    let mut meta_index = HashMap::with_capacity(metadata.capacity());
    for i in 0..n_kv {
        let key_at = c.pos as u64;
        let (key, value, offset) = parse_kv(&mut c, i).map_err(|e| kv_count.blame(path, e, i))?;
        if meta_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(c.invalid(
                format!("metadata[{i}].key"),
                key_at,
                format!("duplicate key `{key}`"),
            ));
        }
        metadata.push(MetaEntry { key, value, offset });
    }
    let alignment = alignment_of(
        &c,
        meta_index.get("general.alignment").map(|&i| &metadata[i]),
    )?;

    let mut tensors: Vec<TensorInfo> =
        Vec::with_capacity(n_tensors.min(c.remaining() / 32) as usize);
    let mut names: HashMap<String, usize> = HashMap::with_capacity(tensors.capacity());
    for i in 0..n_tensors {
        let t =
            parse_tensor_info(&mut c, i, alignment).map_err(|e| tensor_count.blame(path, e, i))?;
        if names.insert(t.name.clone(), tensors.len()).is_some() {
            return Err(c.invalid(
                format!("tensor_info[{i}].name"),
                t.info_offset,
                format!("duplicate tensor name `{}`", t.name),
            ));
        }
        tensors.push(t);
    }
    let data_offset = place_tensors(path, c.pos as u64, &mut tensors, alignment, file_size)?;
    Ok(Header {
        path: path.to_path_buf(),
        version,
        metadata,
        meta_index,
        tensors,
        alignment,
        data_offset,
        file_size,
    })
}

/// `GGUF` and a version glmcheck reads (2 or 3).
fn parse_magic_version(c: &mut Cursor) -> Result<u32, GgufError> {
    let magic = c.array::<4>(&|| "header.magic".into())?;
    if &magic != b"GGUF" {
        return Err(c.invalid(
            "header.magic".into(),
            0,
            format!(
                "expected \"GGUF\", found {:?}: not a GGUF file",
                String::from_utf8_lossy(&magic)
            ),
        ));
    }
    let version = c.u32(&|| "header.version".into())?;
    if !(2..=3).contains(&version) {
        let hint = if version.swap_bytes() <= 3 {
            " (a big-endian GGUF, which glmcheck does not read)"
        } else {
            ""
        };
        return Err(c.invalid(
            "header.version".into(),
            4,
            format!("unsupported GGUF version {version}{hint}; versions 2 and 3 are supported"),
        ));
    }
    Ok(version)
}

/// A record count from the header, and whether the file could hold that many records.
struct CountCheck {
    field: &'static str,
    what: &'static str,
    n: u64,
    at: u64,
    fits: bool,
}

impl CountCheck {
    /// A truncation inside records the file never had room for is the count's fault.
    fn blame(&self, path: &Path, e: GgufError, i: u64) -> GgufError {
        match e {
            GgufError::Truncated {
                field: inner,
                offset,
                ..
            } if !self.fits => GgufError::invalid(
                path,
                self.field,
                self.at,
                format!(
                    "claims {} {}, but the file ends in {inner} (byte offset {offset}, record {i}): the count is wrong or the file is truncated",
                    self.n, self.what
                ),
            ),
            other => other,
        }
    }
}

fn parse_kv(c: &mut Cursor<'_>, i: u64) -> Result<(String, Value, u64), GgufError> {
    let key = c.utf8_string(&|| format!("metadata[{i}].key"))?;
    let ty_at = c.pos as u64;
    let ty_id = c.u32(&|| format!("metadata[{i}] (`{key}`).type"))?;
    let ty = ValueType::from_id(ty_id).ok_or_else(|| {
        c.invalid(
            format!("metadata[{i}] (`{key}`).type"),
            ty_at,
            format!("unknown value type id {ty_id}"),
        )
    })?;
    let offset = c.pos as u64;
    let value = c.value(ty, 0, &|| format!("metadata `{key}`"))?;
    Ok((key, value, offset))
}

fn alignment_of(c: &Cursor<'_>, entry: Option<&MetaEntry>) -> Result<u64, GgufError> {
    let Some(e) = entry else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match e.value {
        Value::U32(a) if a.is_power_of_two() => Ok(a as u64),
        Value::U32(a) => Err(c.invalid(
            "metadata `general.alignment`".into(),
            e.offset,
            format!("alignment {a} is not a non-zero power of two"),
        )),
        ref other => Err(c.invalid(
            "metadata `general.alignment`".into(),
            e.offset,
            format!("must be a u32, found {}", other.type_name()),
        )),
    }
}

fn parse_tensor_info(c: &mut Cursor<'_>, i: u64, alignment: u64) -> Result<TensorInfo, GgufError> {
    let info_offset = c.pos as u64;
    let name = c.utf8_string(&|| format!("tensor_info[{i}].name"))?;
    let field = |f: &str| format!("tensor_info[{i}] (`{name}`).{f}");
    let nd_at = c.pos as u64;
    let n_dims = c.u32(&|| field("n_dims"))?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(c.invalid(
            field("n_dims"),
            nd_at,
            format!("{n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}"),
        ));
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    let mut n_elements: u64 = 1;
    for d in 0..n_dims {
        let at = c.pos as u64;
        let dim = c.u64(&|| field(&format!("ne[{d}]")))?;
        if dim == 0 {
            return Err(c.invalid(field(&format!("ne[{d}]")), at, "zero-size dimension"));
        }
        if dim > i64::MAX as u64 {
            return Err(c.invalid(
                field(&format!("ne[{d}]")),
                at,
                format!("dimension {dim} exceeds i64"),
            ));
        }
        n_elements = n_elements.checked_mul(dim).ok_or_else(|| {
            c.invalid(
                field(&format!("ne[{d}]")),
                at,
                "element count overflows 64 bits",
            )
        })?;
        ne.push(dim);
    }
    let ty_at = c.pos as u64;
    let ty_id = c.u32(&|| field("type"))?;
    let dtype = GgmlType::from_id(ty_id).ok_or_else(|| {
        c.invalid(
            field("type"),
            ty_at,
            format!("unknown GGML type id {ty_id}"),
        )
    })?;
    if ne[0] % dtype.block_size != 0 {
        return Err(c.invalid(
            field("ne[0]"),
            nd_at + 4,
            format!(
                "row length {} is not a multiple of {}'s block size {}",
                ne[0], dtype, dtype.block_size
            ),
        ));
    }
    let n_bytes = dtype.bytes_for(n_elements).ok_or_else(|| {
        c.invalid(
            field("ne"),
            nd_at + 4,
            format!("byte size of {n_elements} {dtype} elements overflows"),
        )
    })?;
    let off_at = c.pos as u64;
    let offset = c.u64(&|| field("offset"))?;
    if offset % alignment != 0 {
        return Err(c.invalid(
            field("offset"),
            off_at,
            format!("data offset {offset} is not a multiple of the alignment {alignment}"),
        ));
    }
    Ok(TensorInfo {
        name,
        ne,
        dtype,
        offset,
        abs_offset: 0,
        n_bytes,
        info_offset,
    })
}

/// Lays the tensors out after the header: absolute offsets, bounds against the file size, no overlaps.
/// Returns the data section's offset.
fn place_tensors(
    path: &Path,
    header_end: u64,
    tensors: &mut [TensorInfo],
    alignment: u64,
    file_size: u64,
) -> Result<u64, GgufError> {
    let data_offset = header_end.div_ceil(alignment) * alignment;
    if !tensors.is_empty() && data_offset > file_size {
        return Err(GgufError::Truncated {
            file: path.to_path_buf(),
            field: "data section".into(),
            offset: header_end,
            needed: data_offset - header_end,
            available: file_size - header_end,
        });
    }
    for t in tensors.iter_mut() {
        let abs = data_offset.checked_add(t.offset);
        let end = abs.and_then(|a| a.checked_add(t.n_bytes));
        match (abs, end) {
            (Some(abs), Some(end)) if end <= file_size => t.abs_offset = abs,
            _ => {
                return Err(GgufError::invalid(
                    path,
                    format!("tensor `{}`.offset", t.name),
                    t.info_offset,
                    format!(
                        "data [{}, +{} bytes) runs past the end of the file ({} bytes; data section starts at {})",
                        t.offset, t.n_bytes, file_size, data_offset
                    ),
                ))
            }
        }
    }
    // Overlap check: sort by offset, each must end before the next starts.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        if a.offset + a.n_bytes > b.offset {
            return Err(GgufError::invalid(
                path,
                format!("tensor `{}`.offset", b.name),
                b.info_offset,
                format!(
                    "data at {} overlaps tensor `{}` ([{}, {}))",
                    b.offset,
                    a.name,
                    a.offset,
                    a.offset + a.n_bytes
                ),
            ));
        }
    }

    Ok(data_offset)
}
