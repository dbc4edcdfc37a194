//! Tolerances: how far a candidate may be from its reference, by compute dtype, weight type and
//! what the reference's weights are.

use std::path::Path;

use candle_core::DType;
use serde::Serialize;

use super::io::{meta, Activations};
use crate::gguf::{GgmlType, GgufModel};

// Tolerances

/// The arithmetic a forward ran in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    F32,
    Bf16,
    F16,
}

impl ComputeDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(ComputeDtype::F32),
            "bf16" | "bfloat16" => Some(ComputeDtype::Bf16),
            "f16" | "float16" => Some(ComputeDtype::F16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "f16",
        }
    }

    pub fn candle(self) -> DType {
        match self {
            ComputeDtype::F32 => DType::F32,
            ComputeDtype::Bf16 => DType::BF16,
            ComputeDtype::F16 => DType::F16,
        }
    }
}

/// The coarsest type among a GGUF's matrices (≥ 2 dims): what decides its weight noise.
pub fn weight_class(model: &GgufModel) -> GgmlType {
    model
        .tensors()
        .filter(|t| t.info.ne.len() >= 2)
        .map(|t| t.info.dtype)
        .max_by(|a, b| {
            a.noise_rel_l2()
                .total_cmp(&b.noise_rel_l2())
                .then(b.bits_per_weight().total_cmp(&a.bits_per_weight()))
        })
        .unwrap_or(GgmlType::F32)
}

/// What the reference's weights are, relative to the candidate's GGUF: what may differ decides the
/// bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReferenceWeights {
    /// The same GGUF run by glmcheck (its `--dump`): only the compute dtype may differ.
    Same,
    /// The same GGUF run by another engine (llama.cpp, a deployment's dump): its kernels differ
    /// (activations quantized for the matmuls, fused kernels), the weights do not.
    SameGguf,
    /// The unquantized originals (a transformers dump of the HF checkpoint): the quant type's
    /// noise on top.
    Original,
}

impl ReferenceWeights {
    pub fn name(self) -> &'static str {
        match self {
            ReferenceWeights::Same => "same",
            ReferenceWeights::SameGguf => "same-gguf",
            ReferenceWeights::Original => "original",
        }
    }

    /// What a dump's metadata says: glmcheck's dump of a GGUF with this file name and weight class
    /// is the same GGUF; anything else is taken as the originals (the loosest, never a false
    /// alarm from weight noise).
    pub fn of_dump(acts: &Activations, gguf: &Path, weights: GgmlType) -> Self {
        let base = |p: &str| {
            Path::new(p)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        };
        let same_file = acts
            .metadata
            .get(meta::GGUF)
            .and_then(|g| base(g))
            .zip(base(&gguf.to_string_lossy()))
            .is_some_and(|(a, b)| a == b);
        let same_type = acts.metadata.get(meta::WEIGHTS).map(String::as_str) == Some(weights.name);
        if same_file && same_type {
            ReferenceWeights::Same
        } else {
            ReferenceWeights::Original
        }
    }
}

/// What a set of tolerances rests on: the profile it was measured (or derived) for, and the flags
/// that overrode figures of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Basis {
    pub dtype: ComputeDtype,
    pub weights: GgmlType,
    pub kind: BasisKind,
    /// The flags (`rel-l2`, `kl-mean`, …) that replaced a figure, in the order applied.
    pub overridden: Vec<&'static str>,
}

/// Where the figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BasisKind {
    /// Measured on the fixtures for this compute dtype and weight type.
    Measured,
    /// 5- and 6-bit types: the 4-bit figures.
    FromFourBit,
    /// 2- and 3-bit types: twice the 4-bit figures.
    TwiceFourBit,
    /// f16 compute: bf16's figures.
    FromBf16,
    /// The same weights on both sides (glmcheck's own run): only the compute dtype differs.
    SameWeights,
    /// The same GGUF run by another engine: its kernels' noise, measured against llama.cpp.
    OtherEngine,
}

/// How far a candidate may be from an f32 transformers reference and still be correct.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tolerances {
    /// Largest rel-L2 of any float module.
    pub rel_l2: f64,
    /// Mean over positions of KL(ref ‖ cand) of the next-token distributions, nats.
    pub kl_mean: f64,
    /// Largest per-position KL.
    pub kl_max: f64,
    /// Smallest fraction of positions whose top-1 token agrees.
    pub top1_min: f64,
    /// Noise of an index score, relative to the largest visible |score| of its row: a top-k swap
    /// whose margin is below it is a near-tie.
    pub score_noise: f64,
    /// Largest fraction of tokens whose routed experts may differ (near-tied expert scores) while
    /// the router logits agree.
    pub router_flip_max: f64,
    /// What the figures are based on (worded by `crate::report::reading`).
    pub basis: Basis,
    /// What the reference's weights are (decides which figures apply).
    pub reference: ReferenceWeights,
    /// Per module class (a glob over the module path without `model.layers.N.`, e.g.
    /// `mlp.experts*` or `self_attn.kv_b_proj`): its own largest rel-L2, in place of `rel_l2`
    /// (gate.toml's `[tolerances.rel_l2_by_class]`). The first matching class wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rel_l2_by_class: Vec<(String, f64)>,
}

