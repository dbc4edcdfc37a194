//! How two float tensors differ (rel-L2, cosine, max-abs), and the noise storage and quantization
//! may put between them. Used for weights (shards, faults) and activations alike. No printing.

use serde::Serialize;

use crate::gguf::GgmlType;

/// How two tensors differ.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Diff {
    /// ‖a − b‖ / ‖b‖ (b is the reference); 0 when both are zero, ∞ when only b is.
    pub rel_l2: f64,
    pub cosine: f64,
    pub max_abs: f64,
    /// Flat index of the largest absolute difference.
    pub max_abs_at: usize,
}

/// Compares `cand` against `reference` (same length; callers check shapes first).
pub fn diff(cand: &[f32], reference: &[f32]) -> Diff {
    let (mut num, mut den, mut aa, mut ab, mut max_abs, mut at) = (0f64, 0f64, 0f64, 0f64, 0f64, 0);
    for (i, (&a, &b)) in cand.iter().zip(reference).enumerate() {
        let (a, b) = (a as f64, b as f64);
        let d = a - b;
        num += d * d;
        den += b * b;
        aa += a * a;
        ab += a * b;
        // NaN never compares greater: make a NaN difference the maximum.
        if d.abs() > max_abs || (d.is_nan() && !max_abs.is_nan()) {
            max_abs = d.abs();
            at = i;
        }
    }
    let rel_l2 = if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    let cosine = if aa > 0.0 && den > 0.0 {
        ab / (aa.sqrt() * den.sqrt())
    } else if aa == 0.0 && den == 0.0 {
        1.0
    } else {
        0.0
    };
    Diff {
        rel_l2,
        cosine,
        max_abs,
        max_abs_at: at,
    }
}

/// The relative L2 error a weight stored as `t` may legitimately carry against its f32 original:
/// [`GgmlType::noise_rel_l2`], the one quantization-noise table (src/gguf/noise.rs).
pub fn quant_rel_l2_bound(t: GgmlType) -> f64 {
    t.noise_rel_l2()
}

/// Rounding error of storing f32 values as this float dtype (of a dump), as rel-L2.
pub fn dump_dtype_rel_l2(dtype: safetensors::Dtype) -> f64 {
    match dtype {
        safetensors::Dtype::F64 | safetensors::Dtype::F32 => 1e-6,
        safetensors::Dtype::F16 => 1e-3,
        safetensors::Dtype::BF16 => 6e-3,
        _ => 0.2,
    }
}

/// The rel-L2 that storing an activation in `dtype` may add by itself: round-to-nearest errs by at
/// most half a unit in the last place, 2⁻⁸ of the value for bf16 (8 significant bits), 2⁻¹¹ for f16,
/// 2⁻²⁴ for f32 — the pointwise worst case, so a sum of such errors stays under it in rel-L2 too.
pub fn activation_storage_rel_l2(dtype: safetensors::Dtype) -> f64 {
    match dtype {
        safetensors::Dtype::BF16 => 2f64.powi(-8),
        safetensors::Dtype::F16 => 2f64.powi(-11),
        safetensors::Dtype::F32 => 2f64.powi(-24),
        _ => 0.0,
    }
}

/// Half a unit in the last place of `x` stored as `dtype` (0 for f64 and non-float dtypes): how far
/// a stored value may be from the one computed.
pub fn storage_half_ulp(dtype: safetensors::Dtype, x: f32) -> f64 {
    let bits = match dtype {
        safetensors::Dtype::BF16 => 8,
        safetensors::Dtype::F16 => 11,
        safetensors::Dtype::F32 => 24,
        _ => return 0.0,
    };
    let a = (x as f64).abs();
    if a == 0.0 || !a.is_finite() {
        // Zero is exact; subnormals and infinities do not decide a comparison.
        return 0.0;
    }
    2f64.powi(a.log2().floor() as i32 - bits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diff_basics() {
        let d = diff(&[1.0, 2.0, 2.0], &[1.0, 2.0, 3.0]);
        assert!((d.rel_l2 - (1.0f64 / 14.0).sqrt()).abs() < 1e-12);
        assert_eq!(d.max_abs, 1.0);
        assert_eq!(d.max_abs_at, 2);
        assert_eq!(diff(&[0.0; 3], &[0.0; 3]).rel_l2, 0.0);
        assert_eq!(diff(&[1.0], &[0.0]).rel_l2, f64::INFINITY);
        assert!(diff(&[f32::NAN], &[1.0]).max_abs.is_nan());
        assert!((diff(&[2.0, 0.0], &[1.0, 0.0]).cosine - 1.0).abs() < 1e-12);
    }

    #[test]
    fn storage_rounding_is_half_an_ulp() {
        use safetensors::Dtype;
        // bf16 keeps 8 significant bits: 1.0 + 2⁻⁸ rounds to 1.0 or 1.0 + 2⁻⁷.
        assert_eq!(storage_half_ulp(Dtype::BF16, 1.0), 2f64.powi(-8));
        assert_eq!(storage_half_ulp(Dtype::BF16, 3.0), 2f64.powi(-7));
        assert_eq!(storage_half_ulp(Dtype::F16, -1.5), 2f64.powi(-11));
        assert_eq!(storage_half_ulp(Dtype::F64, 1.0), 0.0);
        for x in [0.1f32, 1.7, -23.25, 1e-3, 7.9e4] {
            let b = half::bf16::from_f32(x).to_f32();
            assert!(
                ((b - x) as f64).abs() <= storage_half_ulp(Dtype::BF16, x),
                "{x}"
            );
            let rel = ((b - x) / x).abs() as f64;
            assert!(rel <= activation_storage_rel_l2(Dtype::BF16), "{x}");
        }
    }

    #[test]
    fn coarser_types_get_looser_bounds() {
        assert!(quant_rel_l2_bound(GgmlType::Q8_0) < quant_rel_l2_bound(GgmlType::Q6_K));
        assert!(quant_rel_l2_bound(GgmlType::Q6_K) < quant_rel_l2_bound(GgmlType::Q4_K));
    }
}
