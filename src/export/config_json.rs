//! The exported checkpoint's `config.json`: every field transformers 5.23's `GlmMoeDsaConfig`
//! declares (`configuration_glm_moe_dsa.py`), keys sorted as `save_pretrained` writes them, plus the
//! three keys GLM-5's own config.json carries for vLLM that transformers does not declare
//! (`topk_method`, `scoring_func`, `indexer_rope_interleave`: without them vLLM 0.33 drops the
//! correction bias, routes by softmax and rotates the indexer half-split — see `arch::hf_config`).
//! The dimensions are `arch::hf_config`'s declared-dimension table, so this file and the
//! `--hf-config` check cannot drift apart.

use serde_json::{json, Map, Value};

use super::ExportDtype;
use crate::arch::Config;
use crate::gguf::{GgufModel, Value as GgufValue};

/// The token ids config.json takes from the GGUF's tokenizer metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u64>,
    /// eos, then eot and eom (llama.cpp's converter writes GLM's three end tokens `[<|endoftext|>,
    /// <|user|>, <|observation|>]` there), without repeats.
    pub eos: Vec<u64>,
}

impl SpecialIds {
    /// `tokenizer.ggml.{bos,eos,eot,eom}_token_id`, where present.
    pub fn read(model: &GgufModel) -> Self {
        let id = |k: &str| {
            model
                .value(&format!("tokenizer.ggml.{k}_token_id"))
                .and_then(GgufValue::as_u64)
        };
        let mut eos = Vec::new();
        for v in ["eos", "eot", "eom"].into_iter().filter_map(id) {
            if !eos.contains(&v) {
                eos.push(v);
            }
        }
        SpecialIds {
            bos: id("bos"),
            eos,
        }
    }
}

/// A float the GGUF stored as f32, written as the shortest decimal that gives that f32 back (the GGUF's
/// 1e-5 is 9.99999974e-6 as f32 widened: config.json says 1e-05).
fn f32_decimal(x: f64) -> Value {
    let f = x as f32;
    if f64::from(f) != x || !f.is_finite() {
        return json!(x);
    }
    json!(f.to_string().parse::<f64>().unwrap_or(x))
}

