//! The comparison engine's old home: everything in [`crate::compare`] is re-exported here, so
//! `glmcheck::activations::{Activations, compare, Tolerances, …}` keeps working.
//!
//! # Submodules
//! [`forward`]: `glmcheck forward` as a library call (next tokens, greedy continuation, dump,
//! comparison). [`tp`]: the forward as vLLM's tensor-parallel ranks compute it.

pub mod forward;
pub mod tp;

pub use crate::compare::*;
