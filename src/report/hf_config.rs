//! Words for `--hf-config`: the deployment's config.json against the GGUF (see `arch::hf_config`).

use serde_json::{json, Value};

use super::table;
use crate::arch::config::Source;
use crate::arch::hf_config::{
    FieldRow, Finding, FindingKind, HfConfigCheck, Key, Origin, StartFailure, Verdict,
};

fn key_text<T: std::fmt::Display>(k: &Key<T>) -> String {
    match k {
        Key::Absent => "absent".into(),
        Key::Null => "null".into(),
        Key::Set(v) => v.to_string(),
    }
}

fn json_cell(k: &Key<Value>) -> String {
    match k {
        Key::Absent => "(absent)".into(),
        Key::Null => "null".into(),
        Key::Set(v) => v.to_string(),
    }
}

fn origin_note(o: Origin) -> &'static str {
    match o {
        Origin::ConfigJson => "",
        Origin::TransformersDefault => " (absent: transformers' GlmMoeDsaConfig default)",
        Origin::VllmDefault => " (absent: vLLM's getattr default)",
    }
}

fn gguf_from(s: &Option<Source>) -> String {
    match s {
        Some(Source::Metadata(k)) => k.clone(),
        Some(Source::Derived(_)) => "derived".into(),
        Some(Source::Default(k)) => format!("GLM-5 default (no {k})"),
        None => "glm-dsa architecture".into(),
    }
}

fn value_text(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

fn layers(v: &[usize]) -> String {
    const SHOWN: usize = 12;
    let mut s: Vec<String> = v.iter().take(SHOWN).map(|l| l.to_string()).collect();
    if v.len() > SHOWN {
        s.push(format!("… ({} layers)", v.len()));
    }
    s.join(", ")
}

/// What a plain value mismatch of `field` changes in vLLM.
fn consequence(field: &str) -> &'static str {
    match field {
        "num_hidden_layers" => "vLLM builds that many decoder layers",
        "hidden_size" | "q_lora_rank" | "kv_lora_rank" | "qk_nope_head_dim" | "v_head_dim"
        | "moe_intermediate_size" | "intermediate_size" => {
            "vLLM's parameter shapes disagree with the weights: loading fails or reads the wrong slices"
        }
        "qk_rope_head_dim" => {
            "the MLA and indexer rope widths change: loading fails or rotates the wrong dimensions"
        }
        "num_attention_heads" => "the heads per rank and the MLA head split change",
        "n_routed_experts" => "the router's width and the expert stacks change",
        "num_experts_per_tok" => "vLLM mixes that many routed experts per token",
        "n_shared_experts" => {
            "the shared expert's width (moe_intermediate_size × n_shared_experts) changes"
        }
        "n_group" | "topk_group" => {
            "vLLM's grouped top-k restricts each token to topk_group of n_group expert groups: \
             a different expert choice"
        }
        "routed_scaling_factor" => "the routed experts' sum is scaled by a different factor",
        "norm_topk_prob" => "the top-k routing weights are renormalized differently",
        "first_k_dense_replace" => "the boundary between dense and MoE layers moves",
        "index_n_heads" | "index_head_dim" => "the DSA indexer's projections change shape",
        "index_topk" => "each query keeps a different number of keys",
        "rope_theta" => "every rotary frequency changes (MLA and indexer)",
        "rms_norm_eps" => "every RMSNorm uses a different epsilon",
        "vocab_size" => "the embedding and lm_head sizes change",
        "max_position_embeddings" => {
            "only the rope cache length and the longest context change (harmless)"
        }
        "num_key_value_heads" => "vLLM's MLA attention never reads it (harmless)",
        _ => "vLLM computes with a different value",
    }
}

