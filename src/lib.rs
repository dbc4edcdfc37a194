//! glmcheck: find out why a GLM-5 (`glm-dsa`) deployment that loads fine still produces garbage.
//!
//! Data flows one way: [`gguf`] (read, mmap) → [`arch`] (the one name table, config) → [`weights`]
//! (logical tensors) → later stages. Commands ([`cmd`]) are thin: each calls the stages and returns a
//! typed outcome that the binary maps to the exit code.

pub mod arch;
pub mod bisect;
pub mod cmd;
pub mod compare;
pub mod dump;
pub mod export;
pub mod faults;
pub mod forward;
pub mod fuzzing;
pub mod gate;
pub mod gguf;
pub mod inspect;
pub mod model;
pub mod outputs;
pub mod plan;
pub mod report;
pub mod shards;
pub mod synth;
pub mod tokenizer;
pub mod weights;
