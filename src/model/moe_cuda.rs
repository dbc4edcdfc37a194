//! q8 mode's routed experts on CUDA: one grouped launch per projection over every expert that has
//! tokens, by glmcheck's int8 kernel (`cuda/q8_moe.cu`: Q4_K, Q6_K, Q8_0) or llama.cpp's MMQ tiles
//! as vendored in candle-kernels (`cuda/moe_mmq.cu`: the other types; see [`Q8Kernel`]).
//!
//! The router's choices are read back and grouped by expert on the host ([`Grouping`]); the
//! activations are quantized to Q8_1 (llama.cpp's MMQ layout) in that order, and each expert's
//! weights are read once for all of its tokens. candle's own `indexed_moe_forward` runs one
//! matrix-vector product per (token, slot) instead: at 256 tokens it re-read each expert ~8 times
//! (56 of 78 ms of a 3-layer GLM-5-sized forward on an H200).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{result, sys, DevicePtr};
use candle_core::quantized::{GgmlDType, QTensor};
use std::ops::Range;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor,
};

use super::grouping::Grouping;
use crate::gguf::cuda_decode::{fill, kernel_type, tiled_type};

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
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_q8_moe_type(ggml_type: i32) -> i32;
    fn glmcheck_dequant_experts(
        ggml_type: i32,
        dst_dtype: i32,
        x: *const std::ffi::c_void,
        experts: *const i32,
        n: i32,
        expert_bytes: i64,
        y: *mut std::ffi::c_void,
        expert_elems: i64,
        stream: *mut std::ffi::c_void,
    ) -> i32;
    fn glmcheck_dequant_matmul(
        ggml_type: i32,
        dtype: i32,
        w: *const std::ffi::c_void,
        expert_bytes: i64,
        row_bytes: i64,
        x: *const std::ffi::c_void,
        src: *const i32,
        bounds: *const i32,
        experts: *const i32,
        y: *mut std::ffi::c_void,
        n_out: i32,
        k_in: i32,
        n_active: i32,
        max_rows: i32,
        stream: *mut std::ffi::c_void,
    ) -> i32;
}

/// Whether an expert stack of this type can be multiplied by the grouped kernel (and decoded by
/// `cuda/dequant_experts.cu`: the same ten types).
pub(crate) fn grouped_type(t: GgmlDType) -> bool {
    kernel_type(t).is_some()
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
        match std::env::var_os("GLMCHECK_Q8_EXPERTS") {
            Some(v) if v == "mmq" => Q8Kernel::Mmq,
            _ => Q8Kernel::Int8,
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

/// Whether dequant mode's tiled kernel (`cuda/dequant_gemm.cu`: blocks decoded into shared memory
/// and multiplied there, never written out) covers this `[E, out, in]` stack in `dtype`: bf16 or
/// f16 compute, Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K blocks, `out` a multiple of 64 and `in` of 256.
/// `GLMCHECK_DEQUANT_EXPERTS=batched` turns it off (decode-then-GEMM, to cross-check the two).
pub(crate) fn tiled_dequant(w: &QTensor, dtype: DType) -> bool {
    let shape_ok = matches!(w.shape().dims(), &[_, out, inp] if out.is_multiple_of(64) && inp.is_multiple_of(256));
    let type_ok = tiled_type(w.dtype()).is_some();
    let off = std::env::var_os("GLMCHECK_DEQUANT_EXPERTS").is_some_and(|v| v == "batched");
    matches!(dtype, DType::BF16 | DType::F16) && shape_ok && type_ok && !off
}

impl Grouping {
    /// Dequant mode's tiled kernel: `w` `[E, out, in]` (quantized) applied to rows of `x` (bf16 or
    /// f16 `[_, in]`): grouped row j is expert `experts(j)` times `x[tokens[j]]` (`by_token`) or
    /// `x[j]`. → `[rows, out]` in `x`'s dtype, rows in grouped order (see [`tiled_dequant`]).
    pub fn dequant_matmul(&self, w: &QTensor, x: &Tensor, by_token: bool) -> Result<Tensor> {
        let op = DequantMatmul {
            w,
            g: self,
            by_token,
        };
        x.contiguous()?.apply_op2_no_bwd(&self.table, &op)
    }

    /// Active experts `range` (of [`Grouping::active`], ascending ids) of `w` `[E, out, in]`
    /// (quantized) decoded into `dtype` (f32, f16 or bf16): `[range.len(), out, in]`, one launch.
    pub fn dequantize(&self, w: &QTensor, dtype: DType, range: Range<usize>) -> Result<Tensor> {
        let op = DequantExperts {
            w,
            g: self,
            range,
            dtype,
        };
        self.table.apply_op1_no_bwd(&op)
    }

    /// `w` `[E, out, in]` (quantized) applied to rows of `x` (f32 `[_, in]`): for every grouped
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
        let op = GroupedMatmul {
            w,
            g: self,
            by_token,
            kernel,
        };
        x.contiguous()?.apply_op2_no_bwd(&self.table, &op)
    }
}

struct DequantExperts<'a> {
    w: &'a QTensor,
    g: &'a Grouping,
    range: Range<usize>,
    dtype: DType,
}

