//! dequant mode's routed experts on CUDA (the tiled kernel `cuda/dequant_gemm.cu`, the active
//! experts decoded by `cuda/dequant_experts.cu`), whole tensors decoded straight into the compute
//! dtype, the device memory pool setting, and what the expert ops of both modes share: the check
//! of an `[E, out, in]` stack and the grouping table's device segments. q8 mode's ops are
//! [`super::q8_cuda`].

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{result, sys, DevicePtr};
use candle_core::quantized::{GgmlDType, QTensor};
use std::ops::Range;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor,
};

use super::grouping::Grouping;
use crate::gguf::cuda_decode::{fill, kernel_type, tiled_type};

extern "C" {
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
        kernel: i32,
        tn: i32,
        w: *const std::ffi::c_void,
        expert_bytes: i64,
        row_bytes: i64,
        x: *const std::ffi::c_void,
        src: *const i32,
        bounds: *const i32,
        experts: *const i32,
        zlist: *const i32,
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

/// Whether dequant mode's tiled kernels (`cuda/dequant_gemm.cu`: blocks decoded on the fly and
/// multiplied, never written out) cover this `[E, out, in]` stack in `dtype`: bf16 or f16 compute,
/// Q4_0, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K blocks, `out` a multiple of 64 and `in` of 256.
/// `GLMCHECK_DEQUANT_EXPERTS=batched` turns them off (decode-then-GEMM, to cross-check).
pub(crate) fn tiled_dequant(w: &QTensor, dtype: DType) -> bool {
    let covered =
        matches!(w.shape().dims(), &[_, out, inp] if tiles_cover(w.dtype(), dtype, out, inp));
    let off = super::knobs::knobs().experts_are("batched");
    covered && !off
}

/// Whether the tiled kernels multiply `[out, in]` matrices of quant type `t` in `dtype`: bf16 or
/// f16 compute, a type they decode, `out` a multiple of 64 and `in` of 256 (what the launcher's
/// shape guard takes). An expert stack's matrices ([`tiled_dequant`]) or a dense weight
/// ([`dense_tiled`]).
fn tiles_cover(t: GgmlDType, dtype: DType, out: usize, inp: usize) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && tiled_type(t).is_some()
        && out.is_multiple_of(64)
        && inp.is_multiple_of(256)
}

/// The most tokens a dense matmul of dequant mode runs through the grouped kernel with by default
/// ([`dense_tiled`]): one 32-token tile, so each weight is decoded once, inside the GEMM, instead
/// of decoded whole into device memory (the lm_head: 1.9 GB of bf16 written and read back) and
/// multiplied by cuBLAS. Past one tile every tile decodes and reads the weight again: on an H100
/// at 256 tokens (8 tiles) the forward took 13.2 ms that way against 10.4 with the decoded copies,
/// at 16 tokens 3.7 ms against 6.0 (both measured with build AA's packed-decode kernel, since
/// removed). With the exact kernel, on an H100: a 1-layer GLM-5's 16-token forward 3.6–3.7 ms with
/// the decoded copies, 1.9–2.2 ms this way (`reports/gpu-moe.md` build AB).
pub(crate) const DENSE_TILED_TOKENS: usize = 32;

/// Whether a dense matmul of `t` tokens goes through the grouped kernel: up to
/// [`DENSE_TILED_TOKENS`], or as `GLMCHECK_DENSE=decode` (never: decode whole, then cuBLAS, to
/// cross-check) and `GLMCHECK_DENSE=tiled` (always, to measure) say.
pub(crate) fn dense_on_tiles(t: usize) -> bool {
    match super::knobs::knobs().dense.as_deref() {
        Some("decode") => false,
        Some("tiled") => true,
        _ => t <= DENSE_TILED_TOKENS,
    }
}

