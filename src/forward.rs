//! The forward stage that `glmcheck forward` calls: run the model on a prompt, the next-token
//! distribution, a greedy continuation, the capture as a dump, and (given a reference dump) the
//! comparison, with the reference's top-k replayed at indexer ties ([`crate::compare::Aligner`]).

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use serde::Serialize;

use crate::compare::{compare, meta, ActError, Activations, Aligner, CompareOptions};
use crate::compare::{Comparison, ComputeDtype, Tolerances};
use crate::gguf::GgmlType;
use crate::model::{DsaMode, Glm5, ModelError, NoCapture};
use crate::tokenizer::GgufTokenizer;

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Model(Box<ModelError>),
    #[error(transparent)]
    Acts(Box<ActError>),
    #[error("reading the logits back: {0}")]
    Candle(Box<candle_core::Error>),
}

impl From<ModelError> for ForwardError {
    fn from(e: ModelError) -> Self {
        ForwardError::Model(Box::new(e))
    }
}

impl From<ActError> for ForwardError {
    fn from(e: ActError) -> Self {
        ForwardError::Acts(Box::new(e))
    }
}

impl From<candle_core::Error> for ForwardError {
    fn from(e: candle_core::Error) -> Self {
        ForwardError::Candle(Box::new(e))
    }
}

/// How to run.
#[derive(Debug, Clone)]
pub struct ForwardSpec {
    pub dtype: ComputeDtype,
    /// The GGUF's coarsest matrix type (for tolerances and the dump's metadata).
    pub weights: GgmlType,
    pub max_new_tokens: usize,
    /// How many next-token candidates to list.
    pub top: usize,
    /// Recorded in the dump's metadata.
    pub gguf: String,
    pub prompt: Option<String>,
    /// Tolerances for the comparison (`None`: [`Tolerances::for_profile`]).
    pub tolerances: Option<Tolerances>,
    /// Time this many extra plain (uncaptured) forwards of the prompt and report the best and
    /// the median.
    pub bench: usize,
    /// After the timed forwards, one more with the device synchronized after every module, its
    /// time split by module kind.
    pub profile: bool,
    /// The model's `index_topk` (read by the comparison: where the indexer starts to matter).
    pub index_topk: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct TopToken {
    pub id: u32,
    pub text: Option<String>,
    pub prob: f64,
}

/// What DSA mode means for this prompt (worded by `report::notes::dsa_message`).
#[derive(Debug, Clone, Serialize)]
pub struct DsaNote {
    pub mode: &'static str,
    pub index_topk: usize,
    pub tokens: usize,
    /// Dense and sparse give the same output on this prompt.
    pub identical: bool,
    /// Tokens of greedy continuation asked for (dense and sparse may part once the sequence
    /// passes `index_topk`).
    #[serde(skip)]
    pub new_tokens: usize,
}

/// Why the greedy continuation stopped before `max_new_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The tokenizer's end-of-generation token was produced.
    EndOfGeneration(u32),
    /// The sequence reached the model's `max_position_embeddings`.
    MaxPositions,
}