struct DequantMatmul<'a> {
    w: &'a QTensor,
    g: &'a Grouping,
    by_token: bool,
}

struct GroupedMatmul<'a> {
    w: &'a QTensor,
    g: &'a Grouping,
    by_token: bool,
    kernel: Q8Kernel,
}

/// The Q8_1 activation quantizers candle-kernels exports (one per scale layout).
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

/// candle-kernels' Q8_1 quantizer for the activations, in the scale layout llama.cpp's MMQ pairs
/// with the weight type (`mmq_get_q8_1_ds_layout`).
fn quantizer(t: GgmlDType) -> Quantizer {
    use candle_kernels::ffi;
    match t {
        GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q4K | GgmlDType::Q5K => {
            ffi::launch_mmq_quantize_q8_1_DS4
        }
        GgmlDType::Q2K => ffi::launch_mmq_quantize_q8_1_D2S6,
        _ => ffi::launch_mmq_quantize_q8_1_D4,
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

pub(super) fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    unsafe { result::device::get_attribute(dev, a) }
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
}

fn too_big(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "grouped MoE matmul: {what} exceeds the kernel's 32-bit offsets"
    ))
}

/// An `[E, out, in]` expert stack the kernels can read: its dims, (ggml type id, block size) and
/// the bytes of one row, checked against the bytes the stack holds (the kernels address expert
/// `e` at `e·out·row_bytes`). `what` names the operation in the errors.
fn stack(w: &QTensor, what: &str) -> Result<([usize; 3], (i32, usize), usize)> {
    let (n_experts, out, inp) = match *w.shape().dims() {
        [e, out, inp] => (e, out, inp),
        [out, inp] => (1, out, inp), // a dense weight: one expert
        _ => candle_core::bail!("{what}: weight {:?} is not [E, out, in]", w.shape()),
    };
    let Some(ty) = kernel_type(w.dtype()) else {
        candle_core::bail!("{what}: no kernel for {:?}", w.dtype())
    };
    let row_bytes = inp / w.dtype().block_size() * w.dtype().type_size();
    if n_experts * out * row_bytes > w.storage_size_in_bytes() {
        candle_core::bail!("{what}: {n_experts} experts overrun the stack's bytes")
    }
    Ok(([n_experts, out, inp], ty, row_bytes))
}

/// The segments of a [`Grouping`]'s table on the device (`t_ptr`: its first u32): tokens
/// `[rows]`, slots `[rows]`, bounds `[active + 1]`, experts `[active]`.
struct Segments {
    tokens: *const i32,
    slots: *const i32,
    bounds: *const i32,
    experts: *const i32,
}

impl Grouping {
    fn segments(&self, t_ptr: u64) -> Segments {
        let at = |offset: usize| (t_ptr + 4 * offset as u64) as *const i32;
        let (rows, active) = (self.rows, self.active());
        Segments {
            tokens: at(0),
            slots: at(rows),
            bounds: at(2 * rows),
            experts: at(2 * rows + active + 1),
        }
    }
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
    stride_expert: usize,
    /// (compute capability, warp size)
    device: (i32, i32),
    stream: *mut std::ffi::c_void,
}

