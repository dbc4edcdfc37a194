//! dequant mode's dense matmuls of many tokens on Hopper's warpgroup MMA (`cuda/dequant_wgmma.cu`):
//! a quantized `[out, in]` weight decoded into registers by the register kernel's arithmetic
//! (`cuda/dq_decode.cuh`) and multiplied there with `wgmma`, each decoded value used for 64 or 128
//! tokens, never written out. Opt-in (`GLMCHECK_DENSE=wgmma|wgmma64`) until its device test
//! ([`tests`]) has run: past [`DENSE_TILED_TOKENS`] tokens the default decodes the whole weight
//! into device memory and multiplies it with cuBLAS.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use std::ffi::c_void;

use super::moe_cuda::{stack, too_big, DENSE_TILED_TOKENS};
use crate::gguf::cuda_decode::fill;

extern "C" {
    fn glmcheck_dequant_wgmma_ready() -> i32;
    fn glmcheck_dequant_wgmma_tokens(n_tok: i32, variant: i32) -> i32;
    fn glmcheck_dequant_wgmma(
        ggml_type: i32,
        dtype: i32,
        variant: i32,
        w: *const c_void,
        row_bytes: i64,
        x: *const c_void,
        xt: *mut c_void,
        y: *mut c_void,
        n_out: i32,
        k_in: i32,
        n_tok: i32,
        stream: *mut c_void,
    ) -> i32;
}

/// The kernel's shapes: a block of 128 tokens and two warpgroups (128 weight rows), or of 64
/// tokens and one (64 rows; also what the first runs as on a weight whose rows are not a
/// multiple of 128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgmmaTile {
    Wide,
    Narrow,
}

impl WgmmaTile {
    /// The launcher's variant code.
    fn code(self) -> i32 {
        match self {
            WgmmaTile::Wide => 0,
            WgmmaTile::Narrow => 1,
        }
    }
}

/// The tile `GLMCHECK_DENSE` asks a dense matmul of `t` tokens to take on the wgmma kernel, past
/// [`DENSE_TILED_TOKENS`] tokens (up to there the register kernel decodes each weight once
/// anyway): `wgmma` the wide one, or the narrow one up to 64 tokens (a 128-token tile would be
/// half padding); `wgmma64` the narrow one. `None` otherwise.
pub(crate) fn dense_wgmma_tile(t: usize) -> Option<WgmmaTile> {
    wgmma_tile_for(super::knobs::knobs().dense.as_deref(), t)
}

/// [`dense_wgmma_tile`] for the setting `dense`.
fn wgmma_tile_for(dense: Option<&str>, t: usize) -> Option<WgmmaTile> {
    if t <= DENSE_TILED_TOKENS {
        return None;
    }
    match dense {
        Some("wgmma") if t <= 64 => Some(WgmmaTile::Narrow),
        Some("wgmma") => Some(WgmmaTile::Wide),
        Some("wgmma64") => Some(WgmmaTile::Narrow),
        _ => None,
    }
}

/// Whether the kernel runs here: `Some(true)` this build has it (built for sm_90a) and the
/// current GPU is compute capability 9.0; `Some(false)` the GPU is another (or CUDA did not
/// say); `None` this build has no kernel (another `CUDA_COMPUTE_CAP`).
pub(crate) fn wgmma_here() -> Option<bool> {
    // SAFETY: reads device attributes only.
    match unsafe { glmcheck_dequant_wgmma_ready() } {
        1 => Some(true),
        0 => None,
        _ => Some(false),
    }
}

/// `x · Wᵀ` `[T, out]` in `x`'s dtype on the wgmma kernel: the GGUF's values rounded once to the
/// dtype (as the decoded copy holds them), f32 sums in another order than cuBLAS'. `None`: not
/// taken (not bf16/f16 on CUDA, not `[T, in]`, a quant type other than Q4_K, Q5_K, Q6_K, Q8_0, a
/// shape it does not cover: `out` a multiple of 64 and `in` of 256, or no Hopper kernel here).
pub(crate) fn dense_wgmma(w: &QTensor, x: &Tensor, tile: WgmmaTile) -> Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.rank() != 2 || !matches!(x.dtype(), DType::BF16 | DType::F16) {
        return Ok(None);
    }
    let &[out, inp] = w.shape().dims() else {
        return Ok(None);
    };
    let covered = matches!(
        w.dtype(),
        GgmlDType::Q4K | GgmlDType::Q5K | GgmlDType::Q6K | GgmlDType::Q8_0
    ) && out.is_multiple_of(64)
        && inp.is_multiple_of(256)
        && x.dim(1)? == inp;
    if !covered || wgmma_here() != Some(true) {
        return Ok(None);
    }
    x.contiguous()?
        .apply_op1_no_bwd(&DenseWgmma { w, tile })
        .map(Some)
}

