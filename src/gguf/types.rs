//! Every GGML tensor type id that has ever been written into a GGUF file, with its block geometry.
//!
//! The table follows ggml's `ggml.h` / gguf-py's `GGML_QUANT_SIZES`. A type we know by name but cannot
//! dequantize (IQ*, TQ*, MXFP4, …) still has a byte size, so a file holding it is fully inventoried;
//! only dequantizing that one tensor fails.

use serde::Serialize;

/// One GGML tensor type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GgmlType {
    /// The id stored in the GGUF tensor info.
    pub id: u32,
    /// ggml's name, as gguf-py spells it (`Q4_K`, `IQ2_XXS`, `BF16`).
    pub name: &'static str,
    /// Elements per block.
    pub block_size: u64,
    /// Bytes per block.
    pub type_size: u64,
}

impl Serialize for GgmlType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

const QK_K: u64 = 256;

macro_rules! ggml_types {
    ($($konst:ident = $id:expr, $name:expr, $bs:expr, $ts:expr;)*) => {
        impl GgmlType {
            $(pub const $konst: GgmlType = GgmlType { id: $id, name: $name, block_size: $bs, type_size: $ts };)*
            /// All known types, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$konst),*];
        }
    };
}

ggml_types! {
    F32 = 0, "F32", 1, 4;
    F16 = 1, "F16", 1, 2;
    Q4_0 = 2, "Q4_0", 32, 2 + 16;
    Q4_1 = 3, "Q4_1", 32, 2 + 2 + 16;
    Q5_0 = 6, "Q5_0", 32, 2 + 4 + 16;
    Q5_1 = 7, "Q5_1", 32, 2 + 2 + 4 + 16;
    Q8_0 = 8, "Q8_0", 32, 2 + 32;
    // ggml: {ggml_half d, s; int8 qs[32]} = 36 bytes (gguf-py lists an older 40-byte layout).
    Q8_1 = 9, "Q8_1", 32, 2 + 2 + 32;
    Q2_K = 10, "Q2_K", 256, 2 + 2 + QK_K / 16 + QK_K / 4;
    Q3_K = 11, "Q3_K", 256, 2 + QK_K / 4 + QK_K / 8 + 12;
    Q4_K = 12, "Q4_K", 256, 2 + 2 + QK_K / 2 + 12;
    Q5_K = 13, "Q5_K", 256, 2 + 2 + QK_K / 2 + QK_K / 8 + 12;
    Q6_K = 14, "Q6_K", 256, 2 + QK_K / 16 + 3 * QK_K / 4;
    Q8_K = 15, "Q8_K", 256, 4 + QK_K + QK_K / 8;
    IQ2_XXS = 16, "IQ2_XXS", 256, 2 + QK_K / 4;
    IQ2_XS = 17, "IQ2_XS", 256, 2 + QK_K / 4 + QK_K / 32;
    IQ3_XXS = 18, "IQ3_XXS", 256, 2 + QK_K / 4 + QK_K / 8;
    IQ1_S = 19, "IQ1_S", 256, 2 + QK_K / 8 + QK_K / 16;
    IQ4_NL = 20, "IQ4_NL", 32, 2 + 16;
    IQ3_S = 21, "IQ3_S", 256, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    IQ2_S = 22, "IQ2_S", 256, 2 + QK_K / 4 + QK_K / 16;
    IQ4_XS = 23, "IQ4_XS", 256, 2 + 2 + QK_K / 2 + QK_K / 64;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", 256, QK_K / 8 + QK_K / 16 + QK_K / 32;
    BF16 = 30, "BF16", 1, 2;
    // 31-33: Q4_0_4_4 / Q4_0_4_8 / Q4_0_8_8, interleaved Q4_0 repacks, removed from ggml in 2024
    // but present in files written then. Same bytes per 32 elements as Q4_0.
    Q4_0_4_4 = 31, "Q4_0_4_4", 32, 2 + 16;
    Q4_0_4_8 = 32, "Q4_0_4_8", 32, 2 + 16;
    Q4_0_8_8 = 33, "Q4_0_8_8", 32, 2 + 16;
    TQ1_0 = 34, "TQ1_0", 256, 2 + 4 * 13;
    TQ2_0 = 35, "TQ2_0", 256, 2 + 64;
    // 36-38: IQ4_NL_4_4 / _4_8 / _8_8, removed likewise.
    IQ4_NL_4_4 = 36, "IQ4_NL_4_4", 32, 2 + 16;
    IQ4_NL_4_8 = 37, "IQ4_NL_4_8", 32, 2 + 16;
    IQ4_NL_8_8 = 38, "IQ4_NL_8_8", 32, 2 + 16;
    MXFP4 = 39, "MXFP4", 32, 1 + 16;
    NVFP4 = 40, "NVFP4", 64, 4 + 32;
    Q1_0 = 41, "Q1_0", 128, 2 + 16;
    Q2_0 = 42, "Q2_0", 64, 2 + 16;
}

impl GgmlType {
    /// The type with this id, if ggml ever defined one.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id == id)
    }

    /// The type with this (case-insensitive) name.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name.eq_ignore_ascii_case(name))
    }

    /// Whether glmcheck can dequantize this type to f32 (through candle's block decoders).
    pub fn dequantizable(self) -> bool {
        super::dequant::supported(self)
    }

    /// A block-quantized type (more than one element per block).
    pub fn is_quantized(self) -> bool {
        self.block_size > 1
    }

    /// Bytes taken by `n_elements` elements, or `None` when `n_elements` is not a whole number of blocks
    /// or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size) {
            return None;
        }
        (n_elements / self.block_size).checked_mul(self.type_size)
    }

    /// Bits per weight, for reports.
    pub fn bits_per_weight(self) -> f64 {
        self.type_size as f64 * 8.0 / self.block_size as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_sizes_match_ggml() {
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
        // Sizes from ggml-common.h's static_asserts.
        assert_eq!(GgmlType::Q4_K.type_size, 144);
        assert_eq!(GgmlType::Q5_K.type_size, 176);
        assert_eq!(GgmlType::Q6_K.type_size, 210);
        assert_eq!(GgmlType::Q2_K.type_size, 84);
        assert_eq!(GgmlType::Q3_K.type_size, 110);
        assert_eq!(GgmlType::Q8_K.type_size, 292);
        assert_eq!(GgmlType::IQ2_XXS.type_size, 66);
        assert_eq!(GgmlType::IQ4_XS.type_size, 136);
        assert_eq!(GgmlType::IQ1_M.type_size, 56);
        assert_eq!(GgmlType::TQ1_0.type_size, 54);
        assert_eq!(GgmlType::MXFP4.type_size, 17);
        assert_eq!(GgmlType::from_id(30), Some(GgmlType::BF16));
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_name("q4_k"), Some(GgmlType::Q4_K));
    }

    #[test]
    fn bytes_for_rejects_partial_blocks() {
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
