//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) and fixed crashers
//! (`fuzz/regressions/<target>/`) through `glmcheck::fuzzing` under plain `cargo test`: no libFuzzer,
//! no nightly. A panic in any entry point fails the test and names the file.
//!
//! `cargo test --test fuzz_corpus -- --ignored write_seeds` regenerates the hand-made seeds
//! (`seed-*` files) the corpus was grown from.

use std::collections::BTreeMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use glmcheck::gguf::writer::{string_array, write_gguf, WriteTensor};
use glmcheck::gguf::{GgmlType, GgufFile, Value};

/// A `glmcheck::fuzzing` entry point: bytes in, accepted or not.
type Entry = fn(&[u8]) -> bool;

const TARGETS: &[(&str, Entry)] = &[
    ("gguf_reader", glmcheck::fuzzing::gguf),
    ("safetensors_dump", glmcheck::fuzzing::safetensors_dump),
    ("tokenizer", glmcheck::fuzzing::tokenizer),
    ("activation_dump", glmcheck::fuzzing::activation_dump),
    ("hf_config", glmcheck::fuzzing::hf_config),
    ("toml_inputs", glmcheck::fuzzing::toml_inputs),
];

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

/// Runs `f` on every file in `dir`; returns (files, accepted). A panic is reported with the file.
fn replay(dir: &Path, f: Entry) -> (usize, usize) {
    let mut accepted = 0;
    let list = files(dir);
    for p in &list {
        let data = std::fs::read(p).unwrap();
        let ok = std::panic::catch_unwind(|| f(&data))
            .unwrap_or_else(|_| panic!("{} panicked on {}", dir.display(), p.display()));
        accepted += ok as usize;
    }
    (list.len(), accepted)
}

#[test]
fn corpus_replays_without_panics() {
    for (target, f) in TARGETS {
        let (n, accepted) = replay(&fuzz_dir().join("corpus").join(target), *f);
        assert!(n > 0, "fuzz/corpus/{target} is empty or missing");
        // The corpus must still reach past the parser: some inputs are accepted (for the tokenizer:
        // a tokenizer is built), some are rejected.
        assert!(accepted > 0, "no input in fuzz/corpus/{target} is accepted");
        assert!(
            accepted < n,
            "every input in fuzz/corpus/{target} is accepted"
        );
        eprintln!("{target}: {n} inputs, {accepted} accepted");
        let (m, _) = replay(&fuzz_dir().join("regressions").join(target), *f);
        eprintln!("{target}: {m} regression inputs");
    }
}

#[test]
fn known_bad_inputs_are_rejected() {
    // Not GGUF, a GGUF header claiming 2^63 tensors, truncated after the magic.
    let mut lying = b"GGUF".to_vec();
    lying.extend(3u32.to_le_bytes());
    lying.extend((1u64 << 63).to_le_bytes());
    lying.extend(0u64.to_le_bytes());
    for bad in [&b"not a gguf"[..], &lying, b"GGUF"] {
        assert!(!glmcheck::fuzzing::gguf(bad));
        assert!(!glmcheck::fuzzing::tokenizer(bad));
    }
    // A safetensors header of 2^60 bytes, and one whose JSON lies about offsets.
    let mut st = (1u64 << 60).to_le_bytes().to_vec();
    st.extend(b"{}");
    assert!(!glmcheck::fuzzing::safetensors_dump(&st));
    let json = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut st = (json.len() as u64).to_le_bytes().to_vec();
    st.extend(json);
    st.extend([0u8; 8]);
    assert!(!glmcheck::fuzzing::safetensors_dump(&st));
    // And the good seeds are accepted, so the checks above mean something.
    assert!(glmcheck::fuzzing::gguf(&small_gguf()));
    assert!(glmcheck::fuzzing::tokenizer(&tokenizer_gguf()));
    assert!(glmcheck::fuzzing::safetensors_dump(
        &safetensors_seeds()[0].1
    ));
}

