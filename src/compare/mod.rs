//! The comparison engine: activation dumps compared module by module (rel-L2 / cosine / max-abs),
//! the DSA indexer's top-k as sets with ties told apart from divergence, router choices, logit
//! metrics, tolerances by compute dtype and weight quantization, and the first divergence in
//! execution order with a typed reading. No printing and no sentences: the wording is in
//! [`crate::report::reading`] (readings, notes, suspects) and [`crate::report::forward`] (tables).
//!
//! # Dumps
//! A dump is a safetensors file of module outputs keyed by HF module path (the fixtures'
//! convention, see fixtures/README.md), with metadata `token_ids`, `prompt`, `execution_order`. Two
//! producers are known: transformers forward hooks (the fixtures: `execution_order` lists module
//! outputs only; the routed experts' `act_fn#n` rows come slot-major) and glmcheck (`--dump`:
//! `execution_order` lists every key; `act_fn#n` rows in ascending token order, marked by
//! `glmcheck.expert_act_rows = "token"`). On load both are brought to ascending token order.
//!
//! # Ties and positions
//! The model is causal and routes tokens independently, so a choice made at position `p` (an indexer
//! top-k, a router's experts) cannot change any output at a position `< p`. When two dumps choose
//! differently at a tie or near-tie, every later module is compared on the positions before the
//! earliest such choice only, and the table says so; a tie is never reported as a divergence.
//! `glmcheck forward --reference` goes further and replays the reference's choice at indexer ties
//! ([`Aligner`]), so the whole prompt stays comparable.
//!
//! # Tolerances
//! See [`Tolerances::for_profile`] for the figures measured on the fixtures.
//!
//! # Parts
//! - [`io`]: reading and writing dumps ([`Activations`]).
//! - [`graph`]: GLM-5's dataflow (which captured key feeds which, and what to suspect), as a table.
//! - [`tolerance`]: how far a candidate may be from its reference.
//! - [`diff`]: how two float tensors differ; storage and quantization noise.
//! - [`metrics`]: one float module's row (masking, token positions, shapes).
//! - [`topk`]: the indexer's top-k and its tie classes.
//! - [`router`]: routed experts (ids, weights, per-expert activations).
//! - [`logits`]: next-token distributions (KL, top-1, entropy).
//! - [`divergence`]: the first divergence and its reading.
//! - [`normalize`]: the two dumps brought to one naming and shape.
//! - [`driver`]: [`compare`], which runs the parts in execution order.
//! - [`aligner`]: a model capture that replays the reference's top-k at ties.

pub mod aligner;
pub mod behaviour;
pub mod diff;
pub mod divergence;
pub mod driver;
pub mod graph;
pub mod io;
pub mod logits;
pub mod metrics;
pub mod normalize;
pub mod router;
pub mod tolerance;
pub mod topk;

pub use aligner::Aligner;
pub use behaviour::{ModelFacts, Signature};
pub use diff::{
    activation_storage_rel_l2, diff, dump_dtype_rel_l2, quant_rel_l2_bound, storage_half_ulp, Diff,
};
pub use divergence::{Cause, FirstDivergence, IndexerSignature, InputStatus, Reading, What};
pub use driver::{compare, CmpVerdict, CompareOptions, Comparison, Exclusion, ModuleRow, Status};
pub use graph::{short_name, Module, ValueKind};
pub use io::{meta, Act, ActError, Activations, Values};
pub use logits::{entropy, garbage, logits_metrics, LogitsCmp};
pub use metrics::{common_shape, MASKED};
pub use router::RouterCmp;
pub use tolerance::{profile_of, weight_class, ComputeDtype, ReferenceWeights, Tolerances};
pub use topk::{classify_topk_row, TieClass, TopkCmp, TopkRow};
