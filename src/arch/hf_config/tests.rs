//! The comparison of config.json with the GGUF's config, field by field, on GLM-5's own config.json
//! edited one key at a time.

use std::path::Path;

use serde_json::{Map, Value};

use super::table::DIMS;
use super::*;
use crate::arch::config::Source;
use crate::arch::Config;

/// GLM-5's config.json (zai-org/GLM-5, as in fixtures/hf_config/glm5.json).
const GLM5: &str = r#"{
  "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
  "hidden_act": "silu", "hidden_size": 6144, "num_hidden_layers": 78,
  "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048,
  "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
  "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "moe_intermediate_size": 2048, "intermediate_size": 12288, "first_k_dense_replace": 3,
  "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
  "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
  "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
  "indexer_rope_interleave": true, "rope_interleave": true,
  "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
  "rms_norm_eps": 1e-05, "vocab_size": 154880, "max_position_embeddings": 202752,
  "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "some_future_key": [1, 2]
}"#;

fn edited(edit: impl FnOnce(&mut Map<String, Value>)) -> HfConfig {
    let mut v: Value = serde_json::from_str(GLM5).expect("GLM5 is JSON");
    edit(v.as_object_mut().expect("object"));
    HfConfig::parse(Path::new("config.json"), &v.to_string()).expect("parses")
}

fn run(hf: &HfConfig) -> HfConfigCheck {
    check(hf, &Config::glm5(), &[])
}

fn kinds(c: &HfConfigCheck) -> Vec<(&str, bool, &FindingKind)> {
    c.findings
        .iter()
        .map(|f| (f.field.as_str(), f.harmless, &f.kind))
        .collect()
}

#[test]
fn glm5_config_agrees_with_glm5() {
    let c = run(&edited(|_| {}));
    assert!(c.findings.is_empty(), "{:?}", c.findings);
    assert!(!c.fails());
    assert!(c.rows.iter().all(|r| r.verdict == Verdict::Agrees));
    for f in [
        "topk_method",
        "scoring_func",
        "indexer_rope_interleave",
        "rope_theta",
    ] {
        assert!(c.rows.iter().any(|r| r.field == f), "no row for {f}");
    }
}

#[test]
fn no_topk_method_means_no_correction_bias() {
    let c = run(&edited(|m| {
        m.remove("topk_method");
    }));
    assert_eq!(
        kinds(&c),
        vec![(
            "topk_method",
            false,
            &FindingKind::NoCorrectionBias { topk_method: None }
        )]
    );
    assert!(c.fails());
    let c = run(&edited(|m| {
        m.insert("topk_method".into(), "greedy".into());
    }));
    assert_eq!(
        c.findings[0].kind,
        FindingKind::NoCorrectionBias {
            topk_method: Some("greedy".into())
        }
    );
}

#[test]
fn no_scoring_func_means_softmax() {
    let c = run(&edited(|m| {
        m.remove("scoring_func");
    }));
    assert_eq!(
        c.findings,
        vec![Finding {
            field: "scoring_func".into(),
            harmless: false,
            kind: FindingKind::Scoring {
                vllm: Some("softmax".into()),
                vllm_from: Origin::VllmDefault,
                gguf: "sigmoid".into()
            }
        }]
    );
}

#[test]
fn no_or_false_indexer_rope_interleave_means_neox() {
    for (edit, key) in [
        (None, Key::Absent),
        (Some(Value::Bool(false)), Key::Set(false)),
        (Some(Value::Null), Key::Null),
    ] {
        let c = run(&edited(|m| match edit {
            None => {
                m.remove("indexer_rope_interleave");
            }
            Some(v) => {
                m.insert("indexer_rope_interleave".into(), v);
            }
        }));
        assert_eq!(
            kinds(&c),
            vec![(
                "indexer_rope_interleave",
                false,
                &FindingKind::IndexerRopeNeox {
                    indexer_rope_interleave: key.clone()
                }
            )]
        );
    }
}

#[test]
fn removed_index_topk_keeps_dsa_at_the_class_default() {
    let hf = edited(|m| {
        m.remove("index_topk");
    });
    let c = run(&hf);
    assert_eq!(
        kinds(&c),
        vec![(
            "index_topk",
            true,
            &FindingKind::IndexTopkDefault {
                vllm: 2048,
                gguf: 2048
            }
        )]
    );
    assert!(!c.fails(), "GLM-5's own top-k: harmless");
    // A model whose top-k is not 2048 (the tiny fixture's 8) gets 2048 in vLLM: a finding.
    let mut cfg = Config::glm5();
    cfg.index_topk = 8;
    let c = check(&hf, &cfg, &[]);
    assert!(c.fails());
    assert_eq!(
        c.findings[0].kind,
        FindingKind::IndexTopkDefault {
            vllm: 2048,
            gguf: 8
        }
    );
}

