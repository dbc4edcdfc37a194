//! Tensor parallel in one process: the points where vLLM's ranks meet (all-reduce after the
//! row-parallel layers, the vocab-parallel embedding's masked lookups, the lm_head's gather), and
//! how the ranks' captures are merged into what the unsharded model would capture — column-parallel
//! outputs concatenated, row-parallel and MoE outputs summed, replicated outputs from rank 0 — so
//! that a simulated-TP run compares key by key with a transformers dump or the unsharded forward.
//!
//! With one rank every function here is the plain computation and the capture sees the module
//! outputs directly.

use std::collections::HashMap;

use candle_core::{Result, Tensor};

use super::capture::{emit, Capture, VecCapture};
use super::linear::{Linear, Weight};
use super::names::{conv, LayerPaths, MlpKind, SwiGluPaths};

/// Runs `f` for each of `n` ranks (with the capture each should emit into) and sums the ranks'
/// tensors: vLLM's all-reduce. Returns the sum and rank 0's extra value. Every rank's emits are
/// merged into `capture` as the unsharded module would emit them; the DSA indexer's top-k, which a
/// capture may replace (a reference replay), is decided on rank 0 and applied on every rank — the
/// indexer is replicated.
pub(crate) fn all_reduce<T>(
    n: usize,
    lp: &LayerPaths,
    capture: &mut dyn Capture,
    mut f: impl FnMut(usize, &mut dyn Capture) -> Result<(Tensor, T)>,
) -> Result<(Tensor, T)> {
    if n == 1 {
        return f(0, capture);
    }
    let mut caps: Vec<RankCapture> = (0..n).map(|_| RankCapture::default()).collect();
    let mut sum: Option<(Tensor, T)> = None;
    for r in 0..n {
        if r > 0 {
            caps[r].decided = caps[0].decided.clone();
        }
        let cap = &mut caps[r];
        cap.outer_replace = r == 0;
        let mut bridge = Bridge {
            rank: cap,
            outer: &mut *capture,
        };
        let (t, extra) = f(r, &mut bridge)?;
        sum = Some(match sum {
            None => (t, extra),
            Some((s, first)) => ((s + t)?, first),
        });
    }
    merge(&caps, lp, capture)?;
    sum.ok_or_else(|| candle_core::Error::Msg("tensor parallel with no ranks".into()))
}

/// The vocab-parallel embedding: rank r holds rows `[r·per_rank, (r+1)·per_rank)` of the padded
/// table; each looks up the ids in its rows, zero elsewhere, and the lookups are summed.
/// `ids` `[T]` U32 → `[T, hidden]`.
pub(crate) fn embed(
    shards: &[&Weight],
    per_rank: usize,
    tokens: &[u32],
    ids: &Tensor,
) -> Result<Tensor> {
    if let [only] = shards {
        return only.rows(ids);
    }
    let dev = ids.device();
    let t = tokens.len();
    let mut x: Option<Tensor> = None;
    for (r, shard) in shards.iter().enumerate() {
        let lo = r * per_rank;
        let rows = shard.dim(0)?;
        let local_row = |id: u32| (id as usize).checked_sub(lo).filter(|&i| i < rows);
        let local: Vec<u32> = tokens
            .iter()
            .map(|&id| local_row(id).unwrap_or(0) as u32)
            .collect();
        let mask: Vec<f32> = tokens
            .iter()
            .map(|&id| if local_row(id).is_some() { 1.0 } else { 0.0 })
            .collect();
        let local = Tensor::new(local.as_slice(), dev)?;
        let mask = Tensor::from_vec(mask, (t, 1), dev)?.to_dtype(shard.dtype())?;
        let e = shard.rows(&local)?.broadcast_mul(&mask)?;
        x = Some(match x {
            None => e,
            Some(s) => (s + e)?,
        });
    }
    x.ok_or_else(|| candle_core::Error::Msg("an embedding with no ranks".into()))
}

