//! The closed sets the command line accepts, as clap `ValueEnum`s (their spellings are the flags'
//! possible values), each mapped exhaustively onto the library's type, and the tolerance overrides
//! `forward` and `diff` share.

use clap::ValueEnum;

use crate::arch::glm_dsa::VllmNames;
use crate::compare::{ComputeDtype, ReferenceWeights, Tolerances};
use crate::model::{DsaMode, MatmulMode};
use crate::shards::Provenance;

// No doc comments on the variants below: clap would list them in --help as value descriptions.

/// `forward --dsa`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DsaArg {
    Sparse,
    Dense,
}

impl From<DsaArg> for DsaMode {
    fn from(a: DsaArg) -> Self {
        match a {
            DsaArg::Sparse => DsaMode::Sparse,
            DsaArg::Dense => DsaMode::Dense,
        }
    }
}

/// `forward --matmul`: how weights kept as quantized blocks are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MatmulArg {
    /// Decode the blocks into the compute dtype for each product: the GGUF's own values, for
    /// diagnosis (on CUDA inside the GEMM where the tiled kernels cover the weight)
    Dequant,
    /// What a GGUF deployment computes: activations quantized to 8 bits per block, llama.cpp's
    /// kernels (candle's MMVQ/MMQ, glmcheck's grouped MoE kernel); judged at looser bounds
    Q8,
}

impl From<MatmulArg> for MatmulMode {
    fn from(a: MatmulArg) -> Self {
        match a {
            MatmulArg::Dequant => MatmulMode::Dequant,
            MatmulArg::Q8 => MatmulMode::Q8,
        }
    }
}

/// `forward --dtype`: what the forward computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ForwardDtype {
    F32,
    Bf16,
}

impl From<ForwardDtype> for ComputeDtype {
    fn from(a: ForwardDtype) -> Self {
        match a {
            ForwardDtype::F32 => ComputeDtype::F32,
            ForwardDtype::Bf16 => ComputeDtype::Bf16,
        }
    }
}

/// `diff --dtype`: what the candidate computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DiffDtype {
    F32,
    Bf16,
    F16,
}

impl From<DiffDtype> for ComputeDtype {
    fn from(a: DiffDtype) -> Self {
        match a {
            DiffDtype::F32 => ComputeDtype::F32,
            DiffDtype::Bf16 => ComputeDtype::Bf16,
            DiffDtype::F16 => ComputeDtype::F16,
        }
    }
}

/// `inject --dtype`: the dtype of the dumped tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DumpDtype {
    F32,
    Bf16,
    F16,
}

impl From<DumpDtype> for safetensors::Dtype {
    fn from(a: DumpDtype) -> Self {
        match a {
            DumpDtype::F32 => safetensors::Dtype::F32,
            DumpDtype::Bf16 => safetensors::Dtype::BF16,
            DumpDtype::F16 => safetensors::Dtype::F16,
        }
    }
}

/// `shards --against --provenance`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProvenanceArg {
    Gguf,
    Originals,
}

impl From<ProvenanceArg> for Provenance {
    fn from(a: ProvenanceArg) -> Self {
        match a {
            ProvenanceArg::Gguf => Provenance::Gguf,
            ProvenanceArg::Originals => Provenance::Originals,
        }
    }
}

/// `inject --vllm-names`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VllmNamesArg {
    #[value(name = "0.33")]
    V033,
    Legacy,
}

impl From<VllmNamesArg> for VllmNames {
    fn from(a: VllmNamesArg) -> Self {
        match a {
            VllmNamesArg::V033 => VllmNames::V033,
            VllmNamesArg::Legacy => VllmNames::Legacy,
        }
    }
}

/// `--reference-weights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RefWeightsArg {
    Same,
    SameGguf,
    Original,
}

impl From<RefWeightsArg> for ReferenceWeights {
    fn from(a: RefWeightsArg) -> Self {
        match a {
            RefWeightsArg::Same => ReferenceWeights::Same,
            RefWeightsArg::SameGguf => ReferenceWeights::SameGguf,
            RefWeightsArg::Original => ReferenceWeights::Original,
        }
    }
}

/// Overrides of the comparison tolerances.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TolFlags {
    /// Largest rel-L2 of a float module.
    #[arg(long, value_name = "X")]
    pub rel_l2: Option<f64>,
    /// Largest mean KL(ref ‖ cand) of the next-token distributions, nats.
    #[arg(long, value_name = "X")]
    pub kl_mean: Option<f64>,
    /// Largest per-position KL, nats.
    #[arg(long, value_name = "X")]
    pub kl_max: Option<f64>,
    /// Smallest fraction of positions whose top-1 token agrees (0..1).
    #[arg(long, value_name = "X")]
    pub top1_min: Option<f64>,
    /// Index-score noise, relative to a row's largest score: top-k swaps with a smaller margin are near-ties.
    #[arg(long, value_name = "X")]
    pub score_noise: Option<f64>,
    /// Largest fraction of tokens whose routed experts may differ while the router logits agree.
    #[arg(long, value_name = "X")]
    pub router_flips: Option<f64>,
    /// Modules whose layouts cannot be matched (shapes that differ beyond singleton dims) are
    /// listed but do not make the run "incomplete" (exit 1).
    #[arg(long)]
    pub allow_incomparable: bool,
    /// What the reference's weights are: same (glmcheck's --dump of the same GGUF: only the compute
    /// dtype differs), same-gguf (the same GGUF run by another engine, e.g. llama.cpp: its kernel
    /// noise too), original (the unquantized checkpoint, e.g. transformers: the quant type's noise).
    /// Default: same for glmcheck's dump of this GGUF, else original.
    #[arg(long, value_enum, value_name = "KIND")]
    pub reference_weights: Option<RefWeightsArg>,
}

