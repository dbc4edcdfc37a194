//! The rules of the table's fields that are more than a value compared with the GGUF's: what vLLM
//! 0.33 does with each key (file:line in its wheel), and when that differs from what the GGUF,
//! llama.cpp, transformers and glmcheck's forward compute.

use serde_json::Value;

use super::check::{declared, key_value, same_f64, undeclared, Ctx, Judged};
use super::{FindingKind, HfConfig, Key, Origin, RopeDict, StartFailure};
use crate::arch::config::MAX_BLOCKS;

fn string_or_null(s: Option<String>) -> Value {
    s.map_or(Value::Null, Value::String)
}

// ---------------------------------------------------------------------------------------------
// Identity

/// transformers_utils/config.py:417-447: the model_type picks the config class (AutoConfig →
/// GlmMoeDsaConfig and its defaults for `glm_moe_dsa`; vLLM's registry's DeepseekV3Config for
/// `deepseek_v32`, :132), and deepseek_v2.py:139-142 forces f32 router logits only for
/// `model_type == "glm_moe_dsa"` ("Older GLM-5/5.2 configs require fp32 routing").
pub(super) fn model_type(x: &Ctx<'_>) -> Option<Judged> {
    let model_type = x.hf.model_type.set().cloned();
    let j = Judged::new(
        key_value(&x.hf.model_type),
        string_or_null(model_type.clone()),
        Origin::ConfigJson,
        Value::String("glm_moe_dsa".into()),
    );
    Some(j.finding_if(
        model_type.as_deref() != Some("glm_moe_dsa"),
        false,
        FindingKind::ModelType { model_type },
    ))
}

/// registry.py:126 maps `GlmMoeDsaForCausalLM` to vllm.models.deepseek_v32 (and :95-98
/// `DeepseekV32ForCausalLM` to the same module's class, identical on CUDA); anything else builds
/// another model.
pub(super) fn architectures(x: &Ctx<'_>) -> Option<Judged> {
    let arch = x.hf.architectures.set().and_then(|a| a.first()).cloned();
    let harmless = arch.as_deref() == Some("DeepseekV32ForCausalLM");
    let j = Judged::new(
        key_value(&x.hf.architectures),
        string_or_null(arch.clone()),
        Origin::ConfigJson,
        Value::String("GlmMoeDsaForCausalLM".into()),
    );
    Some(j.finding_if(
        arch.as_deref() != Some("GlmMoeDsaForCausalLM"),
        harmless,
        FindingKind::Architecture { architecture: arch },
    ))
}

/// deepseek_v2.py:314-318: `if config.hidden_act != "silu": raise ValueError(…)`. The class
/// declares "silu" (configuration_glm_moe_dsa.py:112).
pub(super) fn hidden_act(x: &Ctx<'_>) -> Option<Judged> {
    let (act, from) = declared(&x.hf.hidden_act, "silu".to_string());
    let j = Judged::new(
        key_value(&x.hf.hidden_act),
        Value::String(act.clone()),
        from,
        Value::String("silu".into()),
    );
    Some(j.finding_if(
        act != "silu",
        false,
        FindingKind::StartFailure(StartFailure::UnsupportedActivation { hidden_act: act }),
    ))
}

// ---------------------------------------------------------------------------------------------
// Routing

/// deepseek_v2.py:327-332:
///   if getattr(config, "topk_method", None) == "noaux_tc":
///       self.gate.e_score_correction_bias = nn.Parameter(torch.empty(n_routed_experts, f32))
///   else:
///       self.gate.e_score_correction_bias = None
/// and :390 passes it to FusedMoE as `e_score_correction_bias`. GLM-5's router always adds the
/// bias (`exp_probs_b` in the GGUF; transformers' GlmMoeDsaTopkRouter). Not declared by the class
/// (configuration_glm_moe_dsa.py:92-133), so an absent key is None.
pub(super) fn topk_method(x: &Ctx<'_>) -> Option<Judged> {
    let (method, from) = undeclared(&x.hf.topk_method, None);
    let j = Judged::new(
        key_value(&x.hf.topk_method),
        string_or_null(method.clone()),
        from,
        Value::String("noaux_tc".into()),
    );
    Some(j.finding_if(
        method.as_deref() != Some("noaux_tc"),
        false,
        FindingKind::NoCorrectionBias {
            topk_method: method,
        },
    ))
}

