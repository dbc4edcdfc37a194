//! Building blocks shared by the modules: linear layers, norms, RoPE, masks. Only candle tensor ops,
//! so every block runs on any candle device.

use candle_core::{DType, Device, Result, Tensor, D};

/// transformers' `GlmMoeDsaRMSNorm`: computed in f32, cast back to the input dtype, then times the
/// weight: `w · (x / sqrt(mean(x²) + eps))`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// `[n]`
    pub weight: Tensor,
    pub eps: f64,
    /// One fused kernel (candle-nn's `rms_norm`: f32 inside, rounded once) instead of
    /// transformers' op-by-op arithmetic (the normalised value rounded to the compute dtype before
    /// the weight multiplies it; equal in f32 up to rsqrt's rounding, one bf16 ulp apart in bf16).
    /// q8 mode on CUDA only: a GGUF deployment's norm (llama.cpp's) is fused anyway. (Dequant mode
    /// on CUDA runs the op-by-op arithmetic as one launch too: [`RmsNorm::forward`].)
    pub fused: bool,
}

impl RmsNorm {
    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm {
            weight,
            eps,
            fused: false,
        }
    }

    /// The same norm computed by one fused kernel when `fused`.
    pub fn fused(self, fused: bool) -> Self {
        RmsNorm { fused, ..self }
    }

    /// `[…, n]` → `[…, n]`. On CUDA transformers' arithmetic is one launch of glmcheck's kernel
    /// (`fused_cuda::rms_norm`, equal to [`RmsNorm::chain`] bit for bit).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.fused {
            return candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32);
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = super::fused_cuda::rms_norm(x, &self.weight, self.eps)? {
            return Ok(y);
        }
        self.chain(x)
    }

    /// transformers' arithmetic op by op.
    pub fn chain(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let xf = x.to_dtype(DType::F32)?;
        let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let inv = (var + self.eps)?.sqrt()?.recip()?;
        xf.broadcast_mul(&inv)?
            .to_dtype(dtype)?
            .broadcast_mul(&self.weight)
    }
}

/// `torch.nn.LayerNorm` with weight and bias (biased variance), in the input dtype.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// `[n]`
    pub weight: Tensor,
    /// `[n]`
    pub bias: Tensor,
    pub eps: f64,
    /// One fused kernel (candle-nn's `layer_norm`, f32 inside), as [`RmsNorm::fused`].
    pub fused: bool,
}

impl LayerNorm {
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Self {
        LayerNorm {
            weight,
            bias,
            eps,
            fused: false,
        }
    }

    /// The same norm computed by one fused kernel when `fused`.
    pub fn fused(self, fused: bool) -> Self {
        LayerNorm { fused, ..self }
    }

    /// `[…, n]` → `[…, n]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.fused {
            return candle_nn::ops::layer_norm(
                &x.contiguous()?,
                &self.weight,
                &self.bias,
                self.eps as f32,
            );
        }
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let inv = (var + self.eps)?.sqrt()?.recip()?;
        centered
            .broadcast_mul(&inv)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}

/// Which RoPE pair layout the rotary part uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs `(x0, x1), (x2, x3), …` (DeepSeek / GLM-5, transformers'
    /// `apply_rotary_pos_emb_interleave`). The rotated output comes back de-interleaved:
    /// `[x_even·cos − x_odd·sin | x_odd·cos + x_even·sin]`, as transformers returns it.
    Interleaved,
    /// Pairs `(x_i, x_{i+d/2})` (Llama's `rotate_half`). Not GLM-5's layout; kept for experiments.
    HalfSplit,
}

/// Default RoPE (no scaling): `inv_freq[i] = 1 / θ^(2i/d)`, in f32 like transformers.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `[d/2]` f32
    inv_freq: Tensor,
    pub dim: usize,
}

/// cos/sin of one forward, `[T, d/2]` each (the per-pair angles), computed in f32.
#[derive(Debug, Clone)]
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl RopeTables {
    /// Both tables cast to `dtype` (transformers' rotary_emb returns them in the input's dtype).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(RopeTables {
            cos: self.cos.to_dtype(dtype)?,
            sin: self.sin.to_dtype(dtype)?,
        })
    }
}

