//! `shards --verify` (the GGUF's own shards are sound), `shards --against DIR` (what a deployment's
//! ranks hold, diagnosed) and `inject` (the dump a known loader bug would leave). No printing:
//! reports are typed values for `report::shards`.

mod against;
mod diagnose;
mod inject;
mod provenance;
mod verify;

pub use against::{
    against, rank_list, AgainstError, AgainstOptions, AgainstReport, Checked, Class, Finding,
    Provenance, ProvenanceBasis, Unchecked, UncheckedReason, UnreadableRank, Verdict,
};
pub use diagnose::Cause;
pub use inject::{inject, inject_with, InjectSpec};
pub use provenance::{dump_weights, DumpWeights, Relation};
pub use verify::{verify, KvbPart, Problem, ReassemblyCheck, VerifyReport, VerifyRow};

use candle_core::Tensor;

fn values(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}
