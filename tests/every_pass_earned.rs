//! Issue 10, "every pass earned", for activations: the bound follows what differs between the two
//! sides. glmcheck's own dump of the same GGUF leaves only the compute dtype; llama.cpp's logits of
//! the same GGUF add its kernels' noise; a transformers dump of the originals adds the quant type's.
//! `--dsa dense` (the indexer switched off) must then diverge against a same-GGUF reference, at
//! the attention of the first layer where positions exceed index_topk — never "suspect lm_head".

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{fixture, gguf, glmcheck, path_str as s, stderr, stdout};
use serde_json::Value as Json;

/// The fixture prompt's token ids, as `--tokens` takes them.
fn ids(prompt: &str) -> String {
    let bytes = std::fs::read(fixture(&format!("activations/{prompt}.safetensors"))).expect("dump");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let text = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("token_ids").cloned())
        .expect("token_ids");
    let v: Vec<u32> = serde_json::from_str(&text).expect("ids");
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

fn forward(stem: &str, prompt: &str, extra: &[&str]) -> (Option<i32>, Json) {
    let g = gguf(stem);
    let t = ids(prompt);
    let mut args = vec![
        "forward",
        s(&g),
        "--tokens",
        &t,
        "--max-new-tokens",
        "0",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = glmcheck(&args);
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(&out), stderr(&out)));
    (out.status.code(), v)
}

/// llama.cpp's logits of `prompt` on `ty` (fixtures/tiny/activations/llamacpp_logits.safetensors,
/// written by llama-cpp-python) as a reference dump: the `logits` key and the prompt's token ids.
fn llamacpp_reference(dir: &Path, prompt: &str, ty: &str) -> PathBuf {
    let bytes = std::fs::read(fixture("activations/llamacpp_logits.safetensors")).expect("fixture");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let view = st.tensor(&format!("{prompt}.{ty}")).expect("logits");
    let t = ids(prompt);
    let meta: HashMap<String, String> = [
        ("token_ids".to_string(), format!("[{t}]")),
        (
            "producer".to_string(),
            "llama.cpp (llama-cpp-python 0.3.36)".to_string(),
        ),
    ]
    .into_iter()
    .collect();
    let out = dir.join(format!("llamacpp-{prompt}-{ty}.safetensors"));
    safetensors::serialize_to_file(vec![("logits", view)], Some(meta), &out).expect("write");
    out
}

#[test]
fn dsa_dense_against_glmchecks_own_dump_is_named_at_the_first_layers_attention() {
    let dir = tempfile::tempdir().expect("tmp");
    let dump = dir.path().join("q4.safetensors");
    let (code, _) = forward("tiny-Q4_K_M", "prompt0", &["--dump", s(&dump)]);
    assert_eq!(code, Some(0));
    // The dump's metadata names this GGUF: the same weights, so only the compute dtype may differ.
    let (code, v) = forward("tiny-Q4_K_M", "prompt0", &["--reference", s(&dump)]);
    assert_eq!(code, Some(0), "{:#}", v["first_divergence"]);
    assert_eq!(v["comparison"]["tolerances"]["reference"], "same");
    let (code, v) = forward(
        "tiny-Q4_K_M",
        "prompt0",
        &["--reference", s(&dump), "--dsa", "dense"],
    );
    assert_eq!(code, Some(1), "{v:#}");
    let f = &v["first_divergence"];
    assert_eq!(f["layer"], 0, "{f:#}");
    let module = f["module"].as_str().expect("module");
    assert!(
        module.starts_with("model.layers.0.self_attn"),
        "the attention of layer 0 (positions beyond index_topk 8 see other keys): {f:#}"
    );
    let reading = f["reading"].as_str().expect("reading");
    assert!(reading.contains("DSA indexer is disabled"), "{reading}");
    assert!(!reading.contains("lm_head"), "{reading}");
}

