//! Streaming safetensors: a shard's header computed from the planned shapes alone (so the values can
//! follow tensor by tensor, never all in memory), the values encoded chunk by chunk, and the
//! `model.safetensors.index.json` that names every tensor's shard.

use safetensors::Dtype;
use serde_json::{json, Map, Value};

use super::{ExportPlan, Planned};

/// Values encoded per chunk (16 MiB of f32).
pub const CHUNK_VALUES: usize = 4 << 20;

/// A safetensors header for `tensors`, laid out contiguously in the given order: the 8-byte
/// little-endian length, then the JSON, padded with spaces to a multiple of 8 (as the `safetensors`
/// crate writes it, so the data starts aligned).
pub fn header(tensors: &[Planned]) -> Vec<u8> {
    let mut map = Map::new();
    map.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for t in tensors {
        let end = offset + t.bytes();
        map.insert(
            t.name.clone(),
            json!({
                "dtype": dtype_name(t.dtype),
                "shape": t.shape,
                "data_offsets": [offset, end],
            }),
        );
        offset = end;
    }
    let mut text = Value::Object(map).to_string().into_bytes();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out
}

/// The header's name of a dtype (only the two the export writes).
fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::BF16 => "BF16",
        _ => "F32",
    }
}

/// `model.safetensors.index.json`: `{"metadata": {"total_size"}, "weight_map": {tensor: shard}}`.
pub fn index_json(plan: &ExportPlan) -> Value {
    let mut map = Map::new();
    for s in &plan.shards {
        for t in &s.tensors {
            map.insert(t.name.clone(), Value::String(s.file.clone()));
        }
    }
    json!({
        "metadata": { "total_size": plan.data_bytes() },
        "weight_map": map,
    })
}

/// Calls `f` with the tensor's f32 values in row-major order: its own storage when it is a
/// contiguous CPU f32 tensor (no copy), else a copy.
pub fn with_values<R>(
    t: &candle_core::Tensor,
    f: impl FnOnce(&[f32]) -> R,
) -> candle_core::Result<R> {
    let t = t.to_dtype(candle_core::DType::F32)?;
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            let all = cpu.as_slice::<f32>()?;
            if let Some(v) = all.get(a..b) {
                return Ok(f(v));
            }
        }
    }
    let v = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&v))
}

/// f32 → bf16 bits, rounded to nearest even as torch does (`c10::BFloat16`'s
/// `round_to_nearest_even`): NaN becomes the quiet NaN 0x7FC0, ±inf and overflow stay infinite.
pub fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let bits = x.to_bits();
    let rounding_bias = 0x7FFF + ((bits >> 16) & 1);
    ((bits + rounding_bias) >> 16) as u16
}

/// Little-endian bytes of `values` as `dtype` (BF16 rounded by [`bf16_bits`], else F32) into `buf`
/// (replacing its contents), split over all cores.
pub fn encode_into(dtype: Dtype, values: &[f32], buf: &mut Vec<u8>) {
    let width = if dtype == Dtype::BF16 { 2 } else { 4 };
    buf.clear();
    buf.resize(values.len() * width, 0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = values.len().div_ceil(threads).max(1 << 16);
    let encode = |vs: &[f32], out: &mut [u8]| {
        if width == 2 {
            for (v, o) in vs.iter().zip(out.chunks_exact_mut(2)) {
                o.copy_from_slice(&bf16_bits(*v).to_le_bytes());
            }
        } else {
            for (v, o) in vs.iter().zip(out.chunks_exact_mut(4)) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
    };
    if values.len() <= per {
        encode(values, buf);
        return;
    }
    std::thread::scope(|s| {
        for (vs, out) in values.chunks(per).zip(buf.chunks_mut(per * width)) {
            s.spawn(move || encode(vs, out));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(name: &str, shape: &[usize], dtype: Dtype) -> Planned {
        Planned {
            name: name.into(),
            source: name.into(),
            gguf: Vec::new(),
            shape: shape.to_vec(),
            dtype,
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even_as_torch_does() {
        // Exactly halfway between two bf16 values: to the even one.
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80); // 1 + 2^-8 → 1
        assert_eq!(bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82); // → even 0x3F82
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81); // above half: up
        assert_eq!(bf16_bits(f32::from_bits(0x3F80_7FFF)), 0x3F80); // below half: down
        assert_eq!(bf16_bits(-2.0), 0xC000);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7F80);
        assert_eq!(bf16_bits(f32::NEG_INFINITY), 0xFF80);
        assert_eq!(bf16_bits(f32::MAX), 0x7F80); // overflows to inf, as torch
        assert_eq!(bf16_bits(f32::NAN), 0x7FC0);
        assert_eq!(bf16_bits(-0.0), 0x8000);
        // The `half` crate agrees on every non-NaN value of a sweep.
        for i in 0..100_000u32 {
            let x = f32::from_bits(i.wrapping_mul(2_654_435_761));
            if !x.is_nan() {
                assert_eq!(bf16_bits(x), half::bf16::from_f32(x).to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn encoding_splits_over_threads_without_changing_a_byte() {
        let vs: Vec<f32> = (0..300_001).map(|i| (i as f32).sin() * 1e3).collect();
        let mut par = Vec::new();
        encode_into(Dtype::BF16, &vs, &mut par);
        let one: Vec<u8> = vs
            .iter()
            .flat_map(|v| bf16_bits(*v).to_le_bytes())
            .collect();
        assert_eq!(par, one);
        encode_into(Dtype::F32, &vs, &mut par);
        let one: Vec<u8> = vs.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(par, one);
    }

    #[test]
    fn the_header_reads_back_with_the_safetensors_crate() {
        let ts = [
            planned("a", &[3, 5], Dtype::BF16),
            planned("b.bias", &[7], Dtype::F32),
            planned("c", &[2, 2, 2], Dtype::BF16),
        ];
        let mut file = header(&ts);
        assert_eq!((file.len() - 8) % 8, 0, "data must start 8-aligned");
        let data: u64 = ts.iter().map(Planned::bytes).sum();
        assert_eq!(data, 30 + 28 + 16);
        file.extend(std::iter::repeat_n(0u8, data as usize));
        let st = safetensors::SafeTensors::deserialize(&file).expect("valid safetensors");
        let b = st.tensor("b.bias").expect("b");
        assert_eq!((b.dtype(), b.shape()), (Dtype::F32, &[7usize][..]));
        assert_eq!(st.tensor("c").expect("c").data().len(), 16);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&file).expect("meta");
        assert_eq!(
            meta.metadata().as_ref().and_then(|m| m.get("format")),
            Some(&"pt".to_string())
        );
    }
}