impl Rope {
    /// The tables' frequencies; each module that rotates says its own pair layout
    /// ([`Rope::rotate`]).
    pub fn new(dim: usize, theta: f64, device: &Device) -> Result<Self> {
        // transformers: 1.0 / (base ** (arange(0, dim, 2, dtype=float32) / dim)), all f32. This is
        // a config-derived constant table, built on the host once.
        let half = dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0f32 / (theta as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        Ok(Rope {
            inv_freq: Tensor::from_vec(inv, half, device)?,
            dim,
        })
    }

    /// Angles for positions `0..t`.
    pub fn tables(&self, t: usize) -> Result<RopeTables> {
        let pos = Tensor::arange(0u32, t as u32, self.inv_freq.device())?
            .to_dtype(DType::F32)?
            .unsqueeze(1)?; // [T, 1]
        let freqs = pos.broadcast_mul(&self.inv_freq.unsqueeze(0)?)?; // [T, d/2]
        Ok(RopeTables {
            cos: freqs.cos()?,
            sin: freqs.sin()?,
        })
    }

    /// Rotates `x` in `layout`: `[H, T, d]` (tokens on axis 1, `tokens_first` false: MLA's query
    /// heads, or its one shared key `[1, T, d]`) or `[T, …, d]` (tokens on axis 0: the indexer's
    /// `[T, nI, d]` query and `[T, d]` key). The output is de-interleaved as transformers returns
    /// it: `[x_even·cos − x_odd·sin | x_odd·cos + x_even·sin]` (Interleaved; HalfSplit pairs
    /// `x_i, x_{i+d/2}`). The tables are cast to `x`'s dtype first, as transformers does.
    ///
    /// One kernel instead of ten op-by-op launches, with the op-by-op roundings in `x`'s dtype
    /// (each product, then the difference or sum, rounded: transformers' eager values). On the
    /// CPU candle-nn's half-split `rope` after one de-interleaving copy (bit for bit the op-by-op
    /// result, tested); on CUDA glmcheck's own kernel (`model::rope_cuda`: candle's CUDA `rope`
    /// lets nvcc fuse a product into the sum, an ulp off transformers in bf16 — measured).
    pub fn rotate(
        &self,
        layout: RopeLayout,
        x: &Tensor,
        tables: &RopeTables,
        tokens_first: bool,
    ) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let (d, half) = (self.dim, self.dim / 2);
        let t = tables.cos.dim(0)?;
        let cos = tables.cos.to_dtype(x.dtype())?;
        let sin = tables.sin.to_dtype(x.dtype())?;
        #[cfg(feature = "cuda")]
        if x.device().is_cuda() {
            let interleaved = matches!(layout, RopeLayout::Interleaved);
            return super::rope_cuda::rotate(x, &cos, &sin, tokens_first, interleaved);
        }
        let x = match layout {
            RopeLayout::Interleaved => {
                let last = dims.len() - 1;
                let mut pairs = dims[..last].to_vec();
                pairs.extend([half, 2]);
                x.reshape(pairs)?
                    .transpose(last, last + 1)?
                    .contiguous()?
                    .reshape(dims.as_slice())?
            }
            RopeLayout::HalfSplit => x.contiguous()?,
        };
        let heads = x.elem_count() / (t * d).max(1);
        let y = if tokens_first {
            // [T, heads, 1, d] with one table row per batch entry (token).
            candle_nn::rotary_emb::rope(
                &x.reshape((t, heads, 1, d))?,
                &cos.reshape((t, 1, half))?,
                &sin.reshape((t, 1, half))?,
            )?
        } else {
            candle_nn::rotary_emb::rope(&x.reshape((1, heads, t, d))?, &cos, &sin)?
        };
        y.reshape(dims)
    }

    /// `x` `[T, heads, width]` (tokens first) with columns `offset..offset + d` rotated as
    /// [`Rope::rotate`] rotates them and the rest kept: `cat(x[.., ..offset], rot, x[.., offset +
    /// d..])`, `[T, heads, width]`, or `[heads, T, width]` when `heads_out_first` (MLA's query:
    /// per head, `[nope | rope]`). On CUDA one launch with the same roundings
    /// (`rope_cuda::rotate_part`, tested bit for bit against this chain).
    pub fn rotate_part(
        &self,
        layout: RopeLayout,
        x: &Tensor,
        tables: &RopeTables,
        offset: usize,
        heads_out_first: bool,
    ) -> Result<Tensor> {
        // The tables' width is the rotated width the kernel takes: it must be this rope's.
        #[cfg(feature = "cuda")]
        if x.device().is_cuda()
            && super::fused_cuda::enabled()
            && x.elem_count() > 0
            && 2 * tables.cos.dim(1)? == self.dim
        {
            let cos = tables.cos.to_dtype(x.dtype())?;
            let sin = tables.sin.to_dtype(x.dtype())?;
            let interleaved = matches!(layout, RopeLayout::Interleaved);
            return super::rope_cuda::rotate_part(
                x,
                &cos,
                &sin,
                offset,
                interleaved,
                heads_out_first,
            );
        }
        self.rotate_part_chain(layout, x, tables, offset, heads_out_first)
    }

