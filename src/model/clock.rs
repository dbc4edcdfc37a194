//! Marks on the device's timeline without synchronizing it: CUDA events recorded on the device's
//! stream (timed by the GPU when the work before them is done), so a forward can be cut into
//! stretches of GPU time while it runs at its own pace. On the CPU there is no such clock (the
//! work is done when the call returns): [`EventClock::new`] gives `None` there.

use candle_core::{Device, Result};

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{sys, CudaContext, CudaEvent};

/// An event that records a time (cudarc's default disables timing).
#[cfg(feature = "cuda")]
fn timed_event(ctx: &std::sync::Arc<CudaContext>) -> Result<CudaEvent> {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(candle_core::Error::wrap)
}

/// Events recorded in order on one CUDA device's stream; the first is the origin.
pub struct EventClock {
    #[cfg(feature = "cuda")]
    dev: candle_core::CudaDevice,
    #[cfg(feature = "cuda")]
    spare: Vec<CudaEvent>,
    #[cfg(feature = "cuda")]
    marks: Vec<CudaEvent>,
}

impl EventClock {
    /// A clock on `device` with `capacity` events created ahead (creating one is a driver call
    /// the host would otherwise pay between two launches), or `None` off CUDA.
    pub fn new(device: &Device, capacity: usize) -> Result<Option<Self>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            let ctx = dev.cuda_stream().context().clone();
            let spare = (0..capacity)
                .map(|_| timed_event(&ctx))
                .collect::<Result<Vec<_>>>()?;
            return Ok(Some(Self {
                dev: dev.clone(),
                spare,
                marks: Vec::with_capacity(capacity),
            }));
        }
        let _ = (device, capacity);
        Ok(None)
    }

    /// Records a mark after the work enqueued so far.
    pub fn mark(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let stream = self.dev.cuda_stream();
            let ev = match self.spare.pop() {
                Some(ev) => ev,
                None => timed_event(stream.context())?,
            };
            ev.record(&stream).map_err(candle_core::Error::wrap)?;
            self.marks.push(ev);
        }
        Ok(())
    }

    /// Waits for every mark and gives each one's time after the first, in ms (the first is 0).
    #[cfg(feature = "cuda")]
    pub fn read(self) -> Result<Vec<f64>> {
        let Some(first) = self.marks.first() else {
            return Ok(Vec::new());
        };
        self.marks
            .iter()
            .map(|m| {
                first
                    .elapsed_ms(m)
                    .map(f64::from)
                    .map_err(candle_core::Error::wrap)
            })
            .collect()
    }

    /// Off CUDA there are no marks.
    #[cfg(not(feature = "cuda"))]
    pub fn read(self) -> Result<Vec<f64>> {
        Ok(Vec::new())
    }
}