impl Serialize for Stop {
    /// As the report words it (`"end-of-generation token 7"`).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::report::notes::stop_text(*self))
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ForwardOutcome {
    pub tokens: Vec<u32>,
    pub token_texts: Option<Vec<String>>,
    pub dtype: ComputeDtype,
    pub weights: GgmlType,
    /// How quantized weights were multiplied (`dequant` or `q8`).
    pub matmul: crate::model::MatmulMode,
    pub dsa: DsaNote,
    /// Next-token candidates after the last prompt token.
    pub top: Vec<TopToken>,
    /// Entropy of that distribution, nats, and log(vocab).
    pub entropy: f64,
    pub vocab: usize,
    pub log_vocab: f64,
    pub garbage: bool,
    pub continuation_ids: Vec<u32>,
    pub continuation: Option<String>,
    /// Why the continuation stopped early, if it did.
    pub stopped: Option<Stop>,
    /// `"<indexer path>:<position>"` where the reference's top-k was replayed at a tie.
    pub replayed: Vec<String>,
    /// Simulated tensor-parallel degree (`None`: the unsharded forward).
    pub tp: Option<usize>,
    /// Notes on how the run was made (the simulated ranks' weight source, …).
    pub notes: Vec<String>,
    /// The `GLMCHECK_*` settings the run was made with (`model::knobs`' table: other kernels than
    /// the defaults, and main's), name → value; empty: none set.
    pub settings: std::collections::BTreeMap<String, String>,
    /// With `--bench N`: the best of N plain forwards of the prompt, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forward_seconds: Option<f64>,
    /// With `--bench N`: the timings.
    pub bench: Option<Bench>,
    pub comparison: Option<Comparison>,
    #[serde(skip)]
    pub capture: Activations,
}

fn dsa_note(model: &Glm5, t: usize, new: usize) -> DsaNote {
    let k = model.config().index_topk;
    let dense = model.dsa_mode() == DsaMode::Dense;
    DsaNote {
        mode: if dense { "dense" } else { "sparse" },
        index_topk: k,
        tokens: t,
        identical: t <= k,
        new_tokens: new,
    }
}

fn last_row(logits: &Tensor) -> Result<Vec<f32>, candle_core::Error> {
    let (t, _) = logits.dims2()?;
    logits
        .narrow(0, t - 1, 1)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let e: Vec<f64> = row.iter().map(|&x| (x as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0 as u32
}

/// The dump's metadata: producer, compute dtype, weight type, DSA mode and the GGUF.
fn metadata(spec: &ForwardSpec, dsa: DsaMode) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert(
        meta::PRODUCER.to_string(),
        format!("glmcheck {}", env!("CARGO_PKG_VERSION")),
    );
    m.insert(meta::DTYPE.to_string(), spec.dtype.name().to_string());
    m.insert(meta::WEIGHTS.to_string(), spec.weights.name.to_string());
    let dsa = match dsa {
        DsaMode::Dense => "dense",
        DsaMode::Sparse => "sparse",
    };
    m.insert(meta::DSA.to_string(), dsa.to_string());
    m.insert(meta::GGUF.to_string(), spec.gguf.clone());
    m
}

/// The `n` most likely next tokens (ties by id).
fn top_tokens(probs: &[f64], n: usize, tokenizer: Option<&GgufTokenizer>) -> Vec<TopToken> {
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order
        .iter()
        .take(n)
        .map(|&i| TopToken {
            id: i as u32,
            text: tokenizer.and_then(|t| t.token_text(i as u32)),
            prob: probs[i],
        })
        .collect()
}

/// Greedy continuation from `first` (the argmax after the prompt); the full forward is
/// recomputed per token.
fn continue_greedy(
    model: &Glm5,
    tokenizer: Option<&GgufTokenizer>,
    tokens: &[u32],
    first: u32,
    max_new_tokens: usize,
) -> Result<(Vec<u32>, Option<Stop>), ForwardError> {
    let ends = tokenizer.map(|t| t.end_ids()).unwrap_or_default();
    let max_pos = model.config().max_position_embeddings.max(1);
    let mut seq = tokens.to_vec();
    let mut next = first;
    let mut ids = Vec::new();
    for step in 0..max_new_tokens {
        ids.push(next);
        seq.push(next);
        if ends.contains(&next) {
            return Ok((ids, Some(Stop::EndOfGeneration(next))));
        }
        if step + 1 == max_new_tokens {
            break;
        }
        if seq.len() >= max_pos {
            return Ok((ids, Some(Stop::MaxPositions)));
        }
        let l = model.forward(&seq, &mut NoCapture)?;
        next = argmax(&last_row(&l)?);
    }
    Ok((ids, None))
}

/// Timed plain forwards of the prompt (each ends with the device synchronized).
#[derive(Debug, Clone, Serialize)]
pub struct Bench {
    pub runs: usize,
    pub best_ms: f64,
    pub median_ms: f64,
    /// With `--profile`: one more forward's time by module kind (layer numbers as `*`), in
    /// execution order of first appearance; the device is synchronized after every module, so
    /// the sum exceeds an unprofiled forward.
    pub profile: Option<Vec<ModuleTime>>,
    /// With `--profile`: one more forward, not synchronized, marked at module boundaries. Not
    /// taken for a simulated tensor-parallel model of several ranks: they run one after another
    /// and their modules reach the sink only when merged, so the marks would time the merges.
    pub timeline: Option<Timeline>,
}

/// A forward cut at module boundaries without synchronizing it: each mark's host time (when the
/// host had enqueued the module) and, on CUDA, its GPU time (an event on the device's stream:
/// when the GPU had done it). The GPU can reach a mark only after the host enqueued it; where it
/// reaches it just after, it had been waiting for the host's launches (or a host synchronization).
/// Its JSON carries the readings too ([`Timeline::idle_bound_ms`], [`Timeline::host_paced`] within
/// [`HOST_PACED_MS`]), so no script re-derives them.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// Host time until the forward returned (ms), its work enqueued.
    pub host_ms: f64,
    /// Time until the device had done the forward (ms): the last event on CUDA, the host's on CPU.
    pub total_ms: f64,
    /// Whether `gpu_ms` comes from CUDA events (false on CPU: the host's time is the work's).
    pub gpu_events: bool,
    pub marks: Vec<TimelineMark>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TimelineMark {
    pub module: String,
    pub host_ms: f64,
    pub gpu_ms: Option<f64>,
}

/// A mark the GPU reached within `within_ms` of the host enqueueing it, with the GPU time since
/// the previous mark: a stretch whose pace the host set. `idle_ms` bounds the GPU's idle time
/// in it from above: how long after the GPU had done the previous stretch the host was still
/// enqueueing this one (once all of it is enqueued the GPU runs it without a pause).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostPaced {
    pub module: String,
    pub lead_ms: f64,
    pub stretch_ms: f64,
    pub idle_ms: f64,
}

/// How close behind the host the GPU reaches a mark for the stretch before it to count as set by
/// the host's pace (a launch takes the GPU a few µs to start).
pub const HOST_PACED_MS: f64 = 0.05;

impl Timeline {
    /// The marks the GPU reached less than `within_ms` after the host enqueued them (CUDA only).
    pub fn host_paced(&self, within_ms: f64) -> Vec<HostPaced> {
        let mut prev = 0.0;
        let mut out = Vec::new();
        for m in &self.marks {
            let Some(g) = m.gpu_ms else { continue };
            if g - m.host_ms < within_ms {
                out.push(HostPaced {
                    module: m.module.clone(),
                    lead_ms: g - m.host_ms,
                    stretch_ms: g - prev,
                    idle_ms: (m.host_ms - prev).max(0.0),
                });
            }
            prev = g;
        }
        out
    }

