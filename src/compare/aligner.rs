//! Replaying the reference's top-k at ties during glmcheck's own forward.

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use super::driver::get_f32;
use super::io::Activations;
use super::metrics::common_shape;
use super::topk::{classify_topk_row, TieClass};
use crate::model::names::conv;
use crate::model::{Capture, VecCapture};

// Replaying the reference's top-k at ties

/// A capture that keeps everything and, at each indexer, replays the reference's top-k on rows
/// where ours differs only by an exact tie or a near-tie (so later modules compare on the whole
/// prompt). Rows that differ for real are left alone.
pub struct Aligner<'r> {
    pub inner: VecCapture,
    reference: &'r Activations,
    score_noise: f64,
    /// Our index scores by indexer path (captured just before its top-k).
    scores: HashMap<String, Vec<f32>>,
    /// `"<indexer path>:<position>"` of every replayed row.
    pub replayed: Vec<String>,
}

impl<'r> Aligner<'r> {
    pub fn new(reference: &'r Activations, score_noise: f64) -> Self {
        Aligner {
            inner: VecCapture::new(),
            reference,
            score_noise,
            scores: HashMap::new(),
            replayed: Vec::new(),
        }
    }
}

impl Capture for Aligner<'_> {
    fn capture(&mut self, path: &str, tensor: &Tensor) -> candle_core::Result<()> {
        if let Some(indexer) = path.strip_suffix(&format!(".{}", conv::IDX_SCORES)) {
            self.scores.insert(
                indexer.to_string(),
                tensor
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        self.inner.capture(path, tensor)
    }

    fn replace(&mut self, path: &str, ours: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let our_scores = self.scores.remove(path);
        let Some(theirs) = self.reference.tensors.get(path) else {
            return Ok(None);
        };
        let (t, k) = ours.dims2()?;
        // A reference that kept the batch dim ([1, T, k]) holds the same rows.
        if common_shape(&theirs.shape, &[t, k]).as_deref() != Some(&[t, k][..]) {
            return Ok(None);
        }
        let Some(their_rows) = theirs.rows_i64() else {
            return Ok(None);
        };
        let Some(ref_scores) = get_f32(self.reference, &format!("{path}.{}", conv::IDX_SCORES))
            .filter(|s| s.len() == t * t)
        else {
            return Ok(None);
        };
        let ours_flat: Vec<i64> = ours.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?;
        let mut out: Vec<u32> = ours_flat.iter().map(|&x| x as u32).collect();
        let mut changed = false;
        for i in 0..t {
            let row = |s: &[f32]| s[i * t..(i + 1) * t].to_vec();
            let cand_row = our_scores.as_deref().filter(|s| s.len() == t * t).map(row);
            let Some(d) = classify_topk_row(
                i,
                k,
                their_rows[i],
                &ours_flat[i * k..(i + 1) * k],
                Some(&row(ref_scores)),
                cand_row.as_deref(),
                self.score_noise,
            ) else {
                continue;
            };
            if matches!(d.class, TieClass::ExactTie | TieClass::NearTie)
                && their_rows[i].iter().all(|&j| j >= 0 && (j as usize) < t)
            {
                for (o, &j) in out[i * k..(i + 1) * k].iter_mut().zip(their_rows[i]) {
                    *o = j as u32;
                }
                self.replayed.push(format!("{path}:{i}"));
                changed = true;
            }
        }
        if !changed {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec(out, (t, k), ours.device())?))
    }
}