/// The int8 kernel's tile width in tokens: the grouping's choice ([`Grouping::tile_width`], which
/// weighs re-reading an expert's weights per tile against padded columns) capped at 32 (wider tiles
/// hold too many accumulators). The kernel skips a tile's empty groups of 8 tokens. Measured on an
/// H200 at 256 tokens (ncu, the six expert launches of a 3-layer GLM-5 synth): 7.30 ms with this
/// choice (16 wide), 7.87 ms with the narrowest tile holding the busiest expert (32 wide: fewer
/// resident blocks), 7.50 ms before the skipping. `GLMCHECK_Q8_TILE=8|16|32` fixes the width (to
/// measure the choice).
pub(crate) fn int8_tile(grouping_tile: usize) -> usize {
    let fixed = std::env::var("GLMCHECK_Q8_TILE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|w| [8, 16, 32].contains(w));
    fixed.unwrap_or(grouping_tile.min(32))
}

impl GroupedMatmul<'_> {
    /// The grouped product by the int8 kernel where it applies, llama.cpp's MMQ elsewhere.
    fn multiply(&self, l: &Launch) -> Result<()> {
        let (ggml_type, qk) = kernel_type(self.w.dtype()).unwrap_or((-1, 1));
        let int8 = self.kernel.int8_type(self.w);
        let block_bytes = self.w.dtype().type_size();
        let rc = unsafe {
            match int8 {
                Some(id) => glmcheck_q8_moe(
                    id,
                    int8_tile(l.tile) as i32,
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

        let x = xs.as_cuda_slice::<f32>()?.slice(x0..);
        let table = ts.as_cuda_slice::<u32>()?.slice(t0..);
        let (x_ptr, _gx) = x.device_ptr(&stream);
        let (t_ptr, _gt) = table.device_ptr(&stream);
        let Segments {
            tokens,
            slots,
            bounds,
            experts,
        } = g.segments(t_ptr);

        // Q8_1 activations in the MMQ layout, rows in expert order (+ one tile of slack).
        let padded = inp.div_ceil(ROW_PADDING) * ROW_PADDING;
        let q8_bytes = (rows * (padded / 128) + 128) * BLOCK_Q8_1_MMQ_BYTES;
        let q8 = unsafe { dev.alloc::<u8>(q8_bytes)? };
        let (q8_ptr, _gq) = q8.device_ptr(&stream);
        let dst = unsafe { dev.alloc::<f32>(rows * out)? };
        let (dst_ptr, _gd) = dst.device_ptr(&stream);
        let w_ptr = self.w.device_ptr()?;

        let quantize = quantizer(self.w.dtype());
        unsafe {
            quantize(
                x_ptr as *const std::ffi::c_void,
                if self.by_token { tokens } else { slots },
                q8_ptr as *mut std::ffi::c_void,
                0,
                inp as i64,
                inp as i64,
                0,
                0,
                padded as i64,
                rows as i64,
                1,
                1,
                stream_ptr,
            );
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
            stride_expert,
            device: (cc, warp),
            stream: stream_ptr,
        })?;
        drop((_gd, _gq, _gx, _gt));
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), (rows, out).into()))
    }
}

