//! Files glmcheck did not write (tools/make_other_writers.py; fixtures/other_writers.json says which
//! tool wrote each and how): llama.cpp's converter without the nextn key and with a real MTP block,
//! a transformers forward-hook dump in bf16 with batch dims kept, and per-rank dumps written by
//! vLLM 0.33's own loader (8 gloo ranks, `DeepseekV32ForCausalLM`) from the HF originals, from the
//! Q4_K_M GGUF's dequantized values, and with `VLLM_REPLICATE_EMBED=1`.

mod common;

use std::path::{Path, PathBuf};

use common::{
    fixture, gguf, glmcheck, json_of, path_str as s, rewrite_safetensors, stderr, stdout,
};
use serde_json::Value as Json;

fn run(args: &[&str]) -> (Option<i32>, Json) {
    let out = glmcheck(args);
    (out.status.code(), json_of(&out))
}

fn forward(model: &Path, reference: &Path, extra: &[&str]) -> (Option<i32>, Json) {
    common::forward_prompt0(model, reference, extra)
}

// ---------------------------------------------------------------------------------------------
// llama.cpp's converter

#[test]
fn the_converters_file_without_the_nextn_key_has_all_its_layers() {
    let g = gguf("tiny-nonextn-Q8_0");
    let (code, r) = run(&["inspect", s(&g), "--json"]);
    assert_eq!(code, Some(0), "{:#}", r["problems"]);
    assert!(
        r["config_sources"]["num_nextn_predict_layers"]
            .to_string()
            .contains("no `glm-dsa.nextn_predict_layers`"),
        "the converter wrote no key: {}",
        r["config_sources"]
    );
    assert_eq!(r["config"]["num_hidden_layers"], 3);
    assert_eq!(r["config"]["num_nextn_predict_layers"], 0);
    let (code, v) = forward(&g, &fixture("activations/prompt0.safetensors"), &[]);
    assert_eq!(code, Some(0), "{:#}", v["first_divergence"]);
    assert_eq!(v["verdict"], "within tolerance");
}

