//! What a per-rank dump's weights are, relative to the GGUF: where their values came from (this
//! GGUF's dequantized values, or the unquantized originals) and the float type they are stored in.
//! A forward fed by the dump may differ from the GGUF's own forward by exactly that much.

use serde::Serialize;

use super::against::{against, AgainstError, AgainstOptions, Provenance, ProvenanceBasis};
use crate::dump::{is_float, RankDump};
use crate::gguf::GgmlType;
use crate::plan::ShardPlan;
use crate::weights::Weights;

/// How a dump's weights relate to the GGUF's.
#[derive(Debug, Clone, Serialize)]
pub struct DumpWeights {
    /// Decided from the sampled layer's quantized parameters (see [`super::against`]).
    pub provenance: ProvenanceBasis,
    /// The coarsest float type any rank file stores a tensor in (BF16 for a bf16 deployment).
    pub stored: GgmlType,
    /// The layer whose parameters decided the provenance: the first holding a quantized parameter
    /// (None: the GGUF quantizes nothing, so provenance cannot matter).
    pub sampled_layer: Option<usize>,
    /// The GGUF's coarsest matrix type.
    pub gguf: GgmlType,
}

/// What the provenance check could tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Relation {
    /// The GGUF quantizes nothing: its values and the originals are the same.
    Unquantized,
    /// The dump's storage rounding is as coarse as the GGUF's quantization (Q8_0 in bf16): the
    /// two provenances cannot be told apart.
    Indistinct,
    /// The sampled layer's quantized shards equal this GGUF's dequantized values.
    Dequantized,
    /// They differ from them by quantization noise: the originals.
    Originals,
}

impl DumpWeights {
    /// The weight type whose noise separates the dump's weights from the GGUF's dequantized ones:
    /// the dump's storage rounding when it holds this GGUF's values, else also the GGUF's own
    /// quantization noise (the originals differ from the GGUF by it).
    pub fn class(&self) -> GgmlType {
        match self.relation() {
            Relation::Dequantized => self.stored,
            _ if self.gguf.noise_rel_l2() > self.stored.noise_rel_l2() => self.gguf,
            _ => self.stored,
        }
    }

    /// What the check could tell: the provenance counts only where the GGUF's quantization noise
    /// stands clear of the dump's storage rounding (the margin `shards --against` uses).
    pub fn relation(&self) -> Relation {
        if self.sampled_layer.is_none() {
            Relation::Unquantized
        } else if self.gguf.noise_rel_l2() <= 2.0 * self.stored.noise_rel_l2() {
            Relation::Indistinct
        } else if self.provenance.provenance == Provenance::Gguf {
            Relation::Dequantized
        } else {
            Relation::Originals
        }
    }
}

/// The float type a safetensors dtype rounds to, as a GGML type.
fn ggml_of(d: safetensors::Dtype) -> GgmlType {
    match d {
        safetensors::Dtype::BF16 => GgmlType::BF16,
        safetensors::Dtype::F16 => GgmlType::F16,
        _ => GgmlType::F32,
    }
}

/// Decides what the dump's weights are from one layer (the first with a quantized parameter; its
/// parameters are compared with the plan's cut as `shards --against` does) and the rank files'
/// stored types. Bounded by that layer's parameters, read one expert at a time.
pub fn dump_weights(
    w: &Weights<'_>,
    plan: &ShardPlan,
    dump: &RankDump,
    gguf: GgmlType,
) -> Result<DumpWeights, AgainstError> {
    let quantized = |p: &crate::plan::ParamPlan| p.dtypes.iter().any(|t| t.noise_bits() < 16);
    let sampled_layer = plan
        .params
        .iter()
        .find(|p| p.layer.is_some() && quantized(p))
        .and_then(|p| p.layer);
    let mut stored = GgmlType::F32;
    for r in 0..plan.tp {
        let Some(f) = dump.open_rank(r)? else {
            continue;
        };
        for name in f.names() {
            let t = match f.dtype(&name) {
                Some(d) if is_float(d) => ggml_of(d),
                _ => continue,
            };
            if t.noise_rel_l2() > stored.noise_rel_l2() {
                stored = t;
            }
        }
    }
    let provenance = match sampled_layer {
        Some(layer) => {
            let sample = ShardPlan {
                tp: plan.tp,
                params: plan
                    .params
                    .iter()
                    .filter(|p| p.layer == Some(layer))
                    .cloned()
                    .collect(),
                mtp_blocks: plan.mtp_blocks.clone(),
            };
            against(w, &sample, dump, &AgainstOptions::default(), &mut |_| {})?.provenance
        }
        None => ProvenanceBasis {
            provenance: Provenance::Gguf,
            forced: false,
            quantized_shards: 0,
            equal_to_dequantized: 0,
        },
    };
    Ok(DumpWeights {
        provenance,
        stored,
        sampled_layer,
        gguf,
    })
}
