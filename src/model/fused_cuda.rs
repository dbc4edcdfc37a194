//! Elementwise chains of the forward fused into one launch each on CUDA (`cuda/fused.cu`), with the
//! roundings of the candle kernels they replace, bit for bit (`fused_cuda_tests.rs`, on the device):
//!
//! * [`masked_softmax`]: attention's `softmax_f32((scores · scale) as f32 + mask)` cast back to
//!   the scores' dtype: five launches (affine, cast, broadcast add, softmax, cast) and four
//!   `[H, T, S]` round trips through device memory per attention.
//! * [`slot_sum`]: the MoE combine `(y [T, k, H] · w [T, k, 1]).sum(1)` cast to the compute dtype:
//!   three launches (broadcast multiply, sum, cast) and a `[T, k, H]` f32 product tensor per MoE
//!   layer (~50 MB at 256 tokens and GLM-5's width).
//!
//! * [`token_sum`]: dequant mode's MoE combine from grouped rows, `zeros.index_add(tokens, (y as
//!   f32 · w) as dtype)`: candle's `index_add` walks all R rows in each of H threads (~1 ms per
//!   MoE layer at 256 tokens of GLM-5); one thread per output walks its token's k rows instead.
//!
//! * [`mla_kv`]: MLA's per-head keys `[k_nope | k_rot]` and values from kv_b's output: the
//!   transpose, narrows, broadcast, cat and contiguous copies (four to six launches) in one.
//!
//! * [`heads_to_tokens`]: attention's `[H, T, v]` output as o_proj's `[T, H·v]` input: candle's
//!   transpose copy walks a strided index per value (~40 µs per layer for GLM-5 at 256 tokens on
//!   an H100, 0.4 TB/s); one launch of 16-byte pieces instead (a copy: the same bits). With
//!   [`mla_kv`]'s 16-byte copies, the default since their device tests passed on an H100
//!   (`GLMCHECK_COPY16=off`: candle's copies and one value a thread).
//!
//! * [`rms_norm`]: transformers' RMSNorm as `ops::RmsNorm` computes it op by op (f32 inside, the
//!   normalised value rounded to the compute dtype before the weight multiplies it): ten launches
//!   and five `[T, n]` round trips per norm (~100 µs for GLM-5's hidden at 256 tokens on an H100).
//!
//! Callers go through `ops::masked_softmax`, `ops::RmsNorm::forward`, `Experts::fused` and `Mla::keys_values`, which keep
//! candle's chain on the CPU and for layouts these kernels do not take. `GLMCHECK_FUSED=off` keeps
//! candle's chains on CUDA too (with `ops::Rope::rotate_part`'s), to measure the difference.

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use std::sync::atomic::{AtomicI32, Ordering};

use super::cuda_ffi::{alloc, check, code, i32_of, ptr, stream};

