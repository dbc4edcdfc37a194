//! Entry points for the `cargo fuzz` targets in `fuzz/` and for the corpus replay test
//! (`tests/fuzz_corpus.rs`). Each takes arbitrary bytes, drives one reader as far as the bytes allow,
//! and must never panic, abort, hang or allocate what the input merely claims: every failure is a
//! `Result` that is dropped here. Work is bounded: tensors above [`MAX_DECODE_ELEMENTS`] values are
//! not decoded, and at most [`MAX_TENSORS_DECODED`] tensors are decoded per input.

use std::path::Path;

use crate::arch::config::ConfigReader;
use crate::compare::{compare, Activations, CompareOptions, ComputeDtype, Tolerances, Values};
use crate::dump::RankFile;
use crate::gguf::stats;
use crate::gguf::{GgmlType, GgufFile, GgufModel};
use crate::inspect::InspectReport;
use crate::tokenizer::GgufTokenizer;

/// Largest tensor (in values) the fuzz entry points decode.
pub const MAX_DECODE_ELEMENTS: u64 = 1 << 16;
/// Most tensors decoded per input.
pub const MAX_TENSORS_DECODED: usize = 64;
/// Most safetensors entries read per input.
pub const MAX_DUMP_TENSORS: usize = 256;
/// Largest safetensors tensor (in bytes) copied out per input.
pub const MAX_DUMP_BYTES: usize = 1 << 22;

/// Most values an activation dump may hold for the comparisons to run on it (parsing always runs).
pub const MAX_COMPARE_VALUES: usize = 1 << 16;

/// Texts the tokenizer target encodes: ASCII, digits, contractions, whitespace runs, CJK, emoji,
/// a GLM special token and an invalid-looking mix.
const TEXTS: &[&str] = &[
    "",
    "Hello, world! It's 2026.",
    "  \t\n\r\n  12345678 you'll we'd",
    "[gMASK]<sop><|user|>你好，世界<|assistant|>",
    "🦀 naïve café — ß ﬁ \u{200b}\u{feff}",
];

fn path() -> &'static Path {
    Path::new("<fuzz>")
}

/// Parses a GGUF image, then runs what `inspect` and a scan run on it: the inspect report, the
/// `glm-dsa` config reader, and dequantization plus streaming statistics of every small tensor.
/// Returns whether the bytes parsed as a GGUF (for tests).
pub fn gguf(data: &[u8]) -> bool {
    let Ok(file) = GgufFile::parse_bytes(path(), data.to_vec()) else {
        return false;
    };
    let Ok(model) = GgufModel::from_file(file) else {
        return true;
    };
    let _ = InspectReport::build(&model);
    let _ = ConfigReader::read(&model, "glm-dsa");
    for t in model
        .tensors()
        .filter(|t| t.info.n_elements() <= MAX_DECODE_ELEMENTS)
        .take(MAX_TENSORS_DECODED)
    {
        if let Ok(values) = t.dequantize() {
            // Decoding must give exactly the values the header declares.
            assert_eq!(values.len() as u64, t.info.n_elements(), "{}", t.info.name);
        }
        let _ = stats::stream_stats(t);
        let outer = t.info.ne.last().copied().unwrap_or(1);
        let _ = t.dequantize_outer(0, 1.min(outer));
        let _ = t.dequantize_outer(outer.saturating_sub(1), 1);
    }
    true
}

/// Parses a safetensors rank file from memory with the same validation as a file on disk, then reads
/// every tensor whole, as f32, and its first outer slice. Returns whether the bytes were accepted.
pub fn safetensors_dump(data: &[u8]) -> bool {
    let Ok(f) = RankFile::from_bytes(path(), data.to_vec()) else {
        return false;
    };
    for name in f.names().into_iter().take(MAX_DUMP_TENSORS) {
        let _ = f.shape(&name);
        let Some(t) = f.get(&name) else {
            continue;
        };
        if t.data.len() <= MAX_DUMP_BYTES {
            let _ = t.to_f32();
        }
        if let Some(slice) = f.get_outer(&name, 0) {
            let _ = slice.to_f32();
        }
    }
    true
}

/// Parses a GGUF image and, if it carries a tokenizer, builds it and round-trips a few fixed texts.
/// Returns whether a tokenizer was built.
pub fn tokenizer(data: &[u8]) -> bool {
    let Ok(file) = GgufFile::parse_bytes(path(), data.to_vec()) else {
        return false;
    };
    let Ok(model) = GgufModel::from_file(file) else {
        return false;
    };
    let Ok(tok) = GgufTokenizer::from_gguf(&model) else {
        return false;
    };
    for text in TEXTS {
        if let Ok(ids) = tok.encode(text) {
            let _ = tok.decode(&ids);
            for &id in ids.iter().take(16) {
                let _ = tok.token_text(id);
            }
        }
    }
    let _ = tok.decode(&[0, 1, u32::MAX]);
    let _ = tok.end_ids();
    true
}

/// Parses an activation dump from memory as `diff` and `forward --reference` read one, then (when it
/// is small) compares it with itself and with a perturbed copy (floats scaled and shifted, integers
/// shifted by one, so indexer sets and router choices differ), and renders both reports. Returns
/// whether the bytes were accepted.
pub fn activation_dump(data: &[u8]) -> bool {
    let Ok(a) = Activations::from_bytes(path(), data) else {
        return false;
    };
    let total: usize = a
        .tensors
        .values()
        .map(|t| match &t.values {
            Values::F32(v) => v.len(),
            Values::I64(v) => v.len(),
        })
        .sum();
    if total > MAX_COMPARE_VALUES {
        return true;
    }
    let opts = CompareOptions {
        tolerances: Tolerances::for_profile(ComputeDtype::F32, GgmlType::F32),
        index_topk: Some(2),
        facts: None,
    };
    let _ = compare(&a, &a, &opts);
    let mut b = a.clone();
    b.source = "<fuzz, perturbed>".into();
    for t in b.tensors.values_mut() {
        match &mut t.values {
            Values::F32(v) => v.iter_mut().for_each(|x| *x = *x * 1.5 + 0.25),
            Values::I64(v) => v.iter_mut().for_each(|x| *x = x.wrapping_add(1)),
        }
    }
    if let Ok(c) = compare(&a, &b, &opts) {
        let _ = crate::report::forward::diff_json(&c);
        let _ = crate::report::forward::comparison_text(&c, true);
    }
    true
}

/// Parses bytes as a deployment's config.json the way `--hf-config` reads one, then checks it
/// against GLM-5's config and renders the findings. Returns whether the bytes were accepted.
pub fn hf_config(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(hf) = crate::arch::hf_config::HfConfig::parse(path(), text) else {
        return false;
    };
    let cfg = crate::arch::Config::glm5();
    let check = crate::arch::hf_config::check(&hf, &cfg, &[]);
    let _ = check.fails();
    let _ = crate::report::hf_config::hf_config_text(&check);
    let _ = crate::report::hf_config::hf_config_json(&check);
    true
}

/// Parses bytes as the two TOML inputs, bisect's PATCHES.toml (at tp 8 on GLM-5's 78 layers) and
/// gate.toml. Returns whether either was accepted.
pub fn toml_inputs(data: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let patches = crate::bisect::parse_patches(text, 8, 78).is_ok();
    let gate = crate::gate::parse_config(text).is_ok();
    patches || gate
}
