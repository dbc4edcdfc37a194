//! `glmcheck export`: the checkpoint it writes, read back with the `safetensors` crate, holds exactly
//! the logical tensors glmcheck rebuilds (and, from the F32 GGUF, the original HF checkpoint's), each
//! once, indexed, with transformers' own config.json; layer subsets are renumbered; an existing
//! output is never touched without --force.

mod common;
use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use glmcheck::arch::config::ConfigReader;
use glmcheck::arch::glm_dsa;
use glmcheck::arch::Config;
use glmcheck::gguf::GgufModel;
use glmcheck::weights::Weights;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// One tensor of the exported checkpoint and the shard that holds it.
struct Stored {
    file: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Runs `export GGUF --hf OUT ARGS… --json`, expecting success; the JSON summary.
fn export(stem: &str, out: &Path, args: &[&str]) -> Value {
    let g = gguf(stem);
    let mut all = vec!["export", path_str(&g), "--hf", path_str(out), "--json"];
    all.extend_from_slice(args);
    let o = glmcheck(&all);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    json_of(&o)
}

/// Every tensor of every shard the index names; checks that the index names each tensor once, at
/// the shard that holds it, with the right total size, and that no shard holds a tensor twice.
fn read_checkpoint(dir: &Path) -> BTreeMap<String, Stored> {
    let index: Value = serde_json::from_slice(
        &std::fs::read(dir.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("index JSON");
    let map = index["weight_map"].as_object().expect("weight_map");
    let mut files: Vec<&str> = map.values().filter_map(Value::as_str).collect();
    files.sort_unstable();
    files.dedup();
    let n = files.len();
    for (i, f) in files.iter().enumerate() {
        assert_eq!(*f, format!("model-{:05}-of-{n:05}.safetensors", i + 1));
    }
    let mut out = BTreeMap::new();
    let mut total = 0u64;
    for f in files {
        let bytes = std::fs::read(dir.join(f)).expect("shard");
        let st = SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{f}: {e}"));
        let (_, meta) = SafeTensors::read_metadata(&bytes).expect("header");
        assert_eq!(
            meta.metadata().as_ref().and_then(|m| m.get("format")),
            Some(&"pt".to_string()),
            "{f}: transformers wants format pt"
        );
        for (name, view) in st.tensors() {
            assert_eq!(map.get(&name).and_then(Value::as_str), Some(f), "{name}");
            total += view.data().len() as u64;
            let prev = out.insert(
                name.clone(),
                Stored {
                    file: f.to_string(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    data: view.data().to_vec(),
                },
            );
            assert!(prev.is_none(), "{name} stored twice");
        }
    }
    assert_eq!(
        out.len(),
        map.len(),
        "the index names tensors no shard holds"
    );
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    out
}

fn config_of(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("config.json"))
        .expect("config JSON")
}

fn model_of(stem: &str) -> (GgufModel, Config) {
    let model = GgufModel::open(&gguf(stem)).expect("open");
    let cfg = ConfigReader::read(&model, "glm-dsa")
        .expect("config")
        .config;
    (model, cfg)
}

fn f32s(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn values(w: &Weights<'_>, param: &str) -> Vec<f32> {
    w.hf(param)
        .and_then(|t| {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|err| glmcheck::weights::WeightError::Candle {
                    param: param.into(),
                    err,
                })
        })
        .unwrap_or_else(|e| panic!("{e}"))
}

fn tiny_vllm_config() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf_config/tiny-vllm.json");
    serde_json::from_slice(&std::fs::read(path).expect("fixture")).expect("json")
}

/// From the F32 GGUF, in f32: every HF parameter once, bit for bit what `Weights::hf` rebuilds and
/// what the transformers checkpoint held (hf_tensors.json's sha256, hf_kv_b_proj.safetensors), cut
/// into several shards; config.json is transformers' own plus vLLM's three keys.
#[test]
fn an_f32_export_is_the_checkpoint_bit_for_bit_with_transformers_config() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("hf");
    let r = export(
        "tiny-F32",
        &out,
        &["--dtype", "f32", "--max-shard-bytes", "3000000"],
    );
    let stored = read_checkpoint(&out);
    assert_eq!(r["tensors"].as_u64(), Some(stored.len() as u64));
    assert_eq!(r["dtype"], "f32");
    assert_eq!(
        r["layers"],
        serde_json::json!({"first": 0, "last": 2, "count": 3, "of": 3})
    );
    let files = r["files"].as_array().expect("files");
    assert!(files.len() >= 7, "15.7 MB in 3 MB shards: {files:?}");
    let on_disk: u64 = files
        .iter()
        .filter_map(Value::as_str)
        .map(|f| std::fs::metadata(out.join(f)).expect("file").len())
        .sum();
    assert_eq!(r["bytes"].as_u64(), Some(on_disk));

    let (model, cfg) = model_of("tiny-F32");
    let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
    let params = glm_dsa::hf_params(&cfg);
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(stored.keys().map(String::as_str).collect::<Vec<_>>(), {
        let mut n = names.clone();
        n.sort_unstable();
        n
    });
    let checkpoint = json("hf_tensors.json");
    for p in &params {
        let s = &stored[&p.name];
        assert_eq!(s.dtype, Dtype::F32, "{}", p.name);
        assert_eq!(s.shape, p.shape(&cfg), "{}", p.name);
        let ours = f32s(&s.data);
        let want = values(&w, &p.name);
        assert!(
            ours.iter()
                .map(|v| v.to_bits())
                .eq(want.iter().map(|v| v.to_bits())),
            "{} ({}) differs from Weights::hf",
            p.name,
            s.file
        );
        assert_eq!(
            Some(sha256_f32(&ours).as_str()),
            checkpoint[&p.name]["sha256"].as_str(),
            "{}: not the transformers checkpoint's values",
            p.name
        );
    }
    let kvb = std::fs::read(fixture("hf_kv_b_proj.safetensors")).expect("fixture");
    let kvb = SafeTensors::deserialize(&kvb).expect("fixture");
    for (name, t) in kvb.tensors() {
        assert_eq!(stored[&name].data, t.data(), "{name}");
    }

    let mut want = tiny_vllm_config();
    assert_eq!(config_of(&out), want);
    let transformers = json("config.json");
    for (k, v) in transformers.as_object().expect("object") {
        assert_eq!(config_of(&out).get(k), Some(v), "{k}");
    }
    // The same config in bf16 says so; vLLM's reading of it agrees with the GGUF on every field.
    let bf = dir.path().join("bf");
    export("tiny-F32", &bf, &["-q"]);
    want["dtype"] = "bfloat16".into();
    assert_eq!(config_of(&bf), want);
    let cfg_path = out.join("config.json");
    let o = glmcheck(&[
        "inspect",
        path_str(&gguf("tiny-F32")),
        "--hf-config",
        path_str(&cfg_path),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
}

/// bf16: every value is the dequantized f32 rounded to nearest even (the `half` crate's rounding,
/// torch's), except the router's correction bias, kept f32 bit for bit.
#[test]
fn a_bf16_export_is_the_dequantized_values_rounded_to_nearest_even() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("hf");
    let r = export("tiny-Q4_K_M", &out, &[]);
    assert_eq!(r["dtype"], "bf16");
    let stored = read_checkpoint(&out);
    let (model, cfg) = model_of("tiny-Q4_K_M");
    let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
    let mut biases = 0;
    for p in glm_dsa::hf_params(&cfg) {
        let s = &stored[&p.name];
        let want = values(&w, &p.name);
        if p.name.ends_with("e_score_correction_bias") {
            biases += 1;
            assert_eq!(s.dtype, Dtype::F32, "{}", p.name);
            assert_eq!(f32s(&s.data), want, "{}", p.name);
            continue;
        }
        assert_eq!(s.dtype, Dtype::BF16, "{}", p.name);
        let ours: Vec<u16> = s
            .data
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let rounded: Vec<u16> = want
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        assert_eq!(ours, rounded, "{}", p.name);
    }
    assert_eq!(biases, 2);
    assert_eq!(config_of(&out)["dtype"], "bfloat16");
}

/// `--layers 1..1` writes layer 1 as layer 0 (an MoE layer: first_k_dense_replace 0), the globals
/// always; `--layers 0..1` keeps the dense layer first.
#[test]
fn a_layer_subset_is_renumbered_from_zero_with_a_config_to_match() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("l1");
    let r = export("tiny-F32", &out, &["--layers", "1..1", "--dtype", "f32"]);
    assert_eq!(
        r["layers"],
        serde_json::json!({"first": 1, "last": 1, "count": 1, "of": 3})
    );
    let stored = read_checkpoint(&out);
    let (model, cfg) = model_of("tiny-F32");
    let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
    let mut layer_tensors = 0;
    for (name, s) in &stored {
        let source = match name.strip_prefix("model.layers.0.") {
            Some(rest) => {
                layer_tensors += 1;
                format!("model.layers.1.{rest}")
            }
            None => {
                assert!(!name.starts_with("model.layers."), "{name}");
                name.clone()
            }
        };
        assert_eq!(f32s(&s.data), values(&w, &source), "{name} ≠ {source}");
    }
    // An MoE layer: 19 tensors + 3 × 8 experts; and the embedding, final norm and lm_head.
    assert_eq!(layer_tensors, 19 + 3 * 8);
    assert_eq!(stored.len(), layer_tensors + 3);
    assert!(stored.contains_key("model.layers.0.mlp.experts.7.down_proj.weight"));

    let c = config_of(&out);
    let mut want = tiny_vllm_config();
    want["num_hidden_layers"] = 1.into();
    want["first_k_dense_replace"] = 0.into();
    want["mlp_layer_types"] = serde_json::json!(["sparse"]);
    want["layer_types"] = serde_json::json!(["indexed_attention"]);
    assert_eq!(c, want);

    let two = dir.path().join("l01");
    export("tiny-F32", &two, &["--layers", "0..1", "-q"]);
    let c = config_of(&two);
    assert_eq!(c["mlp_layer_types"], serde_json::json!(["dense", "sparse"]));
    assert_eq!(c["first_k_dense_replace"], 1);
    let stored = read_checkpoint(&two);
    assert!(stored.contains_key("model.layers.0.mlp.gate_proj.weight"));
    assert!(stored.contains_key("model.layers.1.mlp.experts.0.up_proj.weight"));
    assert!(!stored.keys().any(|k| k.starts_with("model.layers.2.")));
}

/// An existing OUTDIR is refused (exit 2, naming --force) and left as it was; so is an OUTDIR that
/// holds the input, even with --force; a bad --layers writes nothing.
#[test]
fn an_existing_outdir_is_refused_without_force_and_left_untouched() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("hf");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::write(out.join("mine.txt"), b"keep me").expect("write");
    let g = gguf("tiny-Q8_0");
    let o = glmcheck(&["export", path_str(&g), "--hf", path_str(&out)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--force"), "{}", stderr(&o));
    let listing = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .expect("ls")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(listing(&out), ["mine.txt"]);
    assert_eq!(
        std::fs::read(out.join("mine.txt")).expect("kept"),
        b"keep me"
    );
    assert_eq!(listing(dir.path()), ["hf"], "no temp directory is left");

    for bad in [["--layers", "3"], ["--layers", "2..1"]] {
        let fresh = dir.path().join("never");
        let mut args = vec!["export", path_str(&g), "--hf", path_str(&fresh)];
        args.extend_from_slice(&bad);
        let o = glmcheck(&args);
        assert_eq!(o.status.code(), Some(2), "{bad:?}");
        assert!(!fresh.exists(), "{bad:?}");
    }

    // The input's own directory, even with --force: refused, the input intact.
    let inputs = dir.path().join("models");
    std::fs::create_dir(&inputs).expect("mkdir");
    let copy = inputs.join("m.gguf");
    std::fs::copy(&g, &copy).expect("copy");
    let o = glmcheck(&[
        "export",
        path_str(&copy),
        "--hf",
        path_str(&inputs),
        "--force",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("an input of this command"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        std::fs::read(&copy).expect("input"),
        std::fs::read(&g).expect("fixture")
    );

    // With --force the old directory is replaced whole.
    export("tiny-Q8_0", &out, &["--force"]);
    assert!(!out.join("mine.txt").exists());
    assert_eq!(
        listing(&out),
        [
            "config.json",
            "model-00001-of-00001.safetensors",
            "model.safetensors.index.json"
        ]
    );
    assert_eq!(listing(dir.path()), ["hf", "models"]);
}
