//! `--hf-config`: the deployment's config.json against the GGUF, on `inspect`, `shards` and
//! `forward`. Fixtures: fixtures/hf_config/ (see its README).

mod common;

use std::path::{Path, PathBuf};

use common::*;
use glmcheck::gguf::GgmlType;
use serde_json::Value;

fn hf_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/hf_config")
        .join(name)
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// `inspect GGUF --hf-config CONFIG --json`: (exit code, the `hf_config` object).
fn inspect_hf(gguf_path: &Path, config: &Path) -> (Option<i32>, Value) {
    let out = glmcheck(&["inspect", s(gguf_path), "--hf-config", s(config), "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", stderr(&out)));
    (out.status.code(), v["hf_config"].clone())
}

/// The findings' (field, kind, harmless).
fn findings(hf: &Value) -> Vec<(String, String, bool)> {
    hf["findings"]
        .as_array()
        .expect("findings array")
        .iter()
        .map(|f| {
            (
                f["field"].as_str().expect("field").to_string(),
                f["kind"].as_str().expect("kind").to_string(),
                f["harmless"].as_bool().expect("harmless"),
            )
        })
        .collect()
}

fn message(hf: &Value, field: &str) -> String {
    hf["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .find(|f| f["field"] == field)
        .and_then(|f| f["message"].as_str())
        .unwrap_or_else(|| panic!("no finding for {field}: {hf}"))
        .to_string()
}

/// `edit` applied to the JSON of `src`, written into `dir`.
fn edited(
    dir: &Path,
    src: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> PathBuf {
    let text = std::fs::read_to_string(src).expect("read config");
    let mut v: Value = serde_json::from_str(&text).expect("config is JSON");
    edit(v.as_object_mut().expect("object"));
    let out = dir.join("config.json");
    std::fs::write(&out, serde_json::to_string_pretty(&v).expect("encode")).expect("write");
    out
}

/// A sparse GGUF with GLM-5's real dimensions and metadata, in a temp dir removed on drop.
fn real_dims() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("glm5.gguf");
    write_real_dims(&p, GgmlType::Q4_K);
    (dir, p)
}

#[test]
fn tiny_config_with_the_vllm_keys_is_clean() {
    let (code, hf) = inspect_hf(&gguf("tiny-Q8_0"), &hf_fixture("tiny-vllm.json"));
    assert_eq!(code, Some(0), "{hf}");
    assert_eq!(hf["verdict"], "pass");
    assert_eq!(findings(&hf), vec![]);
    // Every field vLLM reads has a row, each agreeing.
    let rows = hf["rows"].as_array().expect("rows");
    for f in [
        "topk_method",
        "scoring_func",
        "indexer_rope_interleave",
        "index_topk",
        "n_group",
        "topk_group",
        "rope_theta",
        "rope_type",
        "num_nextn_predict_layers",
        "tie_word_embeddings",
        "hidden_size",
        "vocab_size",
    ] {
        let r = rows
            .iter()
            .find(|r| r["field"] == f)
            .unwrap_or_else(|| panic!("no row {f}"));
        assert_eq!(r["verdict"], "agrees", "{r}");
    }
}

#[test]
fn the_transformers_saved_tiny_config_lacks_three_vllm_keys() {
    // fixtures/tiny/config.json is what transformers' GlmMoeDsaConfig saved: it has no
    // topk_method, scoring_func or indexer_rope_interleave, so vLLM 0.33 would run it differently.
    let (code, hf) = inspect_hf(&gguf("tiny-Q8_0"), &fixture("config.json"));
    assert_eq!(code, Some(1), "{hf}");
    assert_eq!(hf["verdict"], "fail");
    assert_eq!(
        findings(&hf),
        vec![
            ("topk_method".into(), "no_correction_bias".into(), false),
            ("scoring_func".into(), "scoring".into(), false),
            (
                "indexer_rope_interleave".into(),
                "indexer_rope_neox".into(),
                false
            ),
        ]
    );
    assert!(message(&hf, "scoring_func").contains("with softmax"));
}

#[test]
fn the_real_glm5_config_agrees_with_a_real_glm5_gguf() {
    let (_dir, gguf_path) = real_dims();
    let base = glmcheck(&["inspect", s(&gguf_path)]).status.code();
    let (code, hf) = inspect_hf(&gguf_path, &hf_fixture("glm5.json"));
    assert_eq!(findings(&hf), vec![], "{hf}");
    assert_eq!(hf["verdict"], "pass");
    assert_eq!(
        code, base,
        "--hf-config with no finding leaves the exit code alone"
    );
}

#[test]
fn glm5_without_topk_method_has_no_correction_bias_in_vllm() {
    let (_dir, gguf_path) = real_dims();
    let (code, hf) = inspect_hf(&gguf_path, &hf_fixture("glm5-no-topk-method.json"));
    assert_eq!(code, Some(1), "{hf}");
    assert_eq!(
        findings(&hf),
        vec![("topk_method".into(), "no_correction_bias".into(), false)]
    );
    let m = message(&hf, "topk_method");
    assert!(
        m.contains("creates no mlp.gate.e_score_correction_bias") && m.contains("deepseek_v2.py"),
        "{m}"
    );
}

#[test]
fn glm5_without_indexer_rope_interleave_rotates_the_indexer_neox() {
    let (_dir, gguf_path) = real_dims();
    let (code, hf) = inspect_hf(
        &gguf_path,
        &hf_fixture("glm5-no-indexer-rope-interleave.json"),
    );
    assert_eq!(code, Some(1), "{hf}");
    assert_eq!(
        findings(&hf),
        vec![(
            "indexer_rope_interleave".into(),
            "indexer_rope_neox".into(),
            false
        )]
    );
    let m = message(&hf, "indexer_rope_interleave");
    assert!(
        m.contains("half-split (NeoX") && m.contains("interleaved"),
        "{m}"
    );
}

#[test]
fn glm5_without_index_topk_keeps_dsa_on_in_vllm() {
    // GlmMoeDsaConfig declares index_topk = 2048: removing the key changes nothing for GLM-5.
    let (_dir, gguf_path) = real_dims();
    let base = glmcheck(&["inspect", s(&gguf_path)]).status.code();
    let (code, hf) = inspect_hf(&gguf_path, &hf_fixture("glm5-no-index-topk.json"));
    assert_eq!(
        findings(&hf),
        vec![("index_topk".into(), "index_topk_default".into(), true)]
    );
    assert_eq!(code, base, "a harmless finding does not fail the run");
    let m = message(&hf, "index_topk");
    assert!(
        m.contains("does not switch DSA off") && m.contains("top-2048"),
        "{m}"
    );
    // On the tiny model (index_topk 8) the same removal makes vLLM keep 2048 keys: dense attention
    // for any prompt the model can take.
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = edited(dir.path(), &hf_fixture("tiny-vllm.json"), |m| {
        m.remove("index_topk");
    });
    let (code, hf) = inspect_hf(&gguf("tiny-Q8_0"), &cfg);
    assert_eq!(code, Some(1), "{hf}");
    assert_eq!(
        findings(&hf),
        vec![("index_topk".into(), "index_topk_default".into(), false)]
    );
    assert!(message(&hf, "index_topk").contains("dense attention"));
}

#[test]
fn a_dimension_mismatch_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = edited(dir.path(), &hf_fixture("tiny-vllm.json"), |m| {
        m.insert("hidden_size".into(), Value::from(512));
        m.insert("n_group".into(), Value::from(1));
    });
    let out = glmcheck(&["inspect", s(&gguf("tiny-Q8_0")), "--hf-config", s(&cfg)]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("finding: hidden_size: vLLM 0.33 uses 512 where the GGUF has 256"),
        "{text}"
    );
    assert!(
        text.contains("finding: n_group: vLLM 0.33 uses 1 where the GGUF has 4"),
        "{text}"
    );
    assert!(text.contains("2 change what vLLM 0.33 computes"), "{text}");
    // An absent declared key is transformers' default, GLM-5's value, not the tiny model's.
    let cfg = edited(dir.path(), &hf_fixture("tiny-vllm.json"), |m| {
        m.remove("vocab_size");
    });
    let (code, hf) = inspect_hf(&gguf("tiny-Q8_0"), &cfg);
    assert_eq!(code, Some(1));
    let f = &hf["findings"][0];
    assert_eq!(f["field"], "vocab_size");
    assert_eq!(f["vllm"], 154880);
    assert_eq!(f["vllm_from"], "transformers_default");
    assert_eq!(f["gguf"], 600);
}

