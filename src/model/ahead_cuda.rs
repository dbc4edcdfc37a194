//! Dense weights decoded one layer ahead on a second CUDA stream (dequant mode; opt-in while it is
//! measured: `GLMCHECK_DECODE_AHEAD=on`). Before layer `l` runs, the forward asks for layer
//! `l + 1`'s dense quantized weights (attention, indexer, dense MLP or shared experts; lm_head
//! before the last layer): each is decoded by glmcheck's whole-tensor decoder on the side stream
//! into a buffer of the main stream's pool, and its GEMM, when it comes, waits for that decode
//! alone. The decodes (memory-bound) then overlap layer `l`'s kernels instead of standing between
//! them. The values are the same as decoding in place (the same kernel, the same bits); memory
//! holds one layer's dense weights more (GLM-5: ~0.4 GB in bf16, lm_head 1.9 GB).
//!
//! Ordering: the side stream waits for the main stream's allocation of the buffer; the main stream
//! waits for the decode before the buffer's first use (or before it is freed unused), so a buffer
//! is never written after it returns to the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent, CudaStream};
use candle_core::quantized::QTensor;
use candle_core::{DType, Result, Tensor};

/// Whether the forward decodes ahead (`GLMCHECK_DECODE_AHEAD=on`).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("GLMCHECK_DECODE_AHEAD").is_some_and(|v| v == "on"))
}

/// A weight decoded (or being decoded) on the side stream.
struct Pending {
    tensor: Tensor,
    done: CudaEvent,
    main: Arc<CudaStream>,
}

impl Pending {
    /// The tensor, once the main stream waits for its decode.
    fn ready(self) -> Result<Tensor> {
        self.main.wait(&self.done).map_err(cuda_err)?;
        Ok(self.tensor.clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // Unused or used: the main stream frees the buffer only after the decode wrote it.
        let _ = self.main.wait(&self.done);
    }
}

#[derive(Default)]
struct State {
    /// The side stream of each device (by its main stream's handle).
    side: HashMap<usize, Arc<CudaStream>>,
    /// By (the QTensor's address, dtype).
    pending: HashMap<(usize, DType), Pending>,
}

fn state() -> &'static Mutex<State> {
    static STATE: OnceLock<Mutex<State>> = OnceLock::new();
    STATE.get_or_init(|| Mutex::new(State::default()))
}

fn cuda_err(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("decode-ahead stream: {e:?}"))
}

fn poisoned<T>(_: T) -> candle_core::Error {
    candle_core::Error::Msg("decode-ahead state poisoned by a panic".into())
}

/// An event without timing (the cheaper kind) recorded on `s`.
pub(crate) fn mark(s: &CudaStream) -> Result<CudaEvent> {
    s.record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(cuda_err)
}

/// Starts decoding `q` into `dtype` on the side stream of its device, unless it is pending already
/// or the whole-tensor decoder does not cover it (it is then decoded in place when used).
pub fn start(q: &QTensor, dtype: DType) -> Result<()> {
    let candle_core::Device::Cuda(dev) = q.device() else {
        return Ok(());
    };
    let key = (q as *const QTensor as usize, dtype);
    let main = dev.cuda_stream();
    let mut st = state().lock().map_err(poisoned)?;
    if st.pending.contains_key(&key) {
        return Ok(());
    }
    let side = match st.side.get(&(main.cu_stream() as usize)) {
        Some(s) => s.clone(),
        None => {
            let s = main.context().new_stream().map_err(cuda_err)?;
            st.side.insert(main.cu_stream() as usize, s.clone());
            s
        }
    };
    if let Some((tensor, done)) = crate::gguf::cuda_decode::decode_on(q, dtype, &side)? {
        st.pending.insert(key, Pending { tensor, done, main });
    }
    Ok(())
}

/// `q` decoded into `dtype` if [`start`] decoded it ahead (the main stream then waits for that
/// decode), else None.
pub fn take(q: &QTensor, dtype: DType) -> Result<Option<Tensor>> {
    let key = (q as *const QTensor as usize, dtype);
    let pending = state().lock().map_err(poisoned)?.pending.remove(&key);
    pending.map(Pending::ready).transpose()
}

/// Drops every pending decode (the end of a forward: nothing is kept between forwards).
pub fn clear() -> Result<()> {
    let drained: Vec<Pending> = state()
        .lock()
        .map_err(poisoned)?
        .pending
        .drain()
        .map(|(_, p)| p)
        .collect();
    drop(drained);
    Ok(())
}
