//! q8 mode's dense matmuls on glmcheck's int8 kernel (`cuda/q8_moe.cu`) where it beats candle's
//! MMQ: a dense weight `[out, in]` multiplied as a one-expert stack by the grouped op of
//! [`super::moe_cuda`], all tokens to expert 0. Used by `linear::q8_matmul` on CUDA.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor};

use super::grouping::Grouping;
use super::moe_cuda::{attribute, Q8Kernel};

/// q8 mode's dense matmuls from 9 to this many tokens may go to the int8 kernel (one tile: each
/// weight read once; see [`int8_dense`]); fewer stay on candle's MMVQ (llama.cpp's choice up to 8),
/// more on candle's MMQ. Measured on an H200 (ncu, lm_head of GLM-5): 0.55 ms against MMQ's 0.66
/// at 16 tokens, 0.95 against 0.77 at 32 (32-wide tiles: four times the per-block scale work).
pub(crate) const INT8_DENSE_TOKENS: std::ops::RangeInclusive<usize> = 9..=16;

/// `x · Wᵀ` for a dense quantized `w` `[out, in]` by the int8 kernel, when it applies: x f32
/// `[T, in]` on CUDA with T in [`INT8_DENSE_TOKENS`], a Q4_K, Q6_K or Q8_0 weight with `in` a
/// multiple of 256 and `out / 64` (the kernel's blocks: it has no split-K, each block walks the
/// whole `in`) at least twice the device's SMs, and not `GLMCHECK_Q8_DENSE=candle` (candle's
/// kernels for every dense matmul, to cross-check; `=all` drops the grid condition, to measure
/// it). At GLM-5's sizes that is lm_head alone: the other projections have 9 to 256 blocks of 64
/// rows, and on the int8 kernel they took twice candle's stream-k MMQ (H200: 1.02 against 0.54 ms
/// per 16-token forward; `reports/gpu-moe.md`, H2). The same arithmetic as llama.cpp's MMQ (see
/// `cuda/q8_moe.cu`). → f32 `[T, out]`.
pub(crate) fn int8_dense(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    let choice = std::env::var_os("GLMCHECK_Q8_DENSE");
    let forced_off = choice.as_ref().is_some_and(|v| v == "candle");
    let any_grid = choice.as_ref().is_some_and(|v| v == "all");
    let t = x.dim(0)?;
    let candle_core::Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let applies = x.dtype() == DType::F32
        && INT8_DENSE_TOKENS.contains(&t)
        && matches!(w.shape().dims(), &[out, inp] if inp.is_multiple_of(256) && (any_grid || out / 64 >= 2 * sm_count(dev)?))
        && Q8Kernel::Int8.int8_type(w).is_some();
    if forced_off || !applies {
        return Ok(None);
    }
    IDENTITY.with(|cell| {
        let mut cell = cell.borrow_mut();
        let fresh = match cell.as_ref() {
            Some(g) => g.rows != t || !g.table.device().same_device(x.device()),
            None => true,
        };
        if fresh {
            *cell = Some(Grouping::identity(t, x.device())?);
        }
        match cell.as_ref() {
            Some(g) => g.matmul_with(w, x, true, Q8Kernel::Int8).map(Some),
            None => Ok(None),
        }
    })
}

thread_local! {
    /// The last identity grouping [`int8_dense`] used: one forward's dense matmuls all have the
    /// same token count, so its table is uploaded once per forward, not once per matmul.
    static IDENTITY: std::cell::RefCell<Option<Grouping>> = const { std::cell::RefCell::new(None) };
}

/// The device's streaming multiprocessors.
fn sm_count(dev: &candle_core::CudaDevice) -> Result<usize> {
    let cu = dev.cuda_stream().context().cu_device();
    let n = attribute(
        cu,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok(n.max(1) as usize)
}
