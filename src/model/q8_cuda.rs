//! q8 mode on CUDA: glmcheck's int8 kernel (`cuda/q8_moe.cu`: Q4_K, Q6_K, Q8_0) or llama.cpp's MMQ
//! tiles as vendored in candle-kernels (`cuda/moe_mmq.cu`: the other types; see [`Q8Kernel`]).
//!
//! Routed experts: one grouped launch per projection over every expert that has tokens. The
//! router's choices are read back and grouped by expert on the host ([`Grouping`]); the
//! activations are quantized to Q8_1 (llama.cpp's MMQ layout) in that order, and each expert's
//! weights are read once for all of its tokens. candle's own `indexed_moe_forward` runs one
//! matrix-vector product per (token, slot) instead: at 256 tokens it re-read each expert ~8 times
//! (56 of 78 ms of a 3-layer GLM-5-sized forward on an H200).
//!
//! Dense matmuls ([`int8_dense`]): a dense weight `[out, in]` as a one-expert stack, all tokens to
//! expert 0, where the int8 kernel beats candle's MMQ (`linear::q8_matmul`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaStream, DevicePtr, SyncOnDrop};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::grouping::{tile_width_for, Grouping};
use super::moe_cuda::{attribute, stack, too_big, Segments};
use crate::gguf::cuda_decode::kernel_type;

const QK8_1: usize = 32;
/// `block_q8_1_mmq`: 128 quants + 16 bytes of scales.
const BLOCK_Q8_1_MMQ_BYTES: usize = 4 * QK8_1 + 16;
/// llama.cpp's `MATRIX_ROW_PADDING`: activation rows are padded to it.
const ROW_PADDING: usize = 512;
extern "C" {
    fn glmcheck_moe_mmq(
        ggml_type_x: i32,
        mmq_x: i32,
        x: *const std::ffi::c_void,
        y: *const std::ffi::c_void,
        ids_dst: *const i32,
        expert_bounds: *const i32,
        expert_map: *const i32,
        dst: *mut f32,
        ncols_x: i32,
        nrows_x: i32,
        stride_row_x: i32,
        ncols_y: i32,
        stride_expert_x: i32,
        n_active: i32,
        ncols_max: i32,
        cc: i32,
        warp_size: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_q8_moe(
        ggml_type: i32,
        tn: i32,
        w: *const std::ffi::c_void,
        expert_bytes: i64,
        row_bytes: i64,
        y: *const std::ffi::c_void,
        ncols_y: i32,
        ids_dst: *const i32,
        bounds: *const i32,
        experts: *const i32,
        dst: *mut f32,
        n_out: i32,
        k_in: i32,
        n_active: i32,
        max_cols: i32,
        splits: i32,
        partial: *mut f32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_q8_moe_type(ggml_type: i32) -> i32;
    fn glmcheck_quantize_q8_1_bf16(
        layout: i32,
        x: *const std::ffi::c_void,
        ids: *const i32,
        vy: *mut std::ffi::c_void,
        ne00: i64,
        s01: i64,
        ne0: i64,
        ne1: i64,
        stream: *mut std::ffi::c_void,
    ) -> i32;
}

/// Which kernel multiplies q8 mode's experts: glmcheck's int8 tensor-core kernel
/// (`cuda/q8_moe.cu`: Q4_K, Q6_K and Q8_0 stacks with `out` a multiple of 64) where it applies, or
/// llama.cpp's MMQ (`cuda/moe_mmq.cu`, every other type; all of them with
/// `GLMCHECK_Q8_EXPERTS=mmq`, to cross-check the two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Q8Kernel {
    Int8,
    Mmq,
}

impl Q8Kernel {
    fn from_env() -> Self {
        if super::knobs::knobs().q8_experts_mmq {
            Q8Kernel::Mmq
        } else {
            Q8Kernel::Int8
        }
    }

    /// The ggml type id the int8 kernel takes for this `[E, out, in]` stack, if it does.
    pub(crate) fn int8_type(self, w: &QTensor) -> Option<i32> {
        let shape_ok =
            matches!(w.shape().dims(), &[_, out, _] | &[out, _] if out.is_multiple_of(64));
        kernel_type(w.dtype())
            .map(|(id, _)| id)
            .filter(|_| self == Q8Kernel::Int8 && shape_ok)
            .filter(|&id| unsafe { glmcheck_q8_moe_type(id) } == 1)
    }
}

impl Grouping {
    /// `w` `[E, out, in]` (quantized) applied to rows of `x` (f32 or bf16 `[_, in]`): for every grouped
    /// row j, expert `experts(j)` times `x[tokens[j]]` (`by_token`) or `x[slots[j]]`, written to
    /// output row `slots[j]`. → f32 `[T·k, out]`.
    pub fn matmul(&self, w: &QTensor, x: &Tensor, by_token: bool) -> Result<Tensor> {
        self.matmul_with(w, x, by_token, Q8Kernel::from_env())
    }

    /// [`Grouping::matmul`] by the given kernel.
    pub(crate) fn matmul_with(
        &self,
        w: &QTensor,
        x: &Tensor,
        by_token: bool,
        kernel: Q8Kernel,
    ) -> Result<Tensor> {
        self.grouped(w, x, by_token, kernel, 1, None)
    }

    /// [`Grouping::matmul`] by the int8 kernel with its k steps split `splits` ways (split-K:
    /// partial sums per split, added in split order by a second launch) and tiles up to
    /// `tile_cap` tokens wide.
    pub(crate) fn matmul_split(
        &self,
        w: &QTensor,
        x: &Tensor,
        by_token: bool,
        splits: usize,
        tile_cap: usize,
    ) -> Result<Tensor> {
        self.grouped(w, x, by_token, Q8Kernel::Int8, splits, Some(tile_cap))
    }

    fn grouped(
        &self,
        w: &QTensor,
        x: &Tensor,
        by_token: bool,
        kernel: Q8Kernel,
        splits: usize,
        tile_cap: Option<usize>,
    ) -> Result<Tensor> {
        let op = GroupedMatmul {
            w,
            g: self,
            by_token,
            kernel,
            splits: splits.max(1),
            tile_cap,
        };
        x.contiguous()?.apply_op2_no_bwd(&self.table, &op)
    }
}

struct GroupedMatmul<'a> {
    w: &'a QTensor,
    g: &'a Grouping,
    by_token: bool,
    kernel: Q8Kernel,
    /// k split this many ways (int8 kernel only; 1: no split).
    splits: usize,
    /// The int8 kernel's widest tile ([`int8_tile`]): `None` for the routed experts.
    tile_cap: Option<usize>,
}