#[test]
fn absent_declared_dimension_takes_the_class_default() {
    let hf = edited(|m| {
        m.remove("hidden_size");
    });
    assert!(run(&hf).findings.is_empty(), "6144 is GLM-5's");
    let mut cfg = Config::glm5();
    cfg.hidden_size = 256;
    let c = check(&hf, &cfg, &[]);
    assert_eq!(
        kinds(&c),
        vec![(
            "hidden_size",
            false,
            &FindingKind::Mismatch {
                vllm: Value::from(6144u64),
                vllm_from: Origin::TransformersDefault,
                gguf: Value::from(256u64),
                gguf_defaulted: false
            }
        )]
    );
}

#[test]
fn every_dimension_mismatch_is_named() {
    for dim in DIMS {
        let name = dim.field;
        let gguf = (dim.gguf)(&Config::glm5()) as u64;
        let c = run(&edited(|m| {
            m.insert(name.into(), Value::from(gguf + 1));
        }));
        let f: Vec<_> = c.findings.iter().filter(|f| f.field == name).collect();
        assert_eq!(f.len(), 1, "{name}: {:?}", c.findings);
        let harmless = matches!(name, "max_position_embeddings" | "num_key_value_heads");
        assert_eq!(f[0].harmless, harmless, "{name}");
        assert_eq!(c.fails(), !harmless, "{name}");
    }
}

#[test]
fn float_and_bool_mismatches() {
    let c = run(&edited(|m| {
        m.insert("rms_norm_eps".into(), Value::from(1e-6));
        m.insert("routed_scaling_factor".into(), Value::from(1.0));
        m.insert("norm_topk_prob".into(), Value::Bool(false));
    }));
    let fields: Vec<&str> = c.findings.iter().map(|f| f.field.as_str()).collect();
    assert_eq!(
        fields,
        vec!["norm_topk_prob", "routed_scaling_factor", "rms_norm_eps"]
    );
    // The GGUF's f32 1e-5 (9.99999974738e-6) is the same value.
    let mut cfg = Config::glm5();
    cfg.rms_norm_eps = 1e-5f32 as f64;
    assert!(check(&edited(|_| {}), &cfg, &[]).findings.is_empty());
}

#[test]
fn rope_theta_sources_and_default() {
    // Top-level rope_theta (older configs) is honoured when the dict has none.
    let c = run(&edited(|m| {
        m.remove("rope_parameters");
        m.insert("rope_theta".into(), Value::from(1e6));
    }));
    assert!(c.findings.is_empty(), "{:?}", c.findings);
    // Nowhere: transformers' default_theta 10000.
    let c = run(&edited(|m| {
        m.remove("rope_parameters");
    }));
    assert_eq!(
        kinds(&c),
        vec![(
            "rope_theta",
            false,
            &FindingKind::Mismatch {
                vllm: Value::from(10000.0),
                vllm_from: Origin::TransformersDefault,
                gguf: Value::from(1e6),
                gguf_defaulted: false
            }
        )]
    );
}

#[test]
fn yarn_rope_scaling_changes_rope_and_softmax_scale() {
    let c = run(&edited(|m| {
        m.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0,
                               "rope_theta": 1e6}),
        );
    }));
    assert_eq!(c.findings.len(), 1, "{:?}", c.findings);
    match &c.findings[0].kind {
        FindingKind::RopeScaling {
            rope_type,
            vllm_rope,
            factor,
            softmax_scale_factor,
        } => {
            assert_eq!(rope_type, "yarn");
            assert_eq!(vllm_rope, "deepseek_yarn");
            assert_eq!(*factor, Some(4.0));
            let m = 0.1 * 4f64.ln() + 1.0;
            assert!((softmax_scale_factor - m * m).abs() < 1e-12);
        }
        k => panic!("{k:?}"),
    }
    let c = run(&edited(|m| {
        m.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6}),
        );
    }));
    assert_eq!(
        c.findings[0].kind,
        FindingKind::StartFailure(StartFailure::RopeWithoutFactor {
            rope_type: "yarn".into()
        })
    );
}

#[test]
fn group_routing_mismatch() {
    let c = run(&edited(|m| {
        m.insert("n_group".into(), Value::from(8u64));
        m.insert("topk_group".into(), Value::from(4u64));
    }));
    let fields: Vec<&str> = c.findings.iter().map(|f| f.field.as_str()).collect();
    assert_eq!(fields, vec!["n_group", "topk_group"]);
    assert!(c.fails());
}

