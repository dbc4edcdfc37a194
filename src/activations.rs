//! The comparison engine's old home: everything in [`crate::compare`] is re-exported here, so
//! `glmcheck::activations::{Activations, compare, Tolerances, …}` keeps working.
//!
//! # Submodules
//! [`forward`]: `glmcheck forward` as a library call (next tokens, greedy continuation, dump,
//! comparison).

pub use crate::forward;

pub use crate::compare::*;

/// The old name of [`crate::compare::ValueKind`] (what kind of value a captured key holds), kept so
/// that code written against `activations::Role` still builds; `arch::glm_dsa::Role` is the tensor
/// role. Remove once nothing uses it.
pub type Role = crate::compare::ValueKind;
