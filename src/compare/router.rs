//! Routed experts: which experts each token chose.

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct RouterCmp {
    pub tokens: usize,
    /// Tokens whose expert sets differ.
    pub flipped: Vec<usize>,
}
