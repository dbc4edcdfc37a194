//! GGUF reading: bytes to a validated tensor index, nothing about GLM.
//!
//! All checks of sizes and offsets live here; later stages may trust what this module hands out.

#[cfg(feature = "cuda")]
pub mod cuda_decode;
pub mod dequant;
pub mod device_decode;
pub mod error;
pub mod model;
pub mod noise;
pub mod reader;
pub mod stats;
pub mod storage;
pub mod types;
pub mod value;
pub mod writer;

pub use error::{DequantError, GgufError};
pub use model::{GgufModel, TensorRef};
pub use reader::{GgufFile, MetaEntry, TensorInfo};
pub use storage::SharedBytes;
pub use types::GgmlType;
pub use value::{Value, ValueType};
