//! Weight matrices and the linear layers and embeddings built on them. A weight is either dense in
//! the compute dtype or the GGUF's quantized blocks as stored (a candle `QTensor` on the model's
//! device), used in one of two ways ([`MatmulMode`]).

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};

use crate::gguf::{GgmlType, SharedBytes};

/// How a quantized weight meets its activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatmulMode {
    /// Dequantize the blocks into the compute dtype right before each GEMM: equal to a reference
    /// computed from the same dequantized weights, to the compute dtype's precision.
    #[default]
    Dequant,
    /// candle's llama.cpp-derived quantized kernels (MMVQ/MMQ on CUDA, its quantized CPU matmul):
    /// activations are quantized to 8 bits per block first, as llama.cpp and vLLM's GGUF kernels
    /// compute. What a GGUF deployment computes, within its own (looser) tolerance.
    Q8,
}

impl MatmulMode {
    pub fn name(self) -> &'static str {
        match self {
            MatmulMode::Dequant => "dequant",
            MatmulMode::Q8 => "q8",
        }
    }
}

/// A quantized `[rows, cols]` matrix (or a stack's slice of one) as the GGUF stores it.
#[derive(Debug, Clone)]
pub enum Blocks {
    /// Uploaded as they are to a device (resident, e.g. in GPU memory).
    OnDevice(Arc<QTensor>),
    /// Left in the GGUF's mapping (the CPU): decoded from the mapped pages when used, in row
    /// chunks of at most [`CHUNK_F32_BYTES`] of f32, so no weight is ever held whole in f32 and the
    /// process holds no anonymous copy of the blocks.
    Mapped(Box<MappedBlocks>),
}

/// The f32 a mapped weight is decoded into at once, at most: 256 MiB.
pub const CHUNK_F32_BYTES: usize = 256 << 20;

/// A matrix's blocks in the GGUF's mapping.
#[derive(Debug, Clone)]
pub struct MappedBlocks {
    pub name: String,
    pub bytes: SharedBytes,
    pub dtype: GgmlType,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// The f32 decoded at once, at most, bytes ([`CHUNK_F32_BYTES`]).
    pub chunk: usize,
}

impl MappedBlocks {
    /// Rows `start..start + n` as a CPU `QTensor` (the blocks copied out of the mapping).
    fn rows(&self, start: usize, n: usize) -> Result<QTensor> {
        let [rows, cols] = self.shape;
        let row_bytes = self.bytes.len() / rows.max(1);
        let bad = |why: String| candle_core::Error::Msg(format!("{}: {why}", self.name));
        if row_bytes * rows != self.bytes.len() {
            return Err(bad(format!(
                "{} bytes are not {rows} equal rows",
                self.bytes.len()
            )));
        }
        if start.checked_add(n).is_none_or(|end| end > rows) {
            return Err(bad(format!("rows {start}..{start}+{n} of {rows}")));
        }
        let part = self.bytes.slice(start * row_bytes, n * row_bytes);
        crate::gguf::dequant::qtensor(
            &self.name,
            self.dtype,
            part.bytes(),
            &[n, cols],
            &Device::Cpu,
        )
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?
        .ok_or_else(|| bad(format!("{} is not kept as blocks", self.dtype.name)))
    }

    /// Row chunks `(start, n)` whose f32 fits `self.chunk` bytes.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> {
        let [rows, cols] = self.shape;
        let per = (self.chunk / (cols.max(1) * 4)).max(1);
        (0..rows).step_by(per).map(move |s| (s, per.min(rows - s)))
    }
}

impl Blocks {
    /// `[rows, cols]`.
    pub fn dims(&self) -> &[usize] {
        match self {
            Blocks::OnDevice(q) => q.shape().dims(),
            Blocks::Mapped(m) => &m.shape,
        }
    }

