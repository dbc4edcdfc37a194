//! RoPE on CUDA with transformers' roundings (`cuda/rope.cu`): each product and the sum rounded
//! separately in the tensor's dtype, as torch's eager `q·cos + rotate_half(q)·sin` does, and the
//! interleaved layout de-interleaved in the same launch. candle's fused `rope` kernel lets nvcc
//! contract a product into the difference (one rounding fewer): on an H200 it put MLA's bf16
//! query states 6.6e-4 rel-L2 off transformers where the op-by-op rotation was bit-identical.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::cuda_ffi::{alloc, check, code, i32_of, ptr, stream};

extern "C" {
    fn glmcheck_rope(
        dtype: i32,
        x: *const std::ffi::c_void,
        cos: *const std::ffi::c_void,
        sin: *const std::ffi::c_void,
        y: *mut std::ffi::c_void,
        rows: i64,
        t: i32,
        heads: i32,
        d: i32,
        tokens_first: i32,
        interleaved: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_rope_part(
        dtype: i32,
        x: *const std::ffi::c_void,
        cos: *const std::ffi::c_void,
        sin: *const std::ffi::c_void,
        y: *mut std::ffi::c_void,
        t: i32,
        heads: i32,
        width: i32,
        offset: i32,
        d: i32,
        interleaved: i32,
        heads_out_first: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
}

/// `x` contiguous `[rows, d]` (rows `(token, head)` when `tokens_first`, else `(head, token)`),
/// `cos`/`sin` `[t, d/2]` in `x`'s dtype → the rotated `[rows, d]`, de-interleaved as transformers
/// returns it. CUDA only (the CPU keeps candle's kernel, whose per-op roundings already match).
pub fn rotate(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    tokens_first: bool,
    interleaved: bool,
) -> Result<Tensor> {
    let op = RopeOp {
        tokens_first,
        interleaved,
    };
    x.contiguous()?
        .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

/// `x` `[t, heads, width]` (tokens first) with columns `offset..offset + d` rotated as
/// [`rotate`] does (same roundings, de-interleaved) and the others copied, in one launch; the
/// output is `[t, heads, width]`, or `[heads, t, width]` when `heads_out_first`. `cos`/`sin`
/// `[t, d/2]` in `x`'s dtype. Replaces narrow → contiguous → rotate → cat (→ transpose →
/// contiguous): MLA's query and the indexer's query and key.
pub fn rotate_part(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    offset: usize,
    interleaved: bool,
    heads_out_first: bool,
) -> Result<Tensor> {
    let op = RopePartOp {
        offset,
        interleaved,
        heads_out_first,
    };
    x.contiguous()?
        .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

struct RopePartOp {
    offset: usize,
    interleaved: bool,
    heads_out_first: bool,
}

impl CustomOp3 for RopePartOp {
    fn name(&self) -> &'static str {
        "glmcheck-rope-part"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's RoPE kernel runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (t, heads, width) = xl.shape().dims3()?;
        let (Some((x0, _)), Some((c0, _)), Some((s0, _))) = (
            xl.contiguous_offsets(),
            cl.contiguous_offsets(),
            sl.contiguous_offsets(),
        ) else {
            candle_core::bail!(
                "rope: {:?} is not a contiguous [t, heads, width]",
                xl.shape()
            )
        };
        let (tt, half) = cl.shape().dims2()?;
        if tt != t
            || sl.shape().dims2()? != (t, half)
            || xs.dtype() != cs.dtype()
            || xs.dtype() != ss.dtype()
        {
            candle_core::bail!("rope: tables {:?} for {:?}", cl.shape(), xl.shape())
        }
        let (t32, h32, w32) = (
            i32_of(t, "rope tokens")?,
            i32_of(heads, "heads")?,
            i32_of(width, "width")?,
        );
        let (o32, d32) = (
            i32_of(self.offset, "offset")?,
            i32_of(2 * half, "rope dim")?,
        );
        let dev = xs.device();
        let (st, raw) = stream(dev);
        let out = alloc(dev, xs.dtype(), t * heads * width)?;
        let ((xp, _gx), (cp, _gc), (sp, _gs), (yp, gy)) = (
            ptr(xs, x0, &st)?,
            ptr(cs, c0, &st)?,
            ptr(ss, s0, &st)?,
            ptr(&out, 0, &st)?,
        );
        let rc = unsafe {
            glmcheck_rope_part(
                code(xs.dtype()).unwrap_or(-1),
                xp,
                cp,
                sp,
                yp,
                t32,
                h32,
                w32,
                o32,
                d32,
                i32::from(self.interleaved),
                i32::from(self.heads_out_first),
                raw,
            )
        };
        drop(gy);
        check("rope", rc)?;
        let shape: Shape = if self.heads_out_first {
            (heads, t, width).into()
        } else {
            (t, heads, width).into()
        };
        Ok((out, shape))
    }
}

struct RopeOp {
    tokens_first: bool,
    interleaved: bool,
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "glmcheck-rope"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's RoPE kernel runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dims = xl.shape().dims();
        let (Some(&d), Some((x0, _)), Some((c0, _)), Some((s0, _))) = (
            dims.last(),
            xl.contiguous_offsets(),
            cl.contiguous_offsets(),
            sl.contiguous_offsets(),
        ) else {
            candle_core::bail!("rope: {:?} is not a contiguous [.., d]", xl.shape())
        };
        let (t, half) = cl.shape().dims2()?;
        if sl.shape().dims2()? != (t, half)
            || 2 * half != d
            || xs.dtype() != cs.dtype()
            || xs.dtype() != ss.dtype()
        {
            candle_core::bail!("rope: tables {:?} for {:?}", cl.shape(), xl.shape())
        }
        let rows = xl.shape().elem_count() / d.max(1);
        if t == 0 || !rows.is_multiple_of(t) {
            candle_core::bail!("rope: {rows} rows for {t} tokens")
        }
        let dev = xs.device();
        let (st, raw) = stream(dev);
        let out = alloc(dev, xs.dtype(), rows * d)?;
        let ((xp, _gx), (cp, _gc), (sp, _gs), (yp, gy)) = (
            ptr(xs, x0, &st)?,
            ptr(cs, c0, &st)?,
            ptr(ss, s0, &st)?,
            ptr(&out, 0, &st)?,
        );
        let rc = unsafe {
            glmcheck_rope(
                code(xs.dtype()).unwrap_or(-1),
                xp,
                cp,
                sp,
                yp,
                rows as i64,
                i32_of(t, "rope tokens")?,
                i32_of(rows / t, "heads")?,
                i32_of(d, "rope dim")?,
                i32::from(self.tokens_first),
                i32::from(self.interleaved),
                raw,
            )
        };
        drop(gy);
        check("rope", rc)?;
        Ok((out, xl.shape().clone()))
    }
}
