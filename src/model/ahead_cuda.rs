//! Decoding ahead (opt-in, `GLMCHECK_AHEAD=on` or `=N` blocks): past the dense route's token count
//! (`moe_cuda::dense_on_tiles`) a dense weight is decoded into the compute dtype, then multiplied by
//! cuBLAS (`Blocks::matmul`). The decode is a pass over DRAM that depends on no activation: at 256
//! tokens on an H100, 1.8 ms of the forward's ~10 ms of kernels (the lm_head's 1.0 of it), while the
//! routed experts' kernel, bound by issue rather than bytes, leaves DRAM half idle. Here the next
//! layer's dense weights (during the last layer, the lm_head's) are decoded on a second stream while
//! this layer computes; the matmul that needs one waits for its decode (an event) instead of
//! decoding it.
//!
//! The same kernel writes the same bits; only the stream and the time differ. Memory: one layer's
//! decoded dense weights more than without (and the lm_head's, ~1.9 GB in bf16 for GLM-5).
//!
//! Ordering, all on raw driver handles (cudarc's own second stream would switch every candle
//! allocation to event tracking): the output is allocated on the device's stream, the side stream
//! waits for that, decodes, and records `done`; the device's stream waits for `done` before the
//! output is read ([`take`]) or freed (a decode never taken is waited for when the [`Scope`] ends).
//!
//! Thread-local: candle's CUDA device launches on the calling thread's per-thread stream, so a
//! forward's decodes ahead belong to its thread.

use std::cell::RefCell;

use candle_core::cuda_backend::cudarc::driver::{result, sys};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Result, Tensor};

use super::linear::{Blocks, Linear, MatmulMode, Weight};

/// How a forward decodes ahead, from `GLMCHECK_AHEAD`: `on` (the decoder's own grid: as many blocks
/// as the device holds), `N` (at most N blocks, leaving SMs to the layer that computes meanwhile),
/// anything else or unset: off.
pub(crate) fn grid_from_env() -> Option<i32> {
    let v = std::env::var("GLMCHECK_AHEAD").ok()?;
    match v.as_str() {
        "on" => Some(0),
        n => n.parse::<i32>().ok().filter(|&n| n > 0),
    }
}

/// What a forward's decodes ahead came to (a test's check that every one was used).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Decodes started on the side stream.
    pub started: usize,
    /// Of those, taken by the matmul that needed them.
    pub taken: usize,
}

struct Pending {
    /// The `QTensor`'s address and the dtype it was decoded into.
    key: (usize, DType),
    tensor: Tensor,
    done: sys::CUevent,
}

#[derive(Default)]
struct State {
    /// The side stream and the context it belongs to (a raw `CUcontext`).
    side: Option<(usize, sys::CUstream)>,
    /// Decodes ahead of this thread's forward, when one is running (a [`Scope`]).
    active: Option<Active>,
}

struct Active {
    grid: i32,
    pending: Vec<Pending>,
    counts: Counts,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn err(what: &str) -> impl Fn(result::DriverError) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("decode ahead, {what}: {e}"))
}

/// The device's own stream (candle's, per thread) and this thread's side stream on its context.
fn streams(dev: &candle_core::CudaDevice) -> Result<(sys::CUstream, sys::CUstream)> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    ctx.bind_to_thread()
        .map_err(|e| candle_core::Error::Msg(format!("decode ahead, context: {e}")))?;
    let key = ctx.cu_ctx() as usize;
    let side = STATE.with(|s| -> Result<sys::CUstream> {
        let mut s = s.borrow_mut();
        match s.side {
            Some((k, side)) if k == key => Ok(side),
            _ => {
                // Non-blocking: no implicit ordering against the per-thread stream. Kept for the
                // thread's life (one per thread and context).
                let side = result::stream::create(result::stream::StreamKind::NonBlocking)
                    .map_err(err("stream"))?;
                s.side = Some((key, side));
                Ok(side)
            }
        }
    })?;
    Ok((stream.cu_stream(), side))
}

/// Decodes ahead for the forward running on this thread until the scope is dropped (or
/// [`Scope::finish`]ed); `grid` as [`grid_from_env`] says. Decodes never taken are waited for
/// (on the device's stream) before their memory is released.
pub(crate) struct Scope {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Scope {
    pub(crate) fn begin(grid: i32) -> Scope {
        STATE.with(|s| {
            s.borrow_mut().active = Some(Active {
                grid,
                pending: Vec::new(),
                counts: Counts::default(),
            })
        });
        Scope {
            _not_send: std::marker::PhantomData,
        }
    }