    /// [`Rope::rotate_part`] as candle ops: narrow, rotate, cat (, transpose).
    fn rotate_part_chain(
        &self,
        layout: RopeLayout,
        x: &Tensor,
        tables: &RopeTables,
        offset: usize,
        heads_out_first: bool,
    ) -> Result<Tensor> {
        let (_, _, width) = x.dims3()?;
        let d = self.dim;
        let rot = self.rotate(layout, &x.narrow(2, offset, d)?, tables, true)?;
        let mut parts = Vec::with_capacity(3);
        if offset > 0 {
            parts.push(x.narrow(2, 0, offset)?);
        }
        parts.push(rot);
        if offset + d < width {
            parts.push(x.narrow(2, offset + d, width - offset - d)?);
        }
        let y = Tensor::cat(&parts, 2)?;
        if heads_out_first {
            y.transpose(0, 1)
        } else {
            Ok(y)
        }
    }
}

/// The smallest finite value of a float dtype (transformers' `torch.finfo(dtype).min`, used as the
/// additive mask value).
pub fn dtype_min(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => f64::from(half::bf16::MIN),
        DType::F16 => f64::from(half::f16::MIN),
        DType::F64 => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}

/// Causal masks of one forward.
#[derive(Debug, Clone)]
pub struct CausalMask {
    /// `[T, T]` U8, 1 where key j ≤ query i.
    pub allowed: Tensor,
    /// `[T, T]` F32, 0 where allowed, `finfo(dtype).min` elsewhere (transformers' eager mask).
    pub additive: Tensor,
    /// The mask value used.
    pub min: f64,
}

impl CausalMask {
    pub fn new(t: usize, dtype: DType, device: &Device) -> Result<Self> {
        let allowed = Tensor::tril2(t, DType::U8, device)?;
        let min = dtype_min(dtype);
        Ok(CausalMask {
            additive: additive(&allowed, min)?,
            allowed,
            min,
        })
    }
}

/// 0 where `allowed` (U8) is 1, `min` elsewhere, F32.
pub fn additive(allowed: &Tensor, min: f64) -> Result<Tensor> {
    let zeros = Tensor::zeros(allowed.shape(), DType::F32, allowed.device())?;
    let mins = Tensor::full(min as f32, allowed.shape(), allowed.device())?;
    allowed.where_cond(&zeros, &mins)
}

/// Attention's probabilities: `softmax(f32(scores · scale) + mask)` over the last dim, in the
/// scores' dtype (`scores` `[H, T, S]`, `mask` `[T, S]` f32). Eager attention's roundings: the
/// scaled scores rounded to the compute dtype, mask and softmax in f32 (candle's softmax computes
/// in its input dtype), probabilities rounded back. On CUDA one fused launch with the same
/// roundings (`model::fused_cuda`, tested bit for bit against this chain).
pub fn masked_softmax(scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(probs) = super::fused_cuda::masked_softmax(scores, scale, mask)? {
        return Ok(probs);
    }
    let masked = (scores * scale)?
        .to_dtype(DType::F32)?
        .broadcast_add(mask)?;
    candle_nn::ops::softmax_last_dim(&masked)?.to_dtype(scores.dtype())
}

/// Indices of the `k` largest entries of each row of `x` `[R, N]` (descending; ties in no promised
/// order), as U32 `[R, k]`.
pub fn topk_indices(x: &Tensor, k: usize) -> Result<Tensor> {
    x.contiguous()?
        .arg_sort_last_dim(false)?
        .narrow(D::Minus1, 0, k)?
        .contiguous()
}