/// deepseek_v2.py:387 `scoring_func=getattr(config, "scoring_func", "softmax")`: not declared by
/// the class, so an absent key routes by softmax. The GGUF's `expert_gating_func` (absent:
/// sigmoid, GLM-5's) is what llama.cpp and glmcheck use.
pub(super) fn scoring_func(x: &Ctx<'_>) -> Option<Judged> {
    let (func, from) = undeclared(&x.hf.scoring_func, Some("softmax".to_string()));
    let gguf = x.cfg.scoring_func.clone();
    let j = Judged::new(
        key_value(&x.hf.scoring_func),
        string_or_null(func.clone()),
        from,
        Value::String(gguf.clone()),
    );
    Some(j.finding_if(
        func.as_deref() != Some(gguf.as_str()),
        false,
        FindingKind::Scoring {
            vllm: func,
            vllm_from: from,
            gguf,
        },
    ))
}

/// deepseek_v2.py:381 `renormalize=config.norm_topk_prob` (declared: True, :111).
pub(super) fn norm_topk_prob(x: &Ctx<'_>) -> Option<Judged> {
    let (norm, from) = declared(&x.hf.norm_topk_prob, true);
    let gguf = x.cfg.norm_topk_prob;
    Some(x.compared(
        key_value(&x.hf.norm_topk_prob),
        Value::Bool(norm),
        from,
        Value::Bool(gguf),
        norm == gguf,
        false,
    ))
}

/// deepseek_v2.py:305 `self.routed_scaling_factor = getattr(config, "routed_scaling_factor",
/// 1.0)` → FusedMoE :388 (declared: 2.5, :102, so an absent key is 2.5, not 1.0).
pub(super) fn routed_scaling_factor(x: &Ctx<'_>) -> Option<Judged> {
    let (scale, from) = declared(&x.hf.routed_scaling_factor, 2.5);
    let gguf = x.cfg.routed_scaling_factor;
    Some(x.compared(
        key_value(&x.hf.routed_scaling_factor),
        Value::from(scale),
        from,
        Value::from(gguf),
        same_f64(scale, gguf),
        false,
    ))
}

/// nvidia/model.py:74,94 `moe_layer_freq = getattr(config, "moe_layer_freq", 1)`; a layer is MoE
/// only when `layer_idx % moe_layer_freq == 0` (deepseek_v2.py:1269,1296 alike). The GGUF (and
/// transformers' mlp_layer_types) make every layer from first_k_dense_replace on MoE.
pub(super) fn moe_layer_freq(x: &Ctx<'_>) -> Option<Judged> {
    let json = x.hf.uint("moe_layer_freq");
    let (freq, from) = undeclared(&json, Some(1));
    let freq = freq.unwrap_or(1);
    let mut j = Judged::new(key_value(&json), Value::from(freq), from, Value::from(1u64));
    if freq != 1 {
        let n = x.cfg.num_hidden_layers.min(MAX_BLOCKS);
        let dense: Vec<usize> = (x.cfg.first_k_dense_replace..n)
            .filter(|l| freq == 0 || !(*l as u64).is_multiple_of(freq))
            .collect();
        j.finding(
            dense.is_empty(),
            FindingKind::MoeLayerFreq {
                moe_layer_freq: freq,
                dense,
            },
        );
    }
    Some(j)
}

// ---------------------------------------------------------------------------------------------
// The indexer

/// index_topk: declared by the class with 2048 (configuration_glm_moe_dsa.py:125), so removing the
/// key does NOT switch DSA off in vLLM 0.33: `hasattr(config, "index_topk")` stays true
/// (deepseek_v2.py:1138,1439) and the CUDA model is sparse unconditionally (nvidia/model.py:
/// 188-197 allocates `config.index_topk` columns; attention.py:212 `use_sparse=True`). Each query
/// attends to its top-2048 keys: every key while the context is at most 2048 tokens.
pub(super) fn index_topk(x: &Ctx<'_>) -> Option<Judged> {
    let json = x.hf.uint("index_topk");
    let (topk, from) = declared(&json, 2048);
    let gguf = x.cfg.index_topk as u64;
    if !json.is_absent() {
        return Some(x.compared(
            key_value(&json),
            Value::from(topk),
            from,
            Value::from(gguf),
            topk == gguf,
            false,
        ));
    }
    let j = Judged::new(key_value(&json), Value::from(topk), from, Value::from(gguf));
    Some(j.finding_if(
        true,
        topk == gguf,
        FindingKind::IndexTopkDefault { vllm: topk, gguf },
    ))
}

