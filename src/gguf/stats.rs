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
        for chunk in values.chunks(4096) {
            let k = kernel(chunk);
            if k.bad > 0 {
                let nan = chunk.iter().filter(|v| v.is_nan()).count() as u64;
                self.nan += nan;
                self.inf += k.bad as u64 - nan;
            }
            self.sum += k.sum;
            self.sumsq += k.sumsq;
            self.absmax = self.absmax.max(f32::from_bits(k.absmax_bits) as f64);
            self.n += chunk.len() as u64 - k.bad as u64;
        }
    }

    pub fn merge(&mut self, o: &Stats) {
        self.absmax = self.absmax.max(o.absmax);
        self.sum += o.sum;
        self.sumsq += o.sumsq;
        self.n += o.n;
        self.nan += o.nan;
        self.inf += o.inf;
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

/// One chunk's partial statistics.
struct Partial {
    sum: f64,
    sumsq: f64,
    absmax_bits: u32,
    bad: u32,
}

/// Sums over ≤ 4096 values in 16 f32 lanes, branch-free (non-finite values masked to zero, counted),
/// so the compiler vectorises it; the lanes carry ~1e-6 relative error, ample for statistics.
/// |v|'s bit pattern orders like |v| for finite values, so the max runs on integers.
#[inline(always)]
fn kernel_body(chunk: &[f32]) -> Partial {
    const L: usize = 16;
    let (mut s, mut ss, mut m, mut bad) = ([0f32; L], [0f32; L], [0u32; L], [0u32; L]);
    let (rows, tail) = chunk.as_chunks::<L>();
    let mut lane = |j: usize, v: f32| {
        let bits = v.to_bits();
        let a = bits & 0x7fff_ffff;
        let finite = a < 0x7f80_0000;
        let mask = 0u32.wrapping_sub(u32::from(finite));
        let x = f32::from_bits(bits & mask);
        s[j] += x;
        ss[j] += x * x;
        m[j] = m[j].max(a & mask);
        bad[j] += u32::from(!finite);
    };
    for row in rows {
        for (j, &v) in row.iter().enumerate() {
            lane(j, v);
        }
    }
    for (j, &v) in tail.iter().enumerate() {
        lane(j, v);
    }
    Partial {
        sum: s.iter().map(|&x| x as f64).sum(),
        sumsq: ss.iter().map(|&x| x as f64).sum(),
        absmax_bits: m.iter().copied().max().unwrap_or(0),
        bad: bad.iter().sum(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn kernel_avx2(chunk: &[f32]) -> Partial {
    kernel_body(chunk)
}

fn kernel(chunk: &[f32]) -> Partial {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { kernel_avx2(chunk) };
        }
    }
    kernel_body(chunk)
}

/// Statistics of a whole tensor, decoded in cache-sized chunks on all cores (no full f32 copy).
pub fn stream_stats(t: TensorRef<'_>) -> Result<Stats, crate::gguf::DequantError> {
    let parts = t.fold_chunks(Stats::default, |s, v| s.add(v))?;
    let mut total = Stats::default();
    for p in &parts {
        total.merge(p);
    }
    Ok(total)
}

/// (absmax, mean, std, NaN count, Inf count) of `values`.
pub fn stats_of(values: &[f32]) -> (f64, f64, f64, u64, u64) {
    let mut s = Stats::default();
    s.add(values);
    (s.absmax, s.mean(), s.std(), s.nan, s.inf)
}

/// Decodes one tensor `repeat` times (at least once) and reports its statistics and best decode
/// time. `stream`: straight into the statistics in cache-sized chunks, never holding the f32 tensor
/// (the way `shards --verify` scans expert stacks); otherwise into `buf` (grown as needed and reused
/// across tensors, so memory stays bounded by the largest), statistics computed after the timing.
pub fn scan_tensor(
    t: TensorRef<'_>,
    repeat: usize,
    stream: bool,
    buf: &mut Vec<f32>,
) -> TensorStats {
    let i = t.info;
    let n = i.n_elements() as usize;
    let mut best = f64::INFINITY;
    let mut result: Option<Result<Stats, crate::gguf::DequantError>> = None;
    for _ in 0..repeat.max(1) {
        let start = Instant::now();
        let r = if stream {
            stream_stats(t)
        } else {
            if buf.len() < n {
                buf.resize(n, 0.0);
            }
            t.dequantize_into(&mut buf[..n]).map(|()| Stats::default())
        };
        best = best.min(start.elapsed().as_secs_f64());
        result = Some(r);
    }
    let mut row = TensorStats {
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
        seconds: best,
        out_gbps: (n * 4) as f64 / best.max(1e-12) / 1e9,
        error: None,
    };
    match result {
        Some(Ok(mut s)) => {
            if !stream {
                s.add(&buf[..n]);
            }
            row.absmax = s.absmax;
            row.mean = s.mean();
            row.std = s.std();
            row.nan = s.nan;
            row.inf = s.inf;
        }
        Some(Err(e)) => {
            row.error = Some(e.to_string());
            row.seconds = 0.0;
            row.out_gbps = 0.0;
        }
        None => {}
    }
    row
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