impl Tolerances {
    /// The largest rel-L2 of module `name`: its class's bound if one matches, else `rel_l2`.
    pub fn rel_l2_for(&self, name: &str) -> f64 {
        let class = module_class(name);
        self.rel_l2_by_class
            .iter()
            .find(|(glob, _)| crate::gguf::stats::glob_match(glob, &class))
            .map_or(self.rel_l2, |&(_, x)| x)
    }

    /// Tolerances for a forward in `dtype` on weights whose coarsest matrix type is `weights`,
    /// against an f32 transformers reference.
    ///
    /// Measured on the fixtures (glmcheck's forward of each GGUF against transformers' f32 dumps of
    /// both prompts, the reference's top-k replayed at indexer ties, every captured module; produced
    /// by `cargo test --test forward_cli measured_figures_sit_inside_their_profiles -- --nocapture`, full table in
    /// reports/forward-tolerances.md). Worst over both prompts:
    ///
    /// | compute | weights | worst rel-L2 (module / index scores) | KL mean / max | top-1 | top-k swap margin / row max | routed-expert flips |
    /// |---|---|---|---|---|---|---|
    /// | f32 | F32 | 9.7e-7 / 1.2e-6 | 6.7e-13 / 1.1e-12 | 45/45 | 0 (one exact tie) | 0 |
    /// | f32 | BF16 | 5.2e-3 / 6.9e-3 | 1.7e-5 / 2.5e-5 | 45/45 | 0.002 | 0 |
    /// | f32 | Q8_0 | 1.8e-2 / 2.2e-2 | 1.9e-4 / 3.3e-4 | 43/45 | 0.010 | 0 |
    /// | f32 | Q4_K (Q4_K_M mix) | 0.22 / 0.31 | 2.1e-2 / 3.8e-2 | 34/40 | 0.91 | 3 of 27 tokens in a layer |
    /// | bf16 | F32 or BF16 | 1.2e-2 / 1.6e-2 | 1.1e-4 / 2.2e-4 | 44/45 | 0.007 | 0 |
    /// | bf16 | Q8_0 | 2.2e-2 / 2.6e-2 | 2.6e-4 / 4.4e-4 | 45/45 | 0.010 | 0 |
    /// | bf16 | Q4_K (Q4_K_M mix) | 0.22 / 0.31 | 2.2e-2 / 3.9e-2 | 31/39 | 0.91 | 3 of 27 tokens in a layer |
    ///
    /// The bounds below are those figures with about 3× headroom (rel-L2 covers the index scores,
    /// the noisiest float output; f32 on F32 keeps the acceptance bound 1e-4). At 4 bits a top-k
    /// swap margin reached 0.91 of the row's largest score, so there every indexer swap counts as a
    /// near-tie: the indexer's choices are noise-dominated at that precision, and a broken indexer
    /// shows in its float outputs instead. Not measured, derived: f16 compute takes bf16's bounds;
    /// 5- and 6-bit types take the 4-bit ones; 2- and 3-bit types twice those.
    /// Tolerances against a reference whose weights relate to the candidate's as `reference` says:
    /// the same GGUF through glmcheck leaves only the compute dtype ([`Self::for_profile`] with F32
    /// weights); the same GGUF through another engine adds its kernels' noise, measured against
    /// llama.cpp's logits of the fixtures (llama-cpp-python 0.3.36, both prompts, worst: F32 KL
    /// 9.0e-8, BF16 2.2e-5, Q8_0 mean 8.6e-3 / max 8.0e-2 / top-1 15 of 18, Q4_K_M mean 1.7e-2 /
    /// max 0.15 / top-1 25 of 27 — its indexer picks near-ties differently), bounds about 3× that;
    /// the originals take the full profile.
    pub fn for_reference(
        dtype: ComputeDtype,
        weights: GgmlType,
        reference: ReferenceWeights,
    ) -> Self {
        match reference {
            ReferenceWeights::Original => Self::for_profile(dtype, weights),
            ReferenceWeights::Same => {
                let mut t = Self::for_profile(dtype, GgmlType::F32);
                t.reference = reference;
                t.basis = Basis {
                    dtype,
                    weights,
                    kind: BasisKind::SameWeights,
                    overridden: Vec::new(),
                };
                t
            }
            ReferenceWeights::SameGguf => {
                let bits = weights.noise_bits();
                let mut t =
                    Self::for_profile(dtype, if bits >= 16 { weights } else { GgmlType::F32 });
                if bits < 16 {
                    let full = Self::for_profile(dtype, weights);
                    let (kl_mean, kl_max) = if bits >= 8 {
                        (3e-2, 0.25)
                    } else {
                        (5e-2, 0.45)
                    };
                    t = Tolerances {
                        kl_mean,
                        kl_max,
                        top1_min: 0.75,
                        ..full
                    };
                }
                t.reference = reference;
                t.basis = Basis {
                    dtype,
                    weights,
                    kind: BasisKind::OtherEngine,
                    overridden: Vec::new(),
                };
                t
            }
        }
    }