extern "C" {
    fn glmcheck_masked_softmax(
        dtype: i32,
        scores: *const std::ffi::c_void,
        mask: *const f32,
        probs: *mut std::ffi::c_void,
        heads: i64,
        t: i32,
        s: i32,
        scale: f32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_slot_sum(
        dtype: i32,
        y: *const f32,
        w: *const f32,
        out: *mut std::ffi::c_void,
        n: i64,
        k: i32,
        h: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_token_sum(
        dtype: i32,
        y: *const std::ffi::c_void,
        w: *const f32,
        order: *const u32,
        out: *mut std::ffi::c_void,
        n: i64,
        k: i32,
        h: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_rms_norm(
        dtype: i32,
        x: *const std::ffi::c_void,
        w: *const std::ffi::c_void,
        y: *mut std::ffi::c_void,
        rows: i64,
        n: i32,
        mul: f32,
        eps: f32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_mla_kv(
        dtype: i32,
        kv: *const std::ffi::c_void,
        krot: *const std::ffi::c_void,
        out: *mut std::ffi::c_void,
        t: i32,
        heads: i32,
        nope: i32,
        rope: i32,
        v: i32,
        pieces: i32,
        took: *mut i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_heads_to_tokens(
        dtype: i32,
        x: *const std::ffi::c_void,
        y: *mut std::ffi::c_void,
        heads: i32,
        t: i32,
        v: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
}

/// Whether the fused kernels run (`GLMCHECK_FUSED=off`: candle's chains instead;
/// `GLMCHECK_FUSED=no-norm`: all but [`rms_norm`], to measure it alone).
pub fn enabled() -> bool {
    super::knobs::knobs().fused.as_deref() != Some("off")
}

/// Whether the copies move 16 bytes a thread ([`heads_to_tokens`], [`mla_kv`]); `GLMCHECK_COPY16=off`:
/// candle's transpose copy and one value a thread (to measure). Read once. The default since their
/// device tests passed on an H100 (build AD: the 256-token forward bit for bit, 563 modules).
fn copy16() -> bool {
    !super::knobs::knobs().copy16_off
}

fn norm_enabled() -> bool {
    !matches!(
        super::knobs::knobs().fused.as_deref(),
        Some("off" | "no-norm")
    )
}

/// `scores` `[H, T, S]` (any of f32/f16/bf16, on CUDA), `mask` `[T, S]` f32 →
/// `softmax(f32(scores · scale) + mask)` over S in the scores' dtype. `None` when the operands are
/// not what the kernel takes (the caller then runs candle's chain).
pub fn masked_softmax(scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Option<Tensor>> {
    let (Ok((_, t, s)), Ok(mdims)) = (scores.dims3(), mask.dims2()) else {
        return Ok(None);
    };
    if !enabled()
        || !scores.device().is_cuda()
        || scores.elem_count() == 0
        || mask.dtype() != DType::F32
        || mdims != (t, s)
        || code(scores.dtype()).is_none()
    {
        return Ok(None);
    }
    // candle's affine multiplies by `T::from_f64(scale)`: the scale rounded to the dtype.
    let scale = match scores.dtype() {
        DType::BF16 => half::bf16::from_f64(scale).to_f32(),
        DType::F16 => half::f16::from_f64(scale).to_f32(),
        _ => scale as f32,
    };
    let op = MaskedSoftmax { scale };
    scores
        .contiguous()?
        .apply_op2_no_bwd(&mask.contiguous()?, &op)
        .map(Some)
}

/// `y` `[T, k, H]` f32 and `w` `[T, k]` f32 on CUDA → `Σ_k y·w` `[T, H]` in `dtype`. `None` when
/// the operands are not what the kernel takes.
pub fn slot_sum(y: &Tensor, w: &Tensor, dtype: DType) -> Result<Option<Tensor>> {
    let (Ok((t, k, _)), Ok(wdims)) = (y.dims3(), w.dims2()) else {
        return Ok(None);
    };
    // candle sums more than 32 values per output with a block tree (another order): decline.
    if !enabled()
        || !y.device().is_cuda()
        || y.elem_count() == 0
        || k > 32
        || y.dtype() != DType::F32
        || w.dtype() != DType::F32
        || wdims != (t, k)
        || code(dtype).is_none()
    {
        return Ok(None);
    }
    let op = SlotSum { dtype };
    y.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &op)
        .map(Some)
}

/// Grouped rows' outputs `y` `[R, H]` (f32/f16/bf16, on CUDA), routing weights `w` `[n, k]` f32,
/// `order` `[2·n·k]` u32 (`Grouping::token_order`: each token's rows ascending, then their slots)
/// → `[n, H]` in y's dtype, equal bit for bit to `zeros.index_add(tokens, (y as f32 ·
/// w[slot]) as dtype)` over the rows in order. `None` when the operands are not what the kernel
/// takes.
pub fn token_sum(y: &Tensor, w: &Tensor, order: &Tensor) -> Result<Option<Tensor>> {
    let (Ok((_, h)), Ok((n, k))) = (y.dims2(), w.dims2()) else {
        return Ok(None);
    };
    if !enabled()
        || !y.device().is_cuda()
        || y.elem_count() == 0
        || w.dtype() != DType::F32
        || order.dtype() != DType::U32
        || order.elem_count() != 2 * n * k
        || code(y.dtype()).is_none()
    {
        return Ok(None);
    }
    let op = TokenSum { h };
    y.contiguous()?
        .apply_op3_no_bwd(&w.contiguous()?, &order.contiguous()?, &op)
        .map(Some)
}

/// `x` `[…, n]` and `weight` `[n]` (one of f32/f16/bf16, on CUDA) → transformers' RMSNorm
/// `w · (x / sqrt(mean(x²) + eps))` with the roundings of `ops::RmsNorm`'s candle chain, bit for bit.
/// `None` when the operands are not what the kernel takes (rows of 32 values or fewer, or not a
/// multiple of 4: candle sums those in another order).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    let n = x.dim(candle_core::D::Minus1)?;
    if !norm_enabled()
        || !x.device().is_cuda()
        || x.elem_count() == 0
        || n <= 32
        || !n.is_multiple_of(4)
        || weight.dims() != [n]
        || weight.dtype() != x.dtype()
        || code(x.dtype()).is_none()
    {
        return Ok(None);
    }
    let op = RmsNormOp {
        mul: (1f64 / n as f64) as f32,
        eps: eps as f32,
    };
    x.contiguous()?
        .apply_op2_no_bwd(&weight.contiguous()?, &op)
        .map(Some)
}

struct RmsNormOp {
    mul: f32,
    eps: f32,
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "glmcheck-rms-norm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's fused RMSNorm runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = xl.shape().dims().last().copied().unwrap_or(0);
        let (Some((x0, _)), Some((w0, _))) = (xl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            candle_core::bail!("rms norm: operands are not contiguous")
        };
        let elems = xl.shape().elem_count();
        let rows = elems / n.max(1);
        let n32 = i32_of(n, "rms norm width")?;
        let dev = xs.device();
        let (st, raw) = stream(dev);
        let dtype = code(xs.dtype()).unwrap_or(-1);
        let out = alloc(dev, xs.dtype(), elems)?;
        let ((xp, _gx), (wp, _gw), (yp, gy)) =
            (ptr(xs, x0, &st)?, ptr(ws, w0, &st)?, ptr(&out, 0, &st)?);
        let rc = unsafe {
            glmcheck_rms_norm(dtype, xp, wp, yp, rows as i64, n32, self.mul, self.eps, raw)
        };
        drop(gy);
        check("rms norm", rc)?;
        Ok((out, xl.shape().clone()))
    }
}

/// `x` `[H, T, v]` (attention's per-head output) → `[T, H·v]`, what
/// `x.transpose(0, 1).reshape((T, H·v))` gives (a copy, the same bits). `None` when the kernel does
/// not take it (not CUDA, another dtype, rows of v values not whole 16-byte pieces, or
/// `GLMCHECK_FUSED=off`), or [`copy16`] off.
pub fn heads_to_tokens(x: &Tensor) -> Result<Option<Tensor>> {
    if !copy16() {
        return Ok(None);
    }
    heads_to_tokens_kernel(x)
}

/// [`heads_to_tokens`] whatever [`copy16`] says (its device test calls this).
fn heads_to_tokens_kernel(x: &Tensor) -> Result<Option<Tensor>> {
    let Ok((h, t, v)) = x.dims3() else {
        return Ok(None);
    };
    let size = x.dtype().size_in_bytes();
    if !enabled()
        || !x.device().is_cuda()
        || code(x.dtype()).is_none()
        || x.elem_count() == 0
        || !(v * size).is_multiple_of(16)
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    // device buffers start on 256-byte boundaries: the view's offset decides the alignment
    if !(x.layout().start_offset() * size).is_multiple_of(16) {
        return Ok(None);
    }
    x.apply_op1_no_bwd(&HeadsToTokens)
        .and_then(|y| y.reshape((t, h * v)))
        .map(Some)
}

struct HeadsToTokens;

impl CustomOp1 for HeadsToTokens {
    fn name(&self) -> &'static str {
        "glmcheck-heads-to-tokens"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's heads-to-tokens copy runs on CUDA only")
    }

    fn cuda_fwd(&self, xs: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (h, t, v) = xl.shape().dims3()?;
        let Some((x0, _)) = xl.contiguous_offsets() else {
            candle_core::bail!("heads to tokens: the input is not contiguous")
        };
        let (h32, t32, v32) = (
            i32_of(h, "heads")?,
            i32_of(t, "tokens")?,
            i32_of(v, "head width")?,
        );
        let dev = xs.device();
        let (st, raw) = stream(dev);
        let dtype = code(xs.dtype()).unwrap_or(-1);
        let out = alloc(dev, xs.dtype(), h * t * v)?;
        let ((xp, _gx), (yp, gy)) = (ptr(xs, x0, &st)?, ptr(&out, 0, &st)?);
        let rc = unsafe { glmcheck_heads_to_tokens(dtype, xp, yp, h32, t32, v32, raw) };
        drop(gy);
        check("heads to tokens", rc)?;
        Ok((out, (t, h, v).into()))
    }
}

/// MLA's per-head keys and values from `kv` `[T, H, nope + v]` (kv_b's output) and the rotated
/// shared key `k_rot` `[T, rope]`: `key` `[H, T, nope + rope]` = `[k_nope | k_rot]`, `value`
/// `[H, T, v]`, both contiguous (views of one buffer), in one launch of copies. `None` when the
/// operands are not what the kernel takes.
pub fn mla_kv(kv: &Tensor, k_rot: &Tensor, nope: usize) -> Result<Option<(Tensor, Tensor)>> {
    let (Ok((t, h, w)), Ok((tr, rope))) = (kv.dims3(), k_rot.dims2()) else {
        return Ok(None);
    };
    if !enabled()
        || !kv.device().is_cuda()
        || kv.elem_count() == 0
        || tr != t
        || w <= nope
        || kv.dtype() != k_rot.dtype()
        || code(kv.dtype()).is_none()
    {
        return Ok(None);
    }
    let v = w - nope;
    let op = MlaKv {
        nope,
        pieces: copy16(),
        took: AtomicI32::new(0),
    };
    let out = kv
        .contiguous()?
        .apply_op2_no_bwd(&k_rot.contiguous()?, &op)?;
    let key_n = h * t * (nope + rope);
    let key = out.narrow(0, 0, key_n)?.reshape((h, t, nope + rope))?;
    let value = out.narrow(0, key_n, h * t * v)?.reshape((h, t, v))?;
    Ok(Some((key, value)))
}

struct MlaKv {
    nope: usize,
    /// 16-byte copies where the split and the buffers allow (the launcher checks).
    pieces: bool,
    /// The bytes each thread of the last launch copied at once (16, or the element's size): which
    /// path the launcher took, for its device test.
    took: AtomicI32,
}

impl CustomOp2 for MlaKv {
    fn name(&self) -> &'static str {
        "glmcheck-mla-kv"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's MLA key/value kernel runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        ks: &CudaStorage,
        kl: &Layout,
        rs: &CudaStorage,
        rl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (t, h, w) = kl.shape().dims3()?;
        let (_, rope) = rl.shape().dims2()?;
        let (Some((k0, _)), Some((r0, _))) = (kl.contiguous_offsets(), rl.contiguous_offsets())
        else {
            candle_core::bail!("mla kv: operands are not contiguous")
        };
        let v = w - self.nope;
        let n = h * t * (self.nope + rope + v);
        let (t32, h32) = (i32_of(t, "mla kv tokens")?, i32_of(h, "heads")?);
        let (n32, r32, v32) = (
            i32_of(self.nope, "nope")?,
            i32_of(rope, "rope")?,
            i32_of(v, "v")?,
        );
        let dev = ks.device();
        let (st, raw) = stream(dev);
        let dtype = code(ks.dtype()).unwrap_or(-1);
        let out = alloc(dev, ks.dtype(), n)?;
        let ((kp, _gk), (rp, _gr), (op, go)) =
            (ptr(ks, k0, &st)?, ptr(rs, r0, &st)?, ptr(&out, 0, &st)?);
        let pieces = i32::from(self.pieces);
        let mut took = 0i32;
        let rc = unsafe {
            glmcheck_mla_kv(
                dtype, kp, rp, op, t32, h32, n32, r32, v32, pieces, &mut took, raw,
            )
        };
        self.took.store(took, Ordering::Relaxed);
        drop(go);
        check("mla kv", rc)?;
        Ok((out, n.into()))
    }
}

struct MaskedSoftmax {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "glmcheck-masked-softmax"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's fused softmax runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ms: &CudaStorage,
        ml: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (h, t, s) = xl.shape().dims3()?;
        let (Some((x0, _)), Some((m0, _))) = (xl.contiguous_offsets(), ml.contiguous_offsets())
        else {
            candle_core::bail!("masked softmax: operands are not contiguous")
        };
        let (t32, s32) = (i32_of(t, "masked softmax rows")?, i32_of(s, "keys")?);
        let dev = xs.device();
        let (st, raw) = stream(dev);
        let dtype = code(xs.dtype()).unwrap_or(-1);
        let out = alloc(dev, xs.dtype(), h * t * s)?;
        let ((xp, _gx), (mp, _gm), (yp, gy)) =
            (ptr(xs, x0, &st)?, ptr(ms, m0, &st)?, ptr(&out, 0, &st)?);
        let rc = unsafe {
            glmcheck_masked_softmax(
                dtype,
                xp,
                mp as *const f32,
                yp,
                h as i64,
                t32,
                s32,
                self.scale,
                raw,
            )
        };
        drop(gy);
        check("masked softmax", rc)?;
        Ok((out, xl.shape().clone()))
    }
}

struct SlotSum {
    dtype: DType,
}

impl CustomOp2 for SlotSum {
    fn name(&self) -> &'static str {
        "glmcheck-slot-sum"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's fused MoE combine runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        ys: &CudaStorage,
        yl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, k, h) = yl.shape().dims3()?;
        let (Some((y0, _)), Some((w0, _))) = (yl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            candle_core::bail!("slot sum: operands are not contiguous")
        };
        let (k32, h32) = (i32_of(k, "slot sum slots")?, i32_of(h, "width")?);
        let dev = ys.device();
        let (st, raw) = stream(dev);
        let dtype = code(self.dtype).unwrap_or(-1);
        let out = alloc(dev, self.dtype, n * h)?;
        let ((yp, _gy), (wp, _gw), (op, go)) =
            (ptr(ys, y0, &st)?, ptr(ws, w0, &st)?, ptr(&out, 0, &st)?);
        let rc = unsafe {
            glmcheck_slot_sum(
                dtype,
                yp as *const f32,
                wp as *const f32,
                op,
                n as i64,
                k32,
                h32,
                raw,
            )
        };
        drop(go);
        check("slot sum", rc)?;
        Ok((out, (n, h).into()))
    }
}