    /// An upper bound on the GPU's idle time in the whole forward (CUDA only): over every
    /// stretch, how long after the GPU had done the previous one the host was still enqueueing
    /// it (launch latencies aside), and after the last mark until the forward returned.
    pub fn idle_bound_ms(&self) -> Option<f64> {
        let mut prev = 0.0;
        let mut idle = 0.0;
        for m in &self.marks {
            let g = m.gpu_ms?;
            idle += (m.host_ms - prev).max(0.0);
            prev = g;
        }
        Some(idle + (self.host_ms - prev).max(0.0))
    }
}

impl Serialize for Timeline {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Json<'a> {
            host_ms: f64,
            total_ms: f64,
            gpu_events: bool,
            marks: &'a [TimelineMark],
            /// `None` without a device clock (CPU).
            idle_bound_ms: Option<f64>,
            /// Within [`HOST_PACED_MS`], in forward order.
            host_paced: Vec<HostPaced>,
        }
        Json {
            host_ms: self.host_ms,
            total_ms: self.total_ms,
            gpu_events: self.gpu_events,
            marks: &self.marks,
            idle_bound_ms: self.idle_bound_ms(),
            host_paced: self.host_paced(HOST_PACED_MS),
        }
        .serialize(s)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ModuleTime {
    pub module: String,
    pub ms: f64,
    pub calls: usize,
}

/// `n` plain forwards of `tokens` timed (`None` for n = 0), and with `profile` one more split by
/// module.
fn bench(
    model: &Glm5,
    tokens: &[u32],
    n: usize,
    profile: bool,
) -> Result<Option<Bench>, ForwardError> {
    if n == 0 {
        return Ok(None);
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let start = std::time::Instant::now();
        model.forward(tokens, &mut NoCapture)?;
        model.device().synchronize().map_err(ForwardError::from)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let profile = if profile {
        let mut p = Profiler {
            device: model.device(),
            last: std::time::Instant::now(),
            times: Vec::new(),
        };
        model.forward(tokens, &mut p)?;
        Some(p.times)
    } else {
        None
    };
    let timeline = if profile.is_some() && model.tp() == 1 {
        Some(timeline(model, tokens)?)
    } else {
        None
    };
    Ok(Some(Bench {
        runs: n,
        best_ms: times[0],
        median_ms: times[n / 2],
        profile,
        timeline,
    }))
}

/// One forward of `tokens` marked at [`crate::model::names::order::timeline_mark`]'s module
/// boundaries, the device synchronized only before it and after it.
fn timeline(model: &Glm5, tokens: &[u32]) -> Result<Timeline, ForwardError> {
    let device = model.device();
    device.synchronize().map_err(ForwardError::from)?;
    // Every event created ahead: creating one is a driver call the host would pay between launches.
    let marks = model.layers().len() * crate::model::names::order::TIMELINE_LAYER.len()
        + crate::model::names::order::TIMELINE_ROOT.len()
        + 2;
    let clock = crate::model::clock::EventClock::new(device, marks).map_err(ForwardError::from)?;
    let mut sink = Marks {
        clock,
        start: std::time::Instant::now(),
        marks: Vec::new(),
    };
    if let Some(c) = sink.clock.as_mut() {
        c.mark().map_err(ForwardError::from)?;
    }
    sink.start = std::time::Instant::now();
    model.forward(tokens, &mut sink)?;
    let host_ms = sink.start.elapsed().as_secs_f64() * 1e3;
    if let Some(c) = sink.clock.as_mut() {
        c.mark().map_err(ForwardError::from)?;
    }
    device.synchronize().map_err(ForwardError::from)?;
    let end_host = sink.start.elapsed().as_secs_f64() * 1e3;
    let times = match sink.clock.take() {
        Some(c) => Some(c.read().map_err(ForwardError::from)?),
        None => None,
    };
    assemble(sink.marks, times, host_ms, end_host).map_err(ForwardError::from)
}

/// The timeline from its marks and, on CUDA, the events' times: `times[0]` the origin,
/// `times[i + 1]` mark i's, the last the forward's end (one event per mark, so two more times than
/// marks; anything else is an error, never a shifted reading). Off CUDA the GPU end is the host's
/// time after the final synchronization.
fn assemble(
    mut marks: Vec<TimelineMark>,
    times: Option<Vec<f64>>,
    host_ms: f64,
    end_host_ms: f64,
) -> candle_core::Result<Timeline> {
    let Some(times) = times else {
        return Ok(Timeline {
            host_ms,
            total_ms: end_host_ms,
            gpu_events: false,
            marks,
        });
    };
    if times.len() != marks.len() + 2 {
        candle_core::bail!(
            "timeline: {} event times for {} marks (expected the origin, one a mark, the end)",
            times.len(),
            marks.len()
        );
    }
    for (m, &t) in marks.iter_mut().zip(&times[1..]) {
        m.gpu_ms = Some(t);
    }
    Ok(Timeline {
        host_ms,
        total_ms: times.last().copied().unwrap_or(end_host_ms),
        gpu_events: true,
        marks,
    })
}

/// The timeline's sink: a host time and (CUDA) an event at each mark.
struct Marks {
    clock: Option<crate::model::clock::EventClock>,
    start: std::time::Instant,
    marks: Vec<TimelineMark>,
}

impl crate::model::Capture for Marks {
    fn in_transformers_order(&self) -> bool {
        false
    }

    fn wants(&self, path: &str) -> bool {
        crate::model::names::order::timeline_mark(path)
    }

    fn capture(&mut self, path: &str, _t: &candle_core::Tensor) -> candle_core::Result<()> {
        if let Some(c) = self.clock.as_mut() {
            c.mark()?;
        }
        self.marks.push(TimelineMark {
            module: path.to_string(),
            host_ms: self.start.elapsed().as_secs_f64() * 1e3,
            gpu_ms: None,
        });
        Ok(())
    }
}

/// Times each module: synchronizes the device at every capture point and charges the time since
/// the previous one to the module emitted.
struct Profiler<'d> {
    device: &'d candle_core::Device,
    last: std::time::Instant,
    times: Vec<ModuleTime>,
}

impl crate::model::Capture for Profiler<'_> {
    fn times_modules(&self) -> bool {
        true
    }

