//! The router's choices on their way to the host. Grouping the tokens by expert is host work
//! (`grouping::Grouping`), so a MoE layer reads its `[T, k]` expert ids back once. Read with
//! `to_vec2` right before the expert kernels, that read waits for everything enqueued so far and
//! leaves the GPU idle while the host copies, groups and enqueues again (one bubble a MoE layer).
//! [`HostIds::start`] instead enqueues the copy right after the router, into page-locked memory
//! with an event behind it; the layer then enqueues its shared expert (which needs no routing)
//! and only then waits for the event, so the GPU computes the shared expert while the host
//! groups. Same values, same kernels: only the order in which the two independent halves of the
//! layer are enqueued differs. Opt-in on CUDA (`GLMCHECK_ROUTING=ahead`, `Moe::forward`) until
//! its device test (`the_routing_read_ahead_equals_the_synchronous_read`) has run on a GPU.
//! The copy and its wait use the device's stream from the forward's host thread (candle's CUDA
//! device is the per-thread default stream).

use candle_core::{Result, Tensor};

/// A `[T, k]` U32 tensor's values for the host: read already (CPU, or the synchronous read), or a
/// copy in flight on the device's stream.
pub struct HostIds {
    k: usize,
    state: State,
}

enum State {
    Ready(Vec<u32>),
    #[cfg(feature = "cuda")]
    Pending(cuda::Pending),
}

impl HostIds {
    /// Starts reading `ids` `[T, k]` (U32): on CUDA an asynchronous copy enqueued now, elsewhere
    /// the values themselves.
    pub fn start(ids: &Tensor) -> Result<Self> {
        let (_, k) = ids.dims2()?;
        #[cfg(feature = "cuda")]
        if ids.device().is_cuda() {
            return Ok(Self {
                k,
                state: State::Pending(cuda::Pending::start(ids)?),
            });
        }
        Ok(Self {
            k,
            state: State::Ready(ids.flatten_all()?.to_vec1::<u32>()?),
        })
    }

    /// The values, row-major (waits for the copy if it is still in flight).
    pub fn wait(self) -> Result<(Vec<u32>, usize)> {
        #[cfg(feature = "cuda")]
        let values = match self.state {
            State::Ready(v) => v,
            State::Pending(p) => p.wait()?,
        };
        #[cfg(not(feature = "cuda"))]
        let State::Ready(values) = self.state;
        Ok((values, self.k))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        result, CudaContext, CudaEvent, DevicePtr, PinnedHostSlice,
    };
    use candle_core::{Result, Storage, Tensor};
    use std::sync::{Arc, Mutex};

    /// Page-locked buffers kept between layers (allocating one costs far more than a layer's
    /// copy), each with the event that marks its copy done: a copy takes one out, its wait puts
    /// it back.
    static SPARE: Mutex<Vec<Buffer>> = Mutex::new(Vec::new());

    struct Buffer {
        host: PinnedHostSlice<u32>,
        done: CudaEvent,
    }

    pub(super) struct Pending {
        buf: Option<Buffer>,
        n: usize,
    }

    fn wrap<E: std::fmt::Debug>(what: &'static str) -> impl Fn(E) -> candle_core::Error {
        move |e| candle_core::Error::Msg(format!("reading the routing to the host: {what}: {e:?}"))
    }

    /// A spare buffer of `ctx` holding at least `n` values, or a new one.
    fn take(ctx: &Arc<CudaContext>, n: usize) -> Result<Buffer> {
        let mut spare = SPARE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = spare
            .iter()
            .position(|b| b.host.len() >= n && b.host.context() == ctx)
        {
            return Ok(spare.swap_remove(i));
        }
        drop(spare);
        // At least 64 Ki values (256 KB): one buffer serves every later layer and prompt of up
        // to 8192 tokens of top-8.
        // Not write-combined (cudarc's `alloc_pinned`): the host reads this memory, and reads of
        // write-combined memory bypass the caches.
        // SAFETY: only the values a copy wrote are read (`wait`).
        let host = unsafe { ctx.alloc_pinned_with_flags::<u32>(n.max(1 << 16), 0) }
            .map_err(wrap("page-locked buffer"))?;
        let done = ctx.new_event(None).map_err(wrap("event"))?;
        Ok(Buffer { host, done })
    }

    impl Pending {
        pub(super) fn start(ids: &Tensor) -> Result<Self> {
            let ids = ids.contiguous()?;
            let n = ids.elem_count();
            let (storage, layout) = ids.storage_and_layout();
            let Storage::Cuda(s) = &*storage else {
                candle_core::bail!("reading the routing to the host: not a CUDA tensor");
            };
            let stream = s.device().cuda_stream();
            let mut buf = take(stream.context(), n)?;
            let start = layout.start_offset();
            let src = s.as_cuda_slice::<u32>()?.slice(start..start + n);
            let (src_ptr, _guard) = src.device_ptr(&stream);
            // The buffer is idle: its last copy was waited for before it was put back.
            let host = buf.host.as_mut_ptr().map_err(wrap("buffer"))?;
            // SAFETY: `host` holds at least n values and nothing else reads or writes them until
            // `wait` has synchronized the event recorded behind this copy; `src_ptr` addresses n
            // values of a live storage, kept alive by the stream order of its later frees.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(host, n);
                result::memcpy_dtoh_async(dst, src_ptr, stream.cu_stream())
                    .map_err(wrap("copy"))?;
            }
            if let Err(e) = buf.done.record(&stream) {
                // Nothing marks the copy's end: wait for it before the buffer can be freed.
                let _ = stream.synchronize();
                return Err(wrap("event")(e));
            }
            Ok(Pending { buf: Some(buf), n })
        }

        pub(super) fn wait(mut self) -> Result<Vec<u32>> {
            let Some(buf) = self.buf.take() else {
                candle_core::bail!("reading the routing to the host: no buffer");
            };
            // Waits for the copy's event only, not for the work enqueued after it.
            buf.done.synchronize().map_err(wrap("wait"))?;
            let host = buf.host.as_ptr().map_err(wrap("buffer"))?;
            // SAFETY: the copy of n values into `host` is done (the event above).
            let values = unsafe { std::slice::from_raw_parts(host, self.n) }.to_vec();
            SPARE.lock().unwrap_or_else(|p| p.into_inner()).push(buf);
            Ok(values)
        }
    }

    impl Drop for Pending {
        fn drop(&mut self) {
            // A copy never waited for (an error in between): wait for it before the buffer is
            // freed.
            if let Some(buf) = self.buf.take() {
                if buf.done.synchronize().is_err() {
                    // The copy may still be writing into it: never freed (a failed context).
                    std::mem::forget(buf);
                }
            }
        }
    }
}