/// The Q8_1 activation quantizers candle-kernels exports (one per scale layout, f32 input).
type Quantizer = unsafe extern "C" fn(
    *const std::ffi::c_void,
    *const i32,
    *mut std::ffi::c_void,
    i32,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    *mut std::ffi::c_void,
);

/// The Q8_1 scale layout llama.cpp's MMQ pairs with the weight type (`mmq_get_q8_1_ds_layout`):
/// 0 D4, 1 DS4, 2 D2S6.
fn ds_layout(t: GgmlDType) -> i32 {
    match t {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q4K | GgmlDType::Q5K => 1,
        GgmlDType::Q2K => 2,
        _ => 0,
    }
}

/// Activations as the q8 kernels are given them: bf16 as they are (the quantizer reads bf16,
/// `cuda/q8_quantize.cu`), any other dtype cast to f32; contiguous. `GLMCHECK_Q8_INPUT=f32` casts
/// bf16 to f32 too, as before the bf16 quantizer (the same blocks, one launch more per matmul: to
/// measure the difference).
pub(crate) fn q8_input(x: &Tensor) -> Result<Tensor> {
    let cast = super::knobs::knobs().q8_input_f32;
    if x.dtype() == DType::BF16 && !cast {
        x.contiguous()
    } else {
        x.to_dtype(DType::F32)?.contiguous()
    }
}

