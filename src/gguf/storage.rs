//! A parsed file's bytes, shared: the mapping (or in-memory image) and handles on ranges of it
//! that outlive a borrow of the file (a model keeps its quantized weights' mapped bytes).

use std::sync::Arc;

use memmap2::Mmap;

/// Where a file's bytes live once parsed (shared: a model may keep a tensor's mapped bytes).
#[derive(Clone)]
pub(crate) enum Storage {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
}

/// A tensor's bytes that outlive the borrow of its file: a shared handle on the file's mapping
/// (or in-memory image) and a range in it. Pages are read from the file when touched.
#[derive(Clone)]
pub struct SharedBytes {
    data: Storage,
    start: usize,
    len: usize,
}

impl SharedBytes {
    /// `len` bytes of `data` from `start`, clamped to what is there.
    pub(crate) fn new(data: &Storage, start: usize, len: usize) -> Self {
        let all = data.bytes().len();
        let start = start.min(all);
        SharedBytes {
            data: data.clone(),
            start,
            len: len.min(all - start),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        self.data
            .bytes()
            .get(self.start..self.start.saturating_add(self.len))
            .unwrap_or(&[])
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes from `start` of this range (clamped to it).
    pub fn slice(&self, start: usize, len: usize) -> SharedBytes {
        let start = start.min(self.len);
        SharedBytes {
            data: self.data.clone(),
            start: self.start + start,
            len: len.min(self.len - start),
        }
    }

    /// Drops this range's whole pages from the process's mapping (the page cache keeps them).
    pub fn release(&self) {
        release_range(&self.data, self.start, self.len);
    }
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBytes({}..+{})", self.start, self.len)
    }
}

pub(crate) fn release_range(data: &Storage, offset: usize, len: usize) {
    if let Storage::Mapped(m) = data {
        let page = 4096;
        let start = offset.div_ceil(page) * page;
        let end = (offset + len) / page * page;
        if end > start {
            // SAFETY: the map is a read-only private file mapping that is never written, so
            // MADV_DONTNEED only unmaps clean pages; a later access faults them back in from
            // the file. Whole pages inside this range only. Advice failure is harmless.
            let _ = unsafe {
                m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }
}

impl Storage {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}