impl CustomOp2 for DequantMatmul<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-dequant-matmul"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the tiled dequant kernel runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ts: &CudaStorage,
        tl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        const WHAT: &str = "tiled dequant matmul";
        let ([n_experts, out, inp], (ggml_type, _), row_bytes) = stack(self.w, WHAT)?;
        let (&[x_rows, x_in], Some((x0, _)), Some((t0, _))) = (
            xl.shape().dims(),
            xl.contiguous_offsets(),
            tl.contiguous_offsets(),
        ) else {
            candle_core::bail!("{WHAT}: activations {:?} are not [rows, in]", xl.shape())
        };
        let g = self.g;
        let (rows, active) = (g.rows, g.active());
        if x_in != inp || (!self.by_token && x_rows != rows) {
            candle_core::bail!(
                "{WHAT}: activations [{x_rows}, {x_in}] for a [{n_experts}, {out}, {inp}] stack and {rows} rows"
            )
        }
        let dev = xs.device().clone();
        let stream = dev.cuda_stream();
        let stream_ptr = stream.cu_stream() as *mut std::ffi::c_void;
        let table = ts.as_cuda_slice::<u32>()?.slice(t0..);
        let (t_ptr, _gt) = table.device_ptr(&stream);
        let seg = g.segments(t_ptr);
        let src = if self.by_token {
            seg.tokens
        } else {
            std::ptr::null()
        };
        let (bounds, experts) = (seg.bounds, seg.experts);
        let w_ptr = self.w.device_ptr()? as *const std::ffi::c_void;
        if rows == 0 || active == 0 {
            candle_core::bail!("{WHAT}: no routed rows")
        }
        let dims = [out, inp, active, g.max_rows()].map(i32::try_from);
        let [Ok(n_out), Ok(k_in), Ok(n_active), Ok(max_rows)] = dims else {
            return Err(too_big("a dimension"));
        };
        // The kernel copies 16-byte pieces of each activation row.
        let launch = |code: i32, x: u64, y: *mut std::ffi::c_void| unsafe {
            if !x.is_multiple_of(16) {
                return -1;
            }
            glmcheck_dequant_matmul(
                ggml_type,
                code,
                w_ptr,
                (out * row_bytes) as i64,
                row_bytes as i64,
                x as *const std::ffi::c_void,
                src,
                bounds,
                experts,
                y,
                n_out,
                k_in,
                n_active,
                max_rows,
                stream_ptr,
            )
        };
        let (rc, storage) = match xs.dtype() {
            DType::BF16 => {
                let x = xs.as_cuda_slice::<half::bf16>()?.slice(x0..);
                let (x_ptr, _gx) = x.device_ptr(&stream);
                fill::<half::bf16>(&dev, rows * out, |y| launch(2, x_ptr, y))?
            }
            DType::F16 => {
                let x = xs.as_cuda_slice::<half::f16>()?.slice(x0..);
                let (x_ptr, _gx) = x.device_ptr(&stream);
                fill::<half::f16>(&dev, rows * out, |y| launch(1, x_ptr, y))?
            }
            d => candle_core::bail!("{WHAT}: no kernel for {d:?} activations"),
        };
        drop(_gt);
        if rc != 0 {
            candle_core::bail!("{WHAT}: launcher refused (code {rc}; -1: unaligned activations)")
        }
        Ok((storage, (rows, out).into()))
    }
}

impl CustomOp1 for DequantExperts<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-dequant-experts"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the grouped expert decoder runs on CUDA only")
    }

    fn cuda_fwd(&self, ts: &CudaStorage, tl: &Layout) -> Result<(CudaStorage, Shape)> {
        const WHAT: &str = "grouped expert decode";
        let ([_, out, inp], _, row_bytes) = stack(self.w, WHAT)?;
        let (g, range) = (self.g, self.range.clone());
        let n = range.len();
        if range.end > g.active() || n == 0 {
            candle_core::bail!("{WHAT}: experts {range:?} of {} active", g.active())
        }
        let Some((t0, _)) = tl.contiguous_offsets() else {
            candle_core::bail!("{WHAT}: the routing table is not contiguous")
        };
        let (elems, bytes) = (out * inp, out * row_bytes);
        let stream = ts.device().cuda_stream();
        let table = ts.as_cuda_slice::<u32>()?.slice(t0..);
        let (t_ptr, _gt) = table.device_ptr(&stream);
        // The table's `experts` segment, from this range's first expert.
        let experts = g.segments(t_ptr).experts.wrapping_add(range.start);
        let storage = decode(ts.device(), self.w, self.dtype, experts, n, bytes, elems)?;
        drop(_gt);
        Ok((storage, (n, out, inp).into()))
    }
}

/// Keeps memory freed to the device's default pool instead of returning it to the driver at every
/// synchronisation (the pool's release threshold, 0 by default, raised to "never"). The forward
/// frees and re-allocates the same large temporaries each layer (dequant mode: a decoded lm_head
/// is 1.9 GB in bf16, a batch of decoded experts up to 2 GiB) and syncs once per MoE layer; without
/// this every such allocation maps fresh pages. Peak use is unchanged: the pool only keeps what
/// was live at once.
pub fn keep_freed_memory(device: &candle_core::Device) -> Result<()> {
    let candle_core::Device::Cuda(dev) = device else {
        return Ok(());
    };
    let cu = dev.cuda_stream().context().cu_device();
    // Without memory pools cudarc allocates with cuMemAlloc: nothing to keep.
    if attribute(
        cu,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
    )? == 0
    {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    let err = |e: sys::CUresult| candle_core::Error::Msg(format!("the device memory pool: {e:?}"));
    unsafe {
        let rc = sys::cuDeviceGetDefaultMemPool(&mut pool, cu);
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(err(rc));
        }
        let rc = sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        );
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(err(rc));
        }
    }
    Ok(())
}