    /// The whole matrix decoded into `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Blocks::OnDevice(q) => dequantize(q, dtype),
            Blocks::Mapped(m) => {
                let parts = m
                    .chunks()
                    .map(|(s, n)| dequantize(&m.rows(s, n)?, dtype))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)
            }
        }
    }

    /// `x · Wᵀ` `[T, rows]` in `x`'s dtype; the weight decoded into `dtype` (dequant) or multiplied
    /// by the quantized kernels (q8).
    pub fn matmul(&self, x: &Tensor, dtype: DType, mode: MatmulMode) -> Result<Tensor> {
        let one = |q: &QTensor| match mode {
            MatmulMode::Dequant => {
                // on CUDA, a few tokens: decoded inside the grouped kernel (no decoded copy);
                // more, where GLMCHECK_DENSE asks for it: decoded inside the wgmma kernel
                #[cfg(feature = "cuda")]
                if x.rank() == 2 {
                    let t = x.dim(0)?;
                    if super::moe_cuda::dense_on_tiles(t) {
                        if let Some(y) = super::moe_cuda::dense_tiled(q, x)? {
                            return Ok(y);
                        }
                    } else if let Some(tile) = super::wgmma_cuda::dense_wgmma_tile(t) {
                        if let Some(y) = super::wgmma_cuda::dense_wgmma(q, x, tile)? {
                            return Ok(y);
                        }
                    }
                }
                x.matmul(&dequantize(q, dtype)?.t()?)
            }
            MatmulMode::Q8 => q8_matmul(q, x),
        };
        match self {
            Blocks::OnDevice(q) => one(q),
            Blocks::Mapped(m) => {
                let parts = m
                    .chunks()
                    .map(|(s, n)| one(&m.rows(s, n)?))
                    .collect::<Result<Vec<_>>>()?;
                match parts.as_slice() {
                    [only] => Ok(only.clone()),
                    _ => Tensor::cat(&parts, 1),
                }
            }
        }
    }

    /// Rows `ids` `[n]` (U32) decoded into `dtype`, `[n, cols]`.
    pub fn rows(&self, ids: &Tensor, dtype: DType) -> Result<Tensor> {
        match self {
            Blocks::OnDevice(q) => q.embedding(ids)?.to_dtype(dtype),
            Blocks::Mapped(m) => {
                let rows = ids
                    .to_vec1::<u32>()?
                    .into_iter()
                    .map(|id| dequantize(&m.rows(id as usize, 1)?, dtype))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)?.to_device(ids.device())
            }
        }
    }
}

/// A weight matrix `[out, in]` (PyTorch order).
#[derive(Debug, Clone)]
pub enum Weight {
    /// In the compute dtype (or f32 where the module computes in f32).
    Dense(Tensor),
    /// The GGUF's blocks; `dtype` is the compute dtype they are used in.
    Blocks {
        blocks: Blocks,
        dtype: DType,
        mode: MatmulMode,
    },
}

impl Weight {
    /// `[out, in]`.
    pub fn dims(&self) -> &[usize] {
        match self {
            Weight::Dense(t) => t.dims(),
            Weight::Blocks { blocks, .. } => blocks.dims(),
        }
    }

    pub fn dim(&self, d: usize) -> Result<usize> {
        self.dims()
            .get(d)
            .copied()
            .ok_or_else(|| candle_core::Error::Msg(format!("dim {d} of {:?}", self.dims())))
    }

    /// The compute dtype of what this weight produces.
    pub fn dtype(&self) -> DType {
        match self {
            Weight::Dense(t) => t.dtype(),
            Weight::Blocks { dtype, .. } => *dtype,
        }
    }

