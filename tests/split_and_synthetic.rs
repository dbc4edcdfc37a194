//! Split sets, a GGUF with GLM-5's real dimensions (sparse, costs no disk), and types glmcheck can
//! inventory but not decode.

mod common;
use common::*;
use std::fs::File;
use std::time::Instant;

use glmcheck::arch::Config;
use glmcheck::gguf::writer::{write_gguf, WriteTensor};
use glmcheck::gguf::{GgmlType, GgufModel, Value};

fn inspect_json(path: &std::path::Path) -> (Option<i32>, serde_json::Value, String) {
    let out = glmcheck(&["inspect", path.to_str().unwrap(), "--json"]);
    let v = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code(), v, stderr(&out))
}

#[test]
fn a_split_copy_inspects_identically_to_the_whole() {
    let dir = tempfile::tempdir().unwrap();
    let model = GgufModel::open(&gguf("tiny-Q8_0")).unwrap();
    let parts = rewrite(&model, &dir.path().join("tiny.gguf"), &[20, 45]);
    assert_eq!(parts.len(), 3);
    let (code_whole, mut whole, _) = inspect_json(&gguf("tiny-Q8_0"));
    for start in [&parts[0], &parts[2]] {
        let (code, mut split, err) = inspect_json(start);
        assert_eq!(code, code_whole, "{err}");
        assert_eq!(split["files"].as_array().unwrap().len(), 3);
        for v in [&mut whole, &mut split] {
            v.as_object_mut().unwrap().remove("files");
        }
        assert_eq!(split, whole, "given {}", start.display());
    }
    // Every tensor's bytes are the same bytes.
    let split = GgufModel::open(&parts[1]).unwrap();
    for t in model.tensors() {
        assert_eq!(
            split.tensor(&t.info.name).unwrap().bytes(),
            t.bytes(),
            "{}",
            t.info.name
        );
    }
    // A missing part is named.
    std::fs::remove_file(&parts[1]).unwrap();
    let out = glmcheck_bounded(&["inspect", parts[0].to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("00002-of-00003") && stderr(&out).contains("missing"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_foreign_part_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = GgufModel::open(&gguf("tiny-Q8_0")).unwrap();
    let a = rewrite(&model, &dir.path().join("a.gguf"), &[30]);
    let other = tempfile::tempdir().unwrap();
    let b = rewrite(&model, &other.path().join("a.gguf"), &[10, 30]);
    // Put part 2 of a 3-part set where part 2 of the 2-part set belongs.
    std::fs::copy(&b[1], &a[1]).unwrap();
    let out = glmcheck_bounded(&["inspect", a[0].to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("split.count"), "{}", stderr(&out));
}

#[test]
fn real_glm5_dimensions_inspect_fast_with_no_problems() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("glm5-real-dims.gguf");
    write_real_dims(&path, GgmlType::Q4_K);
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size > 300_000_000_000, "a real-size (sparse) file: {size}");
    let start = Instant::now();
    let (code, r, err) = inspect_json(&path);
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(code, Some(0), "{err} {}", r["problems"]);
    assert!(secs < 1.0, "inspect took {secs:.2} s on a {size}-byte file");
    let want = serde_json::to_value(Config::glm5()).unwrap();
    assert_eq!(r["config"], want);
    assert_eq!(
        r["defaulted"].as_array().map(Vec::len),
        Some(0),
        "{}",
        r["defaulted"]
    );
    assert!(r["notes"].to_string().contains("MTP"), "{}", r["notes"]);
    let kvb = r["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.3.attn_k_b.weight")
        .unwrap();
    assert_eq!(kvb["shape"], serde_json::json!([64, 512, 192]));
}

#[test]
fn a_shape_that_disagrees_with_the_config_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = GgufModel::open(&gguf("tiny-F32")).unwrap();
    // Rewrite with one tensor's dims permuted (same bytes) and one tensor dropped.
    let mut meta: Vec<(String, Value)> = model
        .metadata()
        .iter()
        .map(|e| (e.key.clone(), e.value.clone()))
        .collect();
    meta.retain(|(k, _)| !k.starts_with("split."));
    let tensors: Vec<WriteTensor> = model
        .tensors()
        .filter(|t| t.info.name != "blk.2.indexer.proj.weight")
        .map(|t| {
            let mut ne = t.info.ne.clone();
            if t.info.name == "blk.1.attn_k_b.weight" {
                ne.swap(0, 1);
            }
            WriteTensor {
                name: t.info.name.clone(),
                ne,
                dtype: t.info.dtype,
                data: Some(t.bytes()),
            }
        })
        .collect();
    let path = dir.path().join("bad.gguf");
    write_gguf(&mut File::create(&path).unwrap(), &meta, &tensors, 32).unwrap();
    let (code, r, _) = inspect_json(&path);
    assert_eq!(code, Some(1), "problems are findings: exit 1");
    let p = r["problems"].to_string();
    assert!(
        p.contains("wrong_shape") && p.contains("blk.1.attn_k_b.weight"),
        "{p}"
    );
    assert!(
        p.contains("missing") && p.contains("blk.2.indexer.proj.weight"),
        "{p}"
    );
}

#[test]
fn an_iq_typed_tensor_is_inventoried_but_not_dequantizable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("iq.gguf");
    let iq = vec![0u8; 66 * 4];
    let f32s: Vec<u8> = (0..256u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let tensors = vec![
        WriteTensor {
            name: "blk.0.attn_q_a.weight".into(),
            ne: vec![256, 4],
            dtype: GgmlType::IQ2_XXS,
            data: Some(&iq),
        },
        WriteTensor {
            name: "blk.0.attn_norm.weight".into(),
            ne: vec![256],
            dtype: GgmlType::F32,
            data: Some(&f32s),
        },
    ];
    let meta = vec![(
        "general.architecture".to_string(),
        Value::String("glm-dsa".into()),
    )];
    write_gguf(&mut File::create(&path).unwrap(), &meta, &tensors, 32).unwrap();
    let (_, r, err) = inspect_json(&path);
    let types = r["types"].as_array().unwrap_or_else(|| panic!("{err}"));
    let iq = types
        .iter()
        .find(|t| t["dtype"] == "IQ2_XXS")
        .expect("IQ2_XXS inventoried");
    assert_eq!(iq["dequantizable"], false);
    assert_eq!(iq["bytes"], 264);
    assert!(r["notes"].to_string().contains("IQ2_XXS"));
    // Decoding: that tensor fails alone, the other is still decoded; exit 1 (a finding).
    let out = glmcheck(&["dequant", path.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = d["tensors"].as_array().unwrap();
    assert!(rows[0]["error"].as_str().unwrap().contains("IQ2_XXS"));
    assert_eq!(rows[1]["absmax"], 255.0);
}

#[test]
fn a_block_count_that_overstates_the_file_is_one_problem_per_run_of_layers() {
    let dir = tempfile::tempdir().unwrap();
    let model = GgufModel::open(&gguf("tiny-Q8_0")).unwrap();
    let path = dir.path().join("lying-block-count.gguf");
    write_edited(
        &model,
        &path,
        |k, v| match k {
            "glm-dsa.block_count" => Value::U32(1000),
            _ => v.clone(),
        },
        |_, dtype, bytes| (dtype, bytes.to_vec()),
    );
    let out = glmcheck_bounded(&["inspect", path.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems = r["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 1, "{}", r["problems"]);
    let msg = problems[0]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("layers 3–999 have no tensors in the file"),
        "{msg}"
    );
    assert_eq!(problems[0]["kind"], "missing");
}

/// `synth` writes a file the other commands take as GLM-5 (tiny dims here: the real ones are timed on
/// the GPU, reports/gpu-glm5.md), and never replaces an existing file unless told to.
#[test]
fn a_synth_file_inspects_clean_and_runs_and_an_existing_output_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("synth.gguf");
    let o = out.to_str().unwrap();
    let w = glmcheck_bounded(&[
        "synth", "--dims", "tiny", "--layers", "4", "--out", o, "--json",
    ]);
    assert_eq!(w.status.code(), Some(0), "{}", stderr(&w));
    let r: serde_json::Value = serde_json::from_slice(&w.stdout).unwrap();
    assert_eq!(
        (r["layers"].as_u64(), r["dense_layers"].as_u64()),
        (Some(4), Some(1))
    );
    let (code, inspect, err) = inspect_json(&out);
    assert_eq!(code, Some(0), "{err} {}", inspect["problems"]);
    assert_eq!(inspect["config"]["num_hidden_layers"], 4);
    let f = glmcheck_bounded(&[
        "forward",
        o,
        "--prompt",
        "hello there",
        "--max-new-tokens",
        "2",
    ]);
    assert_eq!(f.status.code(), Some(0), "{}", stderr(&f));
    let before = std::fs::read(&out).unwrap();
    let again = glmcheck_bounded(&["synth", "--dims", "tiny", "--seed", "9", "--out", o]);
    assert_eq!(again.status.code(), Some(2));
    assert!(stderr(&again).contains("--force"), "{}", stderr(&again));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        before,
        "the existing file was touched"
    );
}