impl TolFlags {
    /// `t` with the flags given applied, and the overridden ones named in its basis.
    pub fn apply(&self, mut t: Tolerances) -> Tolerances {
        let mut changed = Vec::new();
        let mut set = |slot: &mut f64, v: Option<f64>, name: &'static str| {
            if let Some(v) = v {
                *slot = v;
                changed.push(name);
            }
        };
        set(&mut t.rel_l2, self.rel_l2, "rel-l2");
        set(&mut t.kl_mean, self.kl_mean, "kl-mean");
        set(&mut t.kl_max, self.kl_max, "kl-max");
        set(&mut t.top1_min, self.top1_min, "top1-min");
        set(&mut t.score_noise, self.score_noise, "score-noise");
        set(&mut t.router_flip_max, self.router_flips, "router-flips");
        t.basis.overridden.extend(changed);
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn possible_values_keep_their_spellings() {
        let names = |v: &[clap::builder::PossibleValue]| {
            v.iter()
                .map(|p| p.get_name().to_string())
                .collect::<Vec<_>>()
        };
        let pv = |x: Option<clap::builder::PossibleValue>| x.expect("not skipped");
        assert_eq!(
            names(
                &DsaArg::value_variants()
                    .iter()
                    .map(|v| pv(v.to_possible_value()))
                    .collect::<Vec<_>>()
            ),
            ["sparse", "dense"]
        );
        assert_eq!(
            names(
                &VllmNamesArg::value_variants()
                    .iter()
                    .map(|v| pv(v.to_possible_value()))
                    .collect::<Vec<_>>()
            ),
            ["0.33", "legacy"]
        );
        assert_eq!(
            names(
                &RefWeightsArg::value_variants()
                    .iter()
                    .map(|v| pv(v.to_possible_value()))
                    .collect::<Vec<_>>()
            ),
            ["same", "same-gguf", "original"]
        );
        assert_eq!(DumpDtype::from_str("bf16", false), Ok(DumpDtype::Bf16));
        assert!(ForwardDtype::from_str("f16", false).is_err());
        assert_eq!(DiffDtype::from_str("f16", false), Ok(DiffDtype::F16));
    }

    #[test]
    fn every_dump_dtype_is_written_as_itself() {
        use safetensors::Dtype;
        assert_eq!(Dtype::from(DumpDtype::F32), Dtype::F32);
        assert_eq!(Dtype::from(DumpDtype::Bf16), Dtype::BF16);
        assert_eq!(Dtype::from(DumpDtype::F16), Dtype::F16);
    }

    #[test]
    fn overrides_replace_values_and_are_named() {
        let base = Tolerances::for_profile(ComputeDtype::F32, crate::gguf::GgmlType::F32);
        let same = TolFlags::default().apply(base.clone());
        assert_eq!(same.basis, base.basis);
        let t = TolFlags {
            rel_l2: Some(0.25),
            router_flips: Some(0.5),
            ..TolFlags::default()
        }
        .apply(base.clone());
        assert_eq!(t.rel_l2, 0.25);
        assert_eq!(t.router_flip_max, 0.5);
        assert_eq!(t.kl_mean, base.kl_mean);
        assert_eq!(t.basis.overridden, vec!["rel-l2", "router-flips"]);
        assert!(
            t.basis
                .to_string()
                .ends_with("; overridden: rel-l2, router-flips"),
            "{}",
            t.basis
        );
    }
}

/// `--device cpu | cuda | cuda:N`: where the forward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceArg {
    #[default]
    Cpu,
    /// An NVIDIA GPU by ordinal (needs a build with `--features cuda`).
    Cuda(usize),
}

impl std::str::FromStr for DeviceArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceArg::Cpu),
            "cuda" => Ok(DeviceArg::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceArg::Cuda)
                .ok_or_else(|| format!("`{s}`: expected cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceArg::Cpu => f.write_str("cpu"),
            DeviceArg::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceArg {
    /// The candle device; a CUDA device in a build without the `cuda` feature, or one the machine
    /// does not have, is an error naming it.
    pub fn open(self) -> Result<candle_core::Device, super::CmdError> {
        match self {
            DeviceArg::Cpu => Ok(candle_core::Device::Cpu),
            DeviceArg::Cuda(n) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(super::CmdError::NoCuda(self.to_string()));
                }
                let device = candle_core::Device::new_cuda(n)
                    .map_err(|e| super::CmdError::Device(self.to_string(), e.to_string()))?;
                #[cfg(feature = "cuda")]
                crate::model::moe_cuda::keep_freed_memory(&device)
                    .map_err(|e| super::CmdError::Device(self.to_string(), e.to_string()))?;
                #[cfg(feature = "cuda")]
                crate::model::moe_cuda::skip_event_tracking(&device);
                Ok(device)
            }
        }
    }
}

#[cfg(test)]
mod device_tests {
    use super::DeviceArg;

    #[test]
    fn devices_parse_and_bad_ones_are_named() {
        assert_eq!("cpu".parse(), Ok(DeviceArg::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceArg::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceArg::Cuda(3)));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            let e = bad.parse::<DeviceArg>().expect_err(bad);
            assert!(e.contains(bad), "{e}");
        }
        assert_eq!(DeviceArg::Cuda(2).to_string(), "cuda:2");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_in_a_cpu_build_is_a_clear_error() {
        let e = DeviceArg::Cuda(0).open().expect_err("no cuda here");
        assert!(e.to_string().contains("--features cuda"), "{e}");
    }
}