    /// Whether the weight is kept as quantized blocks.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Weight::Blocks { .. })
    }

    /// The whole matrix in the compute dtype (blocks dequantized now).
    pub fn dense(&self) -> Result<Tensor> {
        match self {
            Weight::Dense(t) => Ok(t.clone()),
            Weight::Blocks { blocks, dtype, .. } => blocks.dequantize(*dtype),
        }
    }

    /// Rows `ids` `[n]` (U32) → `[n, in]` in the compute dtype: an embedding lookup. Blocks are
    /// decoded row by row (only the rows asked for).
    pub fn rows(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense(t) => t.index_select(ids, 0),
            Weight::Blocks { blocks, dtype, .. } => blocks.rows(ids, *dtype),
        }
    }

    /// `[T, in]` → `[T, out]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Weight::Dense(w) => x.matmul(&w.t()?),
            Weight::Blocks {
                blocks,
                dtype,
                mode,
            } => blocks.matmul(x, *dtype, *mode),
        }
    }
}

/// Blocks dequantized into `dtype` on their own device. candle decodes every type to f32; f16 has
/// a direct kernel on CUDA. On CUDA glmcheck's decoders come first
/// (`moe_cuda::dequantize_direct`: the same values as candle's, rounded once from the same f32;
/// faster, and bf16 without an f32 detour).
pub fn dequantize(q: &QTensor, dtype: DType) -> Result<Tensor> {
    let device = q.device();
    #[cfg(feature = "cuda")]
    if matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
        if let Some(t) = super::moe_cuda::dequantize_direct(q, dtype)? {
            return Ok(t);
        }
    }
    if dtype == DType::F16 && device.is_cuda() {
        return q.dequantize_f16(&device);
    }
    q.dequantize(&device)?.to_dtype(dtype)
}

/// `y = x · Wᵀ` with `W` `[out, in]`; no bias (GLM-5 has none).
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
}

impl Linear {
    /// A dense linear layer.
    pub fn new(weight: Tensor) -> Self {
        Linear {
            weight: Weight::Dense(weight),
        }
    }

    /// `[T, in]` → `[T, out]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.weight.forward(x)
    }
}