/// A dense matmul through the grouped kernel: `x · Wᵀ` for a quantized `[out, in]` weight as a
/// one-expert stack of all `T` rows, decoded inside the GEMM (the GGUF's values rounded once to
/// the dtype, as the decoded copy holds them; f32 sums in another order than cuBLAS'). `None`: not
/// taken (not bf16/f16 on CUDA, not `[T, in]`, a type or shape the kernel does not cover).
/// → `[T, out]` in `x`'s dtype.
pub(crate) fn dense_tiled(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    if !x.device().is_cuda() || x.rank() != 2 {
        return Ok(None);
    }
    let &[out, inp] = w.shape().dims() else {
        return Ok(None);
    };
    if !tiles_cover(w.dtype(), x.dtype(), out, inp) || x.dim(1)? != inp {
        return Ok(None);
    }
    let x = x.contiguous()?;
    super::q8_cuda::with_identity(&x, |g| g.dequant_matmul(w, &x, true)).map(Some)
}

/// Which of `cuda/dequant_gemm.cu`'s two tiled kernels multiplies: the register-decode kernel
/// (`glmcheck_dqmma`: each lane decodes its MMA fragments from the raw blocks; Q4_K, Q5_K, Q6_K and
/// Q8_0, the others fall back to the shared-memory kernel) at a tile width of 8, 16 or 32 tokens
/// (`None`: the grouping's cost-model tile, at most 32), the register kernel in the grouping's
/// tile runs (`Runs`, the default: the busy experts in a wider launch of their own,
/// [`Grouping::tile_runs`]; on an H100 at 256 tokens of the 3-layer GLM-5 synth, the same bits
/// as one launch and 0.41 ms less kernel time, `reports/gpu-moe.md` build T), or the shared-memory kernel (`glmcheck_dqmm`: a
/// sub-block per lane decoded into a shared tile, then WMMA). All give decode32's values rounded
/// to the compute dtype, summed in f32 (each output the same way: a tile decides only which
/// tokens share a block). `Direct(w)`: the tile runs on the direct-load kernel (`glmcheck_dqmma_direct`,
/// blocks of `w` warps, 4 or 8: each lane loads its own weight bytes into registers, no weight
/// staging in shared memory) for Q4_K stacks on 16-byte aligned rows, the register kernel for the
/// rest; it sums each chunk's k in another order than the register kernel (the same terms).
/// `DirectH16`: the direct-load kernel (4 warps) decoding a nibble pair with one `LOP3` into two
/// f16 subnormals (q·2^-24, exact as f32), then `fma(d1·2^24, q·2^-24, -m1)`: decode32's FMA for
/// every block (no addend to test), half the integer-pipe work of the byte permutes. The register
/// kernel decodes Q4_K that way too (its default since 2026-12-07: the same bits, the 16-wide Q4_K
/// launches ~8 % faster on an H100, `reports/gpu-moe.md` build Z); `RunsBytes`: the tile runs with
/// the byte permutes for Q4_K as well (the earlier default, kept to compare).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TiledKernel {
    Registers(Option<u8>),
    Runs,
    Direct(u8),
    DirectH16,
    RunsBytes,
    Shared,
}

impl TiledKernel {
    /// The default (tile runs), or `GLMCHECK_DEQUANT_EXPERTS=smem` (the shared-memory kernel),
    /// `GLMCHECK_DEQUANT_EXPERTS=one` (the register kernel in one launch at the cost model's
    /// tile), `GLMCHECK_DEQUANT_EXPERTS=direct|direct8|directh` (the tile runs on the direct-load
    /// kernel with 4 or 8 warps a block, or 4 with the f16 decode), `=runsb` (the tile runs with
    /// Q4_K's byte permutes instead of the f16 decode) and `GLMCHECK_DEQUANT_TILE=8|16|32` (one
    /// launch at that tile width), kept to measure one against the other.
    pub fn from_env() -> TiledKernel {
        let k = super::knobs::knobs();
        match k.dequant_experts.as_deref() {
            Some("smem") => return TiledKernel::Shared,
            Some("one") => return TiledKernel::Registers(None),
            Some("direct") => return TiledKernel::Direct(4),
            Some("direct8") => return TiledKernel::Direct(8),
            Some("directh") => return TiledKernel::DirectH16,
            Some("runsb") => return TiledKernel::RunsBytes,
            _ => {}
        }
        k.dequant_tile
            .map_or(TiledKernel::Runs, |t| TiledKernel::Registers(Some(t)))
    }