/// The parallel lm_head: each rank its vocab rows, gathered, the padding dropped.
/// `[T, hidden]` → `[T, vocab]`.
pub(crate) fn lm_head(shards: &[&Linear], h: &Tensor, vocab: usize) -> Result<Tensor> {
    let parts = shards
        .iter()
        .map(|w| w.forward(h))
        .collect::<Result<Vec<_>>>()?;
    let logits = match parts.as_slice() {
        [only] => only.clone(),
        _ => Tensor::cat(&parts, 1)?,
    };
    if logits.dim(1)? == vocab {
        return Ok(logits);
    }
    logits.narrow(1, 0, vocab)
}

/// One rank's captures of one layer half, and the top-k replacement decided for all ranks.
#[derive(Default)]
struct RankCapture {
    entries: VecCapture,
    decided: HashMap<String, Option<Tensor>>,
    outer_replace: bool,
}

impl Capture for RankCapture {
    fn capture(&mut self, path: &str, tensor: &Tensor) -> Result<()> {
        self.entries.capture(path, tensor)
    }
}

/// Rank 0 asks the outer capture whether to replace the indexer's top-k and every other rank
/// applies the same decision.
struct Bridge<'a> {
    rank: &'a mut RankCapture,
    outer: &'a mut dyn Capture,
}

impl Capture for Bridge<'_> {
    /// What the outer sink wants, every rank alike (so their captures stay in step for
    /// [`merge`]): a rank emits nothing the merge would not hand on, and where nothing reads a
    /// layer's indexer and every key is selected it is skipped on every rank, as unsharded.
    fn wants(&self, path: &str) -> bool {
        self.outer.wants(path)
    }

    fn times_modules(&self) -> bool {
        self.outer.times_modules()
    }

    fn capture(&mut self, path: &str, tensor: &Tensor) -> Result<()> {
        self.rank.capture(path, tensor)
    }

    fn replace(&mut self, path: &str, ours: &Tensor) -> Result<Option<Tensor>> {
        if self.rank.outer_replace {
            let d = self.outer.replace(path, ours)?;
            self.rank.decided.insert(path.to_string(), d.clone());
            Ok(d)
        } else {
            Ok(self.rank.decided.get(path).cloned().flatten())
        }
    }
}

/// How the ranks' pieces of one capture make the unsharded module's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Merge {
    /// Every rank computes the same thing (rank 0's is taken).
    Replicated,
    /// Row-parallel partial sums.
    Sum,
    /// Column-parallel outputs: the ranks' pieces concatenated along this dim.
    Cat(usize),
}

pub(crate) fn merge_op(key: &str, lp: &LayerPaths) -> Merge {
    let a = &lp.attn;
    let s = |x: &str| format!("{}.{x}", a.module);
    if key == a.o || key == a.module || key == lp.mlp.module {
        return Merge::Sum;
    }
    if key == a.q_b {
        return Merge::Cat(1);
    }
    if key == a.kv_b {
        return Merge::Cat(2);
    }
    if [
        s(conv::QUERY_STATES),
        s(conv::KEY_STATES),
        s(conv::VALUE_STATES),
        s("1"),
    ]
    .iter()
    .any(|k| k == key)
    {
        return Merge::Cat(0);
    }
    let swiglu = |p: &SwiGluPaths| {
        if key == p.down || key == p.module {
            Some(Merge::Sum)
        } else if key == p.gate || key == p.up || key == p.act {
            Some(Merge::Cat(1))
        } else {
            None
        }
    };
    match &lp.mlp.kind {
        MlpKind::Dense(p) => swiglu(p).unwrap_or(Merge::Replicated),
        MlpKind::Moe {
            experts, shared, ..
        } => {
            if key == experts {
                Merge::Sum
            } else if key.starts_with(&format!("{experts}.{}", conv::ACT)) {
                Merge::Cat(1)
            } else {
                swiglu(shared).unwrap_or(Merge::Replicated)
            }
        }
    }
}