struct DenseWgmma<'a> {
    w: &'a QTensor,
    tile: WgmmaTile,
}

impl CustomOp1 for DenseWgmma<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-dequant-wgmma"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the wgmma kernel runs on CUDA only")
    }

    fn cuda_fwd(&self, xs: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        const WHAT: &str = "wgmma dense matmul";
        let ([_, out, inp], (ggml_type, _), row_bytes) = stack(self.w, WHAT)?;
        let (&[n_tok, x_in], Some((x0, _))) = (xl.shape().dims(), xl.contiguous_offsets()) else {
            candle_core::bail!("{WHAT}: activations {:?} are not [T, in]", xl.shape())
        };
        if x_in != inp || n_tok == 0 {
            candle_core::bail!("{WHAT}: activations [{n_tok}, {x_in}] for a [{out}, {inp}] weight")
        }
        let [Ok(n_out), Ok(k_in), Ok(t)] = [out, inp, n_tok].map(i32::try_from) else {
            return Err(too_big("a dimension"));
        };
        let variant = self.tile.code();
        // SAFETY: arithmetic only.
        let tokens = unsafe { glmcheck_dequant_wgmma_tokens(t, variant) };
        let scratch = usize::try_from(tokens)
            .ok()
            .filter(|&n| n >= n_tok)
            .and_then(|n| n.checked_mul(inp))
            .ok_or_else(|| too_big("the token tiles"))?;
        let dev = xs.device().clone();
        let stream = dev.cuda_stream();
        let stream_ptr = stream.cu_stream() as *mut c_void;
        let w_ptr = self.w.device_ptr()? as *const c_void;
        let launch = |code: i32, x: u64, xt: u64, y: *mut c_void| unsafe {
            glmcheck_dequant_wgmma(
                ggml_type,
                code,
                variant,
                w_ptr,
                row_bytes as i64,
                x as *const c_void,
                xt as *mut c_void,
                y,
                n_out,
                k_in,
                t,
                stream_ptr,
            )
        };
        let (rc, storage) = match xs.dtype() {
            DType::BF16 => {
                let x = xs.as_cuda_slice::<half::bf16>()?.slice(x0..);
                let (x_ptr, _gx) = x.device_ptr(&stream);
                // SAFETY: the kernel's tile pass writes every value before the kernel reads it.
                let xt = unsafe { dev.alloc::<half::bf16>(scratch)? };
                let (xt_ptr, _gt) = xt.device_ptr(&stream);
                fill::<half::bf16>(&dev, n_tok * out, |y| launch(2, x_ptr, xt_ptr, y))?
            }
            DType::F16 => {
                let x = xs.as_cuda_slice::<half::f16>()?.slice(x0..);
                let (x_ptr, _gx) = x.device_ptr(&stream);
                // SAFETY: as above.
                let xt = unsafe { dev.alloc::<half::f16>(scratch)? };
                let (xt_ptr, _gt) = xt.device_ptr(&stream);
                fill::<half::f16>(&dev, n_tok * out, |y| launch(1, x_ptr, xt_ptr, y))?
            }
            d => candle_core::bail!("{WHAT}: no kernel for {d:?} activations"),
        };
        if rc != 0 {
            let why = match rc {
                1 => "no kernel for this quant type, dtype or GPU",
                2 => "a shape or alignment the kernel does not take",
                3 => "CUDA refused the launch",
                _ => "an unknown code",
            };
            candle_core::bail!(
                "{WHAT}: launcher refused (code {rc}: {why}; {:?})",
                self.tile
            )
        }
        Ok((storage, (n_tok, out).into()))
    }
}

#[cfg(test)]
#[path = "wgmma_cuda_tests.rs"]
mod tests;