    pub fn for_profile(dtype: ComputeDtype, weights: GgmlType) -> Self {
        let bits = weights.noise_bits();
        let half = dtype != ComputeDtype::F32;
        // (rel_l2, kl_mean, kl_max, top1_min, score_noise, router_flip_max)
        use BasisKind::*;
        let (v, kind): ((f64, f64, f64, f64, f64, f64), BasisKind) = match (half, bits) {
            (false, 32) => ((1e-4, 1e-6, 1e-5, 1.0, 1e-5, 0.0), Measured),
            (false, 16) => ((2e-2, 1e-4, 2e-4, 0.9, 1e-2, 0.1), Measured),
            (true, 16..) => ((5e-2, 5e-4, 1e-3, 0.85, 3e-2, 0.1), Measured),
            (false, 8) => ((6e-2, 8e-4, 1.5e-3, 0.85, 4e-2, 0.1), Measured),
            (true, 8) => ((8e-2, 1e-3, 2e-3, 0.85, 4e-2, 0.1), Measured),
            (_, 4) => ((0.6, 8e-2, 0.15, 0.5, 2.0, 0.3), Measured),
            (_, 5..=6) => ((0.6, 8e-2, 0.15, 0.5, 2.0, 0.3), FromFourBit),
            _ => ((1.2, 0.16, 0.3, 0.3, 2.0, 0.5), TwiceFourBit),
        };
        let kind = if dtype == ComputeDtype::F16 {
            FromBf16
        } else {
            kind
        };
        Tolerances {
            rel_l2: v.0,
            kl_mean: v.1,
            kl_max: v.2,
            top1_min: v.3,
            score_noise: v.4,
            router_flip_max: v.5,
            reference: ReferenceWeights::Original,
            basis: Basis {
                dtype,
                weights,
                kind,
                overridden: Vec::new(),
            },
            rel_l2_by_class: Vec::new(),
        }
    }
}

/// A module's class: its path without `model.layers.N.` (`model.layers.3.mlp.experts` →
/// `mlp.experts`; a layer's own output → `layer`), or without `model.` outside the layers.
pub fn module_class(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("model.layers.") {
        return match rest.split_once('.') {
            Some((_, class)) => class.to_string(),
            None => "layer".to_string(),
        };
    }
    name.strip_prefix("model.").unwrap_or(name).to_string()
}