    fn wants(&self, path: &str) -> bool {
        // The per-expert act_fn captures cost a host sync and gathers of their own.
        !path.contains(".experts.act_fn")
    }

    fn capture(&mut self, path: &str, _t: &candle_core::Tensor) -> candle_core::Result<()> {
        self.device.synchronize()?;
        let now = std::time::Instant::now();
        let ms = (now - self.last).as_secs_f64() * 1e3;
        self.last = now;
        let kind = module_kind(path);
        match self.times.iter_mut().find(|m| m.module == kind) {
            Some(m) => {
                m.ms += ms;
                m.calls += 1;
            }
            None => self.times.push(ModuleTime {
                module: kind,
                ms,
                calls: 1,
            }),
        }
        Ok(())
    }
}

/// `model.layers.12.self_attn.q_b_proj` → `model.layers.*.self_attn.q_b_proj`.
fn module_kind(path: &str) -> String {
    path.split('.')
        .map(|p| if p.parse::<usize>().is_ok() { "*" } else { p })
        .collect::<Vec<_>>()
        .join(".")
}

/// `tokens` through `model`, every module captured, as a dump (`prompt` in its metadata): the
/// truth a faulted, sharded or deployed run is compared with.
pub fn capture(
    model: &Glm5,
    tokens: &[u32],
    prompt: Option<&str>,
) -> Result<Activations, ForwardError> {
    let mut cap = crate::model::VecCapture::new();
    model.forward(tokens, &mut cap)?;
    Ok(Activations::from_capture(&cap, prompt, Default::default())?)
}

