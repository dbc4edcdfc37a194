//! Where module outputs go: a [`Capture`] sink receives every module output keyed by its Hugging
//! Face module path, exactly as the fixtures key them (batch dimension dropped).

use candle_core::{Result, Tensor};

/// A sink for module outputs, called in execution order (children before their parent, as
/// transformers' forward hooks fire).
///
/// Floating outputs come in the model's compute dtype (F32 unless configured otherwise); integer
/// outputs (indexer top-k, router expert ids) as I64, like the fixtures. candle tensors are
/// immutable, so keeping a clone is a real copy-at-capture (no later in-place overwrite).
pub trait Capture {
    /// Whether `path` is wanted; a sink may skip work (the model still computes what it needs).
    /// A sink that wants nothing of a layer's indexer (its module, internals, and the top-k the
    /// attention hands on, `self_attn.2`) gets no top-k from that layer where every key is selected
    /// (T ≤ index_topk): the indexer does not run there.
    fn wants(&self, _path: &str) -> bool {
        true
    }

    /// Whether the sink times modules by synchronizing the device at each capture: the forward
    /// then enqueues every module's work before its capture and nothing of a later module's (a
    /// MoE layer otherwise enqueues its shared expert before its routed experts).
    fn times_modules(&self) -> bool {
        false
    }

    /// Whether the sink takes the captures in transformers' order (dumps and comparisons do).
    /// `false`: as the work is enqueued (the timeline's marks, which time that work).
    fn in_transformers_order(&self) -> bool {
        true
    }

    /// One module output.
    fn capture(&mut self, path: &str, tensor: &Tensor) -> Result<()>;

    /// Replace the value a module hands on, before the model uses it. The model asks only at the
    /// indexer's top-k (`model.layers.N.self_attn.indexer`, `[T, k]` U32 key ids), so that a
    /// reference's choices can be replayed (e.g. to look past a tie-break). `None` keeps the
    /// model's own value. Called after [`Capture::capture`] of the same path.
    fn replace(&mut self, _path: &str, _ours: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

/// Captures nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoCapture;

impl Capture for NoCapture {
    fn wants(&self, _path: &str) -> bool {
        false
    }

    fn capture(&mut self, _path: &str, _tensor: &Tensor) -> Result<()> {
        Ok(())
    }
}

/// Keeps every capture in order.
#[derive(Debug, Default, Clone)]
pub struct VecCapture {
    pub entries: Vec<(String, Tensor)>,
}

impl VecCapture {
    pub fn new() -> Self {
        Self::default()
    }

    /// The first capture under `path`.
    pub fn get(&self, path: &str) -> Option<&Tensor> {
        self.entries.iter().find(|(k, _)| k == path).map(|(_, t)| t)
    }

    /// The keys in capture order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Capture for VecCapture {
    fn capture(&mut self, path: &str, tensor: &Tensor) -> Result<()> {
        self.entries.push((path.to_string(), tensor.clone()));
        Ok(())
    }
}

/// Sends `tensor` to the sink if wanted.
pub(crate) fn emit(c: &mut dyn Capture, path: &str, tensor: &Tensor) -> Result<()> {
    if c.wants(path) {
        c.capture(path, tensor)?;
    }
    Ok(())
}

/// Builds the captured tensor only if wanted (reshapes, dtype casts).
pub(crate) fn emit_with(
    c: &mut dyn Capture,
    path: &str,
    make: impl FnOnce() -> Result<Tensor>,
) -> Result<()> {
    if c.wants(path) {
        let t = make()?;
        c.capture(path, &t)?;
    }
    Ok(())
}
