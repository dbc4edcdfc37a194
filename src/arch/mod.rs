//! Architecture knowledge: the one place that knows tensor names (GGUF ↔ HF ↔ vLLM), roles and
//! metadata keys. Another architecture would be a sibling of `glm_dsa`.

pub mod config;
pub mod glm_dsa;
pub mod hf_config;

pub use config::{Config, ConfigReport, ARCH};