    /// Ends the scope; what its decodes came to.
    #[cfg(test)]
    pub(crate) fn finish(self) -> Counts {
        end()
        // (Drop runs `end` again: a no-op once the scope is gone.)
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        end();
    }
}

fn end() -> Counts {
    let Some(active) = STATE.with(|s| s.borrow_mut().active.take()) else {
        return Counts::default();
    };
    for p in active.pending {
        release(p, None);
    }
    active.counts
}

/// The device's stream waits for `p`'s decode (so that reading or freeing its output comes after
/// it), then `p`'s event is released. Falls back to waiting on the host if the wait cannot be
/// enqueued: a freed buffer the side stream still writes would be a silent corruption.
fn release(p: Pending, main: Option<sys::CUstream>) -> Tensor {
    let main = main.or_else(|| match p.tensor.device() {
        Device::Cuda(d) => Some(d.cuda_stream().cu_stream()),
        _ => None,
    });
    // SAFETY: the event is ours and live; `main` is the device's live stream.
    unsafe {
        let waited = main.is_some_and(|m| {
            result::stream::wait_event(m, p.done, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .is_ok()
        });
        if !waited {
            let _ = result::event::synchronize(p.done);
        }
        let _ = result::event::destroy(p.done);
    }
    p.tensor
}

/// Starts decoding `linears`' quantized weights (resident, dequant mode) on the side stream, when
/// this thread has a [`Scope`] and the dense route decodes at `t` tokens. Weights another path
/// multiplies (the grouped kernel's tiles, q8) are left alone.
pub(crate) fn start(linears: &[&Linear], t: usize) -> Result<()> {
    let Some(grid) = STATE.with(|s| s.borrow().active.as_ref().map(|a| a.grid)) else {
        return Ok(());
    };
    if super::moe_cuda::dense_on_tiles(t) {
        return Ok(());
    }
    for l in linears {
        let Weight::Blocks {
            blocks: Blocks::OnDevice(q),
            dtype,
            mode: MatmulMode::Dequant,
        } = &l.weight
        else {
            continue;
        };
        let Device::Cuda(dev) = q.device() else {
            continue;
        };
        let (_, side) = streams(&dev)?;
        let Some(tensor) = crate::gguf::cuda_decode::decode_on(q, *dtype, grid, side as _)? else {
            continue;
        };
        let done = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(err("event"))?;
        let p = Pending {
            key: (&**q as *const QTensor as usize, *dtype),
            tensor,
            done,
        };
        // SAFETY: a live event and stream; on failure the decode is waited for before its output
        // can be freed (`release` falls back to the host).
        if let Err(e) = unsafe { result::event::record(done, side) } {
            let _ = unsafe { result::stream::synchronize(side) };
            release(p, None);
            return Err(err("record")(e));
        }
        STATE.with(|s| {
            if let Some(a) = s.borrow_mut().active.as_mut() {
                a.counts.started += 1;
                a.pending.push(p);
            }
        });
    }
    Ok(())
}

/// `q` decoded into `dtype` ahead, if it was: the device's stream waits for that decode first.
pub(crate) fn take(q: &QTensor, dtype: DType) -> Option<Tensor> {
    let key = (q as *const QTensor as usize, dtype);
    let p = STATE.with(|s| {
        let mut s = s.borrow_mut();
        let a = s.active.as_mut()?;
        let i = a.pending.iter().position(|p| p.key == key)?;
        a.counts.taken += 1;
        Some(a.pending.swap_remove(i))
    })?;
    Some(release(p, None))
}

/// Whether a device's forward should decode ahead: CUDA and `GLMCHECK_AHEAD` set.
pub(crate) fn wanted(device: &Device) -> Option<i32> {
    if device.is_cuda() {
        grid_from_env()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use std::sync::Arc;

    fn blocks(rows: usize, cols: usize, qt: GgmlDType, dev: &Device) -> Result<Linear> {
        let w = (Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu)? * 0.05)?;
        Ok(Linear {
            weight: Weight::Blocks {
                blocks: Blocks::OnDevice(Arc::new(QTensor::quantize_onto(&w, qt, dev)?)),
                dtype: DType::BF16,
                mode: MatmulMode::Dequant,
            },
        })
    }

    fn bits(t: &Tensor) -> Result<Vec<u32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.into_iter().map(f32::to_bits).collect())
    }

    /// Weights decoded ahead on the side stream give the matmuls the bits decoding in place gives,
    /// and every decode is taken. The first weight's decode on one block (a 16M-value Q6_K matrix:
    /// milliseconds) is still running when its matmul is enqueued, so a matmul that did not wait
    /// for it would read a buffer being written. A scope whose decodes are never taken releases
    /// them at its end; at 16 tokens (the grouped kernel's tiles) nothing is started.
    #[test]
    fn weights_decoded_ahead_give_the_same_bits_and_are_waited_for() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("no CUDA device: skipped");
            return Ok(());
        };
        let t = 300;
        let linears = [
            blocks(4096, 4096, GgmlDType::Q6K, &dev)?,
            blocks(512, 1024, GgmlDType::Q4K, &dev)?,
            blocks(256, 512, GgmlDType::Q8_0, &dev)?,
        ];
        let refs: Vec<&Linear> = linears.iter().collect();
        let xs = linears
            .iter()
            .map(|l| Tensor::randn(0f32, 1.0, (t, l.weight.dims()[1]), &dev)?.to_dtype(DType::BF16))
            .collect::<Result<Vec<_>>>()?;
        let want = linears
            .iter()
            .zip(&xs)
            .map(|(l, x)| bits(&l.weight.forward(x)?))
            .collect::<Result<Vec<_>>>()?;
        for grid in [1, 0, 8] {
            let scope = Scope::begin(grid);
            start(&refs, t)?;
            let got = linears
                .iter()
                .zip(&xs)
                .map(|(l, x)| bits(&l.weight.forward(x)?))
                .collect::<Result<Vec<_>>>()?;
            let counts = scope.finish();
            assert_eq!(
                counts,
                Counts {
                    started: 3,
                    taken: 3
                },
                "grid {grid}"
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let n = g.iter().zip(w).filter(|(a, b)| a != b).count();
                assert_eq!((n, g.len()), (0, w.len()), "grid {grid}, weight {i}");
            }
        }
        let scope = Scope::begin(1);
        start(&refs, t)?;
        assert_eq!(
            scope.finish(),
            Counts {
                started: 3,
                taken: 0
            }
        );
        // outside a scope nothing is started nor taken
        start(&refs, t)?;
        let Weight::Blocks {
            blocks: Blocks::OnDevice(q),
            ..
        } = &linears[0].weight
        else {
            unreachable!("built as blocks")
        };
        assert!(take(q, DType::BF16).is_none());
        let scope = Scope::begin(0);
        start(&refs, 16)?;
        assert_eq!(scope.finish(), Counts::default(), "16 tokens: tiles");
        Ok(())
    }
}