/// Quantizes activation rows into llama.cpp's `block_q8_1_mmq` layout for weight type `w`: `rows`
/// rows of `inp` values from `x` (f32 by candle-kernels' quantizer, bf16 by glmcheck's, the same
/// blocks), row `ids[i]` (or i with null `ids`), padded with zeros to `padded` values, at `q8`.
///
/// # Safety
/// `x`, `ids`, `q8` are device addresses on `stream` holding what the sizes say.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn quantize_rows(
    dtype: DType,
    x: u64,
    ids: *const i32,
    q8: u64,
    w: GgmlDType,
    (inp, padded, rows): (usize, usize, usize),
    stream: *mut std::ffi::c_void,
) -> Result<()> {
    let x = x as *const std::ffi::c_void;
    let q8 = q8 as *mut std::ffi::c_void;
    let layout = ds_layout(w);
    match dtype {
        DType::F32 => {
            use candle_kernels::ffi;
            let f: Quantizer = match layout {
                1 => ffi::launch_mmq_quantize_q8_1_DS4,
                2 => ffi::launch_mmq_quantize_q8_1_D2S6,
                _ => ffi::launch_mmq_quantize_q8_1_D4,
            };
            let (inp, padded, rows) = (inp as i64, padded as i64, rows as i64);
            f(x, ids, q8, 0, inp, inp, 0, 0, padded, rows, 1, 1, stream);
            Ok(())
        }
        DType::BF16 => {
            let (inp, padded, rows) = (inp as i64, padded as i64, rows as i64);
            let rc =
                glmcheck_quantize_q8_1_bf16(layout, x, ids, q8, inp, inp, padded, rows, stream);
            if rc != 0 {
                candle_core::bail!(
                    "the bf16 Q8_1 quantizer refused (code {rc}, {rows} rows of {inp})"
                )
            }
            Ok(())
        }
        other => candle_core::bail!("q8 activations in {other:?}: f32 or bf16 only"),
    }
}