#[test]
fn nextn_and_tied_embeddings() {
    let c = run(&edited(|m| {
        m.remove("num_nextn_predict_layers");
    }));
    assert_eq!(
        kinds(&c),
        vec![(
            "num_nextn_predict_layers",
            true,
            &FindingKind::NextnLayers {
                vllm: 0,
                vllm_from: Origin::VllmDefault,
                gguf: 1
            }
        )]
    );
    assert!(!c.fails());
    // Config ties, GGUF has its own lm_head: vLLM ignores the flag.
    let c = run(&edited(|m| {
        m.insert("tie_word_embeddings".into(), Value::Bool(true));
    }));
    assert_eq!(
        kinds(&c),
        vec![(
            "tie_word_embeddings",
            true,
            &FindingKind::TiedEmbeddings {
                vllm_tie: true,
                gguf_tied: false
            }
        )]
    );
    // GGUF without output.weight: vLLM's lm_head gets no weight.
    let mut cfg = Config::glm5();
    cfg.tie_word_embeddings = true;
    let c = check(&edited(|_| {}), &cfg, &[]);
    assert!(c.fails());
}

#[test]
fn indexer_schedule() {
    // GLM-5.2's keys: the indexer runs on layers 0, 1, 2, then every 4th.
    let c = run(&edited(|m| {
        m.insert("index_topk_freq".into(), Value::from(4u64));
        m.insert("index_skip_topk_offset".into(), Value::from(3u64));
        m.insert("num_hidden_layers".into(), Value::from(8u64));
    }));
    let skipped = c
        .findings
        .iter()
        .find_map(|f| match &f.kind {
            FindingKind::IndexerSkipped { layers, .. } => Some(layers.clone()),
            _ => None,
        })
        .expect("skipped layers named");
    // (l - 3 + 1).max(0) % 4 != 0  →  3, 4, 5 skipped; 6 full; 7 skipped.
    assert_eq!(skipped, vec![3, 4, 5, 7]);
    assert!(!c
        .findings
        .iter()
        .any(|f| matches!(f.kind, FindingKind::IndexerTypesDisagree { .. })));
    // An explicit indexer_types that vLLM does not read.
    let c = run(&edited(|m| {
        m.insert("num_hidden_layers".into(), Value::from(4u64));
        m.insert(
            "indexer_types".into(),
            serde_json::json!(["full", "full", "full", "shared"]),
        );
    }));
    assert!(c.findings.iter().any(|f| f.kind
        == FindingKind::IndexerTypesDisagree {
            transformers_shared: vec![3],
            vllm_skipped: vec![]
        }));
    let c = run(&edited(|m| {
        m.insert("index_topk_freq".into(), Value::from(0u64));
    }));
    assert!(c
        .findings
        .iter()
        .any(|f| f.kind == FindingKind::StartFailure(StartFailure::ZeroIndexTopkFreq)));
}

#[test]
fn identity_and_activation() {
    let c = run(&edited(|m| {
        m.insert("model_type".into(), "deepseek_v32".into());
        m.insert(
            "architectures".into(),
            serde_json::json!(["DeepseekV32ForCausalLM"]),
        );
        m.insert("hidden_act".into(), "gelu".into());
    }));
    assert_eq!(
        kinds(&c),
        vec![
            (
                "model_type",
                false,
                &FindingKind::ModelType {
                    model_type: Some("deepseek_v32".into())
                }
            ),
            (
                "architectures",
                true,
                &FindingKind::Architecture {
                    architecture: Some("DeepseekV32ForCausalLM".into())
                }
            ),
            (
                "hidden_act",
                false,
                &FindingKind::StartFailure(StartFailure::UnsupportedActivation {
                    hidden_act: "gelu".into()
                })
            ),
        ]
    );
}

#[test]
fn moe_layer_freq_makes_layers_dense() {
    let mut cfg = Config::glm5();
    cfg.num_hidden_layers = 6;
    let c = check(
        &edited(|m| {
            m.insert("moe_layer_freq".into(), Value::from(2u64));
            m.insert("num_hidden_layers".into(), Value::from(6u64));
        }),
        &cfg,
        &[],
    );
    assert_eq!(
        kinds(&c),
        vec![(
            "moe_layer_freq",
            false,
            &FindingKind::MoeLayerFreq {
                moe_layer_freq: 2,
                dense: vec![3, 5]
            }
        )]
    );
}

#[test]
fn gguf_default_is_marked() {
    let sources = vec![(
        "hidden_size".to_string(),
        Source::Default("glm-dsa.embedding_length".into()),
    )];
    let c = check(
        &edited(|m| {
            m.insert("hidden_size".into(), Value::from(256u64));
        }),
        &Config::glm5(),
        &sources,
    );
    assert!(matches!(
        c.findings[0].kind,
        FindingKind::Mismatch {
            gguf_defaulted: true,
            ..
        }
    ));
}

