//! Whole quantized tensors decoded on CUDA by glmcheck's own kernel (`cuda/dequant_gemm.cu`,
//! `glmcheck_decode_whole`): the tiled expert kernel's decoders — candle-kernels' `dequantize_block_*`
//! expressions, so the same values — with coalesced reads and writes (a warp copies 1024 values'
//! blocks into shared memory, decodes them there and writes them out contiguously). candle's own
//! kernels reach about a third of the copy bandwidth on an H200 for Q8_0 (`reports/gpu-dequant-q8_0.md`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

extern "C" {
    fn glmcheck_dequant_matmul_type(ggml_type: i32) -> i32;
    fn glmcheck_decode_whole(
        ggml_type: i32,
        dtype: i32,
        x: *const std::ffi::c_void,
        y: *mut std::ffi::c_void,
        n_values: i64,
        max_blocks: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
}

/// The quant types glmcheck's kernels are built for (the grouped MMQ kernel, the expert decoder),
/// with ggml's type id and block size.
pub(crate) fn kernel_type(t: GgmlDType) -> Option<(i32, usize)> {
    Some(match t {
        GgmlDType::Q4_0 => (2, 32),
        GgmlDType::Q4_1 => (3, 32),
        GgmlDType::Q5_0 => (6, 32),
        GgmlDType::Q5_1 => (7, 32),
        GgmlDType::Q8_0 => (8, 32),
        GgmlDType::Q2K => (10, 256),
        GgmlDType::Q3K => (11, 256),
        GgmlDType::Q4K => (12, 256),
        GgmlDType::Q5K => (13, 256),
        GgmlDType::Q6K => (14, 256),
        _ => return None,
    })
}

/// ggml's id of a type `cuda/dequant_gemm.cu` decodes (its tiled kernel and [`decode`]): the
/// kernel file says which (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K).
pub(crate) fn tiled_type(t: GgmlDType) -> Option<i32> {
    kernel_type(t)
        .map(|(id, _)| id)
        .filter(|&id| unsafe { glmcheck_dequant_matmul_type(id) } == 1)
}

/// `q` decoded on its CUDA device into `dtype` (f32, f16 or bf16), its shape kept; `None` where the
/// kernel does not apply (another quant type or device, a size not a multiple of 256 values).
pub fn decode(q: &QTensor, dtype: DType) -> Result<Option<Tensor>> {
    decode_grid(q, dtype, 0)
}

/// [`decode`] on the grid `grid` says: 0 as many blocks as the device holds at once (each warp
/// loops over its batches of 1024 values, the next one's loads in flight), N > 0 at most N blocks
/// (tests: warps that loop over many batches).
pub(crate) fn decode_grid(q: &QTensor, dtype: DType, grid: i32) -> Result<Option<Tensor>> {
    let elems = q.shape().elem_count();
    let code = match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        _ => return Ok(None),
    };
    if tiled_type(q.dtype()).is_none()
        || elems == 0
        || !elems.is_multiple_of(256)
        || !q.device().is_cuda()
    {
        return Ok(None);
    }
    let dims = q.shape().dims().to_vec();
    // The op runs on a one-element tensor of the weight's device (candle ops need a storage).
    let anchor = Tensor::zeros(1, DType::U32, &q.device())?;
    let op = Whole {
        q,
        dtype,
        code,
        grid,
    };
    Ok(Some(anchor.apply_op1_no_bwd(&op)?.reshape(dims)?))
}

struct Whole<'a> {
    q: &'a QTensor,
    dtype: DType,
    code: i32,
    grid: i32,
}

impl CustomOp1 for Whole<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-decode-whole"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("glmcheck's whole-tensor decoder runs on CUDA only")
    }

    fn cuda_fwd(&self, anchor: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = anchor.device();
        let elems = self.q.shape().elem_count();
        let ty = tiled_type(self.q.dtype()).unwrap_or(-1);
        let stream = dev.cuda_stream();
        let x = self.q.device_ptr()? as *const std::ffi::c_void;
        let s = stream.cu_stream() as *mut std::ffi::c_void;
        let p = self.grid;
        let run = |y| unsafe { glmcheck_decode_whole(ty, self.code, x, y, elems as i64, p, s) };
        let (rc, storage) = match self.dtype {
            DType::F32 => fill::<f32>(dev, elems, run)?,
            DType::F16 => fill::<half::f16>(dev, elems, run)?,
            _ => fill::<half::bf16>(dev, elems, run)?,
        };
        if rc != 0 {
            candle_core::bail!(
                "whole-tensor decode of {:?} {:?}: launcher refused (code {rc})",
                self.q.dtype(),
                self.q.shape()
            )
        }
        Ok((storage, elems.into()))
    }
}

/// A fresh `len`-element buffer of `T` on `dev`, filled by `run` (a launch given its pointer).
pub(crate) fn fill<T>(
    dev: &candle_core::CudaDevice,
    len: usize,
    run: impl FnOnce(*mut std::ffi::c_void) -> i32,
) -> Result<(i32, CudaStorage)>
where
    T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
{
    let stream = dev.cuda_stream();
    let y = unsafe { dev.alloc::<T>(len)? };
    let (p, guard) = y.device_ptr(&stream);
    let rc = run(p as *mut std::ffi::c_void);
    drop(guard);
    Ok((rc, CudaStorage::wrap_cuda_slice(y, dev.clone())))
}
