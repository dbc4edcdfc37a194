//! `inspect` of every fixture reproduces the config.json the generator gave transformers.

mod common;
use common::*;

fn config_json_value(cfg: &serde_json::Value, key: &str) -> serde_json::Value {
    match key {
        "rope_theta" => cfg["rope_parameters"]["rope_theta"].clone(),
        "scoring_func" => cfg.get(key).cloned().unwrap_or_else(|| "sigmoid".into()),
        _ => cfg[key].clone(),
    }
}

#[test]
fn inspect_reproduces_config_json_for_every_fixture() {
    let cfg = json("config.json");
    let fields = [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "n_group",
        "topk_group",
        "moe_intermediate_size",
        "intermediate_size",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "norm_topk_prob",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "rope_theta",
        "rms_norm_eps",
        "vocab_size",
        "max_position_embeddings",
        "num_nextn_predict_layers",
        "tie_word_embeddings",
    ];
    for stem in FIXTURE_GGUFS {
        let path = gguf(stem);
        let out = glmcheck(&["inspect", path.to_str().unwrap(), "--json"]);
        assert_eq!(out.status.code(), Some(0), "{stem}: {}", stderr(&out));
        let r: serde_json::Value =
            serde_json::from_slice(&out.stdout).expect("inspect --json is JSON");
        assert_eq!(r["arch"], "glm-dsa");
        for f in fields {
            let want = config_json_value(&cfg, f);
            let got = &r["config"][f];
            let same = match (want.as_f64(), got.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => &want == got,
            };
            assert!(same, "{stem}: config.{f} is {got}, config.json says {want}");
        }
        assert_eq!(
            r["problems"].as_array().map(Vec::len),
            Some(0),
            "{stem}: {}",
            r["problems"]
        );
        assert_eq!(r["tensors"].as_array().map(Vec::len), Some(67), "{stem}");
        for t in r["tensors"].as_array().unwrap() {
            assert!(t["name"].is_string() && t["dtype"].is_string() && t["shape"].is_array());
        }
    }
}

#[test]
fn human_output_is_a_table_and_json_is_pure() {
    let path = gguf("tiny-Q8_0");
    let out = glmcheck(&["inspect", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let text = stdout(&out);
    assert!(text.contains("kv_lora_rank"), "{text}");
    assert!(text.contains("blk.0.attn_k_b.weight"), "{text}");
    assert!(text.contains("consistency: all 67 tensors agree"), "{text}");
    let out = glmcheck(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(serde_json::from_slice::<serde_json::Value>(&out.stdout).is_ok());
}

#[test]
fn version_help_and_completions() {
    let out = glmcheck(&["--version"]);
    assert!(stdout(&out).starts_with("glmcheck "), "{}", stdout(&out));
    let out = glmcheck(&["inspect", "--help"]);
    assert!(stdout(&out).contains("Examples:"));
    let out = glmcheck(&["completions", "bash"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("glmcheck"));
    // `forward --help` names every environment setting; `-h` keeps to the examples
    let long = stdout(&glmcheck(&["forward", "--help"]));
    for (name, _) in glmcheck::model::knobs::TABLE {
        assert!(long.contains(name), "forward --help lacks {name}");
    }
    let short = stdout(&glmcheck(&["forward", "-h"]));
    assert!(short.contains("Examples:") && !short.contains("GLMCHECK_COPY16"));
}

/// A `GLMCHECK_*` setting given a value it does not take is a warning naming it and its values,
/// and the command runs with the default.
#[test]
fn an_unlisted_setting_value_warns_and_runs() {
    let path = gguf("tiny-Q8_0");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_glmcheck"))
        .args(["inspect", path.to_str().unwrap()])
        .env("GLMCHECK_COPY16", "of")
        .env("GLMCHECK_INDEXER", "always")
        .output()
        .expect("run glmcheck");
    assert_eq!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("GLMCHECK_COPY16=\"of\" is not a value it takes (off)"),
        "{err}"
    );
    assert!(!err.contains("GLMCHECK_INDEXER"), "{err}");
}

/// `forward` records the settings it ran with (the recognised ones) in its text and JSON, and an
/// empty map without any.
#[test]
fn forward_records_the_settings_it_ran_with() {
    let path = gguf("tiny-Q8_0");
    let run = |env: &[(&str, &str)], json: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_glmcheck"));
        c.args(["forward", path.to_str().unwrap(), "--tokens", "1,2,3"])
            .args(["--max-new-tokens", "0"]);
        if json {
            c.arg("--json");
        }
        // whatever the test's own environment sets
        for (name, _) in glmcheck::model::knobs::TABLE {
            c.env_remove(name);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().expect("run glmcheck");
        assert_eq!(out.status.code(), Some(0), "{env:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let set = [("GLMCHECK_INDEXER", "always"), ("GLMCHECK_COPY16", "of")];
    let text = run(&set, false);
    assert!(
        text.contains("settings (not the defaults): GLMCHECK_INDEXER=always\n"),
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_str(&run(&set, true)).expect("json");
    assert_eq!(
        v["settings"],
        serde_json::json!({"GLMCHECK_INDEXER": "always"})
    );
    let v: serde_json::Value = serde_json::from_str(&run(&[], true)).expect("json");
    assert_eq!(v["settings"], serde_json::json!({}));
    assert!(!run(&[], false).contains("settings"));
}

/// Every special-token id llama.cpp writes is listed (cls and the FIM ids were missing).
#[test]
fn inspect_lists_every_special_token_llama_cpp_writes() {
    use glmcheck::gguf::writer::{write_gguf, WriteTensor};
    use glmcheck::gguf::{GgufModel, Value};
    let m = GgufModel::open(&gguf("tiny-Q8_0")).expect("open");
    let mut kvs: Vec<(String, Value)> = m
        .metadata()
        .iter()
        .map(|e| (e.key.clone(), e.value.clone()))
        .collect();
    kvs.push(("tokenizer.ggml.cls_token_id".into(), Value::U32(5)));
    kvs.push(("tokenizer.ggml.fim_pre_token_id".into(), Value::U32(6)));
    let tensors: Vec<WriteTensor> = m
        .tensors()
        .map(|t| WriteTensor {
            name: t.info.name.clone(),
            ne: t.info.ne.clone(),
            dtype: t.info.dtype,
            data: Some(t.bytes()),
        })
        .collect();
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("specials.gguf");
    let mut f = std::fs::File::create(&path).expect("create");
    write_gguf(&mut f, &kvs, &tensors, 32).expect("write");
    drop(f);
    let out = glmcheck(&["inspect", path_str(&path), "--json"]);
    let r = json_of(&out);
    let special = &r["tokenizer"]["special"];
    assert_eq!(special["cls"]["id"], 5, "{special}");
    assert_eq!(special["fim_pre"]["id"], 6, "{special}");
    assert!(special["cls"]["text"].is_string(), "{special}");
}
