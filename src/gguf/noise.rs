//! The one quantization-noise table: for each GGML type, the bits its values keep and the
//! relative L2 error a weight stored in it may legitimately carry against its f32 original.
//!
//! Uniform rounding on a b-bit grid scaled to a block's absmax gives rel-L2 ≈ absmax / (2^(b−1)·√3·σ);
//! with Gaussian weights (absmax ≈ 2.5–3.5σ per block) that is ≈0.5 % for Q8_0, ≈3 % for 6-bit,
//! ≈6 % for 5-bit and ≈12 % for 4-bit types. The bounds below add headroom; measured values on the
//! fixtures are in fixtures/README.md and reports/. The weight-diff checks (shards, faults) use the
//! rel-L2; the activation tolerances pick their measured profile by the bits.

use super::GgmlType;

/// One row of the table: the types it covers, their noise class in bits, their rel-L2 bound.
struct NoiseClass {
    types: &'static [GgmlType],
    bits: u32,
    rel_l2: f64,
}

const TABLE: &[NoiseClass] = &[
    NoiseClass {
        types: &[GgmlType::F32, GgmlType::F64],
        bits: 32,
        rel_l2: 1e-6,
    },
    NoiseClass {
        types: &[GgmlType::F16],
        bits: 16,
        rel_l2: 1e-3,
    },
    NoiseClass {
        types: &[GgmlType::BF16],
        bits: 16,
        rel_l2: 6e-3,
    },
    NoiseClass {
        types: &[GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8_K],
        bits: 8,
        rel_l2: 1.2e-2,
    },
    NoiseClass {
        types: &[GgmlType::Q6_K],
        bits: 6,
        rel_l2: 4e-2,
    },
    NoiseClass {
        types: &[GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q5_K],
        bits: 5,
        rel_l2: 8e-2,
    },
    NoiseClass {
        types: &[
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
            GgmlType::IQ4_NL,
            GgmlType::IQ4_XS,
            GgmlType::MXFP4,
            GgmlType::NVFP4,
        ],
        bits: 4,
        rel_l2: 0.16,
    },
    NoiseClass {
        types: &[GgmlType::Q3_K, GgmlType::IQ3_XXS, GgmlType::IQ3_S],
        bits: 3,
        rel_l2: 0.3,
    },
];

/// Every other type (2-bit and below, ternary, integer): the loosest class.
const OTHER: NoiseClass = NoiseClass {
    types: &[],
    bits: 3,
    rel_l2: 0.6,
};

impl GgmlType {
    fn noise_class(self) -> &'static NoiseClass {
        TABLE
            .iter()
            .find(|c| c.types.contains(&self))
            .unwrap_or(&OTHER)
    }

    /// The relative L2 error a weight stored as this type may legitimately carry against its f32
    /// original.
    pub fn noise_rel_l2(self) -> f64 {
        self.noise_class().rel_l2
    }

    /// The noise class in bits (32 for f32/f64, 16 for half floats, 8, 6, 5, 4, else 3): what picks
    /// an activation tolerance profile.
    pub fn noise_bits(self) -> u32 {
        self.noise_class().bits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_has_one_class() {
        for t in GgmlType::ALL {
            assert!(
                TABLE.iter().filter(|c| c.types.contains(t)).count() <= 1,
                "{t}"
            );
        }
    }

    #[test]
    fn concrete_bounds() {
        assert_eq!(GgmlType::F32.noise_rel_l2(), 1e-6);
        assert_eq!(GgmlType::BF16.noise_rel_l2(), 6e-3);
        assert_eq!(GgmlType::Q8_0.noise_rel_l2(), 1.2e-2);
        assert_eq!(GgmlType::Q4_K.noise_rel_l2(), 0.16);
        assert_eq!(GgmlType::IQ3_S.noise_rel_l2(), 0.3);
        assert_eq!(GgmlType::Q2_K.noise_rel_l2(), 0.6);
        assert_eq!(GgmlType::F64.noise_bits(), 32);
        assert_eq!(GgmlType::F16.noise_bits(), 16);
        assert_eq!(GgmlType::Q8_K.noise_bits(), 8);
        assert_eq!(GgmlType::Q6_K.noise_bits(), 6);
        assert_eq!(GgmlType::Q5_1.noise_bits(), 5);
        assert_eq!(GgmlType::MXFP4.noise_bits(), 4);
        assert_eq!(GgmlType::Q2_K.noise_bits(), 3);
        assert_eq!(GgmlType::IQ2_XXS.noise_bits(), 3);
    }

    #[test]
    fn fewer_bits_never_mean_less_noise() {
        let mut rows: Vec<(u32, f64)> = TABLE.iter().map(|c| (c.bits, c.rel_l2)).collect();
        rows.push((OTHER.bits, OTHER.rel_l2));
        for w in rows.windows(2) {
            assert!(w[0].0 >= w[1].0 && w[0].1 <= w[1].1, "{w:?}");
        }
    }
}