/// (compute capability as ggml spells it, e.g. 900; warp size) of a device that can run the kernel.
fn device_info(cu: sys::CUdevice) -> Result<(i32, i32)> {
    use sys::CUdevice_attribute as A;
    let major = attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(cu, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    if major < 7 {
        candle_core::bail!(
            "the grouped MoE kernel needs compute capability 7.0, not {major}.{minor}"
        )
    }
    Ok((
        major * 100 + minor * 10,
        attribute(cu, A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?,
    ))
}

/// The device pointers and sizes of one grouped launch (see `glmcheck_moe_mmq` and
/// `glmcheck_q8_moe`): weights, Q8_1 activations, the grouping table's slots/bounds/experts, f32
/// output `[rows, out]`; `stride_expert` in blocks.
struct Launch {
    w: *const std::ffi::c_void,
    q8: *const std::ffi::c_void,
    slots: *const i32,
    bounds: *const i32,
    experts: *const i32,
    dst: *mut f32,
    out: i32,
    inp: usize,
    rows: usize,
    active: usize,
    max_rows: usize,
    tile: usize,
    /// The int8 kernel's widest tile here ([`int8_tile`]): `None` for the routed experts.
    tile_cap: Option<usize>,
    stride_expert: usize,
    /// Split-K ways and the partial sums' buffer (`splits · rows · out` f32; null for 1).
    splits: usize,
    partial: *mut f32,
    /// (compute capability, warp size)
    device: (i32, i32),
    stream: *mut std::ffi::c_void,
}

/// The int8 kernel's tile width in tokens: the grouping's choice ([`Grouping::tile_width`], which
/// weighs re-reading an expert's weights per tile against padded columns) capped at `cap`, or for
/// the routed experts (`None`) at [`EXPERT_TILE_MAX`] (wider tiles hold too many accumulators for
/// the few tokens an expert gets); q8's dense route passes up to 128 ([`dense_tile`]). The kernel skips a
/// tile's empty groups of 8 tokens. Measured on an H200 at 256 tokens (ncu, the six expert launches
/// of a 3-layer GLM-5 synth): 7.30 ms with this choice (16 wide), 7.87 ms with the narrowest tile
/// holding the busiest expert (32 wide: fewer resident blocks), 7.50 ms before the skipping.
/// `GLMCHECK_Q8_TILE=8|16|32` fixes the experts' width (to measure the choice; not the dense
/// route's).
pub(crate) fn int8_tile(grouping_tile: usize, cap: Option<usize>) -> usize {
    if let Some(cap) = cap {
        return grouping_tile.min(cap);
    }
    let fixed = super::knobs::knobs().q8_tile;
    fixed.unwrap_or(grouping_tile.min(EXPERT_TILE_MAX))
}

/// The widest int8 tile the routed experts take (see [`int8_tile`]).
pub(crate) const EXPERT_TILE_MAX: usize = 32;

impl GroupedMatmul<'_> {
    /// The grouped product by the int8 kernel where it applies, llama.cpp's MMQ elsewhere.
    fn multiply(&self, l: &Launch) -> Result<()> {
        let (ggml_type, qk) = kernel_type(self.w.dtype()).unwrap_or((-1, 1));
        let int8 = self.kernel.int8_type(self.w);
        if int8.is_none() && l.splits > 1 {
            candle_core::bail!("grouped MoE matmul: split-K needs the int8 kernel")
        }
        let block_bytes = self.w.dtype().type_size();
        let rc = unsafe {
            match int8 {
                Some(id) => glmcheck_q8_moe(
                    id,
                    int8_tile(l.tile, l.tile_cap) as i32,
                    l.w,
                    (l.stride_expert * block_bytes) as i64,
                    (l.inp / qk * block_bytes) as i64,
                    l.q8,
                    l.rows as i32,
                    l.slots,
                    l.bounds,
                    l.experts,
                    l.dst,
                    l.out,
                    l.inp as i32,
                    l.active as i32,
                    l.max_rows as i32,
                    l.splits as i32,
                    l.partial,
                    l.stream,
                ),
                None => glmcheck_moe_mmq(
                    ggml_type,
                    l.tile as i32,
                    l.w,
                    l.q8,
                    l.slots,
                    l.bounds,
                    l.experts,
                    l.dst,
                    l.inp as i32,
                    l.out,
                    (l.inp / qk) as i32,
                    l.rows as i32,
                    l.stride_expert as i32,
                    l.active as i32,
                    l.max_rows as i32,
                    l.device.0,
                    l.device.1,
                    l.stream,
                ),
            }
        };
        if rc != 0 {
            let which = if int8.is_some() { "int8" } else { "MMQ" };
            candle_core::bail!(
                "grouped MoE matmul: {which} launcher refused (code {rc}, tile {})",
                l.tile
            )
        }
        Ok(())
    }
}

impl CustomOp2 for GroupedMatmul<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-grouped-moe-mmq"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the grouped MoE kernel runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ts: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let ([n_experts, out, inp], (_, qk), _) = stack(self.w, "grouped MoE matmul")?;
        let (&[_, x_in], Some((x0, _)), Some((t0, _))) = (
            xl.shape().dims(),
            xl.contiguous_offsets(),
            tl.contiguous_offsets(),
        ) else {
            candle_core::bail!(
                "grouped MoE matmul: activations {:?} are not [rows, in]",
                xl.shape()
            )
        };
        if x_in != inp || inp % 256 != 0 {
            candle_core::bail!(
                "grouped MoE matmul: {x_in} inputs for a [{n_experts}, {out}, {inp}] stack"
            )
        }
        let g = self.g;
        let (rows, active) = (g.rows, g.active());
        if rows == 0 || active == 0 {
            let dev = xs.device().clone();
            let zeros = dev.alloc_zeros::<f32>(rows * out)?;
            return Ok((CudaStorage::wrap_cuda_slice(zeros, dev), (rows, out).into()));
        }
        let stride_expert = out * inp / qk;
        let i32_of = |v: usize, what: &str| i32::try_from(v).map_err(|_| too_big(what));
        i32_of(n_experts * stride_expert, "the expert stack")?;
        i32_of(
            rows * (inp / 128 + 1) * BLOCK_Q8_1_MMQ_BYTES / 4,
            "the activations",
        )?;

        let dev = xs.device().clone();
        let stream = dev.cuda_stream();
        let stream_ptr = stream.cu_stream() as *mut std::ffi::c_void;
        let (cc, warp) = device_info(stream.context().cu_device())?;

        let (x_ptr, _gx) = activations(xs, x0, &stream)?;
        let table = ts.as_cuda_slice::<u32>()?.slice(t0..);
        let (t_ptr, _gt) = table.device_ptr(&stream);
        let Segments {
            tokens,
            slots,
            bounds,
            experts,
            ..
        } = g.segments(t_ptr);

        // Q8_1 activations in the MMQ layout, rows in expert order (+ one tile of slack).
        let padded = inp.div_ceil(ROW_PADDING) * ROW_PADDING;
        let q8_bytes = (rows * (padded / 128) + 128) * BLOCK_Q8_1_MMQ_BYTES;
        let q8 = unsafe { dev.alloc::<u8>(q8_bytes)? };
        let (q8_ptr, _gq) = q8.device_ptr(&stream);
        let dst = unsafe { dev.alloc::<f32>(rows * out)? };
        let (dst_ptr, _gd) = dst.device_ptr(&stream);
        let w_ptr = self.w.device_ptr()?;
        // Split-K's partial sums: one [rows, out] per split.
        let partial = if self.splits > 1 {
            Some(unsafe { dev.alloc::<f32>(self.splits * rows * out)? })
        } else {
            None
        };
        let partial_ptr = partial.as_ref().map(|p| p.device_ptr(&stream));

        unsafe {
            quantize_rows(
                xs.dtype(),
                x_ptr,
                if self.by_token { tokens } else { slots },
                q8_ptr,
                self.w.dtype(),
                (inp, padded, rows),
                stream_ptr,
            )?;
        }
        self.multiply(&Launch {
            w: w_ptr as *const std::ffi::c_void,
            q8: q8_ptr as *const std::ffi::c_void,
            slots,
            bounds,
            experts,
            dst: dst_ptr as *mut f32,
            out: i32_of(out, "the output width")?,
            inp,
            rows,
            active,
            max_rows: g.max_rows(),
            tile: g.tile_width(),
            tile_cap: self.tile_cap,
            stride_expert,
            splits: self.splits,
            partial: partial_ptr
                .as_ref()
                .map_or(std::ptr::null_mut(), |(p, _)| *p as *mut f32),
            device: (cc, warp),
            stream: stream_ptr,
        })?;
        drop((_gd, _gq, _gx, _gt, partial_ptr));
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), (rows, out).into()))
    }
}