#[test]
fn malformed_input_names_file_and_field() {
    let p = Path::new("/x/config.json");
    let e = HfConfig::parse(p, r#"{"hidden_size": "6144"}"#).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("/x/config.json") && s.contains("`hidden_size`"),
        "{s}"
    );
    assert!(
        s.contains("non-negative integer") && s.contains("\"6144\""),
        "{s}"
    );
    let e = HfConfig::parse(p, r#"{"index_topk": null}"#).unwrap_err();
    assert!(e.to_string().contains("`index_topk`"), "{e}");
    let e = HfConfig::parse(p, r#"{"rope_parameters": {"rope_theta": "big"}}"#).unwrap_err();
    assert!(
        e.to_string().contains("`rope_parameters.rope_theta`"),
        "{e}"
    );
    let e = HfConfig::parse(p, "[1, 2]").unwrap_err();
    assert!(
        matches!(
            e,
            HfConfigError::NotObject {
                found: "an array",
                ..
            }
        ),
        "{e}"
    );
    let e = HfConfig::parse(p, "{\"a\": ").unwrap_err();
    assert!(matches!(e, HfConfigError::Json { .. }), "{e}");
    // Unknown keys and nulls where vLLM's getattr tolerates them are fine.
    let hf = HfConfig::parse(
        p,
        r#"{"quantization_config": {"x": 1}, "topk_method": null}"#,
    )
    .expect("parses");
    assert_eq!(hf.topk_method, Key::Null);
}

#[test]
fn read_refuses_directories_and_huge_files() {
    let dir = std::env::temp_dir();
    assert!(matches!(
        HfConfig::read(&dir),
        Err(HfConfigError::IsDirectory { .. })
    ));
    assert!(matches!(
        HfConfig::read(&dir.join("glmcheck-no-such-config.json")),
        Err(HfConfigError::Io { .. })
    ));
}

#[test]
fn one_row_per_table_field_in_order() {
    let c = run(&edited(|_| {}));
    let fields: Vec<&str> = c.rows.iter().map(|r| r.field.as_str()).collect();
    // GLM-5's config has no indexer-schedule key: no index_topk_freq row.
    let table: Vec<&str> = super::table::rows()
        .map(|r| r.field)
        .filter(|f| *f != "index_topk_freq")
        .collect();
    assert_eq!(fields, table);
    assert_eq!(fields.len(), 36);
    assert_eq!(
        (fields[0], fields[8], fields[35]),
        ("model_type", "num_hidden_layers", "tie_word_embeddings")
    );
}

#[test]
fn absent_undeclared_key_shows_vllms_getattr_default() {
    let sources = vec![(
        "num_nextn_predict_layers".to_string(),
        Source::Metadata("glm-dsa.nextn_predict_layers".into()),
    )];
    let c = check(
        &edited(|m| {
            m.remove("moe_layer_freq");
            m.remove("num_nextn_predict_layers");
        }),
        &Config::glm5(),
        &sources,
    );
    let row = |f: &str| {
        c.rows
            .iter()
            .find(|r| r.field == f)
            .unwrap_or_else(|| panic!("no row {f}"))
    };
    let freq = row("moe_layer_freq");
    assert_eq!(freq.json, Key::Absent);
    assert_eq!(
        (&freq.vllm, freq.vllm_from, freq.verdict),
        (&Value::from(1u64), Origin::VllmDefault, Verdict::Agrees)
    );
    assert_eq!(freq.gguf_from, None, "fixed by the architecture");
    let nextn = row("num_nextn_predict_layers");
    assert_eq!(
        (&nextn.vllm, nextn.vllm_from, &nextn.gguf, nextn.verdict),
        (
            &Value::from(0u64),
            Origin::VllmDefault,
            &Value::from(1u64),
            Verdict::Harmless
        )
    );
    assert_eq!(nextn.gguf_from, Some(sources[0].1.clone()));
    assert!(!c.fails());
}

#[test]
fn verdicts_follow_the_findings() {
    // The other CUDA architecture name: a harmless finding, the row harmless.
    let c = run(&edited(|m| {
        m.insert(
            "architectures".into(),
            serde_json::json!(["DeepseekV32ForCausalLM"]),
        );
    }));
    let arch = c
        .rows
        .iter()
        .find(|r| r.field == "architectures")
        .expect("row");
    assert_eq!(arch.verdict, Verdict::Harmless);
    assert!(!c.fails());
    let c = run(&edited(|m| {
        m.insert("index_topk_freq".into(), Value::from(0u64));
        m.insert("num_hidden_layers".into(), Value::from(4u64));
    }));
    let sched = c
        .rows
        .iter()
        .find(|r| r.field == "index_topk_freq")
        .expect("a schedule key gives the row");
    assert_eq!(sched.verdict, Verdict::Finding);
    assert_eq!(sched.vllm, Value::from(0u64));
}