#[test]
fn the_converters_mtp_block_is_the_mtp_layer() {
    let g = gguf("tiny-mtp-Q8_0");
    let (code, r) = run(&["inspect", s(&g), "--json"]);
    assert_eq!(code, Some(0), "{:#}", r["problems"]);
    assert_eq!(r["config"]["num_hidden_layers"], 3);
    assert_eq!(r["config"]["num_nextn_predict_layers"], 1);
    assert_eq!(
        r["config_sources"]["num_nextn_predict_layers"],
        serde_json::json!({"metadata": "glm-dsa.nextn_predict_layers"}),
        "the converter's key agrees with the tensors"
    );
    let mtp: Vec<&str> = r["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .filter(|n| n.starts_with("blk.3."))
        .collect();
    assert!(mtp.contains(&"blk.3.nextn.eh_proj.weight"), "{mtp:?}");
    assert!(
        mtp.contains(&"blk.3.attn_k_b.weight"),
        "a full layer: {mtp:?}"
    );
    let out = glmcheck(&["shards", s(&g), "--tp", "8"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stdout(&out).contains("GGUF block(s) 3: the MTP (nextn) layer"));
    let (code, v) = forward(&g, &fixture("activations/prompt0.safetensors"), &[]);
    assert_eq!(code, Some(0), "{:#}", v["first_divergence"]);
}

// ---------------------------------------------------------------------------------------------
// transformers forward hooks, bf16, batch dims kept

#[test]
fn a_hook_dump_in_bf16_with_batch_dims_matches_the_f32_forward() {
    let (code, v) = forward(
        &gguf("tiny-F32"),
        &fixture("activations/prompt0-hooks-bf16.safetensors"),
        &[],
    );
    assert_eq!(code, Some(0), "{:#}", v["first_divergence"]);
    assert_eq!(v["verdict"], "within tolerance");
    assert!(v["first_divergence"].is_null());
    let modules = v["modules"].as_array().expect("modules");
    // The routed experts' rows are ordered by the hook dump's own `gate.2` ids.
    let experts = modules
        .iter()
        .filter(|m| {
            m["name"]
                .as_str()
                .is_some_and(|n| n.contains("experts.act_fn"))
        })
        .collect::<Vec<_>>();
    assert!(!experts.is_empty());
    assert!(
        experts.iter().all(|m| m["status"] == "match"),
        "{experts:?}"
    );
    assert!(modules.len() > 80, "{} compared", modules.len());
}

#[test]
fn a_hook_dump_with_one_module_transposed_is_incomplete_not_diverged() {
    let reference = fixture("activations/prompt0-hooks-bf16-transposed.safetensors");
    let (code, v) = forward(&gguf("tiny-F32"), &reference, &[]);
    assert_eq!(code, Some(1), "{v:#}");
    assert_eq!(v["verdict"], "incomplete");
    assert!(v["first_divergence"].is_null(), "{}", v["first_divergence"]);
    assert_eq!(
        v["comparison"]["incomparable"],
        serde_json::json!(["model.layers.1.self_attn.q_b_proj"])
    );
    let (code, _) = forward(&gguf("tiny-F32"), &reference, &["--allow-incomparable"]);
    assert_eq!(code, Some(0));
}

// ---------------------------------------------------------------------------------------------
// vLLM 0.33's own loader

fn vllm_dump(name: &str) -> PathBuf {
    fixture(name)
}

fn against(stem: &str, dir: &Path, extra: &[&str]) -> (Option<i32>, Json) {
    let g = gguf(stem);
    let mut args = vec!["shards", s(&g), "--tp", "8", "--against", s(dir), "--json"];
    args.extend_from_slice(extra);
    run(&args)
}

/// Copies a vLLM dump, adding relative noise `sigma` (rel-L2) to `param` on `rank`.
fn with_noise(src: &Path, param: &str, rank: usize, sigma: f32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    for r in 0..8 {
        let name = format!("rank{r}.safetensors");
        let (from, to) = (src.join(&name), dir.path().join(&name));
        let mut seed = 7u32.wrapping_add(r as u32);
        rewrite_safetensors(&from, &to, |n, dtype, _, data| {
            if r == rank && n == param {
                assert_eq!(*dtype, safetensors::Dtype::BF16, "{n}");
                let xs: Vec<f32> = data
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
                let rms = (xs.iter().map(|x| x * x).sum::<f32>() / xs.len() as f32).sqrt();
                *data = xs
                    .iter()
                    .flat_map(|x| {
                        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                        // uniform on [-√3, √3]: unit variance
                        let u = ((seed >> 8) as f32 / (1 << 24) as f32 - 0.5) * 2.0 * 3f32.sqrt();
                        half::bf16::from_f32(x + sigma * rms * u).to_le_bytes()
                    })
                    .collect();
            }
            true
        });
    }
    dir
}

#[test]
fn vllms_dump_of_this_gguf_passes_and_is_held_to_the_dump_dtype() {
    let dump = vllm_dump("vllm033-tp8-q4km");
    let (code, r) = against("tiny-Q4_K_M", &dump, &[]);
    assert_eq!(code, Some(0), "{r:#}");
    assert_eq!(r["verdict"], "pass");
    assert_eq!(r["provenance"]["provenance"], "gguf");
    assert_eq!(r["checked_shards"], 424);
    assert_eq!(r["expected_shards"], 424);
    assert!(r["aliases"]
        .to_string()
        .contains("mlp.experts.routed_experts.w13_weight"));
    // 5 % and 15 % noise on one rank's parameter: quantization noise in size, corruption here.
    let param = "model.layers.1.mlp.shared_experts.gate_up_proj.weight";
    for sigma in [0.05, 0.15] {
        let noisy = with_noise(&dump, param, 3, sigma);
        let (code, r) = against("tiny-Q4_K_M", noisy.path(), &[]);
        assert_eq!(code, Some(1), "σ {sigma}: {r:#}");
        assert_eq!(r["verdict"], "fail");
        let f = r["findings"].as_array().expect("findings");
        assert_eq!(f.len(), 1, "σ {sigma}: {f:?}");
        assert_eq!(f[0]["param"], param);
        assert_eq!(f[0]["ranks"], serde_json::json!([3]));
        // Forced the other way, the same dump passes as noise: the provenance is what decided.
        let (code, _) = against("tiny-Q4_K_M", noisy.path(), &["--provenance", "originals"]);
        assert_eq!(code, Some(0), "σ {sigma} under originals");
    }
}

#[test]
fn vllms_dump_of_the_originals_passes_against_quantized_ggufs_and_catches_2_percent_at_q8() {
    let dump = vllm_dump("vllm033-tp8-originals");
    for stem in ["tiny-F32", "tiny-Q8_0", "tiny-Q4_K_M"] {
        let (code, r) = against(stem, &dump, &[]);
        assert_eq!(code, Some(0), "{stem}: {r:#}");
        assert_eq!(r["checked_shards"], 424, "{stem}");
    }
    let (_, r) = against("tiny-Q4_K_M", &dump, &[]);
    assert_eq!(r["provenance"]["provenance"], "originals");
    let param = "model.layers.2.self_attn.q_b_proj.weight";
    let noisy = with_noise(&dump, param, 5, 0.02);
    let (code, r) = against("tiny-Q8_0", noisy.path(), &[]);
    assert_eq!(code, Some(1), "{r:#}");
    let f = r["findings"].as_array().expect("findings");
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0]["param"], param);
    assert_eq!(f[0]["ranks"], serde_json::json!([5]));
}