/// `x · Wᵀ` by the quantized kernels llama.cpp computes with: the activations quantized to Q8_1,
/// integer dot products per block (candle's MMVQ/MMQ; on CUDA, 9 to 16 tokens of a Q4_K, Q6_K or
/// Q8_0 weight with enough rows to fill the GPU — lm_head — and more tokens of one with at most 16
/// blocks of 64 rows, by glmcheck's int8 kernel, MMQ's arithmetic: `q8_cuda::int8_dense`; bf16
/// activations of more than 8 tokens quantized straight
/// from bf16: `q8_dense_cuda`). The result is cast back to `x`'s dtype.
pub fn q8_matmul(q: &QTensor, x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let xq = super::q8_cuda::q8_input(x)?;
        let y = match super::q8_dense_cuda::dense_q8(q, &xq)? {
            Some(y) => y,
            None => xq.to_dtype(DType::F32)?.apply_op1_no_bwd(q)?,
        };
        return y.to_dtype(x.dtype());
    }
    let xf = x.to_dtype(DType::F32)?.contiguous()?;
    xf.apply_op1_no_bwd(q)?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    /// Mapped blocks decoded in chunks of a few rows equal the same blocks uploaded whole, for
    /// every use: decode, both matmul modes, row lookups.
    #[test]
    fn mapped_chunks_equal_the_whole_tensor() -> Result<()> {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q4_K_M.gguf");
        let image = std::fs::read(&path)?;
        let file = crate::gguf::GgufFile::parse_bytes(&path, image)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut checked = 0;
        for info in file.tensors.iter().filter(|t| t.torch_shape().len() == 2) {
            let shape = info.torch_shape();
            let (rows, cols) = (shape[0], shape[1]);
            let bytes = file.shared_bytes(info);
            let q = crate::gguf::dequant::qtensor(
                &info.name,
                info.dtype,
                bytes.bytes(),
                &shape,
                &Device::Cpu,
            )
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let Some(q) = q.map(Arc::new) else {
                continue;
            };
            // 3 rows per chunk: the last chunk is short whenever rows % 3 != 0.
            let mapped = Blocks::Mapped(Box::new(MappedBlocks {
                name: info.name.clone(),
                bytes,
                dtype: info.dtype,
                shape: [rows, cols],
                chunk: 3 * cols * 4,
            }));
            let whole = Blocks::OnDevice(q);
            let x = Tensor::randn(0f32, 1.0, (4, cols), &Device::Cpu)?;
            // Decoding is exact; a dequant product over row chunks may round differently from
            // the whole GEMM (its blocking), to f32 precision; candle's CPU q8 kernels pick their
            // path by shape (repacked or not), so chunks differ from the whole by 8-bit noise.
            let same = |a: Tensor, b: Tensor, what: &str| -> Result<()> {
                let rel = rel_l2(&a, &b)?;
                let bound = match what {
                    "decode" | "rows" => 0.0,
                    "q8" => 2e-2,
                    _ => 1e-6,
                };
                assert!(rel <= bound, "{} {what}: rel-L2 {rel}", info.name);
                Ok(())
            };
            same(
                mapped.dequantize(DType::F32)?,
                whole.dequantize(DType::F32)?,
                "decode",
            )?;
            for mode in [MatmulMode::Dequant, MatmulMode::Q8] {
                same(
                    mapped.matmul(&x, DType::F32, mode)?,
                    whole.matmul(&x, DType::F32, mode)?,
                    mode.name(),
                )?;
            }
            let ids = Tensor::new(&[0u32, (rows - 1) as u32, 1], &Device::Cpu)?;
            same(
                mapped.rows(&ids, DType::F32)?,
                whole.rows(&ids, DType::F32)?,
                "rows",
            )?;
            checked += 1;
        }
        assert!(checked > 10, "{checked} quantized matrices");
        Ok(())
    }

    use super::*;
    use candle_core::quantized::GgmlDType;

    fn quantized(rows: usize, cols: usize, dtype: GgmlDType) -> Result<(Tensor, Arc<QTensor>)> {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 0.02, (rows, cols), &dev)?;
        let q = Arc::new(QTensor::quantize(&w, dtype)?);
        Ok((q.dequantize(&dev)?, q))
    }

    fn rel_l2(a: &Tensor, b: &Tensor) -> Result<f32> {
        let d = (a - b)?.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt();
        Ok(d / b.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt())
    }

    /// Dequant mode is the dense weight's matmul exactly; q8 mode is within 8-bit activation
    /// rounding of it; row lookups decode exactly the dequantized rows.
    #[test]
    fn both_modes_compute_the_dense_product() -> Result<()> {
        let dev = Device::Cpu;
        for dtype in [GgmlDType::Q4K, GgmlDType::Q8_0, GgmlDType::Q6K] {
            let (dense, q) = quantized(64, 512, dtype)?;
            let x = Tensor::randn(0f32, 1.0, (5, 512), &dev)?;
            let want = Linear::new(dense.clone()).forward(&x)?;
            let blocks = |mode| Linear {
                weight: Weight::Blocks {
                    blocks: Blocks::OnDevice(q.clone()),
                    dtype: DType::F32,
                    mode,
                },
            };
            let got = blocks(MatmulMode::Dequant).forward(&x)?;
            assert_eq!(rel_l2(&got, &want)?, 0.0, "{dtype:?} dequant");
            let q8 = rel_l2(&blocks(MatmulMode::Q8).forward(&x)?, &want)?;
            assert!(q8 > 0.0 && q8 < 2e-2, "{dtype:?} q8 rel-L2 {q8}");
            let ids = Tensor::new(&[3u32, 0, 63, 3], &dev)?;
            let rows = blocks(MatmulMode::Dequant).weight.rows(&ids)?;
            assert_eq!(rel_l2(&rows, &dense.index_select(&ids, 0)?)?, 0.0);
        }
        Ok(())
    }
}