/// The sentence for one finding: what vLLM 0.33 will do, and the line of its source it rests on.
pub fn finding_text(f: &Finding) -> String {
    match &f.kind {
        FindingKind::NoCorrectionBias { topk_method } => format!(
            "topk_method is {}, not \"noaux_tc\": vLLM 0.33 creates no \
             mlp.gate.e_score_correction_bias (deepseek_v2.py:327-332), so its router picks the \
             top experts without GLM-5's correction bias (exp_probs_b) — other experts wherever \
             the bias decides the top-k — and a loader that does not skip unknown names fails on \
             the checkpoint's bias (no such parameter)",
            topk_method
                .as_ref()
                .map_or("absent".to_string(), |m| format!("{m:?}"))
        ),
        FindingKind::Scoring {
            vllm,
            vllm_from,
            gguf,
        } => format!(
            "scoring_func: vLLM 0.33 scores the router with {}{} (deepseek_v2.py:387 \
             `getattr(config, \"scoring_func\", \"softmax\")`) where the GGUF's model uses {gguf}",
            vllm.as_deref().unwrap_or("None"),
            origin_note(*vllm_from)
        ),
        FindingKind::IndexerRopeNeox {
            indexer_rope_interleave,
        } => format!(
            "indexer_rope_interleave is {}: vLLM 0.33 rotates the DSA indexer's q and k \
             half-split (NeoX; deepseek_v32/attention.py:283 `is_neox_style=not getattr(config, \
             \"indexer_rope_interleave\", False)`) while transformers, llama.cpp and glmcheck \
             rotate interleaved pairs: short prompts look fine, long-context top-k picks other keys",
            key_text(indexer_rope_interleave)
        ),
        FindingKind::IndexTopkDefault { vllm, gguf } => index_topk_default_text(*vllm, *gguf),
        FindingKind::IndexerSkipped {
            layers: l,
            num_hidden_layers,
        } => format!(
            "vLLM 0.33 builds no indexer on layer(s) {} of {num_hidden_layers} \
             (index_topk_freq / index_skip_topk_offset / index_topk_pattern; \
             deepseek_v32/attention.py:166-187): they reuse the previous layer's top-k, while the \
             GGUF's model (and glmcheck's forward) runs every layer's indexer",
            layers(l)
        ),
        FindingKind::IndexerTypesDisagree {
            transformers_shared,
            vllm_skipped,
        } => format!(
            "transformers shares the indexer on layer(s) [{}] (indexer_types; \
             configuration_glm_moe_dsa.py:137-148) while vLLM 0.33, which never reads \
             indexer_types, skips it on [{}]",
            layers(transformers_shared),
            layers(vllm_skipped)
        ),
        FindingKind::RopeScaling {
            rope_type,
            vllm_rope,
            factor,
            softmax_scale_factor,
        } => format!(
            "rope_type {rope_type:?}{}: vLLM 0.33 builds {vllm_rope} RoPE for MLA and the indexer \
             and multiplies the attention softmax scale by {} (deepseek_v32/attention.py:153-164), \
             where the GGUF's model uses plain RoPE",
            factor.map_or(String::new(), |x| format!(" (factor {x})")),
            super::num(*softmax_scale_factor)
        ),
        FindingKind::MoeLayerFreq {
            moe_layer_freq,
            dense,
        } => moe_layer_freq_text(*moe_layer_freq, dense),
        FindingKind::ModelType { model_type } => format!(
            "model_type is {}, not \"glm_moe_dsa\": vLLM 0.33 loads it with another config class \
             (none of GlmMoeDsaConfig's defaults; transformers_utils/config.py:417-447) and stops \
             forcing f32 router logits (deepseek_v2.py:139-142)",
            model_type
                .as_ref()
                .map_or("absent".to_string(), |m| format!("{m:?}"))
        ),
        FindingKind::Architecture { architecture } => match architecture.as_deref() {
            Some("DeepseekV32ForCausalLM") => "architectures[0] is \"DeepseekV32ForCausalLM\": \
                 on CUDA vLLM 0.33 builds the same class as for GlmMoeDsaForCausalLM \
                 (registry.py:95-98, 126)"
                .to_string(),
            other => format!(
                "architectures[0] is {}: vLLM 0.33 builds that class, not GlmMoeDsaForCausalLM \
                 (model_executor/models/registry.py:126)",
                other.map_or("absent".to_string(), |a| format!("{a:?}"))
            ),
        },
        FindingKind::StartFailure(s) => start_failure_text(s),
        FindingKind::TiedEmbeddings {
            vllm_tie,
            gguf_tied,
        } => tied_text(*vllm_tie, *gguf_tied),
        FindingKind::NextnLayers {
            vllm,
            vllm_from,
            gguf,
        } => format!(
            "num_nextn_predict_layers: vLLM 0.33 sees {vllm}{} where the GGUF holds {gguf} MTP \
             layer(s): only MTP weight skipping and MTP speculative decoding follow it \
             (model_executor/models/utils.py:589, config/speculative.py:733-760); the served \
             model's outputs do not",
            origin_note(*vllm_from)
        ),
        FindingKind::Mismatch {
            vllm,
            vllm_from,
            gguf,
            gguf_defaulted,
        } => mismatch_text(&f.field, vllm, *vllm_from, gguf, *gguf_defaulted),
    }
}