#[test]
fn shards_and_forward_take_the_flag() {
    let good = hf_fixture("tiny-vllm.json");
    let bad = fixture("config.json");
    let q4 = gguf("tiny-Q4_K_M");
    // shards: the plan's own verdict, plus the config's.
    let plain = glmcheck(&["shards", s(&q4), "--tp", "8", "--json"]);
    let with = glmcheck(&[
        "shards",
        s(&q4),
        "--tp",
        "8",
        "--json",
        "--hf-config",
        s(&good),
    ]);
    assert_eq!(with.status.code(), plain.status.code(), "{}", stderr(&with));
    let v: Value = serde_json::from_slice(&with.stdout).expect("JSON");
    assert_eq!(v["hf_config"]["verdict"], "pass");
    assert!(v["params"].is_array(), "the plan is still there");
    let out = glmcheck(&["shards", s(&q4), "--tp", "8", "--hf-config", s(&bad)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("finding: topk_method is absent"));
    // forward: the run's output, then the config's table.
    let f32 = gguf("tiny-F32");
    let args = |cfg: &Path| {
        vec![
            "forward".to_string(),
            s(&f32).to_string(),
            "--tokens".into(),
            "294,266,220".into(),
            "--max-new-tokens".into(),
            "0".into(),
            "--hf-config".into(),
            s(cfg).to_string(),
        ]
    };
    let run = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        glmcheck(&refs)
    };
    let out = run(args(&good));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("0 change what vLLM 0.33 computes"));
    let mut a = args(&bad);
    a.push("--json".into());
    let out = run(a);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["hf_config"]["verdict"], "fail");
    assert!(v["tokens"].is_array(), "the forward's own JSON is kept");
}