#[test]
fn llamacpp_logits_of_the_same_gguf_pass_and_catch_dsa_dense() {
    let dir = tempfile::tempdir().expect("tmp");
    for (stem, ty) in [
        ("tiny-F32", "F32"),
        ("tiny-BF16", "BF16"),
        ("tiny-Q8_0", "Q8_0"),
        ("tiny-Q4_K_M", "Q4_K_M"),
    ] {
        for prompt in ["prompt0", "prompt1"] {
            let r = llamacpp_reference(dir.path(), prompt, ty);
            let args = ["--reference", s(&r), "--reference-weights", "same-gguf"];
            let (code, v) = forward(stem, prompt, &args);
            assert_eq!(code, Some(0), "{stem} {prompt}: {:#}", v["logits"]);
            let mut dense = args.to_vec();
            dense.extend_from_slice(&["--dsa", "dense"]);
            let (code, d) = forward(stem, prompt, &dense);
            // The table of reports/same-gguf-tolerances.md (--nocapture prints it).
            let row = |v: &Json| {
                let l = &v["logits"];
                format!(
                    "{:.2e} | {:.2e} | {}/{}",
                    l["kl_mean"].as_f64().unwrap_or(f64::NAN),
                    l["kl_max"].as_f64().unwrap_or(f64::NAN),
                    l["top1_agree_count"],
                    l["positions"]
                )
            };
            println!("| {ty} | {prompt} | {} | {} |", row(&v), row(&d));
            let v = d;
            assert_eq!(code, Some(1), "{stem} {prompt} dense: {:#}", v["logits"]);
            let reading = v["first_divergence"]["reading"].as_str().expect("reading");
            assert!(
                reading.contains("cannot be localized to a module")
                    && !reading.contains("suspect the lm_head"),
                "{stem} {prompt}: {reading}"
            );
        }
    }
    // Where the positions say it: agreement below index_topk, divergence after.
    let r = llamacpp_reference(dir.path(), "prompt0", "Q4_K_M");
    let (_, v) = forward(
        "tiny-Q4_K_M",
        "prompt0",
        &[
            "--reference",
            s(&r),
            "--reference-weights",
            "same-gguf",
            "--dsa",
            "dense",
        ],
    );
    let reading = v["first_divergence"]["reading"].as_str().expect("reading");
    assert!(reading.contains("suspect the indexer"), "{reading}");
}

#[test]
fn against_the_originals_a_logits_only_divergence_is_not_blamed_on_lm_head() {
    let (code, v) = forward(
        "tiny-Q4_K_M",
        "prompt0",
        &[
            "--reference",
            s(&fixture("activations/prompt0.safetensors")),
            "--dsa",
            "dense",
        ],
    );
    assert_eq!(code, Some(1), "{v:#}");
    assert_eq!(v["comparison"]["tolerances"]["reference"], "original");
    let reading = v["first_divergence"]["reading"].as_str().expect("reading");
    assert!(
        reading.contains("too coarse to localize") && !reading.contains("suspect the lm_head"),
        "{reading}"
    );
}

/// Each weight profile has a case just outside it: one layer's o_proj weight scaled (F32 by 2 %,
/// Q8_0 by 15 %, both above their profile's module bound and below anything gross) must diverge
/// against the transformers reference, first at that o_proj, blaming its weight.
#[test]
fn a_weight_just_outside_its_profile_is_found_at_its_module() {
    use glmcheck::gguf::{GgmlType, GgufModel};
    let dir = tempfile::tempdir().expect("tmp");
    for (stem, factor) in [("tiny-F32", 1.02f32), ("tiny-Q8_0", 1.15)] {
        let model = GgufModel::open(&gguf(stem)).expect("fixture");
        let out = dir.path().join(format!("{stem}-oproj.gguf"));
        common::write_edited(
            &model,
            &out,
            |_, v| v.clone(),
            |name, t, b| {
                let mut b = b.to_vec();
                if name == "blk.1.attn_output.weight" {
                    match t {
                        GgmlType::F32 => {
                            for c in b.chunks_exact_mut(4) {
                                let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * factor;
                                c.copy_from_slice(&x.to_le_bytes());
                            }
                        }
                        // Q8_0: 34-byte blocks, an f16 scale then 32 int8 values.
                        GgmlType::Q8_0 => {
                            for c in b.chunks_exact_mut(34) {
                                let d = half::f16::from_le_bytes([c[0], c[1]]).to_f32() * factor;
                                c[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                            }
                        }
                        other => panic!("{stem}: o_proj is {other}"),
                    }
                }
                (t, b)
            },
        );
        let t = ids("prompt0");
        let o = glmcheck(&[
            "forward",
            s(&out),
            "--tokens",
            &t,
            "--reference",
            s(&fixture("activations/prompt0.safetensors")),
            "--max-new-tokens",
            "0",
            "--json",
        ]);
        let v: Json = serde_json::from_slice(&o.stdout).expect("json");
        assert_eq!(o.status.code(), Some(1), "{stem}: {}", stderr(&o));
        let f = &v["first_divergence"];
        assert_eq!(
            f["module"], "model.layers.1.self_attn.o_proj",
            "{stem}: {f:#}"
        );
        assert!(
            f["reading"]
                .as_str()
                .is_some_and(|r| r.contains("o_proj weight")),
            "{stem}: {f:#}"
        );
        // And the unedited file is within its profile (the twin that must pass).
        let o = glmcheck(&[
            "forward",
            s(&gguf(stem)),
            "--tokens",
            &t,
            "--reference",
            s(&fixture("activations/prompt0.safetensors")),
            "--max-new-tokens",
            "0",
        ]);
        assert_eq!(o.status.code(), Some(0), "{stem} unedited: {}", stdout(&o));
    }
}