/// attention.py:279-284 (deepseek_v2.py:1173-1177 alike):
///   self.indexer_rope_emb = get_rope(…, is_neox_style=not getattr(config,
///       "indexer_rope_interleave", False))
/// and :244 passes the same flag to the fused norm+rope kernels. Not declared by the class: absent
/// (or null, or false) is NeoX half-split. transformers 5.20/5.23 always interleaves the indexer's
/// rope (modeling_glm_moe_dsa.py:220-221 `apply_rotary_pos_emb_interleave`), as do llama.cpp and
/// glmcheck.
pub(super) fn indexer_rope_interleave(x: &Ctx<'_>) -> Option<Judged> {
    let key = &x.hf.indexer_rope_interleave;
    let (inter, from) = undeclared(key, Some(false));
    let inter = inter.unwrap_or(false);
    let j = Judged::new(key_value(key), Value::Bool(inter), from, Value::Bool(true));
    Some(j.finding_if(
        !inter,
        false,
        FindingKind::IndexerRopeNeox {
            indexer_rope_interleave: key.clone(),
        },
    ))
}

/// The indexer schedule (row `index_topk_freq`): attention.py:166-187 builds an indexer only on
/// layers with `not skip_topk` (MTP layers always); a skipped layer reuses the previous layer's
/// top-k. transformers turns the same keys (or an explicit `indexer_types`) into "shared" layers.
/// glmcheck's forward, like the GGUF's per-layer indexer tensors, runs every layer's indexer. No
/// row when config.json has none of the schedule's keys.
pub(super) fn indexer_schedule(x: &Ctx<'_>) -> Option<Judged> {
    let hf = x.hf;
    let n = (hf
        .uint("num_hidden_layers")
        .set()
        .copied()
        .unwrap_or(78)
        .min(MAX_BLOCKS as u64)) as usize;
    let freq = hf.uint("index_topk_freq");
    let schedule_keys = [
        freq.is_absent(),
        hf.uint("index_skip_topk_offset").is_absent(),
        hf.index_topk_pattern.is_absent(),
        hf.indexer_types.is_absent(),
    ];
    if schedule_keys.iter().all(|a| *a) {
        return None;
    }
    let (v, from) = undeclared(&freq, Some(1));
    let mut j = Judged::new(
        key_value(&freq),
        v.map_or(Value::Null, Value::from),
        from,
        Value::from(1u64),
    );
    let tf = transformers_shared(hf, n);
    match vllm_skipped(hf, n) {
        None => j.finding(
            false,
            FindingKind::StartFailure(StartFailure::ZeroIndexTopkFreq),
        ),
        Some(skipped) => {
            if !skipped.is_empty() {
                j.finding(
                    false,
                    FindingKind::IndexerSkipped {
                        layers: skipped.clone(),
                        num_hidden_layers: n,
                    },
                );
            }
            if skipped != tf {
                j.finding(
                    false,
                    FindingKind::IndexerTypesDisagree {
                        transformers_shared: tf,
                        vllm_skipped: skipped,
                    },
                );
            }
        }
    }
    Some(j)
}

/// vLLM's per-layer "skip the indexer" flags for layers `0..n` (attention.py:166-177;
/// deepseek_v2.py:1144-1158 alike). None: `index_topk_freq` is 0 (a ZeroDivisionError).
fn vllm_skipped(hf: &HfConfig, n: usize) -> Option<Vec<usize>> {
    let freq = hf.uint("index_topk_freq").set().copied().unwrap_or(1);
    let offset = hf
        .uint("index_skip_topk_offset")
        .set()
        .copied()
        .unwrap_or(2);
    match hf.index_topk_pattern.set() {
        Some(p) => Some(
            (0..n)
                .filter(|&l| p.entries.get(l).map(String::as_str) == Some("S"))
                .collect(),
        ),
        None if freq == 0 => None,
        None => Some(
            (0..n)
                .filter(|&l| !(l as u64 + 1).saturating_sub(offset).is_multiple_of(freq))
                .collect(),
        ),
    }
}

