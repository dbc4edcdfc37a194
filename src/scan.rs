//! Dequantize tensors one by one (memory bounded by the largest) and measure them: value statistics
//! and decode throughput. `glmcheck dequant` and the dequantization benchmark stand on this.

use std::time::Instant;

use serde::Serialize;

use crate::gguf::{GgmlType, GgufModel, TensorRef};

/// Statistics of one dequantized tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorStats {
    pub name: String,
    pub dtype: GgmlType,
    pub shape: Vec<usize>,
    pub bytes: u64,
    pub elements: u64,
    pub absmax: f64,
    pub mean: f64,
    pub std: f64,
    pub nan: u64,
    pub inf: u64,
    /// Best of `repeat` decode times, seconds (decode only: no I/O beyond the page cache).
    pub seconds: f64,
    /// f32 output bytes per second of the best run.
    pub out_gbps: f64,
    /// Set when the tensor could not be decoded; statistics are then zero.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Streaming value statistics over finite values; NaN and Inf are counted, not summed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub absmax: f64,
    sum: f64,
    sumsq: f64,
    n: u64,
    pub nan: u64,
    pub inf: u64,
}

impl Stats {
    pub fn add(&mut self, values: &[f32]) {
        // Per-chunk partial sums (the max in f32) keep the inner loop tight.
        for chunk in values.chunks(4096) {
            let (mut s, mut ss, mut m, mut finite) = (0f64, 0f64, 0f32, 0u64);
            for &v in chunk {
                if v.is_finite() {
                    s += v as f64;
                    ss += (v as f64) * (v as f64);
                    m = m.max(v.abs());
                    finite += 1;
                } else if v.is_nan() {
                    self.nan += 1;
                } else {
                    self.inf += 1;
                }
            }
            self.sum += s;
            self.sumsq += ss;
            self.absmax = self.absmax.max(m as f64);
            self.n += finite;
        }
    }

    pub fn mean(&self) -> f64 {
        if self.n > 0 {
            self.sum / self.n as f64
        } else {
            0.0
        }
    }

    pub fn std(&self) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let m = self.mean();
        (self.sumsq / self.n as f64 - m * m).max(0.0).sqrt()
    }
}

/// (absmax, mean, std, NaN count, Inf count) of `values`.
pub fn stats_of(values: &[f32]) -> (f64, f64, f64, u64, u64) {
    let mut s = Stats::default();
    s.add(values);
    (s.absmax, s.mean(), s.std(), s.nan, s.inf)
}

/// Decodes one tensor `repeat` times (at least once) into `buf` (grown as needed and reused across
/// tensors, so memory stays bounded by the largest) and reports its statistics and best time.
pub fn scan_tensor(t: TensorRef<'_>, repeat: usize, buf: &mut Vec<f32>) -> TensorStats {
    let i = t.info;
    let n = i.n_elements() as usize;
    if buf.len() < n {
        buf.resize(n, 0.0);
    }
    let out = &mut buf[..n];
    let mut best = f64::INFINITY;
    let mut result = None;
    for _ in 0..repeat.max(1) {
        let start = Instant::now();
        let r = t.dequantize_into(out);
        let secs = start.elapsed().as_secs_f64();
        best = best.min(secs);
        result = Some(r.map(|()| &*out));
    }
    let base = TensorStats {
        name: i.name.clone(),
        dtype: i.dtype,
        shape: i.torch_shape(),
        bytes: i.n_bytes,
        elements: i.n_elements(),
        absmax: 0.0,
        mean: 0.0,
        std: 0.0,
        nan: 0,
        inf: 0,
        seconds: 0.0,
        out_gbps: 0.0,
        error: None,
    };
    match result {
        Some(Ok(v)) => {
            let (absmax, mean, std, nan, inf) = stats_of(v);
            TensorStats {
                absmax,
                mean,
                std,
                nan,
                inf,
                seconds: best,
                out_gbps: (n * 4) as f64 / best.max(1e-12) / 1e9,
                ..base
            }
        }
        Some(Err(e)) => TensorStats {
            error: Some(e.to_string()),
            ..base
        },
        None => base,
    }
}

/// The tensors of `model` whose names match any of `globs` (all when empty), in file order.
pub fn select<'a>(model: &'a GgufModel, globs: &[String]) -> Vec<TensorRef<'a>> {
    model
        .tensors()
        .filter(|t| globs.is_empty() || globs.iter().any(|g| glob_match(g, &t.info.name)))
        .collect()
}

/// Shell-style `*` / `?` matching over the whole name.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let (mut star, mut mark) = (None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(
            "blk.*.attn_k_b.weight",
            "blk.12.attn_k_b.weight"
        ));
        assert!(glob_match("*", "anything"));
        assert!(glob_match("blk.?.ffn*", "blk.1.ffn_up_exps.weight"));
        assert!(!glob_match("blk.?.ffn*", "blk.10.ffn_up_exps.weight"));
        assert!(!glob_match("output", "output.weight"));
    }

    #[test]
    fn stats_skip_non_finite_and_count_them() {
        let (absmax, mean, std, nan, inf) = stats_of(&[1.0, -3.0, f32::NAN, f32::INFINITY]);
        assert_eq!((absmax, mean, std, nan, inf), (3.0, -1.0, 2.0, 1, 1));
    }
}