/// `[R, N]` U8 with ones at `ids` `[R, k]` (U32) in each row.
pub fn one_hot_rows(ids: &Tensor, n: usize) -> Result<Tensor> {
    let (r, k) = ids.dims2()?;
    let zeros = Tensor::zeros((r, n), DType::U8, ids.device())?;
    let ones = Tensor::ones((r, k), DType::U8, ids.device())?;
    zeros.scatter(ids, &ones, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' op-by-op rotation (`q·cos + rotate_half(q)·sin` on the de-interleaved pairs),
    /// each op rounded to `x`'s dtype: the oracle of [`Rope::rotate`]. `cos`/`sin` broadcast to
    /// `x` without its last dim halved.
    fn op_by_op(layout: RopeLayout, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
        let last = x.rank() - 1;
        let half = x.dim(last)? / 2;
        let (x1, x2) = match layout {
            RopeLayout::Interleaved => {
                let mut shape = x.dims().to_vec();
                shape[last] = half;
                shape.push(2);
                let pairs = x.reshape(shape)?;
                (
                    pairs.narrow(last + 1, 0, 1)?.squeeze(last + 1)?,
                    pairs.narrow(last + 1, 1, 1)?.squeeze(last + 1)?,
                )
            }
            RopeLayout::HalfSplit => (x.narrow(last, 0, half)?, x.narrow(last, half, half)?),
        };
        let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        Tensor::cat(&[&r1, &r2], last)
    }

    /// The fused rotation equals the op-by-op one bit for bit on the CPU, for both layouts, both
    /// token axes (MLA's `[H, T, d]`, the indexer's `[T, nI, d]` and `[T, d]`), f32 and bf16; a
    /// swapped pair or table row would differ in most values.
    #[test]
    fn the_fused_rotation_is_the_op_by_op_one() -> Result<()> {
        fused_equals_op_by_op(&Device::Cpu)
    }

    /// The same on CUDA, where glmcheck's own kernel rotates (f32, f16, bf16): bit for bit the
    /// op-by-op rotation of candle's CUDA elementwise kernels, i.e. torch's eager roundings.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_cuda_rotation_is_the_op_by_op_one() -> Result<()> {
        match Device::new_cuda(0) {
            Ok(dev) => fused_equals_op_by_op(&dev),
            Err(_) => {
                eprintln!("no CUDA device: skipped");
                Ok(())
            }
        }
    }

    /// The one-launch partial rotation on CUDA equals narrow → rotate → cat (→ transpose) bit for
    /// bit: MLA's query (rope part last, heads out first) and the indexer's query and key (rope
    /// part first), both layouts, f32/f16/bf16. A pair taken from the wrong half, or a copied
    /// column shifted, differs.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_cuda_partial_rotation_is_the_chain() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return Ok(());
        };
        let (t, d) = (9usize, 16usize);
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = Rope::new(d, 10000.0, &dev)?;
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let tables = rope.tables(t)?.to_dtype(dtype)?;
                // (heads, width, offset, heads_out_first)
                for (h, w, off, first) in [(5, 40, 24, true), (3, 32, 0, false), (1, 20, 0, false)]
                {
                    let x = Tensor::randn(0f32, 1.0, (t, h, w), &dev)?.to_dtype(dtype)?;
                    let interleaved = matches!(layout, RopeLayout::Interleaved);
                    let got = crate::model::rope_cuda::rotate_part(
                        &x,
                        &tables.cos,
                        &tables.sin,
                        off,
                        interleaved,
                        first,
                    )?;
                    let want = rope.rotate_part_chain(layout, &x, &tables, off, first)?;
                    assert_eq!(got.dims(), want.dims());
                    let bits = crate::model::cuda_ffi::bits;
                    let (g, w) = (bits(&got)?, bits(&want)?);
                    let differ = g.iter().zip(&w).filter(|(a, b)| a != b).count();
                    assert_eq!(differ, 0, "{layout:?} {dtype:?} h={h} off={off}");
                }
            }
        }
        Ok(())
    }

    fn fused_equals_op_by_op(dev: &Device) -> Result<()> {
        let dev = dev.clone();
        let (t, h, d) = (7usize, 3usize, 16usize);
        for layout in [RopeLayout::Interleaved, RopeLayout::HalfSplit] {
            let rope = Rope::new(d, 10000.0, &dev)?;
            let tables = rope.tables(t)?;
            let (cos, sin) = (&tables.cos, &tables.sin);
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let heads_first = Tensor::randn(0f32, 1.0, (h, t, d), &dev)?.to_dtype(dtype)?;
                let tokens_first = Tensor::randn(0f32, 1.0, (t, h, d), &dev)?.to_dtype(dtype)?;
                let keys = Tensor::randn(0f32, 1.0, (t, d), &dev)?.to_dtype(dtype)?;
                let cases = [
                    (&heads_first, false, cos.clone(), sin.clone()),
                    (&tokens_first, true, cos.unsqueeze(1)?, sin.unsqueeze(1)?),
                    (&keys, true, cos.clone(), sin.clone()),
                ];
                for (x, first, c, s) in cases {
                    let got = rope
                        .rotate(layout, x, &tables, first)?
                        .to_dtype(DType::F32)?;
                    let want = op_by_op(layout, x, &c, &s)?.to_dtype(DType::F32)?;
                    let (g, w) = (
                        got.flatten_all()?.to_vec1::<f32>()?,
                        want.flatten_all()?.to_vec1::<f32>()?,
                    );
                    let differ = g.iter().zip(&w).filter(|(a, b)| a.to_bits() != b.to_bits());
                    assert_eq!(
                        differ.count(),
                        0,
                        "{layout:?} {dtype:?} {:?} tokens_first={first}",
                        x.dims()
                    );
                }
            }
        }
        Ok(())
    }
}
