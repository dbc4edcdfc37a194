//! A minimal GGUF v3 writer: metadata, tensor infos, aligned data. Used to split files, to build
//! synthetic models with real GLM-5 dimensions (sparse), and to craft hostile inputs in tests.

use std::io::{self, Seek, SeekFrom, Write};

use super::types::GgmlType;
use super::value::{Value, ValueType};

/// A tensor to write: name, ggml-order dims, type and raw data. `data: None` writes no bytes (the file
/// is extended with a hole instead: a sparse file of the right size).
pub struct WriteTensor<'a> {
    pub name: String,
    pub ne: Vec<u64>,
    pub dtype: GgmlType,
    pub data: Option<&'a [u8]>,
}

impl WriteTensor<'_> {
    pub fn n_bytes(&self) -> u64 {
        let n: u64 = self.ne.iter().product();
        self.dtype.bytes_for(n).unwrap_or(0)
    }
}

fn w_str(w: &mut impl Write, s: &str) -> io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn w_value(w: &mut impl Write, v: &Value) -> io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[*x as u8]),
        Value::String(s) => w_str(w, s),
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
        Value::Array(t, items) => {
            w.write_all(&t.id().to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            items.iter().try_for_each(|i| w_value(w, i))
        }
    }
}

/// Writes a GGUF file with `alignment` (32 unless metadata says otherwise; pass what
/// `general.alignment` holds if present). Returns the total file size.
pub fn write_gguf<W: Write + Seek>(
    w: &mut W,
    metadata: &[(String, Value)],
    tensors: &[WriteTensor<'_>],
    alignment: u64,
) -> io::Result<u64> {
    let (head, offsets) = header(metadata, tensors, alignment)?;
    let data_start = head.len() as u64;
    w.write_all(&head)?;
    let mut end = data_start;
    let mut written = data_start;
    for (t, off) in tensors.iter().zip(offsets) {
        let at = data_start + off;
        if let Some(bytes) = t.data {
            w.seek(SeekFrom::Start(at))?;
            w.write_all(bytes)?;
            written = written.max(at + bytes.len() as u64);
        }
        end = end.max(at + t.n_bytes());
    }
    let total = end.div_ceil(alignment) * alignment;
    if total > written {
        // Extend to the final size; what was never written stays a hole (sparse).
        w.seek(SeekFrom::Start(total - 1))?;
        w.write_all(&[0])?;
    }
    Ok(total)
}

/// The header (magic, metadata, tensor infos, padding to the data section) and each tensor's offset
/// within the data section.
fn header(
    metadata: &[(String, Value)],
    tensors: &[WriteTensor<'_>],
    alignment: u64,
) -> io::Result<(Vec<u8>, Vec<u64>)> {
    let mut head = Vec::new();
    head.extend_from_slice(b"GGUF");
    head.extend_from_slice(&3u32.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        w_str(&mut head, k)?;
        head.extend_from_slice(&v.value_type().id().to_le_bytes());
        w_value(&mut head, v)?;
    }
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors {
        w_str(&mut head, &t.name)?;
        head.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
        for d in &t.ne {
            head.extend_from_slice(&d.to_le_bytes());
        }
        head.extend_from_slice(&t.dtype.id.to_le_bytes());
        head.extend_from_slice(&offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.n_bytes()).div_ceil(alignment) * alignment;
    }
    let data_start = (head.len() as u64).div_ceil(alignment) * alignment;
    head.resize(data_start as usize, 0);
    Ok((head, offsets))
}

/// Writes a GGUF front to back (no seeking: a pipe or a plain file), each tensor's bytes produced
/// by `fill(index, out)` when its turn comes, so a file far larger than memory is written with one
/// tensor's worth of buffers at most. `fill` must write exactly the tensor's byte size (checked).
pub fn write_gguf_streamed<W: Write>(
    w: &mut W,
    metadata: &[(String, Value)],
    tensors: &[WriteTensor<'_>],
    alignment: u64,
    fill: &mut dyn FnMut(usize, &mut dyn Write) -> io::Result<()>,
) -> io::Result<u64> {
    let (head, offsets) = header(metadata, tensors, alignment)?;
    w.write_all(&head)?;
    let mut pos = 0u64;
    for (i, (t, off)) in tensors.iter().zip(offsets).enumerate() {
        w.write_all(&vec![0u8; (off - pos) as usize])?;
        let mut counted = Counted { w: &mut *w, n: 0 };
        fill(i, &mut counted)?;
        if counted.n != t.n_bytes() {
            return Err(io::Error::other(format!(
                "{}: {} bytes written, {} expected",
                t.name,
                counted.n,
                t.n_bytes()
            )));
        }
        pos = off + t.n_bytes();
    }
    let total = pos.div_ceil(alignment) * alignment;
    w.write_all(&vec![0u8; (total - pos) as usize])?;
    Ok(head.len() as u64 + total)
}

/// A writer that counts what passes through.
struct Counted<'w, W: Write + ?Sized> {
    w: &'w mut W,
    n: u64,
}

impl<W: Write + ?Sized> Write for Counted<'_, W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.w.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}

/// Convenience: a string-array metadata value.
pub fn string_array<S: AsRef<str>>(items: &[S]) -> Value {
    Value::Array(
        ValueType::String,
        items
            .iter()
            .map(|s| Value::String(s.as_ref().to_string()))
            .collect(),
    )
}