/// The compute dtype and weight type a dump says it was made with: glmcheck's metadata, else the
/// transformers dump's `dtype` (its weights are taken as the f32 originals), else f32 / F32.
pub fn profile_of(acts: &Activations) -> (ComputeDtype, GgmlType) {
    let dtype = acts
        .metadata
        .get(meta::DTYPE)
        .or_else(|| acts.metadata.get("dtype"))
        .and_then(|s| ComputeDtype::parse(s))
        .unwrap_or(ComputeDtype::F32);
    let weights = acts
        .metadata
        .get(meta::WEIGHTS)
        .and_then(|s| GgmlType::from_name(s))
        .unwrap_or(GgmlType::F32);
    (dtype, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_classes_drop_the_layer_prefix_and_bounds_follow_them() {
        assert_eq!(module_class("model.layers.3.mlp.experts"), "mlp.experts");
        assert_eq!(module_class("model.layers.12"), "layer");
        assert_eq!(module_class("model.norm"), "norm");
        assert_eq!(module_class("lm_head"), "lm_head");
        let mut t = Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32);
        t.rel_l2_by_class = vec![("mlp.experts*".into(), 0.3), ("mlp*".into(), 0.2)];
        assert_eq!(t.rel_l2_for("model.layers.1.mlp.experts.act_fn#2"), 0.3);
        assert_eq!(t.rel_l2_for("model.layers.1.mlp.gate"), 0.2);
        assert_eq!(t.rel_l2_for("model.layers.1.self_attn"), t.rel_l2);
    }

    /// (rel_l2, kl_mean, kl_max, top1_min, score_noise, router_flip_max)
    fn figures(t: &Tolerances) -> (f64, f64, f64, f64, f64, f64) {
        (
            t.rel_l2,
            t.kl_mean,
            t.kl_max,
            t.top1_min,
            t.score_noise,
            t.router_flip_max,
        )
    }

    #[test]
    fn profiles_give_the_measured_bounds() {
        let p = |d, w| figures(&Tolerances::for_profile(d, w));
        use ComputeDtype::{Bf16, F16, F32};
        assert_eq!(p(F32, GgmlType::F32), (1e-4, 1e-6, 1e-5, 1.0, 1e-5, 0.0));
        assert_eq!(p(F32, GgmlType::BF16), (2e-2, 1e-4, 2e-4, 0.9, 1e-2, 0.1));
        assert_eq!(p(Bf16, GgmlType::F32), (5e-2, 5e-4, 1e-3, 0.85, 3e-2, 0.1));
        assert_eq!(
            p(F32, GgmlType::Q8_0),
            (6e-2, 8e-4, 1.5e-3, 0.85, 4e-2, 0.1)
        );
        assert_eq!(p(Bf16, GgmlType::Q8_0), (8e-2, 1e-3, 2e-3, 0.85, 4e-2, 0.1));
        assert_eq!(p(F32, GgmlType::Q4_K), (0.6, 8e-2, 0.15, 0.5, 2.0, 0.3));
        // 5- and 6-bit take the 4-bit bounds, 2- and 3-bit twice those; f16 takes bf16's.
        assert_eq!(p(F32, GgmlType::Q6_K), p(F32, GgmlType::Q4_K));
        assert_eq!(p(F32, GgmlType::Q2_K), (1.2, 0.16, 0.3, 0.3, 2.0, 0.5));
        assert_eq!(p(F16, GgmlType::BF16), p(Bf16, GgmlType::BF16));
        let t = Tolerances::for_profile(F16, GgmlType::Q8_0);
        assert_eq!(t.basis.kind, BasisKind::FromBf16);
        assert_eq!(
            t.basis.to_string(),
            "f16 compute, Q8_0 weights (derived from bf16)"
        );
        assert_eq!(t.reference, ReferenceWeights::Original);
        let t = Tolerances::for_profile(F32, GgmlType::Q5_K);
        assert_eq!(
            t.basis.to_string(),
            "f32 compute, Q5_K weights (derived from 4-bit)"
        );
    }

    #[test]
    fn references_pick_their_bounds() {
        use ComputeDtype::F32;
        let r = |w, kind| Tolerances::for_reference(F32, w, kind);
        // The originals: the full profile.
        assert_eq!(
            r(GgmlType::Q4_K, ReferenceWeights::Original),
            Tolerances::for_profile(F32, GgmlType::Q4_K)
        );
        // The same GGUF through glmcheck: only the compute dtype may differ.
        let same = r(GgmlType::Q4_K, ReferenceWeights::Same);
        assert_eq!(
            figures(&same),
            figures(&Tolerances::for_profile(F32, GgmlType::F32))
        );
        assert_eq!(same.reference, ReferenceWeights::Same);
        // The same GGUF through another engine: the kernels' noise on top.
        let q8 = r(GgmlType::Q8_0, ReferenceWeights::SameGguf);
        assert_eq!(figures(&q8), (6e-2, 3e-2, 0.25, 0.75, 4e-2, 0.1));
        let q4 = r(GgmlType::Q4_K, ReferenceWeights::SameGguf);
        assert_eq!(figures(&q4), (0.6, 5e-2, 0.45, 0.75, 2.0, 0.3));
        // Unquantized weights: their own profile.
        let bf16 = r(GgmlType::BF16, ReferenceWeights::SameGguf);
        assert_eq!(
            figures(&bf16),
            figures(&Tolerances::for_profile(F32, GgmlType::BF16))
        );
        assert_eq!(bf16.reference, ReferenceWeights::SameGguf);
    }

    #[test]
    fn a_dump_says_its_profile() {
        let mut a = Activations::default();
        assert_eq!(profile_of(&a), (ComputeDtype::F32, GgmlType::F32));
        a.metadata.insert(meta::DTYPE.into(), "bfloat16".into());
        a.metadata.insert(meta::WEIGHTS.into(), "Q8_0".into());
        assert_eq!(profile_of(&a), (ComputeDtype::Bf16, GgmlType::Q8_0));
        a.metadata
            .insert(meta::GGUF.into(), "/x/tiny-Q8_0.gguf".into());
        let g = Path::new("/elsewhere/tiny-Q8_0.gguf");
        assert_eq!(
            ReferenceWeights::of_dump(&a, g, GgmlType::Q8_0),
            ReferenceWeights::Same
        );
        assert_eq!(
            ReferenceWeights::of_dump(&a, g, GgmlType::Q4_K),
            ReferenceWeights::Original
        );
    }
}