#[test]
fn vllms_replicated_embedding_passes_on_the_ranks_dumped() {
    let dump = vllm_dump("vllm033-tp8-replicated-embed");
    let (code, r) = against("tiny-F32", &dump, &[]);
    assert_eq!(code, Some(1), "two of eight rank files: {r:#}");
    assert_eq!(r["verdict"], "incomplete");
    let (code, r) = against("tiny-F32", &dump, &["--ranks", "0,1"]);
    assert_eq!(code, Some(0), "{r:#}");
    let replicated = r["checked"]
        .as_array()
        .expect("checked")
        .iter()
        .filter(|c| c["param"] == "model.embed_tokens.weight" && c["replicated"] == true)
        .count();
    assert_eq!(replicated, 2);
}

#[test]
fn state_dict_aliases_and_buffers_are_recognized() {
    // A dump taken with state_dict() instead of named_parameters(): vLLM 0.33 registers the gate
    // and the shared experts twice (info-rank0.json lists the extra names), plus buffers.
    let src = vllm_dump("vllm033-tp8-originals");
    let dir = tempfile::tempdir().expect("tmp");
    for r in 0..8 {
        let name = format!("rank{r}.safetensors");
        let bytes = std::fs::read(src.join(&name)).expect("rank");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("st");
        let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = Vec::new();
        for (n, v) in st.tensors() {
            if let Some(l) = n
                .strip_prefix("model.layers.")
                .and_then(|x| x.strip_suffix(".mlp.gate.weight"))
            {
                // Only the alias: the canonical name is found through it.
                views.push((format!("model.layers.{l}.mlp.experts.gate.weight"), v));
                continue;
            }
            if let Some(l) = n
                .strip_prefix("model.layers.")
                .and_then(|x| x.strip_suffix(".mlp.shared_experts.down_proj.weight"))
            {
                views.push((
                    format!("model.layers.{l}.mlp.experts._shared_experts._layer.down_proj.weight"),
                    v.clone(),
                ));
            }
            views.push((n, v));
        }
        let scale = [0u8; 4];
        let buf = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![], &scale)
            .expect("scalar");
        views.push(("model.layers.0.self_attn._k_scale".into(), buf));
        safetensors::serialize_to_file(views, None, &dir.path().join(&name)).expect("write");
    }
    let (code, r) = against("tiny-F32", dir.path(), &[]);
    assert_eq!(code, Some(0), "{r:#}");
    assert_eq!(r["checked_shards"], 424);
    assert_eq!(r["buffers_ignored"], 8);
    assert!(r["aliases"]
        .to_string()
        .contains("model.layers.{L}.mlp.experts.gate.weight"));
}

/// `forward --tp 8 --weights-from` vLLM's own dumps, with no reference: compared with the GGUF's
/// own f32 forward, the bf16 storage (and, for the originals, the GGUF's quantization) is noise
/// to allow, not a finding — it used to be read as "suspect the token embedding (vocab row
/// order)". A real corruption of one rank's shard still diverges first where it is.
#[test]
fn vllms_dumps_run_as_the_forward_pass_against_the_ggufs_own_forward() {
    let forward = |stem: &str, dir: &Path| {
        run(&[
            "forward",
            s(&gguf(stem)),
            "--tokens",
            common::PROMPT0_IDS,
            "--tp",
            "8",
            "--weights-from",
            s(dir),
            "--max-new-tokens",
            "0",
            "--json",
        ])
    };
    let originals = vllm_dump("vllm033-tp8-originals");
    let q4km = vllm_dump("vllm033-tp8-q4km");
    for (stem, dir, class, says) in [
        ("tiny-F32", &originals, "BF16", "unquantized (F32) GGUF"),
        ("tiny-BF16", &originals, "BF16", "unquantized (BF16) GGUF"),
        ("tiny-Q8_0", &originals, "Q8_0", "cannot be told apart"),
        (
            "tiny-Q4_K_M",
            &originals,
            "Q4_K",
            "the unquantized originals",
        ),
        (
            "tiny-Q4_K_M",
            &q4km,
            "BF16",
            "this GGUF's dequantized values",
        ),
    ] {
        let (code, r) = forward(stem, dir);
        assert_eq!(code, Some(0), "{stem} {dir:?}: {r:#}");
        assert!(r["first_divergence"].is_null(), "{stem}: {r:#}");
        let notes = r["notes"].to_string();
        assert!(notes.contains(says), "{stem}: {notes}");
        assert!(
            notes.contains(&format!("tolerances of {class} weights")),
            "{stem}: {notes}"
        );
    }
    let param = "model.layers.1.mlp.shared_experts.gate_up_proj.weight";
    let noisy = with_noise(&q4km, param, 3, 0.15);
    let (code, r) = forward("tiny-Q4_K_M", noisy.path());
    assert_eq!(code, Some(1), "{r:#}");
    let first = &r["first_divergence"];
    assert_eq!(first["layer"], 1, "{first:#}");
    assert!(
        first["module"]
            .as_str()
            .is_some_and(|m| m.starts_with("model.layers.1.mlp.shared_experts")),
        "{first:#}"
    );
}
