//! The logits' llama-perplexity statistics (`logits.kld_stats`) end to end: `diff` of two fixture
//! dumps, its JSON checked against the per-position KLs it reports beside them (recomputed here the
//! way llama.cpp's `kl_divergence()` does), and the text block that prints them.

mod common;

use common::{fixture, glmcheck, json_of, path_str, stdout};
use serde_json::Value;

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// llama.cpp's `percentile` lambda, written out again on its own.
fn llama_percentile(sorted: &[f64], q: f64) -> f64 {
    let p = q * (sorted.len() - 1) as f64;
    let i = p.floor() as usize;
    let j = (i + 1).min(sorted.len() - 1);
    sorted[i] + (p - i as f64) * (sorted[j] - sorted[i])
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 + 1e-9 * a.abs().max(b.abs())
}

fn diff_args() -> [String; 2] {
    [
        path_str(&fixture("activations/prompt0.safetensors")).to_string(),
        path_str(&fixture("activations/prompt0-hooks-bf16.safetensors")).to_string(),
    ]
}

#[test]
fn kld_stats_agree_with_the_per_position_kls() {
    let [a, b] = diff_args();
    let out = glmcheck(&["diff", &a, &b, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let j = json_of(&out);
    let l = &j["logits"];
    let k = &l["kld_stats"];
    let n = l["positions"].as_u64().unwrap() as usize;
    assert_eq!(k["positions"].as_u64(), Some(n as u64));
    let mut kl: Vec<f64> = l["kl_by_position"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p[1].as_f64().unwrap())
        .collect();
    assert_eq!(kl.len(), n);
    assert!(n > 10, "the ± needs more than 10 positions: {n}");
    kl.sort_by(f64::total_cmp);
    let mean = kl.iter().sum::<f64>() / n as f64;
    let var = kl.iter().map(|x| x * x).sum::<f64>() / n as f64 - mean * mean;
    assert!(close(f(k, "kl_mean"), mean) && close(f(k, "kl_mean"), f(l, "kl_mean")));
    assert!(close(f(k, "kl_mean_err"), (var / (n - 1) as f64).sqrt()));
    assert!(f(k, "kl_mean_err") > 0.0);
    assert_eq!(f(k, "kl_max"), f(l, "kl_max"));
    assert_eq!((f(k, "kl_max"), f(k, "kl_min")), (kl[n - 1], kl[0]));
    for (key, q) in [
        ("kl_p999", 0.999),
        ("kl_p99", 0.99),
        ("kl_p95", 0.95),
        ("kl_p90", 0.90),
        ("kl_p10", 0.10),
        ("kl_p05", 0.05),
        ("kl_p01", 0.01),
        ("kl_p001", 0.001),
    ] {
        assert!(
            close(f(k, key), llama_percentile(&kl, q)),
            "{key}: {} vs {}",
            f(k, key),
            llama_percentile(&kl, q)
        );
    }
    let median = if n.is_multiple_of(2) {
        0.5 * (kl[n / 2 - 1] + kl[n / 2])
    } else {
        kl[n / 2]
    };
    assert!(close(f(k, "kl_median"), median));
    // Every position agrees on its top token here: p = 1, error 0.
    assert_eq!((f(k, "same_top"), f(k, "same_top_err")), (1.0, 0.0));
    // Δp of the next prompt token: every compared position but the last has one.
    let dp = &k["dp"];
    assert_eq!(dp["positions"].as_u64(), Some(n as u64 - 1));
    let order = [
        "min", "p001", "p01", "p05", "p10", "p25", "median", "p75", "p90", "p95", "p99",
    ];
    for w in order
        .windows(2)
        .chain([["p99", "p999"], ["p999", "max"]].iter().map(|p| &p[..]))
    {
        assert!(f(dp, w[0]) <= f(dp, w[1]), "{} > {}: {dp}", w[0], w[1]);
    }
    assert!(f(dp, "rms") >= f(dp, "mean").abs() && f(dp, "rms_err") > 0.0);
}

#[test]
fn the_text_prints_them_as_llama_perplexity_does() {
    let [a, b] = diff_args();
    let out = glmcheck(&["diff", &a, &b]);
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    let kld = text
        .lines()
        .find(|l| l.starts_with("llama-perplexity KLD over 18 position(s): mean "))
        .unwrap_or_else(|| panic!("no KLD line in:\n{text}"));
    for part in [
        "± ",
        ", max ",
        ", 99.9% ",
        ", 99.0% ",
        ", 95.0% ",
        ", 90.0% ",
        ", median ",
    ] {
        assert!(kld.contains(part), "{part:?} not in {kld}");
    }
    // KLs of 1e-5: printed in scientific notation, not as 0.000013 (four digits kept).
    assert!(kld.contains("mean 1.329e-5 ± "), "{kld}");
    let dp = text
        .lines()
        .find(|l| l.starts_with("Δp of the next prompt token over 17 position(s): RMS "))
        .unwrap_or_else(|| panic!("no Δp line in:\n{text}"));
    assert!(dp.ends_with("Same top p 100.000 ± 0.000 %"), "{dp}");
}