/// The device address of element `x0` of contiguous f32 or bf16 activations (and the guard that
/// records their use on `stream`).
pub(crate) fn activations<'a>(
    xs: &'a CudaStorage,
    x0: usize,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    Ok(match xs.dtype() {
        DType::F32 => {
            let (p, g) = xs.as_cuda_slice::<f32>()?.device_ptr(stream);
            (p + 4 * x0 as u64, g)
        }
        DType::BF16 => {
            let (p, g) = xs.as_cuda_slice::<half::bf16>()?.device_ptr(stream);
            (p + 2 * x0 as u64, g)
        }
        other => candle_core::bail!("q8 activations in {other:?}: f32 or bf16 only"),
    })
}

/// q8 mode's dense matmuls from 9 to this many tokens may go to the int8 kernel (one tile: each
/// weight read once; see [`int8_dense`]); fewer stay on candle's MMVQ (llama.cpp's choice up to 8).
/// Measured on an H200 (ncu, lm_head of GLM-5): 0.55 ms against MMQ's 0.66 at 16 tokens, 0.95
/// against 0.77 at 32 (32-wide tiles: four times the per-block scale work).
pub(crate) const INT8_DENSE_TOKENS: std::ops::RangeInclusive<usize> = 9..=16;

/// Past [`INT8_DENSE_TOKENS`], dense grids of at most this many blocks of 64 rows run on the int8
/// kernel with k split over enough blocks to fill the GPU (GLM-5's `kv_a_proj_with_mqa`, 9 blocks,
/// and the indexer's `wk`, 2): candle's stream-k MMQ spends most of their time in its fixup.
/// Measured on an H100 at 256 tokens (ncu, per layer, kernel + fixup or split sum):
/// kv_a_proj_with_mqa 108 → 33 µs, wk 101 → 22 µs; wider grids lost on the int8 kernel (q_a_proj,
/// 32 blocks, 79 → 102 µs; the dense MLP's 192-block projections 256 → 454; lm_head 3.39 → 9.24
/// ms: llama.cpp's 128×128 MMQ tiles beat the int8 kernel's there), so they stay on MMQ.
pub(crate) const SMALL_GRID_BLOCKS: usize = 16;