/// `index_topk` absent: what vLLM's class default keeps against the GGUF's top-k.
fn index_topk_default_text(vllm: u64, gguf: u64) -> String {
    let base = format!(
        "index_topk is absent, which does not switch DSA off in vLLM 0.33: transformers' \
         GlmMoeDsaConfig declares index_topk = {vllm} and vLLM's DSA model is always \
         sparse (deepseek_v32/nvidia/model.py:188-197)"
    );
    if vllm == gguf {
        format!(
            "{base}; it keeps the top-{vllm} keys, as the GGUF does (only a patched vLLM \
             runs dense: `glmcheck forward --dsa dense` shows what that computes)"
        )
    } else if vllm > gguf {
        format!(
            "{base}; it keeps the top-{vllm} keys where the GGUF's model keeps {gguf}: \
             every key of a context up to {vllm} tokens, i.e. dense attention there \
             (`glmcheck forward --dsa dense` computes that)"
        )
    } else {
        format!("{base}; it keeps the top-{vllm} keys where the GGUF's model keeps {gguf}")
    }
}

/// `moe_layer_freq` ≠ 1: the layers that become dense.
fn moe_layer_freq_text(moe_layer_freq: u64, dense: &[usize]) -> String {
    if dense.is_empty() {
        format!("moe_layer_freq {moe_layer_freq}: no MoE layer of this model is affected")
    } else {
        format!(
            "moe_layer_freq {moe_layer_freq}: vLLM 0.33 builds a dense MLP on layer(s) {} \
             (deepseek_v32/nvidia/model.py:91-95 `layer_idx % moe_layer_freq == 0`) whose \
             GGUF blocks hold routed experts",
            layers(dense)
        )
    }
}

/// Why vLLM refuses to build the model.
fn start_failure_text(s: &StartFailure) -> String {
    match s {
        StartFailure::UnsupportedActivation { hidden_act } => format!(
            "hidden_act {hidden_act:?}: vLLM 0.33 refuses to build the MoE (ValueError: only \
             silu, deepseek_v2.py:314-318)"
        ),
        StartFailure::ZeroIndexTopkFreq => "index_topk_freq 0: vLLM 0.33 fails building the \
             attention (`% index_topk_freq` divides by zero, deepseek_v32/attention.py:171)"
            .to_string(),
        StartFailure::RopeWithoutFactor { rope_type } => format!(
            "rope_type {rope_type:?} without a factor: vLLM 0.33 fails building the attention \
             (KeyError 'factor', deepseek_v32/attention.py:162)"
        ),
    }
}

/// Tied embeddings on either side.
fn tied_text(vllm_tie: bool, gguf_tied: bool) -> String {
    if gguf_tied {
        format!(
            "the GGUF has no output.weight (tied embeddings){}: vLLM 0.33 never ties \
             (deepseek_v2.py:1917-1923 builds its own ParallelLMHead), so its lm_head \
             gets no weight: garbage logits",
            if vllm_tie {
                ", and config.json ties"
            } else {
                ", while config.json does not tie"
            }
        )
    } else {
        "config.json ties the embeddings but the GGUF has its own output.weight: vLLM 0.33 \
         ignores the flag and loads output.weight (transformers would use the embedding)"
            .to_string()
    }
}

/// A plain value mismatch and what it changes.
fn mismatch_text(
    field: &str,
    vllm: &Value,
    vllm_from: Origin,
    gguf: &Value,
    gguf_defaulted: bool,
) -> String {
    format!(
        "{}: vLLM 0.33 uses {}{} where the GGUF has {}{}: {}",
        field,
        value_text(vllm),
        origin_note(vllm_from),
        value_text(gguf),
        if gguf_defaulted {
            " (GLM-5's default: the GGUF does not say)"
        } else {
            ""
        },
        consequence(field)
    )
}

