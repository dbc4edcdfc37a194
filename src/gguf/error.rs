use std::path::PathBuf;

/// Everything that can be wrong with a GGUF file or a set of split files. Each variant names the file,
/// and where the problem is inside it, the field and its byte offset.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: cannot read: {err}")]
    Io { file: PathBuf, err: std::io::Error },
    #[error(
        "{file}: truncated: {field} at byte offset {offset} needs {needed} bytes but the file has only {available} left"
    )]
    Truncated {
        file: PathBuf,
        field: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{file}: {field} at byte offset {offset}: {reason}")]
    Invalid {
        file: PathBuf,
        field: String,
        offset: u64,
        reason: String,
    },
    #[error("{file}: split part {part} of {count} is missing: expected {expected}")]
    MissingPart {
        file: PathBuf,
        part: u32,
        count: u32,
        expected: PathBuf,
    },
    #[error("{file}: {what}")]
    NotAFile { file: PathBuf, what: String },
    #[error("{file}: architecture {found}: glmcheck checks {wanted} models (`glmcheck inspect` inventories it)")]
    ForeignArch {
        file: PathBuf,
        found: String,
        wanted: String,
    },
    #[error("{file}: does not belong to the split set of {first}: {reason}")]
    ForeignPart {
        file: PathBuf,
        first: PathBuf,
        reason: String,
    },
}

impl GgufError {
    pub(crate) fn invalid(
        file: &std::path::Path,
        field: impl Into<String>,
        offset: u64,
        reason: impl Into<String>,
    ) -> Self {
        GgufError::Invalid {
            file: file.to_path_buf(),
            field: field.into(),
            offset,
            reason: reason.into(),
        }
    }
}

/// A tensor that is in the index but cannot be turned into f32 values.
#[derive(Debug, thiserror::Error)]
pub enum DequantError {
    #[error("tensor `{tensor}` has type {dtype}, which glmcheck cannot dequantize (it is inventoried, not decoded)")]
    Unsupported { tensor: String, dtype: String },
    #[error("tensor `{tensor}`: {reason}")]
    Bad { tensor: String, reason: String },
    /// Dequantizing would need more memory than can be had (a whole expert stack of a real-size
    /// model in f32, say): an error naming the tensor, never an abort.
    #[error(
        "tensor `{tensor}`: dequantizing it to f32 needs {bytes} bytes, which cannot be allocated"
    )]
    Alloc { tensor: String, bytes: u64 },
}