/// `x · Wᵀ` for a dense quantized `w` `[out, in]` by the int8 kernel, when it applies: x f32 or
/// bf16 `[T, in]` on CUDA, a Q4_K, Q6_K or Q8_0 weight with `in` a multiple of 256, and
/// - T in [`INT8_DENSE_TOKENS`] and `out / 64` (the kernel's blocks, each walking the whole `in`)
///   at least twice the device's SMs: at GLM-5's sizes that is lm_head alone (the other
///   projections, 9 to 256 blocks of 64 rows, took twice candle's stream-k MMQ on the int8 kernel
///   at 16 tokens: H200, 1.02 against 0.54 ms per forward; `reports/gpu-moe.md`, H2);
/// - or more tokens and at most [`SMALL_GRID_BLOCKS`] row blocks, k split ([`split_count`]),
///   tiles up to 128 tokens ([`dense_tile`]).
///
/// `GLMCHECK_Q8_DENSE=candle` keeps candle's kernels for every dense matmul (to cross-check);
/// `=all` drops the grid condition at 9–16 tokens (to measure it); `=splitk` drops it and splits
/// k over enough blocks to fill the GPU; `=narrow` splits k at 9–16 tokens for grids of at most
/// [`NARROW_BLOCKS`] row blocks; `=wide` puts every dense matmul past 16 tokens on the int8 kernel
/// (to measure it). Measured on an H200 (ncu, 16 tokens, per forward): split-K takes GLM-5's
/// indexer `wk` (2 blocks, Q8_0) from 54 to 14 µs and `kv_a_proj_with_mqa` (9 blocks) from 32 to
/// 15 µs, `q_a_proj` and the shared experts' gate/up (32 blocks) from 25 to 20 µs, and gains 3 µs
/// or nothing on wider grids (the dense MLP's down_proj, 96 blocks: 53 → 60). The same arithmetic
/// as llama.cpp's MMQ (see `cuda/q8_moe.cu`). → f32 `[T, out]`.
pub(crate) fn int8_dense(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    let choice = super::knobs::knobs().q8_dense.as_deref();
    let is = |v: &str| choice == Some(v);
    let t = x.dim(0)?;
    let (&[out, inp], candle_core::Device::Cuda(dev)) = (w.shape().dims(), x.device()) else {
        return Ok(None);
    };
    let past = t > *INT8_DENSE_TOKENS.end();
    // The cheap conditions first: every q8 dense matmul of the forward passes here.
    if is("candle")
        || !matches!(x.dtype(), DType::F32 | DType::BF16)
        || !(past || INT8_DENSE_TOKENS.contains(&t))
        || (past && !is("wide") && out / 64 > SMALL_GRID_BLOCKS)
        || !inp.is_multiple_of(256)
        || Q8Kernel::Int8.int8_type(w).is_none()
    {
        return Ok(None);
    }
    let sms = sm_count(dev)?;
    if past {
        // The tile that runs (so the split count sees the real number of column tiles).
        let tile = dense_tile(t).min(dense_tile_cap(dev)?);
        let splits = split_count((out / 64) * t.div_ceil(tile), inp / 256, sms);
        return dense_on_int8(w, x, splits, tile).map(Some);
    }
    let narrow = is("narrow") && out / 64 <= NARROW_BLOCKS;
    if !is("all") && !is("splitk") && !narrow && out / 64 < 2 * sms {
        return Ok(None);
    }
    let splits = if is("splitk") || narrow {
        split_count(out / 64, inp / 256, sms)
    } else {
        1
    };
    dense_on_int8(w, x, splits, EXPERT_TILE_MAX).map(Some)
}

