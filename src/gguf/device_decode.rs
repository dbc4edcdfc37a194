//! Decode throughput on a device: a tensor's blocks uploaded as they are (a candle `QTensor`),
//! decoded to f32 there (by glmcheck's CUDA decoder where it covers the type, `cuda_decode`, else
//! candle's), timed against a plain device copy of the decoded tensor in the same run
//! (the ceiling a decode that must read the blocks and write f32 can approach).

use std::time::Instant;

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use serde::Serialize;

use super::{GgmlType, TensorRef};

/// One tensor decoded on a device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceDecode {
    pub name: String,
    pub dtype: GgmlType,
    pub elements: u64,
    /// The blocks read.
    pub bytes_in: u64,
    /// The f32 written.
    pub bytes_out: u64,
    /// Best decode, seconds (device synchronized).
    pub seconds: f64,
    /// (bytes read + bytes written) / best decode time, GB/s.
    pub gbps: f64,
    /// A device copy of the decoded tensor, (read + written) / best time, GB/s: the same
    /// convention as `gbps`.
    pub copy_gbps: f64,
    /// Why the tensor was not decoded on the device (a float type candle decodes on the host, a
    /// type candle does not hold, a device error).
    pub error: Option<String>,
}

/// Decodes `t` on `device` `repeat` times (at least once) and copies the result as many times;
/// reports the best of each.
pub fn decode_on(device: &Device, t: TensorRef<'_>, repeat: usize) -> DeviceDecode {
    let i = t.info;
    let mut row = DeviceDecode {
        name: i.name.clone(),
        dtype: i.dtype,
        elements: i.n_elements(),
        bytes_in: i.n_bytes,
        bytes_out: i.n_elements() * 4,
        seconds: 0.0,
        gbps: 0.0,
        copy_gbps: 0.0,
        error: None,
    };
    match timed(device, t, repeat.max(1)) {
        Ok((decode, copy)) => {
            row.seconds = decode;
            row.gbps = (row.bytes_in + row.bytes_out) as f64 / decode.max(1e-12) / 1e9;
            row.copy_gbps = (2 * row.bytes_out) as f64 / copy.max(1e-12) / 1e9;
        }
        Err(e) => row.error = Some(e),
    }
    row
}

/// The most elements one decode is given: candle's CUDA decode kernels index with 32-bit ints, so
/// a larger tensor (a GLM-5 expert stack: 3.2 G elements) is decoded in row parts.
const PART_ELEMENTS: usize = 1 << 30;