/// Runs the forward (and the comparison when `reference` is given).
pub fn run(
    model: &Glm5,
    tokenizer: Option<&GgufTokenizer>,
    tokens: &[u32],
    reference: Option<&Activations>,
    spec: &ForwardSpec,
) -> Result<ForwardOutcome, ForwardError> {
    let tol = spec
        .tolerances
        .clone()
        .unwrap_or_else(|| Tolerances::for_profile(spec.dtype, spec.weights));
    let mut metadata = metadata(spec, model.dsa_mode());
    let (logits, capture, replayed) = match reference {
        Some(r) => {
            let mut cap = Aligner::new(r, tol.score_noise);
            let logits = model.forward(tokens, &mut cap)?;
            (logits, cap.inner, cap.replayed)
        }
        None => {
            let mut cap = crate::model::VecCapture::new();
            let logits = model.forward(tokens, &mut cap)?;
            (logits, cap, Vec::new())
        }
    };
    if !replayed.is_empty() {
        metadata.insert(
            meta::ALIGNED.to_string(),
            serde_json::to_string(&replayed).unwrap_or_default(),
        );
    }
    let mut capture = Activations::from_capture(&capture, spec.prompt.as_deref(), metadata)?;
    if let Some(tp) = model.simulated_tp() {
        capture.source = crate::report::notes::simulated_tp_source(tp);
    }

    let row = last_row(&logits)?;
    let top = top_tokens(&softmax(&row), spec.top, tokenizer);
    let entropy = crate::compare::entropy(&row);
    let vocab = row.len();
    let (continuation_ids, stopped) =
        continue_greedy(model, tokenizer, tokens, argmax(&row), spec.max_new_tokens)?;
    let continuation = match tokenizer {
        Some(t) => t.decode(&continuation_ids).ok(),
        None => None,
    };
    let token_texts = tokenizer.map(|t| {
        tokens
            .iter()
            .map(|&id| t.token_text(id).unwrap_or_default())
            .collect()
    });
    let bench = bench(model, tokens, spec.bench, spec.profile)?;
    let forward_seconds = bench.as_ref().map(|b| b.best_ms / 1e3);
    let comparison = match reference {
        Some(r) => Some(compare(
            r,
            &capture,
            &CompareOptions {
                tolerances: tol.clone(),
                index_topk: Some(spec.index_topk),
                // Only a forward with injected behaviour faults can carry their signatures: a
                // clean forward's divergence is in its weights or in the reference.
                facts: model.injected().then(|| model.facts()).transpose()?,
            },
        )?),
        None => None,
    };
    Ok(ForwardOutcome {
        tokens: tokens.to_vec(),
        token_texts,
        dtype: spec.dtype,
        weights: spec.weights,
        matmul: model.options().matmul,
        dsa: dsa_note(model, tokens.len(), spec.max_new_tokens),
        top,
        entropy,
        vocab,
        log_vocab: (vocab as f64).ln(),
        garbage: crate::compare::garbage(entropy, vocab),
        continuation_ids,
        continuation,
        stopped,
        replayed,
        tp: model.simulated_tp(),
        notes: Vec::new(),
        settings: crate::model::knobs::in_effect(crate::model::knobs::env_var)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        forward_seconds,
        bench,
        comparison,
        capture,
    })
}