/// The widest int8 tile of q8's dense route past 16 tokens: 128 tokens, each weight block read
/// once per 128 tokens.
pub(crate) const DENSE_TILE_MAX: usize = 128;

/// The int8 tile a dense matmul of `t` tokens past 16 runs with: the identity grouping's choice
/// ([`tile_width_for`] one expert of `t` rows: 32 for 17–32 tokens, 64 for 33–64, 128 for 65–128,
/// 64 for 150) up to [`DENSE_TILE_MAX`], or up to `GLMCHECK_Q8_DENSE_TILE=32|64|128` (to measure).
pub(crate) fn dense_tile(t: usize) -> usize {
    let cap = super::knobs::knobs()
        .q8_dense_tile
        .unwrap_or(DENSE_TILE_MAX);
    tile_width_for(std::iter::once(t)).min(cap)
}

/// The widest int8 tile the device's shared memory per block takes: 128-token tiles ask up to
/// ~126 KiB (Q8_0; Q4_K 112), 64-token ones up to ~83 KiB, 32-token ones (the experts') ~62. An
/// H100/H200 gives 227 KiB, an A100 163, sm_86/89/120 parts 99: there the dense route stops at 64.
fn dense_tile_cap(dev: &candle_core::CudaDevice) -> Result<usize> {
    let optin = device_attribute(
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    Ok(match optin.max(0) as usize {
        b if b >= 128 * 1024 => 128,
        b if b >= 96 * 1024 => 64,
        _ => EXPERT_TILE_MAX,
    })
}

/// `GLMCHECK_Q8_DENSE=narrow` splits k for dense grids of at most this many blocks of 64 rows
/// (out ≤ 2048: GLM-5's q_a_proj, kv_a_proj_with_mqa, the indexer's wk, the shared experts'
/// gate/up).
pub(crate) const NARROW_BLOCKS: usize = 32;

/// Split-K ways for a grid of `blocks` blocks and `steps` k steps of 256: enough for twice the
/// SMs' worth of blocks, at least one step per split.
pub(crate) fn split_count(blocks: usize, steps: usize, sms: usize) -> usize {
    (2 * sms).div_ceil(blocks.max(1)).clamp(1, steps.max(1))
}

/// `x · Wᵀ` by the int8 kernel (a one-expert stack, all `T` rows), k split `splits` ways, tiles
/// of up to `tile_cap` tokens (the identity grouping's [`Grouping::tile_width`] below that).
pub(crate) fn dense_on_int8(
    w: &QTensor,
    x: &Tensor,
    splits: usize,
    tile_cap: usize,
) -> Result<Tensor> {
    with_identity(x, |g| g.matmul_split(w, x, true, splits, tile_cap))
}

/// `f` on the identity grouping of `x`'s rows (all to one expert, in order: a dense weight as a
/// one-expert stack), kept from the last call while the row count and device stay the same.
pub(crate) fn with_identity<R>(x: &Tensor, f: impl FnOnce(&Grouping) -> Result<R>) -> Result<R> {
    let t = x.dim(0)?;
    IDENTITY.with(|cell| {
        let mut cell = cell.borrow_mut();
        let g = match cell.take() {
            Some(g) if g.rows == t && g.table.device().same_device(x.device()) => cell.insert(g),
            _ => cell.insert(Grouping::identity(t, x.device())?),
        };
        f(g)
    })
}

thread_local! {
    /// The last identity grouping a dense matmul used ([`with_identity`]): one forward's dense
    /// matmuls all have the same token count, so its table is uploaded once per forward, not once
    /// per matmul.
    static IDENTITY: std::cell::RefCell<Option<Grouping>> = const { std::cell::RefCell::new(None) };
}

/// The device's streaming multiprocessors.
fn sm_count(dev: &candle_core::CudaDevice) -> Result<usize> {
    let n = device_attribute(
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok(n.max(1) as usize)
}

/// One attribute of the device `dev`'s stream runs on.
fn device_attribute(dev: &candle_core::CudaDevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    attribute(dev.cuda_stream().context().cu_device(), attr)
}