/// transformers' "shared" indexer layers (configuration_glm_moe_dsa.py:137-148): `indexer_types`,
/// else the pattern (a string's `S` → "shared"; a list is taken as the types themselves), else the
/// freq/offset schedule with `freq = max(freq, 1)`.
fn transformers_shared(hf: &HfConfig, n: usize) -> Vec<usize> {
    if let Some(t) = hf.indexer_types.set() {
        return t
            .iter()
            .enumerate()
            .filter(|(_, s)| s.as_str() == "shared")
            .map(|(l, _)| l)
            .collect();
    }
    if let Some(p) = hf.index_topk_pattern.set() {
        let shared = if p.from_string { "S" } else { "shared" };
        return (0..n.min(p.entries.len()))
            .filter(|&l| p.entries[l] == shared)
            .collect();
    }
    let freq = hf
        .uint("index_topk_freq")
        .set()
        .copied()
        .unwrap_or(1)
        .max(1);
    let offset = hf
        .uint("index_skip_topk_offset")
        .set()
        .copied()
        .unwrap_or(2);
    (0..n)
        .filter(|&l| !(l as u64 + 1).saturating_sub(offset).is_multiple_of(freq))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// RoPE

/// The RoPE vLLM builds: transformers' standardization, then vLLM's DSA attention.
struct Rope {
    theta: f64,
    theta_from: Origin,
    rope_type: String,
    factor: Option<f64>,
    mscale_all_dim: Option<f64>,
    attention_factor: Option<f64>,
}

fn rope_of(hf: &HfConfig) -> Rope {
    // modeling_rope_utils.py:752-781 (5.20.0) `convert_rope_params_to_dict`: `rope_scaling` wins
    // over `rope_parameters` when truthy; the theta is the dict's `rope_theta`, else the top-level
    // `rope_theta`, else `default_theta` = 10000.0 (:739); the type is `rope_type`, else `type`,
    // else "default" (:802). GlmMoeDsaConfig does not override default_theta.
    let dict = rope_dict(hf);
    let (theta, theta_from) = match (dict.and_then(|d| d.rope_theta), hf.rope_theta.set()) {
        (Some(t), _) => (t, Origin::ConfigJson),
        (None, Some(t)) => (*t, Origin::ConfigJson),
        (None, None) => (10_000.0, Origin::TransformersDefault),
    };
    Rope {
        theta,
        theta_from,
        rope_type: dict
            .and_then(|d| d.rope_type.clone())
            .unwrap_or_else(|| "default".into()),
        factor: dict.and_then(|d| d.factor),
        mscale_all_dim: dict.and_then(|d| d.mscale_all_dim),
        attention_factor: dict.and_then(|d| d.attention_factor),
    }
}

/// The rope dict transformers keeps: `rope_scaling or rope_parameters` (Python truthiness).
fn rope_dict(hf: &HfConfig) -> Option<&RopeDict> {
    match (&hf.rope_scaling, &hf.rope_parameters) {
        (Key::Set(d), _) if !d.empty => Some(d),
        (_, Key::Set(d)) => Some(d),
        _ => None,
    }
}

/// vLLM's `yarn_get_mscale` (rotary_embedding/common.py:73-76).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// attention.py:272-284 `get_rope(qk_rope_head_dim, …, rope_parameters=config.rope_parameters)`
/// for the MLA rope and the indexer's: the base is `rope_parameters["rope_theta"]`.
pub(super) fn rope_theta(x: &Ctx<'_>) -> Option<Judged> {
    let r = rope_of(x.hf);
    let gguf = x.cfg.rope_theta;
    let json = match rope_dict(x.hf).and_then(|d| d.rope_theta) {
        Some(t) => Key::Set(Value::from(t)),
        None => key_value(&x.hf.rope_theta),
    };
    Some(x.compared(
        json,
        Value::from(r.theta),
        r.theta_from,
        Value::from(gguf),
        same_f64(r.theta, gguf),
        false,
    ))
}

/// attention.py:153-164: any rope_type but "default" becomes "deepseek_llama_scaling" (when
/// `attention_factor == 1.0`) or "deepseek_yarn", and for deepseek_yarn the softmax scale is
/// multiplied by `yarn_get_mscale(factor, mscale_all_dim)²`. The GGUF's config carries no RoPE
/// scaling (GLM-5 has none), so glmcheck, like llama.cpp without rope.scaling keys, uses plain
/// RoPE.
pub(super) fn rope_type(x: &Ctx<'_>) -> Option<Judged> {
    let hf = x.hf;
    let r = rope_of(hf);
    let json = match rope_dict(hf) {
        Some(d) => key_value(&Key::Set(d.rope_type.clone())),
        None if hf.rope_scaling == Key::Null || hf.rope_parameters == Key::Null => Key::Null,
        None => Key::Absent,
    };
    let vllm_rope = if r.rope_type == "default" {
        "default".to_string()
    } else if r.attention_factor == Some(1.0) {
        "deepseek_llama_scaling".to_string()
    } else {
        "deepseek_yarn".to_string()
    };
    let from = if json.is_absent() {
        Origin::TransformersDefault
    } else {
        Origin::ConfigJson
    };
    let mut j = Judged::new(
        json,
        Value::String(vllm_rope.clone()),
        from,
        Value::String("default".into()),
    );
    if r.rope_type != "default" {
        match r.factor {
            None => j.finding(
                false,
                FindingKind::StartFailure(StartFailure::RopeWithoutFactor {
                    rope_type: r.rope_type.clone(),
                }),
            ),
            Some(factor) => {
                let m = if vllm_rope == "deepseek_yarn" {
                    yarn_mscale(factor, r.mscale_all_dim.unwrap_or(0.0))
                } else {
                    1.0
                };
                j.finding(
                    false,
                    FindingKind::RopeScaling {
                        rope_type: r.rope_type.clone(),
                        vllm_rope,
                        factor: Some(factor),
                        softmax_scale_factor: m * m,
                    },
                );
            }
        }
    }
    Some(j)
}

// ---------------------------------------------------------------------------------------------
// Norms and heads

/// attention.py:253,261 (q_a/kv_a RMSNorm) and nvidia/model.py:116-119,228 (layer and final norms)
/// `eps=config.rms_norm_eps` (declared: 1e-5, :115).
pub(super) fn rms_norm_eps(x: &Ctx<'_>) -> Option<Judged> {
    let (eps, from) = declared(&x.hf.rms_norm_eps, 1e-5);
    let gguf = x.cfg.rms_norm_eps;
    Some(x.compared(
        key_value(&x.hf.rms_norm_eps),
        Value::from(eps),
        from,
        Value::from(gguf),
        same_f64(eps, gguf),
        false,
    ))
}

/// MTP: model_executor/models/utils.py:589-596 skips weights of layers `num_hidden_layers … +
/// num_nextn_predict_layers` (getattr default 0) when loading the main model;
/// config/speculative.py:733-760 builds the MTP draft from it. The served model's outputs do not
/// depend on it (a draft's tokens are verified by the main model): harmless.
pub(super) fn nextn_layers(x: &Ctx<'_>) -> Option<Judged> {
    let json = x.hf.uint("num_nextn_predict_layers");
    let (n, from) = undeclared(&json, Some(0));
    let n = n.unwrap_or(0);
    let gguf = x.cfg.num_nextn_predict_layers as u64;
    let j = Judged::new(key_value(&json), Value::from(n), from, Value::from(gguf));
    Some(j.finding_if(
        n != gguf,
        true,
        FindingKind::NextnLayers {
            vllm: n,
            vllm_from: from,
            gguf,
        },
    ))
}

/// tie_word_embeddings: DeepseekV2ForCausalLM always builds its own `ParallelLMHead`
/// (deepseek_v2.py:1917-1923) and never ties it (nvidia/model.py:209 only passes the flag to
/// make_input_embedding's VLLM_REPLICATE_EMBED assertion, fused_embed_norm.py:58-63). A GGUF
/// without `output.weight` (tied) leaves vLLM's lm_head without a weight whatever the config says;
/// a config that ties while the GGUF has its own lm_head changes transformers (it would use the
/// embedding) but not vLLM: harmless for the deployment.
pub(super) fn tie_word_embeddings(x: &Ctx<'_>) -> Option<Judged> {
    let (tie, from) = declared(&x.hf.tie_word_embeddings, false);
    let gguf_tied = x.cfg.tie_word_embeddings;
    let j = Judged::new(
        key_value(&x.hf.tie_word_embeddings),
        Value::Bool(tie),
        from,
        Value::Bool(gguf_tied),
    );
    Some(j.finding_if(
        gguf_tied || tie,
        !gguf_tied,
        FindingKind::TiedEmbeddings {
            vllm_tie: tie,
            gguf_tied,
        },
    ))
}