/// Sends the ranks' captures to `out` as the unsharded model would have them, in rank 0's order.
fn merge(caps: &[RankCapture], lp: &LayerPaths, out: &mut dyn Capture) -> Result<()> {
    let Some(first) = caps.first() else {
        return Ok(());
    };
    for (i, (key, t0)) in first.entries.entries.iter().enumerate() {
        let parts: Vec<&Tensor> = caps
            .iter()
            .filter_map(|c| c.entries.entries.get(i).map(|(_, t)| t))
            .collect();
        let merged = match merge_op(key, lp) {
            Merge::Replicated => t0.clone(),
            Merge::Sum => {
                let mut s = t0.clone();
                for p in &parts[1..] {
                    s = (s + *p)?;
                }
                s
            }
            Merge::Cat(d) => Tensor::cat(&parts, d)?,
        };
        emit(out, key, &merged)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn paths(l: usize, moe: bool) -> LayerPaths {
        LayerPaths::new(l, moe).expect("paths")
    }

    #[test]
    fn merge_ops_follow_vllms_parallel_styles() {
        let lp = paths(3, true);
        let k = |s: &str| format!("model.layers.3.{s}");
        assert_eq!(merge_op(&k("self_attn.o_proj"), &lp), Merge::Sum);
        assert_eq!(merge_op(&k("self_attn"), &lp), Merge::Sum);
        assert_eq!(merge_op(&k("self_attn.q_b_proj"), &lp), Merge::Cat(1));
        assert_eq!(merge_op(&k("self_attn.kv_b_proj"), &lp), Merge::Cat(2));
        assert_eq!(merge_op(&k("self_attn.q_a_proj"), &lp), Merge::Replicated);
        assert_eq!(merge_op(&k("self_attn.indexer"), &lp), Merge::Replicated);
        assert_eq!(merge_op(&k("mlp"), &lp), Merge::Sum);
        assert_eq!(merge_op(&k("mlp.experts"), &lp), Merge::Sum);
        assert_eq!(merge_op(&k("mlp.experts.act_fn#2"), &lp), Merge::Cat(1));
        assert_eq!(merge_op(&k("mlp.gate"), &lp), Merge::Replicated);
        assert_eq!(
            merge_op(&k("mlp.shared_experts.up_proj"), &lp),
            Merge::Cat(1)
        );
        assert_eq!(
            merge_op(&k("mlp.shared_experts.down_proj"), &lp),
            Merge::Sum
        );
        let dense = paths(0, false);
        assert_eq!(
            merge_op("model.layers.0.mlp.gate_proj", &dense),
            Merge::Cat(1)
        );
        assert_eq!(merge_op("model.layers.0.mlp.down_proj", &dense), Merge::Sum);
    }

    #[test]
    fn vocab_parallel_embedding_equals_the_whole_table() -> Result<()> {
        let dev = Device::Cpu;
        // 5 real rows padded to 8, two ranks of 4.
        let table = Tensor::arange(0f32, 15., &dev)?.reshape((5, 3))?;
        let padded = Tensor::cat(&[&table, &Tensor::zeros((3, 3), DType::F32, &dev)?], 0)?;
        let (a, b) = (padded.narrow(0, 0, 4)?, padded.narrow(0, 4, 4)?);
        let tokens = [4u32, 0, 3, 4];
        let ids = Tensor::new(&tokens[..], &dev)?;
        let (table, a, b) = (Weight::Dense(table), Weight::Dense(a), Weight::Dense(b));
        let whole = embed(&[&table], 5, &tokens, &ids)?.to_vec2::<f32>()?;
        let split = embed(&[&a, &b], 4, &tokens, &ids)?.to_vec2::<f32>()?;
        assert_eq!(whole, split);
        assert_eq!(split[0], vec![12., 13., 14.]);
        Ok(())
    }

    #[test]
    fn the_lm_head_gather_drops_the_padding() -> Result<()> {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 8., &dev)?.reshape((4, 2))?; // vocab 3 + 1 pad row
        let h = Tensor::new(&[[1f32, 1.]], &dev)?;
        let (a, b) = (
            Linear::new(w.narrow(0, 0, 2)?),
            Linear::new(w.narrow(0, 2, 2)?),
        );
        let out = lm_head(&[&a, &b], &h, 3)?.to_vec2::<f32>()?;
        assert_eq!(out, vec![vec![1., 5., 9.]]);
        Ok(())
    }
}