#[test]
fn malformed_configs_exit_2_naming_file_and_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let q8 = gguf("tiny-Q8_0");
    let cfg = edited(dir.path(), &hf_fixture("tiny-vllm.json"), |m| {
        m.insert("hidden_size".into(), Value::from("256"));
    });
    let out = glmcheck(&["inspect", s(&q8), "--hf-config", s(&cfg)]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains(s(&cfg)) && err.contains("`hidden_size`") && err.contains("\"256\""),
        "{err}"
    );
    let cfg = edited(dir.path(), &hf_fixture("tiny-vllm.json"), |m| {
        m.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_theta": []}),
        );
    });
    let err = stderr(&glmcheck(&["inspect", s(&q8), "--hf-config", s(&cfg)]));
    assert!(err.contains("`rope_parameters.rope_theta`"), "{err}");
    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{\"hidden_size\": 256,").expect("write");
    let out = glmcheck(&["inspect", s(&q8), "--hf-config", s(&broken)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not valid JSON"), "{}", stderr(&out));
    let out = glmcheck(&["inspect", s(&q8), "--hf-config", s(dir.path())]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("is a directory"), "{}", stderr(&out));
    let out = glmcheck(&["inspect", s(&q8), "--hf-config", "/nonexistent/config.json"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/config.json"));
}

#[test]
fn report_never_overwrites_the_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = edited(dir.path(), &hf_fixture("tiny-vllm.json"), |_| {});
    let before = std::fs::read(&cfg).expect("read");
    let out = glmcheck(&[
        "--report",
        s(&cfg),
        "inspect",
        s(&gguf("tiny-Q8_0")),
        "--hf-config",
        s(&cfg),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("refusing to overwrite an input"));
    assert_eq!(std::fs::read(&cfg).expect("read"), before);
}
