//! q8 mode's dense matmuls on CUDA from bf16 activations: the activations quantized to Q8_1 by
//! glmcheck's bf16 quantizer (`cuda/q8_quantize.cu`, the blocks candle-kernels' f32 quantizer
//! writes from the same values cast to f32), then the same kernels candle's quantized matmul runs
//! (llama.cpp's stream-k MMQ as vendored in candle-kernels, or glmcheck's int8 kernel where
//! [`int8_dense`] takes the weight). candle's own path casts bf16 to f32 in a launch of its own
//! first; the outputs are the same bits.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, DevicePtr};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::moe_cuda::attribute;
use super::q8_cuda::{activations, int8_dense, quantize_rows};

/// `block_q8_1_mmq`: 128 quants + 16 bytes of scales.
const BLOCK_Q8_1_MMQ_BYTES: usize = 144;
/// llama.cpp's `MATRIX_ROW_PADDING`.
const ROW_PADDING: usize = 512;
/// candle's matrix-vector kernels (MMVQ) take up to this many tokens, in bf16 already.
const MMVQ_MAX_TOKENS: usize = 8;
/// The widest MMQ tile (columns, rows): the stream-k fixup buffer holds one per SM.
const MMQ_TILE_MAX: usize = 128;

/// `x · Wᵀ` → f32 `[T, out]` for a dense quantized `w` on CUDA, when glmcheck's route applies: the
/// int8 kernel ([`int8_dense`]) or, for bf16 activations of more than 8 tokens and a type candle's
/// MMQ takes, that MMQ on glmcheck's bf16 quantization. `None`: candle's quantized matmul (f32
/// activations; its MMVQ up to 8 tokens). `x` as `q8_cuda::q8_input` gives it (contiguous, bf16 or
/// f32).
pub(crate) fn dense_q8(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    if !x.device().is_cuda() {
        return Ok(None);
    }
    if let Some(y) = int8_dense(w, x)? {
        return Ok(Some(y));
    }
    let (t, inp) = x.dims2()?;
    let Some(launcher) = mmq_launcher(w.dtype()) else {
        return Ok(None);
    };
    if x.dtype() != DType::BF16
        || t <= MMVQ_MAX_TOKENS
        || !inp.is_multiple_of(w.dtype().block_size())
        || !matches!(w.shape().dims(), &[_, cols] if cols == inp)
    {
        return Ok(None);
    }
    x.apply_op1_no_bwd(&DenseMmq { w, launcher }).map(Some)
}

type MmqLauncher = unsafe extern "C" fn(
    *mut std::ffi::c_void,
    *const std::ffi::c_void,
    *const std::ffi::c_void,
    *mut std::ffi::c_void,
    i64,
    i64,
    i64,
    i64,
    i64,
    i32,
    i32,
    i64,
    i32,
    *mut std::ffi::c_void,
);

/// candle-kernels' MMQ launcher for a weight type (the one candle's `fast_mmq` picks).
fn mmq_launcher(t: GgmlDType) -> Option<MmqLauncher> {
    use candle_kernels::ffi;
    Some(match t {
        GgmlDType::Q4_0 => ffi::launch_mmq_gguf_q4_0,
        GgmlDType::Q4_1 => ffi::launch_mmq_gguf_q4_1,
        GgmlDType::Q5_0 => ffi::launch_mmq_gguf_q5_0,
        GgmlDType::Q5_1 => ffi::launch_mmq_gguf_q5_1,
        GgmlDType::Q8_0 => ffi::launch_mmq_gguf_q8_0,
        GgmlDType::Q2K => ffi::launch_mmq_gguf_q2_k,
        GgmlDType::Q3K => ffi::launch_mmq_gguf_q3_k,
        GgmlDType::Q4K => ffi::launch_mmq_gguf_q4_k,
        GgmlDType::Q5K => ffi::launch_mmq_gguf_q5_k,
        GgmlDType::Q6K => ffi::launch_mmq_gguf_q6_k,
        _ => return None,
    })
}

struct DenseMmq<'a> {
    w: &'a QTensor,
    launcher: MmqLauncher,
}

impl CustomOp1 for DenseMmq<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-dense-mmq-bf16"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the bf16 MMQ route runs on CUDA only")
    }

    /// bf16 `[T, in]` → f32 `[T, out]`: quantize (one launch), MMQ and its stream-k fixup.
    fn cuda_fwd(&self, xs: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (&[out, inp], &[t, x_in], Some((x0, _))) = (
            self.w.shape().dims(),
            xl.shape().dims(),
            xl.contiguous_offsets(),
        ) else {
            candle_core::bail!(
                "bf16 MMQ: {:?} by a {:?} weight",
                xl.shape(),
                self.w.shape()
            )
        };
        if x_in != inp {
            candle_core::bail!("bf16 MMQ: {x_in} inputs for a [{out}, {inp}] weight")
        }
        let dev = xs.device().clone();
        let stream = dev.cuda_stream();
        let stream_ptr = stream.cu_stream() as *mut std::ffi::c_void;
        let cu = stream.context().cu_device();
        use sys::CUdevice_attribute as A;
        let major = attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let nsm = attribute(cu, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smpbo = attribute(cu, A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let warp = attribute(cu, A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?;

        // As candle's fast_mmq: rows padded to 512 values, one tile of slack, a fixup tile per SM.
        let padded = inp.div_ceil(ROW_PADDING) * ROW_PADDING;
        let q8_bytes = (t * padded / 128 + MMQ_TILE_MAX) * BLOCK_Q8_1_MMQ_BYTES;
        let q8 = unsafe { dev.alloc::<u8>(q8_bytes)? };
        let fixup_floats = nsm.max(1) as usize * MMQ_TILE_MAX * MMQ_TILE_MAX;
        let fixup = unsafe { dev.alloc::<f32>(fixup_floats)? };
        let dst = unsafe { dev.alloc::<f32>(t * out)? };
        let (x_ptr, _gx) = activations(xs, x0, &stream)?;
        let (q8_ptr, _gq) = q8.device_ptr(&stream);
        let (fixup_ptr, _gf) = fixup.device_ptr(&stream);
        let (dst_ptr, _gd) = dst.device_ptr(&stream);
        let w_ptr = self.w.device_ptr()?;
        let qk = self.w.dtype().block_size();
        unsafe {
            quantize_rows(
                DType::BF16,
                x_ptr,
                std::ptr::null(),
                q8_ptr,
                self.w.dtype(),
                (inp, padded, t),
                stream_ptr,
            )?;
            (self.launcher)(
                fixup_ptr as *mut std::ffi::c_void,
                w_ptr as *const std::ffi::c_void,
                q8_ptr as *const std::ffi::c_void,
                dst_ptr as *mut std::ffi::c_void,
                inp as i64,
                out as i64,
                t as i64,
                (inp / qk) as i64,
                out as i64,
                major * 100 + minor * 10,
                nsm,
                smpbo as i64,
                warp,
                stream_ptr,
            );
        }
        drop((_gx, _gq, _gf, _gd));
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), (t, out).into()))
    }
}