struct TokenSum {
    h: usize,
}

impl CustomOp3 for TokenSum {
    fn name(&self) -> &'static str {
        "glmcheck-token-sum"
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
        candle_core::bail!("glmcheck's grouped MoE combine runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        ys: &CudaStorage,
        yl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
        os: &CudaStorage,
        ol: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, k) = wl.shape().dims2()?;
        let h = self.h;
        let (Some((y0, _)), Some((w0, _)), Some((o0, _))) = (
            yl.contiguous_offsets(),
            wl.contiguous_offsets(),
            ol.contiguous_offsets(),
        ) else {
            candle_core::bail!("token sum: operands are not contiguous")
        };
        let (k32, h32) = (i32_of(k, "token sum slots")?, i32_of(h, "width")?);
        let dev = ys.device();
        let (st, raw) = stream(dev);
        let dtype = ys.dtype();
        let out = alloc(dev, dtype, n * h)?;
        let ((yp, _gy), (wp, _gw), (opp, _go), (outp, gout)) = (
            ptr(ys, y0, &st)?,
            ptr(ws, w0, &st)?,
            ptr(os, o0, &st)?,
            ptr(&out, 0, &st)?,
        );
        let rc = unsafe {
            glmcheck_token_sum(
                code(dtype).unwrap_or(-1),
                yp,
                wp as *const f32,
                opp as *const u32,
                outp,
                n as i64,
                k32,
                h32,
                raw,
            )
        };
        drop(gout);
        check("token sum", rc)?;
        Ok((out, (n, h).into()))
    }
}

#[cfg(test)]
#[path = "fused_cuda_tests.rs"]
mod tests;