/// Best decode and best copy time, seconds, of the whole tensor (decoded part after part).
fn timed(device: &Device, t: TensorRef<'_>, repeat: usize) -> Result<(f64, f64), String> {
    let parts = parts(device, t, PART_ELEMENTS)?;
    let best = |f: &dyn Fn(usize) -> candle_core::Result<Tensor>| -> Result<f64, String> {
        let mut best = f64::INFINITY;
        for _ in 0..repeat {
            let start = Instant::now();
            for p in 0..parts.len() {
                let out = f(p).map_err(|e| e.to_string())?;
                device.synchronize().map_err(|e| e.to_string())?;
                drop(out);
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let decode = best(&|p| to_f32(&parts[p], device))?;
    let outs = parts
        .iter()
        .map(|q| to_f32(q, device))
        .collect::<candle_core::Result<Vec<_>>>()
        .map_err(|e| e.to_string())?;
    let copy = best(&|p| outs[p].copy())?;
    Ok((decode, copy))
}

/// `q` decoded to f32 on `device`: glmcheck's CUDA decoder where it applies, candle's otherwise.
fn to_f32(q: &QTensor, device: &Device) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(t) = super::cuda_decode::decode(q, candle_core::DType::F32)? {
        return Ok(t);
    }
    q.dequantize(device)
}

/// `t`'s blocks on `device` as row parts of at most `part_elements` elements each.
fn parts(device: &Device, t: TensorRef<'_>, part_elements: usize) -> Result<Vec<QTensor>, String> {
    let i = t.info;
    let shape = i.torch_shape();
    let cols = shape.last().copied().unwrap_or(1).max(1);
    let rows = (i.n_elements() as usize) / cols;
    let row_bytes = t.bytes().len() / rows.max(1);
    let per = (part_elements / cols).max(1);
    (0..rows)
        .step_by(per)
        .map(|s| {
            let n = per.min(rows - s);
            let bytes = &t.bytes()[s * row_bytes..(s + n) * row_bytes];
            super::dequant::qtensor(&i.name, i.dtype, bytes, &[n, cols], device)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("{} is not decoded on the device", i.dtype.name))
        })
        .collect()
}

/// One quant type's decodes together.
#[derive(Debug, Clone, Serialize)]
pub struct TypeDecode {
    pub dtype: GgmlType,
    pub tensors: usize,
    /// Σ bytes moved / Σ best decode times, GB/s.
    pub gbps: f64,
    /// Σ bytes moved by the copies / Σ their best times, GB/s.
    pub copy_gbps: f64,
}

/// The decoded rows summed by type, in order of first appearance.
pub fn by_type(rows: &[DeviceDecode]) -> Vec<TypeDecode> {
    // (type, tensors, decode bytes, decode s, copy bytes, copy s)
    let mut acc: Vec<(GgmlType, usize, f64, f64, f64, f64)> = Vec::new();
    for r in rows.iter().filter(|r| r.error.is_none() && r.gbps > 0.0) {
        let moved = (r.bytes_in + r.bytes_out) as f64;
        let copied = (2 * r.bytes_out) as f64;
        let i = match acc.iter().position(|a| a.0 == r.dtype) {
            Some(i) => i,
            None => {
                acc.push((r.dtype, 0, 0.0, 0.0, 0.0, 0.0));
                acc.len() - 1
            }
        };
        let a = &mut acc[i];
        a.1 += 1;
        a.2 += moved;
        a.3 += moved / r.gbps / 1e9;
        a.4 += copied;
        a.5 += copied / r.copy_gbps.max(1e-12) / 1e9;
    }
    acc.into_iter()
        .map(|(dtype, tensors, b, s, cb, cs)| TypeDecode {
            dtype,
            tensors,
            gbps: b / s.max(1e-12) / 1e9,
            copy_gbps: cb / cs.max(1e-12) / 1e9,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufModel;

    #[test]
    fn quantized_tensors_decode_and_float_ones_are_named() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
        let m = GgufModel::open(&path).expect("fixture");
        let mut decoded = 0;
        for t in m.tensors() {
            let row = decode_on(&Device::Cpu, t, 1);
            if t.info.dtype.noise_bits() < 16 {
                assert!(row.error.is_none(), "{}: {:?}", row.name, row.error);
                assert!(row.gbps > 0.0 && row.copy_gbps > 0.0, "{row:?}");
                decoded += 1;
            } else {
                let e = row
                    .error
                    .expect("float tensors are not decoded on the device");
                assert!(e.contains(t.info.dtype.name), "{e}");
            }
        }
        assert!(decoded > 10, "{decoded} quantized tensors");
    }

    /// Decoded in parts of a few rows, a tensor is its whole decode.
    #[test]
    fn parts_decode_to_the_whole_tensor() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
        let m = GgufModel::open(&path).expect("fixture");
        let dev = Device::Cpu;
        let mut split = 0;
        for t in m.tensors().filter(|t| t.info.dtype.noise_bits() < 16) {
            let whole = parts(&dev, t, usize::MAX).expect("whole");
            assert_eq!(whole.len(), 1);
            let cols = *t.info.torch_shape().last().expect("shape");
            let small = parts(&dev, t, 5 * cols).expect("parts");
            split += usize::from(small.len() > 1);
            let decoded = small
                .iter()
                .map(|q| q.dequantize(&dev))
                .collect::<candle_core::Result<Vec<_>>>()
                .expect("decode");
            let cat = Tensor::cat(&decoded, 0).expect("cat");
            let want = whole[0].dequantize(&dev).expect("decode");
            let diff = (cat - want)
                .and_then(|d| d.abs())
                .and_then(|d| d.flatten_all())
                .and_then(|d| d.max(0))
                .and_then(|d| d.to_scalar::<f32>())
                .expect("diff");
            assert_eq!(diff, 0.0, "{}", t.info.name);
        }
        assert!(split > 10, "{split} tensors decoded in several parts");
    }
}