/// Deterministic filler bytes.
fn bytes(n: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

fn write(meta: &[(String, Value)], tensors: &[WriteTensor<'_>]) -> Vec<u8> {
    let mut c = Cursor::new(Vec::new());
    write_gguf(&mut c, meta, tensors, 32).unwrap();
    c.into_inner()
}

fn kv(k: &str, v: Value) -> (String, Value) {
    (k.to_string(), v)
}

/// A tiny glm-dsa header with F32, F16, Q8_0 and Q4_K tensors.
fn small_gguf() -> Vec<u8> {
    let f32s: Vec<u8> = (0..64u32)
        .flat_map(|i| (i as f32 - 32.0).to_le_bytes())
        .collect();
    let f16s: Vec<u8> = (0..32u32)
        .flat_map(|i| half::f16::from_f32(i as f32 / 8.0).to_le_bytes())
        .collect();
    let mut q8 = bytes(34 * 4, 1);
    for b in q8.chunks_mut(34) {
        b[..2].copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
    }
    let mut q4 = bytes(144 * 2, 2);
    for b in q4.chunks_mut(144) {
        b[..2].copy_from_slice(&half::f16::from_f32(0.02).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(0.001).to_le_bytes());
    }
    let meta = vec![
        kv("general.architecture", Value::String("glm-dsa".into())),
        kv("general.alignment", Value::U32(32)),
        kv("glm-dsa.block_count", Value::U32(1)),
        kv("glm-dsa.embedding_length", Value::U32(64)),
        kv("glm-dsa.attention.head_count", Value::U32(2)),
        kv("glm-dsa.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        kv("glm-dsa.rope.freq_base", Value::F32(1e6)),
        kv("glm-dsa.expert_count", Value::U32(4)),
        kv("glm-dsa.expert_used_count", Value::U32(2)),
    ];
    let tensors = vec![
        WriteTensor {
            name: "blk.0.attn_norm.weight".into(),
            ne: vec![64],
            dtype: GgmlType::F32,
            data: Some(&f32s),
        },
        WriteTensor {
            name: "blk.0.ffn_norm.weight".into(),
            ne: vec![16, 2],
            dtype: GgmlType::F16,
            data: Some(&f16s),
        },
        WriteTensor {
            name: "blk.0.attn_q_a.weight".into(),
            ne: vec![64, 2],
            dtype: GgmlType::Q8_0,
            data: Some(&q8),
        },
        WriteTensor {
            name: "token_embd.weight".into(),
            ne: vec![256, 2],
            dtype: GgmlType::Q4_K,
            data: Some(&q4),
        },
    ];
    write(&meta, &tensors)
}

/// The fixture's tokenizer metadata cut down to its first 300 tokens (the 256 byte tokens and the
/// first merges' results), the merges among them, and its special tokens, plus one small tensor.
fn tokenizer_gguf() -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-Q8_0.gguf");
    let src = GgufFile::open(&path).unwrap();
    let strs = |key: &str| -> Vec<String> {
        match src.value(key) {
            Some(Value::Array(_, items)) => items
                .iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect(),
            _ => Vec::new(),
        }
    };
    let tokens = strs("tokenizer.ggml.tokens");
    let merges = strs("tokenizer.ggml.merges");
    let types: Vec<i64> = match src.value("tokenizer.ggml.token_type") {
        Some(Value::Array(_, items)) => items
            .iter()
            .map(|v| match v {
                Value::I32(x) => *x as i64,
                _ => 1,
            })
            .collect(),
        _ => vec![1; tokens.len()],
    };
    assert!(!tokens.is_empty(), "the fixture has no tokenizer");
    let mut keep: Vec<usize> = (0..tokens.len().min(300)).collect();
    keep.extend(
        (0..tokens.len())
            .filter(|&i| types[i] == 3 || types[i] == 4)
            .take(16),
    );
    keep.sort();
    keep.dedup();
    let new_tokens: Vec<String> = keep.iter().map(|&i| tokens[i].clone()).collect();
    let new_types: Vec<Value> = keep.iter().map(|&i| Value::I32(types[i] as i32)).collect();
    let set: std::collections::HashSet<&str> = new_tokens.iter().map(String::as_str).collect();
    let new_merges: Vec<String> = merges
        .iter()
        .filter(|m| {
            m.split_once(' ').is_some_and(|(a, b)| {
                set.contains(a) && set.contains(b) && set.contains(format!("{a}{b}").as_str())
            })
        })
        .cloned()
        .collect();
    let mut meta = vec![kv("general.architecture", Value::String("glm-dsa".into()))];
    for key in ["tokenizer.ggml.model", "tokenizer.ggml.pre"] {
        if let Some(v) = src.value(key) {
            meta.push(kv(key, v.clone()));
        }
    }
    meta.push(kv("tokenizer.ggml.tokens", string_array(&new_tokens)));
    meta.push(kv("tokenizer.ggml.merges", string_array(&new_merges)));
    meta.push(kv(
        "tokenizer.ggml.token_type",
        Value::Array(glmcheck::gguf::ValueType::I32, new_types),
    ));
    for e in &src.metadata {
        if e.key.ends_with("_token_id") {
            let id = e.value.as_u64().unwrap_or(0);
            let new_id = keep.iter().position(|&i| i as u64 == id).unwrap_or(0);
            meta.push(kv(&e.key, Value::U32(new_id as u32)));
        }
    }
    let norm: Vec<u8> = (0..32u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let tensors = vec![WriteTensor {
        name: "output_norm.weight".into(),
        ne: vec![32],
        dtype: GgmlType::F32,
        data: Some(&norm),
    }];
    write(&meta, &tensors)
}

fn safetensors_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let f32s: Vec<u8> = (0..6u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let b16: Vec<u8> = (0..8u32)
        .flat_map(|i| half::bf16::from_f32(i as f32).to_le_bytes())
        .collect();
    let f16: Vec<u8> = (0..8u32)
        .flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes())
        .collect();
    let f64s: Vec<u8> = (0..2u32).flat_map(|i| (i as f64).to_le_bytes()).collect();
    let i32s: Vec<u8> = (0..2u32).flat_map(|i| i.to_le_bytes()).collect();
    let ser = |views: Vec<(&str, TensorView<'_>)>, meta: Option<BTreeMap<String, String>>| {
        safetensors::serialize(views, meta.map(|m| m.into_iter().collect())).unwrap()
    };
    let v = |d, s: Vec<usize>, b| TensorView::new(d, s, b).unwrap();
    let mut meta = BTreeMap::new();
    meta.insert("tp_rank".to_string(), "0".to_string());
    vec![
        (
            "seed-mixed",
            ser(
                vec![
                    (
                        "model.layers.0.mlp.experts.w13_weight",
                        v(Dtype::BF16, vec![2, 2, 2], &b16),
                    ),
                    (
                        "model.layers.0.self_attn.o_proj.weight",
                        v(Dtype::F32, vec![2, 3], &f32s),
                    ),
                    ("model.norm.weight", v(Dtype::F16, vec![8], &f16)),
                    ("model.scale", v(Dtype::F64, vec![2], &f64s)),
                ],
                Some(meta),
            ),
        ),
        ("seed-empty", ser(vec![], None)),
        (
            "seed-scalar",
            ser(vec![("s", v(Dtype::F32, vec![], &f32s[..4]))], None),
        ),
        (
            "seed-zero-dim",
            ser(vec![("z", v(Dtype::F32, vec![0, 3], &[]))], None),
        ),
        (
            "seed-int-dtype",
            ser(vec![("i", v(Dtype::I32, vec![2], &i32s))], None),
        ),
    ]
}

/// The fixture's HF activation dumps, every tensor cut to its leading corner (the 18 tokens to 3,
/// other dimensions to at most 4) and `token_ids` to match: small enough to fuzz, with every module
/// path, dtype and metadata key of a real dump, and index tensors whose values still fit. Plus
/// prompt0's layer 1 alone (an MoE layer with its indexer), without the producer's metadata.
fn activation_seeds() -> Vec<(String, Vec<u8>)> {
    use safetensors::tensor::TensorView;
    let mut out = Vec::new();
    for prompt in ["prompt0", "prompt1"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/tiny/activations")
            .join(format!("{prompt}.safetensors"));
        let bytes = std::fs::read(&path).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let mut meta = header.metadata().clone().unwrap_or_default();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let tokens: Vec<u64> = serde_json::from_str(&meta["token_ids"]).unwrap();
        let t = tokens.len();
        let keep = 3;
        meta.insert(
            "token_ids".into(),
            serde_json::to_string(&tokens[..keep]).unwrap(),
        );
        let mut owned = Vec::new();
        for (name, view) in st.tensors() {
            let shape = view.shape().to_vec();
            let new: Vec<usize> = shape
                .iter()
                .map(|&d| if d == t { keep } else { d.min(4) })
                .collect();
            let item = view.dtype().bitsize() / 8;
            let mut data = Vec::new();
            let n: usize = new.iter().product();
            for flat in 0..n {
                // Row-major index into `new`, then the same index into `shape`.
                let (mut rem, mut src) = (flat, 0);
                let mut stride = 1;
                for (k, &d) in new.iter().enumerate().rev() {
                    let i = rem % d;
                    rem /= d;
                    src += i * stride;
                    stride *= shape[k];
                }
                data.extend_from_slice(&view.data()[src * item..(src + 1) * item]);
            }
            owned.push((name, view.dtype(), new, data));
        }
        let views: Vec<(String, TensorView<'_>)> = owned
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        out.push((
            format!("seed-{prompt}"),
            safetensors::serialize(views.clone(), Some(meta)).unwrap(),
        ));
        if prompt == "prompt0" {
            let layer1: Vec<_> = views
                .into_iter()
                .filter(|(n, _)| n.starts_with("model.layers.1.") || n == "input_ids")
                .collect();
            out.push((
                "seed-prompt0-layer1".into(),
                safetensors::serialize(layer1, None).unwrap(),
            ));
        }
    }
    out
}

#[test]
#[ignore = "regenerates the seed files in fuzz/corpus"]
fn write_seeds() {
    let put = |target: &str, name: &str, data: &[u8]| {
        let dir = fuzz_dir().join("corpus").join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), data).unwrap();
    };
    let small = small_gguf();
    let tok = tokenizer_gguf();
    for (target, g) in [("gguf_reader", &small), ("tokenizer", &tok)] {
        put(target, "seed-valid", g);
        // Truncations: inside the header, the kvs, the tensor infos, the data.
        for frac in [1, 3, 5, 7, 9] {
            let n = g.len() * frac / 10;
            put(target, &format!("seed-trunc-{frac}0pct"), &g[..n]);
        }
    }
    put("gguf_reader", "seed-tokenizer", &tok);
    put("tokenizer", "seed-no-tokenizer", &small);
    for (name, data) in activation_seeds() {
        put("activation_dump", &name, &data);
        put(
            "activation_dump",
            &format!("{name}-trunc"),
            &data[..data.len() / 2],
        );
    }
    for (name, data) in safetensors_seeds() {
        put("safetensors_dump", name, &data);
        if name == "seed-mixed" {
            put(
                "safetensors_dump",
                "seed-mixed-trunc",
                &data[..data.len() - 5],
            );
        }
    }
}