/// config.json for `c` (already the exported layer subset) in `dtype`.
pub fn config_json(c: &Config, dtype: ExportDtype, ids: &SpecialIds) -> Value {
    let n = c.num_hidden_layers;
    let mut m = Map::new();
    for (field, v) in crate::arch::hf_config::declared_dims(c) {
        m.insert(field.into(), json!(v));
    }
    let mlp_types: Vec<&str> = (0..n)
        .map(|l| if c.is_moe_layer(l) { "sparse" } else { "dense" })
        .collect();
    let eos = match ids.eos.as_slice() {
        [] => Value::Null,
        [one] => json!(one),
        many => json!(many),
    };
    let fields = [
        ("architectures", json!(["GlmMoeDsaForCausalLM"])),
        ("model_type", json!("glm_moe_dsa")),
        ("dtype", json!(dtype.torch_name())),
        ("attention_bias", json!(false)),
        ("attention_dropout", json!(0.0)),
        ("bos_token_id", json!(ids.bos)),
        ("eos_token_id", eos),
        // The GGUF's padding id is the converter's eos fallback: it cannot say whether the model had
        // a pad token, and none changes the forward.
        ("pad_token_id", Value::Null),
        // transformers overwrites head_dim with qk_rope_head_dim (`__post_init__`) and saves that.
        ("head_dim", json!(c.qk_rope_head_dim)),
        ("qk_head_dim", json!(c.qk_head_dim())),
        ("hidden_act", json!("silu")),
        ("initializer_range", json!(0.02)),
        ("mlp_bias", json!(false)),
        ("mlp_layer_types", json!(mlp_types)),
        ("layer_types", json!(vec!["indexed_attention"; n])),
        ("norm_topk_prob", json!(c.norm_topk_prob)),
        (
            "routed_scaling_factor",
            f32_decimal(c.routed_scaling_factor),
        ),
        ("rms_norm_eps", f32_decimal(c.rms_norm_eps)),
        (
            "rope_parameters",
            json!({ "rope_theta": f32_decimal(c.rope_theta), "rope_type": "default" }),
        ),
        // The MTP layers are not exported.
        ("num_nextn_predict_layers", json!(0)),
        ("output_router_logits", json!(false)),
        ("tie_word_embeddings", json!(c.tie_word_embeddings)),
        ("use_cache", json!(true)),
        ("topk_method", json!("noaux_tc")),
        ("scoring_func", json!(c.scoring_func)),
        ("indexer_rope_interleave", json!(true)),
    ];
    for (k, v) in fields {
        m.insert(k.into(), v);
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(rel: &str) -> Value {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
        let text = std::fs::read_to_string(&path).expect("fixture");
        serde_json::from_str(&text).expect("json")
    }

    fn tiny_ids() -> SpecialIds {
        SpecialIds {
            bos: Some(502),
            eos: vec![500, 507, 509],
        }
    }

    /// The tiny model's config is transformers' own config.json of it plus the three vLLM keys
    /// (fixtures/hf_config/tiny-vllm.json), key for key and value for value.
    #[test]
    fn the_tiny_config_is_transformers_own_plus_the_vllm_keys() {
        let ours = config_json(&Config::tiny(), ExportDtype::F32, &tiny_ids());
        assert_eq!(ours, fixture("fixtures/hf_config/tiny-vllm.json"));
        let transformers = fixture("fixtures/tiny/config.json");
        let (ours, theirs) = (ours.as_object().expect("obj"), transformers.as_object());
        for (k, v) in theirs.expect("obj") {
            assert_eq!(ours.get(k), Some(v), "{k}");
        }
        let mut extra: Vec<&str> = ours
            .keys()
            .filter(|k| !theirs.is_some_and(|t| t.contains_key(*k)))
            .map(String::as_str)
            .collect();
        extra.sort_unstable();
        assert_eq!(
            extra,
            ["indexer_rope_interleave", "scoring_func", "topk_method"]
        );
    }

    /// GLM-5's dimensions give zai-org's config.json values wherever transformers reads them.
    #[test]
    fn glm5_dimensions_give_the_published_config() {
        let ids = SpecialIds {
            bos: None,
            eos: vec![154820, 154827, 154829],
        };
        let ours = config_json(&Config::glm5(), ExportDtype::Bf16, &ids);
        let published = fixture("fixtures/hf_config/glm5.json");
        let published = published.as_object().expect("obj");
        // Keys of the hub file that transformers 5.23 does not declare and ignores (ep_size,
        // moe_layer_freq, pretraining_tp, rope_interleave), its version stamp, its pad id (the GGUF
        // cannot tell), and num_nextn_predict_layers (the export has no MTP layer).
        let skip = [
            "ep_size",
            "moe_layer_freq",
            "pretraining_tp",
            "rope_interleave",
            "transformers_version",
            "pad_token_id",
            "num_nextn_predict_layers",
        ];
        for (k, v) in published
            .iter()
            .filter(|(k, _)| !skip.contains(&k.as_str()))
        {
            let o = ours.get(k).unwrap_or_else(|| panic!("{k} missing"));
            // rope_theta is 1000000 (an int) in the hub file.
            assert!(
                o == v
                    || (o.as_f64().is_some() && o.as_f64() == v.as_f64())
                    || k == "rope_parameters",
                "{k}: {o} vs {v}"
            );
        }
        assert_eq!(ours["rope_parameters"]["rope_theta"].as_f64(), Some(1e6));
        assert_eq!(ours["mlp_layer_types"][2], "dense");
        assert_eq!(ours["mlp_layer_types"][3], "sparse");
        assert_eq!(ours["layer_types"].as_array().map(Vec::len), Some(78));
    }

    #[test]
    fn floats_the_gguf_stored_as_f32_are_written_as_their_shortest_decimal() {
        assert_eq!(f32_decimal(f64::from(1e-5f32)), json!(1e-5));
        assert_eq!(f32_decimal(f64::from(2.5f32)), json!(2.5));
        assert_eq!(f32_decimal(0.1), json!(0.1), "an f64 is kept as it is");
        let one = SpecialIds {
            bos: None,
            eos: vec![7],
        };
        let c = config_json(&Config::tiny(), ExportDtype::Bf16, &one);
        assert_eq!(
            (c["eos_token_id"].clone(), c["bos_token_id"].clone()),
            (json!(7), Value::Null)
        );
        assert_eq!(c["dtype"], "bfloat16");
    }
}