    /// The launcher's (kernel, tile width) codes.
    fn codes(self) -> (i32, i32) {
        match self {
            TiledKernel::Registers(tile) => (0, tile.map_or(0, i32::from)),
            TiledKernel::Runs => (0, 0),
            TiledKernel::Direct(8) => (3, 0),
            TiledKernel::Direct(_) => (2, 0),
            TiledKernel::DirectH16 => (4, 0),
            TiledKernel::RunsBytes => (5, 0),
            TiledKernel::Shared => (1, 0),
        }
    }
}

impl Grouping {
    /// Dequant mode's tiled kernel: `w` `[E, out, in]` (quantized) applied to rows of `x` (bf16 or
    /// f16 `[_, in]`): grouped row j is expert `experts(j)` times `x[tokens[j]]` (`by_token`) or
    /// `x[j]`. → `[rows, out]` in `x`'s dtype, rows in grouped order (see [`tiled_dequant`]).
    pub fn dequant_matmul(&self, w: &QTensor, x: &Tensor, by_token: bool) -> Result<Tensor> {
        self.dequant_matmul_with(w, x, by_token, TiledKernel::from_env())
    }

    /// [`Grouping::dequant_matmul`] on the given kernel.
    pub fn dequant_matmul_with(
        &self,
        w: &QTensor,
        x: &Tensor,
        by_token: bool,
        kernel: TiledKernel,
    ) -> Result<Tensor> {
        let op = DequantMatmul {
            w,
            g: self,
            by_token,
            kernel,
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
    kernel: TiledKernel,
}

pub(super) fn attribute(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32> {
    unsafe { result::device::get_attribute(dev, a) }
        .map_err(|e| candle_core::Error::Cuda(Box::new(e)))
}

pub(super) fn too_big(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "grouped MoE matmul: {what} exceeds the kernel's 32-bit offsets"
    ))
}

/// An `[E, out, in]` expert stack the kernels can read: its dims, (ggml type id, block size) and
/// the bytes of one row, checked against the bytes the stack holds (the kernels address expert
/// `e` at `e·out·row_bytes`). `what` names the operation in the errors.
pub(super) fn stack(w: &QTensor, what: &str) -> Result<([usize; 3], (i32, usize), usize)> {
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
/// `[rows]`, slots `[rows]`, bounds `[active + 1]`, experts `[active]`, by_size `[active]`.
pub(super) struct Segments {
    pub(super) tokens: *const i32,
    pub(super) slots: *const i32,
    pub(super) bounds: *const i32,
    pub(super) experts: *const i32,
    pub(super) by_size: *const i32,
}

impl Grouping {
    pub(super) fn segments(&self, t_ptr: u64) -> Segments {
        let at = |offset: usize| (t_ptr + 4 * offset as u64) as *const i32;
        let (rows, active) = (self.rows, self.active());
        Segments {
            tokens: at(0),
            slots: at(rows),
            bounds: at(2 * rows),
            experts: at(2 * rows + active + 1),
            by_size: at(2 * rows + 2 * active + 1),
        }
    }
}

impl DequantMatmul<'_> {
    /// The launches: (the active experts' indices, null for all in order; how many; tile width;
    /// the busiest one's rows). By default (`Runs`) the grouping's tile runs: the experts within
    /// the cost-model tile in one launch at it, the busy ones in a 32-wide launch of their own
    /// (`by_size`: the table's by-size segment on the device). `Registers(None)`
    /// (`GLMCHECK_DEQUANT_EXPERTS=one`): one launch at the grouping's cost-model tile (as q8's
    /// int8 experts, at most 32 tokens: 16 at 256 tokens of GLM-5, ~9 rows an expert; 8 at 16
    /// tokens); a fixed tile (`tn`) or the shared-memory kernel: one launch of every expert.
    fn launches(
        &self,
        g: &Grouping,
        by_size: *const i32,
        tn: i32,
    ) -> Result<Vec<(*const i32, i32, i32, i32)>> {
        let all = |tile: usize| vec![(std::ptr::null(), g.active(), tile, g.max_rows())];
        let runs: Vec<(*const i32, usize, usize, usize)> = match self.kernel {
            TiledKernel::Runs
            | TiledKernel::Direct(_)
            | TiledKernel::DirectH16
            | TiledKernel::RunsBytes => g
                .tile_runs(32)
                .into_iter()
                .map(|r| {
                    let list = by_size.wrapping_add(r.range.start);
                    (list, r.range.len(), r.tile, r.max_rows)
                })
                .collect(),
            TiledKernel::Registers(None) => all(g.tile_width().min(32)),
            _ => all(usize::try_from(tn).unwrap_or(0)),
        };
        runs.into_iter()
            .map(|(list, n, tile, busiest)| {
                match (
                    i32::try_from(n),
                    i32::try_from(tile),
                    i32::try_from(busiest),
                ) {
                    (Ok(n), Ok(tile), Ok(busiest)) => Ok((list, n, tile, busiest)),
                    _ => Err(too_big("a dimension")),
                }
            })
            .collect()
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
        let [Ok(n_out), Ok(k_in)] = [out, inp].map(i32::try_from) else {
            return Err(too_big("a dimension"));
        };
        let (kernel, tn) = self.kernel.codes();
        let launches = self.launches(g, seg.by_size, tn)?;
        // The kernel copies 16-byte pieces of each activation row.
        let launch = |code: i32, x: u64, y: *mut std::ffi::c_void| {
            if !x.is_multiple_of(16) {
                return -1;
            }
            for &(zlist, n_active, tn, max_rows) in &launches {
                let rc = unsafe {
                    glmcheck_dequant_matmul(
                        ggml_type,
                        code,
                        kernel,
                        tn,
                        w_ptr,
                        (out * row_bytes) as i64,
                        row_bytes as i64,
                        x as *const std::ffi::c_void,
                        src,
                        bounds,
                        experts,
                        zlist,
                        y,
                        n_out,
                        k_in,
                        n_active,
                        max_rows,
                        stream_ptr,
                    )
                };
                if rc != 0 {
                    return rc;
                }
            }
            0
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
            // -1 is this function's own (the closure above); 1..3 are glmcheck_dequant_matmul's
            let why = match rc {
                -1 => "activations not on a 16-byte boundary",
                1 => "no kernel for this quant type or dtype",
                2 => "a shape the tiling does not cover, or an unknown kernel code",
                3 => "CUDA refused the launch",
                _ => "an unknown code",
            };
            candle_core::bail!(
                "{WHAT}: launcher refused (code {rc}: {why}; kernel {:?}, tile {tn})",
                self.kernel
            )
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

/// Turns off cudarc's per-allocation event tracking for tensors created from now on. cudarc gives
/// every device allocation a read and a write event (two `cuEventCreate` at allocation, two
/// `cuEventDestroy` when freed) but records and waits on them only once the context has a second
/// stream (`new_stream`), which neither candle's `Device::new_cuda` (the per-thread default
/// stream) nor glmcheck creates: the events order nothing here, and each q8 forward op paid four
/// driver calls for them on the host, where the short forwards are launch-bound.
/// `GLMCHECK_EVENT_TRACKING=on` keeps them (to measure the difference).
pub fn skip_event_tracking(device: &candle_core::Device) {
    let candle_core::Device::Cuda(dev) = device else {
        return;
    };
    if super::knobs::knobs().event_tracking {
        return;
    }
    // SAFETY: one stream per device (see above): no cross-stream use for the events to order.
    unsafe { dev.disable_event_tracking() }
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
