//! Every tensor of every fixture dequantizes to exactly what gguf-py's `gguf.quants.dequantize`
//! produced when the fixtures were made (sha256 of the f32 bytes, plus sampled values and sums so a
//! mismatch says where).

mod common;
use common::*;
use glmcheck::gguf::GgufModel;

#[test]
fn dequantization_matches_gguf_py_bit_for_bit() {
    for stem in FIXTURE_GGUFS {
        let model = GgufModel::open(&gguf(stem)).expect("open fixture");
        let want = json(&format!("dequant/{stem}.json"));
        let want = want.as_object().expect("object");
        assert_eq!(want.len(), model.tensor_count(), "{stem}: tensor count");
        for t in model.tensors() {
            let name = &t.info.name;
            let w = &want[name.as_str()];
            assert_eq!(w["type"], t.info.dtype.name, "{stem} {name}: type");
            let ne: Vec<u64> = w["ne"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            assert_eq!(ne, t.info.ne, "{stem} {name}: ne");
            let v = t
                .dequantize()
                .unwrap_or_else(|e| panic!("{stem} {name}: {e}"));
            let idx = w["sample_index"].as_array().unwrap();
            let sample = w["sample"].as_array().unwrap();
            for (i, s) in idx.iter().zip(sample) {
                let i = i.as_u64().unwrap() as usize;
                let s = s.as_f64().unwrap() as f32;
                assert!(
                    v[i] == s || (v[i].is_nan() && s.is_nan()),
                    "{stem} {name} ({}): element {i} is {}, gguf-py gives {s}",
                    t.info.dtype,
                    v[i]
                );
            }
            let sum: f64 = v.iter().map(|&x| x as f64).sum();
            let ws = w["sum"].as_f64().unwrap();
            assert!(
                (sum - ws).abs() <= 1e-9 * ws.abs().max(1.0) * v.len() as f64,
                "{stem} {name}: sum {sum} vs {ws}"
            );
            assert_eq!(
                sha256_f32(&v),
                w["sha256"].as_str().unwrap(),
                "{stem} {name} ({}): sha256",
                t.info.dtype
            );
        }
    }
}

#[test]
fn the_k_quant_fixture_really_holds_k_quants() {
    let model = GgufModel::open(&gguf("tiny-Q4_K_M")).expect("open");
    let types: std::collections::BTreeSet<&str> =
        model.tensors().map(|t| t.info.dtype.name).collect();
    for needed in ["Q4_K", "Q6_K"] {
        assert!(
            types.contains(needed),
            "Q4_K_M fixture has no {needed}: {types:?}"
        );
    }
}

#[test]
fn streaming_statistics_equal_those_of_the_full_tensor() {
    use glmcheck::gguf::stats::{stats_of, stream_stats};
    let model = GgufModel::open(&gguf("tiny-Q4_K_M")).expect("open");
    for t in model.tensors() {
        let full = t.dequantize().unwrap();
        let (absmax, mean, std, nan, inf) = stats_of(&full);
        let s = stream_stats(t).unwrap();
        assert_eq!(
            (s.absmax, s.nan, s.inf),
            (absmax, nan, inf),
            "{}",
            t.info.name
        );
        // Chunk boundaries differ between the two paths; sums are f32 lanes per 4096 values.
        assert!(
            (s.mean() - mean).abs() <= 1e-6 * std.max(1e-30) + 1e-12,
            "{}",
            t.info.name
        );
        assert!((s.std() - std).abs() <= 1e-5 * std, "{}", t.info.name);
    }
}