fn verdict_word(v: Verdict) -> &'static str {
    match v {
        Verdict::Agrees => "agrees",
        Verdict::Finding => "FINDING",
        Verdict::Harmless => "harmless",
    }
}

fn row_cells(r: &FieldRow) -> Vec<String> {
    vec![
        r.field.clone(),
        json_cell(&r.json),
        format!("{}{}", value_text(&r.vllm), origin_note(r.vllm_from)),
        format!("{} ({})", value_text(&r.gguf), gguf_from(&r.gguf_from)),
        verdict_word(r.verdict).to_string(),
    ]
}

/// Human output: every field vLLM reads, then one sentence per finding, then the verdict.
pub fn hf_config_text(c: &HfConfigCheck) -> String {
    let mut out = format!(
        "\ndeployment config {}: what vLLM 0.33 builds from it, against the GGUF\n",
        c.path
    );
    let mut t = table(&["field", "config.json", "vLLM 0.33 uses", "GGUF", "verdict"]);
    for r in &c.rows {
        t.add_row(row_cells(r));
    }
    out.push_str(&t.to_string());
    out.push('\n');
    let (bad, harmless): (Vec<&Finding>, Vec<&Finding>) =
        c.findings.iter().partition(|f| !f.harmless);
    for f in &bad {
        out.push_str(&format!("finding: {}\n", finding_text(f)));
    }
    for f in &harmless {
        out.push_str(&format!("harmless: {}\n", finding_text(f)));
    }
    out.push_str(&format!(
        "hf-config: {} field(s) compared: {} change what vLLM 0.33 computes, {} harmless — {}\n",
        c.rows.len(),
        bad.len(),
        harmless.len(),
        if c.fails() { "fail" } else { "pass" }
    ));
    out
}

/// JSON: the typed rows and findings, each finding with its sentence.
pub fn hf_config_json(c: &HfConfigCheck) -> Value {
    let findings: Vec<Value> = c
        .findings
        .iter()
        .map(|f| {
            let mut v = serde_json::to_value(f).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v {
                m.insert("message".into(), Value::String(finding_text(f)));
            }
            v
        })
        .collect();
    json!({
        "path": c.path,
        "verdict": if c.fails() { "fail" } else { "pass" },
        "rows": c.rows,
        "findings": findings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::hf_config::{check, HfConfig};
    use crate::arch::Config;
    use std::path::Path;

    fn glm5_without(key: &str) -> HfConfigCheck {
        let mut v = json!({
            "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
            "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "indexer_rope_interleave": true, "num_nextn_predict_layers": 1,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}
        });
        v.as_object_mut().expect("object").remove(key);
        let hf = HfConfig::parse(Path::new("c.json"), &v.to_string()).expect("parses");
        check(&hf, &Config::glm5(), &[])
    }

    #[test]
    fn sentences_name_what_vllm_does() {
        let c = glm5_without("topk_method");
        let t = hf_config_text(&c);
        assert!(
            t.contains("e_score_correction_bias") && t.contains("— fail"),
            "{t}"
        );
        let c = glm5_without("scoring_func");
        assert!(hf_config_text(&c).contains("with softmax"));
        let c = glm5_without("indexer_rope_interleave");
        assert!(hf_config_text(&c).contains("half-split (NeoX"));
        let c = glm5_without("num_nextn_predict_layers");
        let t = hf_config_text(&c);
        assert!(
            t.contains("harmless: num_nextn_predict_layers") && t.contains("— pass"),
            "{t}"
        );
    }

    #[test]
    fn json_carries_typed_findings_and_messages() {
        let v = hf_config_json(&glm5_without("topk_method"));
        assert_eq!(v["verdict"], "fail");
        assert_eq!(v["findings"][0]["kind"], "no_correction_bias");
        assert_eq!(v["findings"][0]["field"], "topk_method");
        assert_eq!(v["findings"][0]["harmless"], false);
        assert!(v["findings"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("deepseek_v2.py:327")));
        assert!(v["rows"].as_array().is_some_and(|r| r.len() > 20));
    }
}