/// `q` `[.., out, in]` decoded into `dtype` on its device in one launch of the same kernels as
/// [`Grouping::dequantize`] (candle's f32 decode and a cast, for bf16, write and re-read the f32:
/// a GLM-5 lm_head is 3.8 GB of it). None when the type or shape is not covered.
pub fn dequantize_direct(q: &QTensor, dtype: DType) -> Result<Option<Tensor>> {
    // glmcheck's coalesced decoder where it covers the type, candle-kernels' decoders otherwise.
    if let Some(t) = crate::gguf::cuda_decode::decode(q, dtype)? {
        return Ok(Some(t));
    }
    let elems = q.shape().elem_count();
    if kernel_type(q.dtype()).is_none() || !elems.is_multiple_of(256) || !q.device().is_cuda() {
        return Ok(None);
    }
    let dims = q.shape().dims().to_vec();
    let op = DequantWhole { q, dtype };
    // The op runs on a one-element tensor of the weight's device (candle ops need a storage).
    let anchor = Tensor::zeros(1, DType::U32, &q.device())?;
    Ok(Some(anchor.apply_op1_no_bwd(&op)?.reshape(dims)?))
}

struct DequantWhole<'a> {
    q: &'a QTensor,
    dtype: DType,
}

impl CustomOp1 for DequantWhole<'_> {
    fn name(&self) -> &'static str {
        "glmcheck-dequant-direct"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the direct decoder runs on CUDA only")
    }

    fn cuda_fwd(&self, anchor: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let elems = self.q.shape().elem_count();
        let bytes = elems / self.q.dtype().block_size() * self.q.dtype().type_size();
        let storage = decode(
            anchor.device(),
            self.q,
            self.dtype,
            std::ptr::null(),
            1,
            bytes,
            elems,
        )?;
        Ok((storage, elems.into()))
    }
}

/// `n` experts of `w` (`experts`: a device list of stack indices; null: the first `bytes`) decoded
/// into `dtype`, `elems` values each.
fn decode(
    dev: &candle_core::CudaDevice,
    w: &QTensor,
    dtype: DType,
    experts: *const i32,
    n: usize,
    bytes: usize,
    elems: usize,
) -> Result<CudaStorage> {
    const WHAT: &str = "expert decode";
    // candle's decode kernels index with 32-bit ints.
    if elems == 0 || i32::try_from(elems).is_err() {
        candle_core::bail!("{WHAT}: {elems} values per expert (the kernels take 1..2^31)")
    }
    let Some((ggml_type, _)) = kernel_type(w.dtype()) else {
        candle_core::bail!("{WHAT}: no kernel for {:?}", w.dtype())
    };
    let stream = dev.cuda_stream();
    let stream_ptr = stream.cu_stream() as *mut std::ffi::c_void;
    let w_ptr = w.device_ptr()? as *const std::ffi::c_void;
    let launch = |code: i32, y: *mut std::ffi::c_void| unsafe {
        glmcheck_dequant_experts(
            ggml_type,
            code,
            w_ptr,
            experts,
            n as i32,
            bytes as i64,
            y,
            elems as i64,
            stream_ptr,
        )
    };
    let (rc, storage) = match dtype {
        DType::F32 => fill::<f32>(dev, n * elems, |y| launch(0, y))?,
        DType::F16 => fill::<half::f16>(dev, n * elems, |y| launch(1, y))?,
        DType::BF16 => fill::<half::bf16>(dev, n * elems, |y| launch(2, y))?,
        d => candle_core::bail!("{WHAT}: no kernel for {d:?}"),
    };
    if rc != 0 {
        candle_core::bail!("{WHAT}: launcher refused (code {rc})")
    }
    Ok(storage)
}

#[cfg(test)]
#[path = "moe_cuda_tests.rs"]
mod tests;
