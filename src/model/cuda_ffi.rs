//! What glmcheck's elementwise CUDA ops (`rope_cuda`, `fused_cuda`) share to call their `extern
//! "C"` launchers: the dtype code the launchers take, raw pointers into candle's storages, fresh
//! outputs, the stream, and the launcher's return code turned into an error.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, SyncOnDrop};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, DType, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// The launchers' dtype code: 0 f32, 1 f16, 2 bf16.
pub fn code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

/// `v` as the launchers' `int`, or an error naming `what`.
pub fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{what}: {v} is too large")))
}

/// The device's stream and its raw handle (what the launchers take).
pub fn stream(dev: &CudaDevice) -> (Arc<CudaStream>, *mut c_void) {
    let stream = dev.cuda_stream();
    let raw = stream.cu_stream() as *mut c_void;
    (stream, raw)
}

/// The address of value `offset` of `s` (f32, f16 or bf16), with the guard that orders its use
/// on `stream`.
pub fn ptr<'a>(
    s: &'a CudaStorage,
    offset: usize,
    stream: &'a CudaStream,
) -> Result<(*mut c_void, SyncOnDrop<'a>)> {
    let (base, guard, size) = match s.dtype() {
        DType::F32 => {
            let (p, g) = s.as_cuda_slice::<f32>()?.device_ptr(stream);
            (p, g, 4)
        }
        DType::F16 => {
            let (p, g) = s.as_cuda_slice::<half::f16>()?.device_ptr(stream);
            (p, g, 2)
        }
        DType::BF16 => {
            let (p, g) = s.as_cuda_slice::<half::bf16>()?.device_ptr(stream);
            (p, g, 2)
        }
        DType::U32 => {
            let (p, g) = s.as_cuda_slice::<u32>()?.device_ptr(stream);
            (p, g, 4)
        }
        other => candle_core::bail!("no glmcheck CUDA kernel takes {other:?}"),
    };
    Ok(((base + (offset * size) as u64) as *mut c_void, guard))
}

/// `n` uninitialised values of `dtype` (f32, f16 or bf16) on `dev`, for a launcher to fill.
pub fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    // SAFETY (each arm): the launcher writes every value before the storage is read.
    Ok(match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(n)? }, dev.clone()),
        DType::F16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(n)? }, dev.clone())
        }
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(n)? }, dev.clone())
        }
        other => candle_core::bail!("no glmcheck CUDA kernel writes {other:?}"),
    })
}

/// A launcher's return code: 0 launched; 1 a dtype it does not take; 2 a shape it does not
/// take; 3 CUDA refused the launch.
pub fn check(op: &str, rc: i32) -> Result<()> {
    match rc {
        0 => Ok(()),
        1 => candle_core::bail!("{op}: the kernel does not take this dtype"),
        2 => candle_core::bail!("{op}: the kernel does not take this shape"),
        _ => candle_core::bail!("{op}: CUDA refused the launch (code {rc})"),
    }
}

/// Test helper: the bit patterns of a tensor's values as f32 (exact for f16/bf16), for the
/// bit-for-bit comparisons of the kernels' tests against candle's chains.
#[cfg(test)]
pub fn bits(x: &candle_core::Tensor) -> Result<Vec<u32>> {
    Ok(x.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|v| v.to_bits())
        .collect())
}