#[cfg(test)]
mod timeline_tests {
    use super::*;

    fn mark(module: &str, host_ms: f64, gpu_ms: f64) -> TimelineMark {
        TimelineMark {
            module: module.into(),
            host_ms,
            gpu_ms: Some(gpu_ms),
        }
    }

    #[test]
    fn host_paced_marks_are_those_the_gpu_reached_just_behind_the_host() {
        let t = Timeline {
            host_ms: 3.0,
            total_ms: 9.0,
            gpu_events: true,
            marks: vec![
                // The GPU far behind the host: its own pace.
                mark("a", 0.1, 2.0),
                // Reached 20 µs after the host enqueued it (after a synchronization): host-paced.
                mark("b", 2.5, 2.52),
                mark("c", 2.6, 6.0),
                mark("d", 2.9, 8.99),
            ],
        };
        let p = t.host_paced(HOST_PACED_MS);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].module, "b");
        assert!((p[0].stretch_ms - 0.52).abs() < 1e-9);
        assert!((p[0].lead_ms - 0.02).abs() < 1e-9);
        // "b" enqueued by 2.5 ms, the GPU done with "a" at 2.0: at most 0.5 ms idle.
        assert!((p[0].idle_ms - 0.5).abs() < 1e-9);
        // a 0.1 (from the origin) + b 0.5 + c 0.08 (enqueued by 2.6, the GPU done with b at
        // 2.52); d enqueued before the GPU got there; the end (host 3.0) before its last mark.
        let idle = t.idle_bound_ms().unwrap_or(f64::NAN);
        assert!((idle - 0.68).abs() < 1e-9, "{idle}");
        // The JSON carries both readings (what tools/device_variants_summary.py prints).
        let json = serde_json::to_value(&t).expect("json");
        assert_eq!(json["idle_bound_ms"].as_f64(), Some(idle));
        assert_eq!(json["host_paced"][0]["module"], "b");
        assert_eq!(json["host_paced"].as_array().map(Vec::len), Some(1));
        assert_eq!(json["marks"].as_array().map(Vec::len), Some(4));
        // No device clock: nothing to say.
        let mut cpu = t.clone();
        cpu.marks.iter_mut().for_each(|m| m.gpu_ms = None);
        assert!(cpu.host_paced(HOST_PACED_MS).is_empty());
        assert!(cpu.idle_bound_ms().is_none());
        let json = serde_json::to_value(&cpu).expect("json");
        assert!(json["idle_bound_ms"].is_null());
    }

    #[test]
    fn event_times_go_to_their_marks_and_a_count_that_does_not_fit_is_an_error() {
        let marks = |n: usize| -> Vec<TimelineMark> {
            (0..n)
                .map(|i| TimelineMark {
                    module: format!("m{i}"),
                    host_ms: i as f64,
                    gpu_ms: None,
                })
                .collect()
        };
        // origin 0, marks at 1.5 and 2.5, end 4.0
        let t = assemble(marks(2), Some(vec![0.0, 1.5, 2.5, 4.0]), 3.0, 4.2).expect("fits");
        assert!(t.gpu_events);
        assert_eq!(
            t.marks.iter().map(|m| m.gpu_ms).collect::<Vec<_>>(),
            [Some(1.5), Some(2.5)]
        );
        assert_eq!((t.total_ms, t.host_ms), (4.0, 3.0));
        // one time short or long: refused, not shifted
        assert!(assemble(marks(2), Some(vec![0.0, 1.5, 4.0]), 3.0, 4.2).is_err());
        assert!(assemble(marks(2), Some(vec![0.0, 1.0, 1.5, 2.5, 4.0]), 3.0, 4.2).is_err());
        // no device clock: the host's end, no GPU times
        let cpu = assemble(marks(2), None, 3.0, 4.2).expect("cpu");
        assert!(!cpu.gpu_events && cpu.marks.iter().all(|m| m.gpu_ms.is_none()));
        assert_eq!(cpu.total_ms, 4.2);
    }
}
