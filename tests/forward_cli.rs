//! `glmcheck forward` and `glmcheck diff` on the tiny fixtures: the GGUF's tokenizer against HF's,
//! the forward against transformers' dumps (F32 within 1e-5, BF16/Q8_0/Q4_K_M within the measured
//! bounds), ties told apart from divergence, `--dsa dense`, dumps, and `diff` naming a perturbed
//! module. `measured_figures_sit_inside_their_profiles` re-measures the figures behind `Tolerances::for_profile` and holds them inside their bounds (--nocapture prints the table).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

use candle_core::Device;
use common::rewrite_safetensors;
use glmcheck::arch::config::ConfigReader;
use glmcheck::compare::{
    weight_class, Activations, ComputeDtype, Status, TieClass, Tolerances, ValueKind,
};
use glmcheck::forward::{self, ForwardSpec};
use glmcheck::gguf::{GgufModel, Value};
use glmcheck::model::{DsaMode, Glm5, ModelOptions};
use glmcheck::tokenizer::GgufTokenizer;
use glmcheck::weights::Weights;
use safetensors::SafeTensors;
use serde_json::Value as Json;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny")
}

fn gguf(stem: &str) -> PathBuf {
    fixture_dir().join(format!("{stem}.gguf"))
}

fn acts(prompt: &str) -> PathBuf {
    fixture_dir().join(format!("activations/{prompt}.safetensors"))
}

fn glmcheck(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_glmcheck"))
        .args(args)
        .output()
        .expect("run glmcheck")
}

fn run_json(args: &[&str]) -> (i32, Json, String) {
    let out = glmcheck(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: stdout is not JSON ({e}): {}\nstderr: {err}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.code().unwrap_or(-1), v, err)
}

/// The fixture's `prompt` and `token_ids` metadata.
fn fixture_prompt(prompt: &str) -> (String, Vec<u32>) {
    let bytes = std::fs::read(acts(prompt)).expect("fixture");
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("header");
    let meta = meta.metadata().clone().expect("metadata");
    (
        meta["prompt"].clone(),
        serde_json::from_str(&meta["token_ids"]).expect("token_ids"),
    )
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn load(stem: &str, dtype: ComputeDtype, dsa: DsaMode) -> (Glm5, glmcheck::gguf::GgmlType) {
    let m = GgufModel::open(&gguf(stem)).expect("open");
    let cfg = ConfigReader::read(&m, "glm-dsa").expect("config").config;
    let w = Weights::new(&m, &cfg, Device::Cpu);
    let model = Glm5::load_with(
        &w,
        ModelOptions {
            dtype: dtype.candle(),
            dsa,
            ..ModelOptions::default()
        },
    )
    .expect("load");
    (model, weight_class(&m))
}

fn spec(dtype: ComputeDtype, weights: glmcheck::gguf::GgmlType, new: usize) -> ForwardSpec {
    ForwardSpec {
        dtype,
        weights,
        max_new_tokens: new,
        top: 5,
        gguf: "test".into(),
        prompt: None,
        tolerances: None,
        bench: 0,
        profile: false,
        index_topk: 8,
    }
}

// ---------------------------------------------------------------------------------------------
// Tokenizer

#[test]
fn prompts_give_the_hf_token_ids_and_decode_back() {
    for stem in ["tiny-F32", "tiny-Q4_K_M"] {
        let m = GgufModel::open(&gguf(stem)).expect("open");
        let tok = GgufTokenizer::from_gguf(&m).expect("tokenizer");
        assert_eq!(tok.pre, "glm4");
        for p in ["prompt0", "prompt1"] {
            let (text, ids) = fixture_prompt(p);
            assert_eq!(tok.encode(&text).expect("encode"), ids, "{stem} {p}");
            assert_eq!(tok.decode(&ids).expect("decode"), text, "{stem} {p}");
        }
    }
}

#[test]
fn tokenizer_agrees_with_the_hf_tokenizer_json_beyond_the_prompts() {
    let m = GgufModel::open(&gguf("tiny-F32")).expect("open");
    let ours = GgufTokenizer::from_gguf(&m).expect("tokenizer");
    let hf = tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .expect("tokenizer.json");
    // Ids derived from tokenizer.json (the HF tokenizer the GGUF was converted from), pinned so
    // that a change on both sides still fails.
    let pinned: &[(&str, &[u32])] = &[
        (
            "x = 1234567;\n\n  y=x*2  ",
            &[
                87, 293, 220, 301, 18, 454, 22, 26, 198, 198, 220, 277, 28, 87, 9, 17, 281,
            ],
        ),
        (
            "3.14159 1,000,000 0x1F",
            &[
                18, 13, 444, 16, 20, 24, 220, 16, 11, 15, 15, 15, 11, 15, 15, 15, 220, 15, 87, 16,
                37,
            ],
        ),
        (
            "tab\there\r\nwin",
            &[83, 64, 65, 197, 256, 260, 201, 198, 86, 274],
        ),
        (
            "[gMASK]<sop><|user|>hi<|assistant|>",
            &[502, 504, 507, 71, 72, 508],
        ),
        ("a  b   c    ", &[64, 220, 309, 281, 310, 281, 281]),
    ];
    let extra = [
        "  leading spaces",
        "it's THEY'LL don't we'VE",
        "ünïcødé ✓ 😀",
        "line1\nline2\n\n\nend\n",
        "2024-01-02 12:34:56.789",
        "((a+b)*[c-d]){e}",
        "",
    ];
    for (text, want) in pinned {
        let hf_ids = hf.encode(*text, false).expect("hf").get_ids().to_vec();
        assert_eq!(&hf_ids, want, "tokenizer.json on {text:?}");
        assert_eq!(&ours.encode(text).expect("encode"), want, "{text:?}");
        assert_eq!(ours.decode(want).expect("decode"), *text);
    }
    for text in extra {
        let hf_ids = hf.encode(text, false).expect("hf").get_ids().to_vec();
        let ids = ours.encode(text).expect("encode");
        assert_eq!(ids, hf_ids, "{text:?}");
        assert_eq!(ours.decode(&ids).expect("decode"), text);
    }
    assert_eq!(ours.end_ids(), vec![500, 507, 509]);
}

/// tiny-F32.gguf rewritten with one metadata value replaced.
fn rewrite_with(dir: &Path, key: &str, value: Value) -> PathBuf {
    let m = GgufModel::open(&gguf("tiny-F32")).expect("open");
    let path = dir.join("rewritten.gguf");
    common::write_edited(
        &m,
        &path,
        |k, v| if k == key { value.clone() } else { v.clone() },
        |_, dtype, bytes| (dtype, bytes.to_vec()),
    );
    path
}

#[test]
fn an_unknown_pre_tokenizer_is_an_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = rewrite_with(
        dir.path(),
        "tokenizer.ggml.pre",
        Value::String("qwen35".into()),
    );
    let p = path.to_str().expect("utf-8");
    let out = glmcheck(&["forward", p, "--prompt", "hi", "--max-new-tokens", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`qwen35`") && err.contains("--tokens"),
        "{err}"
    );
    // --tokens needs no tokenizer: it runs, with a warning.
    let out = glmcheck(&["forward", p, "--tokens", "1,2,3", "--max-new-tokens", "0"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("qwen35"));
}

// ---------------------------------------------------------------------------------------------
// forward against transformers

#[test]
fn f32_forward_matches_transformers_on_prompt0() {
    let (_, ids) = fixture_prompt("prompt0");
    let (code, v, err) = run_json(&[
        "forward",
        gguf("tiny-F32").to_str().expect("utf-8"),
        "--tokens",
        &ids_arg(&ids),
        "--reference",
        acts("prompt0").to_str().expect("utf-8"),
        "--max-new-tokens",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}\n{v:#}");
    assert_eq!(v["verdict"], "within tolerance");
    assert!(v["first_divergence"].is_null());
    let modules = v["modules"].as_array().expect("modules");
    assert!(modules.len() > 100, "{} modules compared", modules.len());
    for m in modules {
        if let Some(r) = m["rel_l2"].as_f64() {
            // Measured 1.2e-6: a 10× regression fails.
            assert!(r <= 1e-5, "{}: rel-L2 {r}", m["name"]);
        }
        assert_eq!(m["status"], "match", "{m}");
    }
    let l = &v["logits"];
    assert!(l["kl_mean"].as_f64().expect("kl") < 1e-9, "{l}");
    assert!(l["max_abs"].as_f64().expect("max_abs") <= 5e-5, "{l}");
    assert_eq!(l["top1_agree"].as_f64(), Some(1.0));
    assert_eq!(v["tokens"], serde_json::json!(ids));
    assert_eq!(v["continuation_ids"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["top"].as_array().map(Vec::len), Some(5));
}

/// `--prompt` text gives HF's ids; prompt1's exact indexer tie (layer 1, position 25) is a tie,
/// replayed, and nothing diverges.
#[test]
fn prompt1_by_text_matches_and_its_exact_tie_is_a_tie() {
    let (text, ids) = fixture_prompt("prompt1");
    let (code, v, err) = run_json(&[
        "forward",
        gguf("tiny-F32").to_str().expect("utf-8"),
        "--prompt",
        &text,
        "--reference",
        acts("prompt1").to_str().expect("utf-8"),
        "--max-new-tokens",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}\n{v:#}");
    assert_eq!(v["tokens"], serde_json::json!(ids));
    let tie = v["modules"]
        .as_array()
        .expect("modules")
        .iter()
        .find(|m| m["name"] == "model.layers.1.self_attn.indexer")
        .expect("indexer row");
    assert_eq!(tie["status"], "tie", "{tie:#}");
    let rows = tie["topk"]["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1, "{tie:#}");
    assert_eq!(rows[0]["pos"], 25);
    assert_eq!(rows[0]["class"], "exact_tie");
    assert_eq!(rows[0]["replayed"], true);
    assert_eq!(
        v["replayed"],
        serde_json::json!(["model.layers.1.self_attn.indexer:25"])
    );
    assert!(v["first_divergence"].is_null());
}

/// Without replay (a plain dump diffed against the fixture), the tie is still a tie: positions from
/// 25 on are left out of later modules and nothing diverges; the same dump with the tie's scores
/// removed from the reference makes it unclassified, never corruption.
#[test]
fn diff_without_replay_keeps_ties_out_of_the_verdict() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, ids) = fixture_prompt("prompt1");
    let dump = dir.path().join("p1.safetensors");
    let out = glmcheck(&[
        "forward",
        gguf("tiny-F32").to_str().expect("utf-8"),
        "--tokens",
        &ids_arg(&ids),
        "--max-new-tokens",
        "0",
        "--dump",
        dump.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let (code, v, err) = run_json(&[
        "diff",
        acts("prompt1").to_str().expect("utf-8"),
        dump.to_str().expect("utf-8"),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}\n{:#}", v["first_divergence"]);
    let ex = v["exclusions"].as_array().expect("exclusions");
    assert_eq!(ex.len(), 1, "{ex:?}");
    assert_eq!(ex[0]["module"], "model.layers.1.self_attn.indexer");
    assert_eq!(ex[0]["positions"][0], 25);
    assert_eq!(v["logits"]["positions"], 25);

    // A reference without index scores: the same difference cannot be classified.
    let reference = Activations::load(&acts("prompt1")).expect("load");
    let mut stripped = reference.clone();
    stripped
        .tensors
        .retain(|k, _| !k.ends_with(".indexer.index_scores"));
    stripped
        .order
        .retain(|k| !k.ends_with(".indexer.index_scores"));
    let cand = Activations::load(&dump).expect("load");
    let c = glmcheck::compare::compare(
        &stripped,
        &cand,
        &glmcheck::compare::CompareOptions {
            tolerances: Tolerances::for_profile(ComputeDtype::F32, glmcheck::gguf::GgmlType::F32),
            index_topk: Some(8),
            facts: None,
        },
    )
    .expect("compare");
    let row = c
        .modules
        .iter()
        .find(|r| r.name == "model.layers.1.self_attn.indexer")
        .expect("row");
    assert_eq!(row.status, Status::Unclassified);
    assert!(row.topk.as_ref().expect("topk").rows[0].class == TieClass::Unavailable);
    assert!(!c.diverged(), "{:?}", c.first_divergence);
}

/// BF16, Q8_0 and Q4_K_M weights (f32 and bf16 compute) stay inside the bounds measured on the
/// fixtures (reports/forward-tolerances.md), on both prompts.
#[test]
fn quantized_ggufs_stay_inside_the_measured_bounds() {
    // (file, compute, KL mean ≤, top-1 ≥) — the bounds of Tolerances::for_profile.
    let cases = [
        ("tiny-BF16", ComputeDtype::F32, 1e-4, 0.9),
        ("tiny-Q8_0", ComputeDtype::F32, 8e-4, 0.85),
        ("tiny-Q4_K_M", ComputeDtype::F32, 8e-2, 0.5),
        ("tiny-Q8_0", ComputeDtype::Bf16, 1e-3, 0.85),
    ];
    let refs: Vec<Activations> = ["prompt0", "prompt1"]
        .iter()
        .map(|p| Activations::load(&acts(p)).expect("load"))
        .collect();
    for (stem, dtype, kl, top1) in cases {
        let (model, wc) = load(stem, dtype, DsaMode::Sparse);
        let tol = Tolerances::for_profile(dtype, wc);
        assert_eq!(
            (tol.kl_mean, tol.top1_min),
            (kl, top1),
            "{stem}: {}",
            tol.basis
        );
        for r in &refs {
            let ids = r.tokens.clone().expect("tokens");
            let out = forward::run(&model, None, &ids, Some(r), &spec(dtype, wc, 0)).expect("run");
            let c = out.comparison.expect("comparison");
            let l = c.logits.as_ref().expect("logits");
            assert!(
                !c.diverged() && l.kl_mean <= kl && l.top1_agree >= top1,
                "{stem} {} on {}: KL {:.3e}, top-1 {:.3}, first divergence {:?}",
                dtype.name(),
                r.source,
                l.kl_mean,
                l.top1_agree,
                c.first_divergence
            );
            assert!(
                l.positions >= ids.len() - 3,
                "{stem}: too few positions compared"
            );
            assert!(!l.garbage);
        }
    }
    // The CLI agrees on the coarsest file.
    let (_, ids) = fixture_prompt("prompt0");
    let (code, v, err) = run_json(&[
        "forward",
        gguf("tiny-Q4_K_M").to_str().expect("utf-8"),
        "--tokens",
        &ids_arg(&ids),
        "--reference",
        acts("prompt0").to_str().expect("utf-8"),
        "--max-new-tokens",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}\n{:#}", v["first_divergence"]);
    assert_eq!(v["weights"], "Q4_K");
}

/// The F32 bound is not vacuous: it rejects the Q8_0 file at its first quantized module.
#[test]
fn f32_tolerances_reject_quantized_weights() {
    let (model, _) = load("tiny-Q8_0", ComputeDtype::F32, DsaMode::Sparse);
    let r = Activations::load(&acts("prompt0")).expect("load");
    let mut s = spec(ComputeDtype::F32, glmcheck::gguf::GgmlType::F32, 0);
    s.tolerances = Some(Tolerances::for_profile(
        ComputeDtype::F32,
        glmcheck::gguf::GgmlType::F32,
    ));
    let ids = r.tokens.clone().expect("tokens");
    let c = forward::run(&model, None, &ids, Some(&r), &s)
        .expect("run")
        .comparison
        .expect("comparison");
    // Q8_0 quantizes token_embd too: the very first module is above the F32 bound.
    let f = c
        .first_divergence
        .expect("Q8_0 weights exceed the F32 bound");
    assert_eq!(f.module, "model.embed_tokens", "{f:?}");
    let reading = f.reading.to_string();
    assert!(
        reading.contains("while its input input_ids matches: suspect the token embedding"),
        "{reading}"
    );
}

// ---------------------------------------------------------------------------------------------
// --dsa

#[test]
fn dense_equals_sparse_up_to_index_topk_and_diverges_beyond() {
    let (_, ids) = fixture_prompt("prompt0");
    let short = ids_arg(&ids[..8]);
    let g = gguf("tiny-F32");
    let g = g.to_str().expect("utf-8");
    let run = |dsa: &str| {
        run_json(&[
            "forward",
            g,
            "--tokens",
            &short,
            "--dsa",
            dsa,
            "--max-new-tokens",
            "0",
            "--json",
        ])
    };
    let (c1, dense, _) = run("dense");
    let (c2, sparse, _) = run("sparse");
    assert_eq!((c1, c2), (0, 0));
    assert_eq!(dense["dsa"]["identical"], true);
    let msg = dense["dsa"]["message"].as_str().expect("message");
    assert!(
        msg.contains("identical")
            && msg.contains("index_topk 8")
            && msg.contains("every visible key"),
        "{msg}"
    );
    assert_eq!(dense["top"], sparse["top"]);

    // 18 tokens > index_topk: dense attention parts from transformers' sparse run at layer 0's
    // attention, and the output says why.
    let (code, v, err) = run_json(&[
        "forward",
        g,
        "--tokens",
        &ids_arg(&ids),
        "--dsa",
        "dense",
        "--reference",
        acts("prompt0").to_str().expect("utf-8"),
        "--max-new-tokens",
        "0",
        "--json",
    ]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(v["dsa"]["identical"], false);
    let f = &v["first_divergence"];
    assert_eq!(f["layer"], 0, "{f:#}");
    assert!(
        f["module"]
            .as_str()
            .is_some_and(|m| m.starts_with("model.layers.0.self_attn")),
        "{f:#}"
    );
    assert!(
        f["reading"].as_str().is_some_and(|r| r.contains("densely")),
        "{f:#}"
    );
}

// ---------------------------------------------------------------------------------------------
// --dump and diff

#[test]
fn dump_writes_every_capture_and_never_overwrites_the_gguf() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (text, ids) = fixture_prompt("prompt0");
    let dump = dir.path().join("p0.safetensors");
    let out = glmcheck(&[
        "forward",
        gguf("tiny-BF16").to_str().expect("utf-8"),
        "--prompt",
        &text,
        "--dtype",
        "bf16",
        "--max-new-tokens",
        "0",
        "--dump",
        dump.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(0));
    let a = Activations::load(&dump).expect("dump");
    assert_eq!(a.tokens.as_deref(), Some(ids.as_slice()));
    assert_eq!(a.prompt.as_deref(), Some(text.as_str()));
    assert_eq!(
        a.ordered_by_producer,
        a.tensors.len(),
        "execution order lists every key"
    );
    assert_eq!(a.order.first().map(String::as_str), Some("input_ids"));
    assert_eq!(a.order.last().map(String::as_str), Some("logits"));
    assert_eq!(a.metadata["glmcheck.dtype"], "bf16");
    assert_eq!(a.metadata["glmcheck.weights"], "BF16");
    assert_eq!(a.tensors["lm_head"].dtype, safetensors::Dtype::BF16);
    // Its own profile picks the bf16 tolerances: within them against transformers.
    let (code, v, err) = run_json(&[
        "diff",
        acts("prompt0").to_str().expect("utf-8"),
        dump.to_str().expect("utf-8"),
        "--json",
    ]);
    assert_eq!(code, 0, "{err}\n{:#}", v["first_divergence"]);
    assert!(v["tolerances"]["basis"]
        .as_str()
        .is_some_and(|b| b.starts_with("bf16 compute, BF16 weights")));
    // Against itself: exact.
    let (code, v, _) = run_json(&[
        "diff",
        dump.to_str().expect("utf-8"),
        dump.to_str().expect("utf-8"),
        "--json",
    ]);
    assert_eq!(code, 0);
    assert!(v["modules"]
        .as_array()
        .expect("modules")
        .iter()
        .all(|m| m["rel_l2"].as_f64().unwrap_or(0.0) == 0.0));

    // --dump onto the GGUF (a copy) is refused and leaves it intact.
    let copy = dir.path().join("model.gguf");
    std::fs::copy(gguf("tiny-F32"), &copy).expect("copy");
    let before = std::fs::metadata(&copy).expect("meta").len();
    let out = glmcheck(&[
        "forward",
        copy.to_str().expect("utf-8"),
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "0",
        "--dump",
        copy.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("refusing to overwrite"));
    assert_eq!(std::fs::metadata(&copy).expect("meta").len(), before);
    assert!(GgufModel::open(&copy).is_ok());
}

#[test]
fn diff_of_a_fixture_with_itself_exits_0() {
    let p = acts("prompt0");
    let p = p.to_str().expect("utf-8");
    let out = glmcheck(&["diff", p, p]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("first divergence: none") && text.contains("verdict: within tolerance"));
}

/// A copy of prompt0 with one module's output perturbed (written with the safetensors crate):
/// diff names exactly that module, with its input matching.
#[test]
fn diff_names_the_one_perturbed_module() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = "model.layers.1.self_attn.kv_b_proj";
    let path = dir.path().join("perturbed.safetensors");
    rewrite_safetensors(&acts("prompt0"), &path, |name, _, _, data| {
        if name == target {
            // Scale every 7th value by 1.5: rel-L2 ≈ 0.19.
            for (i, c) in data.chunks_exact_mut(4).enumerate() {
                if i % 7 == 0 {
                    let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * 1.5;
                    c.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
        true
    });

    let (code, v, err) = run_json(&[
        "diff",
        acts("prompt0").to_str().expect("utf-8"),
        path.to_str().expect("utf-8"),
        "--json",
    ]);
    assert_eq!(code, 1, "{err}");
    let f = &v["first_divergence"];
    assert_eq!(f["module"], target, "{f:#}");
    assert_eq!(f["layer"], 1);
    assert_eq!(
        f["inputs"][0]["name"],
        "model.layers.1.self_attn.kv_a_layernorm"
    );
    assert_eq!(f["inputs"][0]["status"], "match");
    let reading = f["reading"].as_str().expect("reading");
    assert!(
        reading.contains("kv_b_proj output diverges")
            && reading.contains("while its input kv_a_layernorm matches")
            && reading.contains("suspect the kv_b_proj weight"),
        "{reading}"
    );
    let diverged: Vec<&str> = v["modules"]
        .as_array()
        .expect("modules")
        .iter()
        .filter(|m| m["status"] == "diverged")
        .filter_map(|m| m["name"].as_str())
        .collect();
    assert_eq!(diverged, vec![target]);
    // The text output says the same.
    let out = glmcheck(&[
        "diff",
        acts("prompt0").to_str().expect("utf-8"),
        path.to_str().expect("utf-8"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("first divergence: {target} (layer 1)")),
        "{text}"
    );
}

#[test]
fn bad_inputs_exit_2() {
    let g = gguf("tiny-F32");
    let g = g.to_str().expect("utf-8");
    for args in [
        vec!["forward", g, "--tokens", "1,x,3"],
        vec!["forward", g, "--tokens", "1,600"],
        vec!["forward", g, "--tokens", ""],
        vec![
            "forward",
            g,
            "--tokens",
            "1,2,3",
            "--reference",
            acts("prompt0").to_str().expect("utf-8"),
        ],
        vec!["diff", g, g],
    ] {
        let out = glmcheck(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("glmcheck: error:"), "{args:?}: {err}");
    }
    // Different tokens: said, with the ids to pass.
    let out = glmcheck(&[
        "forward",
        g,
        "--tokens",
        "1,2,3",
        "--reference",
        acts("prompt0").to_str().expect("utf-8"),
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tokens 294,266,220"));
    // Two dumps of different prompts.
    let out = glmcheck(&[
        "diff",
        acts("prompt0").to_str().expect("utf-8"),
        acts("prompt1").to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("different tokens"));
}

// ---------------------------------------------------------------------------------------------
// Measurement (the figures of reports/forward-tolerances.md)

/// The figures behind `Tolerances::for_profile` (reports/forward-tolerances.md: run with
/// `--nocapture` to print the table), re-measured on every run, and each must sit inside its
/// profile with at least 1.5× headroom: a bound tightened below what is measured, or a forward
/// that drifts toward its bound, fails here.
#[test]
fn measured_figures_sit_inside_their_profiles() {
    let mut outside = Vec::new();
    let loose = Tolerances {
        rel_l2: f64::INFINITY,
        kl_mean: f64::INFINITY,
        kl_max: f64::INFINITY,
        top1_min: 0.0,
        score_noise: 10.0,
        router_flip_max: 1.0,
        reference: glmcheck::compare::ReferenceWeights::Original,
        ..Tolerances::for_profile(ComputeDtype::F32, glmcheck::gguf::GgmlType::F32)
    };
    println!(
        "| weights | compute | prompt | worst module rel-L2 | module | worst index_scores rel-L2 | KL mean | KL max | top-1 | RMS Δp | differing top-k rows (exact ties) | worst swap margin / row max | routed-expert flips (tokens) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for stem in ["tiny-F32", "tiny-BF16", "tiny-Q8_0", "tiny-Q4_K_M"] {
        for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
            let start = Instant::now();
            let (model, wc) = load(stem, dtype, DsaMode::Sparse);
            for p in ["prompt0", "prompt1"] {
                let r = Activations::load(&acts(p)).expect("load");
                let mut s = spec(dtype, wc, 0);
                s.tolerances = Some(loose.clone());
                let ids = r.tokens.clone().expect("tokens");
                let c = forward::run(&model, None, &ids, Some(&r), &s)
                    .expect("run")
                    .comparison
                    .expect("comparison");
                let mut worst = (0.0, String::new());
                let mut scores: f64 = 0.0;
                let (mut rows, mut ties, mut margin) = (0, 0, 0f64);
                for row in &c.modules {
                    if let Some(x) = row.rel_l2 {
                        match row.role {
                            ValueKind::IndexerScores => scores = scores.max(x),
                            ValueKind::Float | ValueKind::ExpertAct | ValueKind::RouterWeights
                                if x > worst.0 =>
                            {
                                worst = (x, row.name.clone())
                            }
                            _ => {}
                        }
                    }
                    if let (Some(t), false) = (&row.topk, row.aux) {
                        for d in &t.rows {
                            rows += 1;
                            ties += (d.class == TieClass::ExactTie) as usize;
                            if let (Some(m), Some(n)) = (d.margin, d.noise) {
                                if n > 0.0 {
                                    margin = margin.max(m / n * loose.score_noise);
                                }
                            }
                        }
                    }
                }
                let flips: Vec<String> = c
                    .exclusions
                    .iter()
                    .filter(|e| !e.from_on)
                    .map(|e| format!("{:?}", e.positions))
                    .collect();
                let l = c.logits.expect("logits");
                let bound = Tolerances::for_profile(dtype, wc);
                let h = 1.5;
                let checks = [
                    ("module rel-L2", worst.0, bound.rel_l2),
                    ("index_scores rel-L2", scores, bound.rel_l2),
                    ("KL mean", l.kl_mean, bound.kl_mean),
                    ("KL max", l.kl_max, bound.kl_max),
                ];
                for (what, x, b) in checks {
                    if x * h > b {
                        outside.push(format!(
                            "{stem} {} {p}: {what} {x:.2e} vs bound {b:.2e}",
                            dtype.name()
                        ));
                    }
                }
                if l.top1_agree < bound.top1_min {
                    outside.push(format!(
                        "{stem} {} {p}: top-1 {:.3} below {:.3}",
                        dtype.name(),
                        l.top1_agree,
                        bound.top1_min
                    ));
                }
                println!(
                    "| {stem} | {} | {p} | {:.2e} | {} | {:.2e} | {:.2e} | {:.2e} | {}/{} | {:.2e} | {rows} ({ties}) | {:.3} | {} |",
                    dtype.name(),
                    worst.0,
                    worst.1,
                    scores,
                    l.kl_mean,
                    l.kl_max,
                    l.top1_agree_count,
                    l.positions,
                    l.rms_dp,
                    margin,
                    if flips.is_empty() { "none".into() } else { flips.join(" ") }
                );
            }
            eprintln!("{stem} {}: {:?}", dtype.name(), start.elapsed());
        }
    }
    assert!(
        outside.is_empty(),
        "measured figures outside their profile's headroom:\n{}",
        outside.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Simulated tensor parallel

/// tp 1/2/4/8 from the GGUF's cut equal the unsharded forward: every module within 1e-5 rel-L2 in
/// f32, the same top-k and routing everywhere.
#[test]
fn simulated_tp_equals_the_unsharded_forward() {
    let m = GgufModel::open(&gguf("tiny-F32")).expect("open");
    let cfg = ConfigReader::read(&m, "glm-dsa").expect("config").config;
    let w = Weights::new(&m, &cfg, Device::Cpu);
    let model = Glm5::load(&w).expect("load");
    let (_, ids) = fixture_prompt("prompt1");
    let mut cap = glmcheck::model::VecCapture::new();
    model.forward(&ids, &mut cap).expect("forward");
    let unsharded = Activations::from_capture(&cap, None, Default::default()).expect("acts");
    let mut tol = Tolerances::for_profile(ComputeDtype::F32, glmcheck::gguf::GgmlType::F32);
    tol.rel_l2 = 1e-5;
    for tp in [1, 2, 4, 8] {
        let plan = glmcheck::plan::ShardPlan::new(&m, &cfg, tp);
        let tpm = Glm5::sharded(&w, &plan, None, model.options()).expect("tp model");
        assert_eq!(tpm.tp(), tp);
        let mut cap = glmcheck::model::VecCapture::new();
        tpm.forward(&ids, &mut cap).expect("tp forward");
        let ours = Activations::from_capture(&cap, None, Default::default()).expect("acts");
        assert_eq!(
            ours.order, unsharded.order,
            "tp={tp}: the same captures in the same order"
        );
        let c = glmcheck::compare::compare(
            &unsharded,
            &ours,
            &glmcheck::compare::CompareOptions {
                tolerances: tol.clone(),
                index_topk: Some(8),
                facts: None,
            },
        )
        .expect("compare");
        assert!(
            c.first_divergence.is_none(),
            "tp={tp}: {:?}",
            c.first_divergence
        );
        assert!(c.exclusions.is_empty(), "tp={tp}: {:?}", c.exclusions);
        let worst = c
            .modules
            .iter()
            .filter_map(|r| r.rel_l2)
            .fold(0.0, f64::max);
        assert!(worst <= 1e-5, "tp={tp}: worst rel-L2 {worst:.3e}");
        if tp == 1 {
            assert_eq!(worst, 0.0, "tp=1 is the unsharded forward");
        }
    }
}

/// `forward --tp 8 --weights-from` a dump with a known loader bug diverges first where the bug is.
#[test]
fn tp_forward_on_a_faulty_dump_diverges_where_the_fault_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, ids) = fixture_prompt("prompt0");
    let g = gguf("tiny-F32");
    let g = g.to_str().expect("utf-8");
    // (fault, layer, expected first divergence)
    let cases = [
        ("none", None, None),
        (
            "kvb-concat",
            Some("1"),
            Some("model.layers.1.self_attn.kv_b_proj"),
        ),
        (
            "rank-swap:0,1",
            Some("2"),
            Some("model.layers.2.self_attn.o_proj"),
        ),
    ];
    for (fault, layer, want) in cases {
        let out_dir = dir.path().join(fault.replace([':', ','], "_"));
        let out_s = out_dir.to_str().expect("utf-8");
        let mut args = vec!["inject", "--fault", fault, "--tp", "8", "--out", out_s, g];
        if let Some(l) = layer {
            args.extend(["--layer", l]);
        }
        let o = glmcheck(&args);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let (code, v, err) = run_json(&[
            "forward",
            g,
            "--tokens",
            &ids_arg(&ids),
            "--tp",
            "8",
            "--weights-from",
            out_s,
            "--max-new-tokens",
            "0",
            "--json",
        ]);
        assert_eq!(v["tp"], 8);
        match want {
            None => assert_eq!(code, 0, "{fault}: {err}\n{:#}", v["first_divergence"]),
            Some(m) => {
                assert_eq!(code, 1, "{fault}: {err}");
                let f = &v["first_divergence"];
                assert_eq!(f["module"], m, "{fault}: {f:#}");
                assert_eq!(
                    f["layer"].as_u64(),
                    layer.and_then(|l| l.parse().ok()),
                    "{fault}"
                );
            }
        }
    }
}

/// A reference dump with one module missing and one of another shape: the missing one is listed,
/// the mis-shaped one is incomparable (never "diverged": a layout is not a fault), every other
/// module is still compared, and the run is incomplete.
#[test]
fn a_reference_with_a_missing_or_misshaped_module_is_reported_and_the_rest_compared() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gone = "model.layers.1.mlp.gate";
    let reshaped = "model.layers.2.self_attn.o_proj";
    let path = dir.path().join("partial.safetensors");
    rewrite_safetensors(&acts("prompt0"), &path, |name, _, shape, _| {
        if name == reshaped {
            let n: usize = shape.iter().product();
            *shape = vec![n]; // the same values, flattened
        }
        name != gone
    });
    // The partial dump is the reference (diff REFERENCE CANDIDATE).
    let (code, v, err) = run_json(&[
        "diff",
        path.to_str().expect("utf-8"),
        acts("prompt0").to_str().expect("utf-8"),
        "--json",
    ]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(v["only_candidate"], serde_json::json!([gone]), "{v:#}");
    assert!(v["first_divergence"].is_null(), "{v:#}");
    assert_eq!(v["verdict"], "incomplete");
    assert_eq!(v["incomparable"], serde_json::json!([reshaped]));
    let modules = v["modules"].as_array().expect("modules");
    let status = |m: &str| {
        modules
            .iter()
            .find(|r| r["name"] == m)
            .map(|r| r["status"].clone())
    };
    assert_eq!(status(reshaped), Some(Json::from("incomparable")), "{v:#}");
    assert_eq!(status(gone), None);
    let matched = modules.iter().filter(|m| m["status"] == "match").count();
    assert!(
        matched > 50,
        "{matched} modules still compared and matching"
    );
    assert_eq!(status("lm_head"), Some(Json::from("match")));
}

/// Keeps every module output except what the indexer computes (its module, its internals, the
/// top-k attention and layer hand on).
struct NoIndexer(glmcheck::model::VecCapture);

impl glmcheck::model::Capture for NoIndexer {
    fn wants(&self, path: &str) -> bool {
        !(path.contains(".indexer") || path.ends_with(".self_attn.2") || path.ends_with(".1"))
    }

    fn capture(&mut self, path: &str, t: &candle_core::Tensor) -> candle_core::Result<()> {
        self.0.capture(path, t)
    }
}

/// Up to index_topk tokens (8 in the tiny model) every key is in the indexer's top-k and the
/// attention mask is the causal one, so a forward whose sink reads nothing of the indexer skips
/// it. Checked: the logits are the same bits whether the sink reads nothing, everything, or all
/// but the indexer; a sink that reads the indexer gets its outputs (and the layers' top-k). Past
/// index_topk (9 and 12 tokens) the top-k picks keys and a skip would change the logits: with the
/// skip forced at every length this test fails there. Whether the indexer ran at all is counted
/// by the unit test `the_indexer_is_skipped_exactly_where_every_key_is_selected_and_nothing_reads_it`.
#[test]
fn the_indexer_runs_where_it_is_read_or_can_change_the_output() {
    use glmcheck::model::{NoCapture, VecCapture};
    let (model, _) = load("tiny-Q8_0", ComputeDtype::F32, DsaMode::Sparse);
    let bits = |t: &candle_core::Tensor| -> Vec<u32> {
        t.flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("logits")
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    for (n, selects_all) in [(7usize, true), (8, true), (9, false), (12, false)] {
        let tokens: Vec<u32> = (0..n as u32).map(|i| 17 + 3 * i).collect();
        let none = model.forward(&tokens, &mut NoCapture).expect("forward");
        let mut all = VecCapture::new();
        let every = model.forward(&tokens, &mut all).expect("forward");
        let mut some = NoIndexer(VecCapture::new());
        let most = model.forward(&tokens, &mut some).expect("forward");
        let differ = |a: &candle_core::Tensor, b: &candle_core::Tensor| {
            let (a, b) = (bits(a), bits(b));
            a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
        };
        let d = differ(&none, &every);
        assert_eq!(
            d, 0,
            "{n} tokens: {d} logits differ, nothing vs everything captured"
        );
        let d = differ(&none, &most);
        assert_eq!(
            d, 0,
            "{n} tokens: {d} logits differ, nothing vs all but the indexer"
        );
        let has = |c: &VecCapture, path: &str| c.entries.iter().any(|(k, _)| k == path);
        for l in 0..2 {
            let idx = format!("model.layers.{l}.self_attn.indexer");
            assert!(
                has(&all, &idx),
                "{n} tokens: {idx} not computed for a sink that reads it"
            );
            assert!(
                has(&all, &format!("model.layers.{l}.1")),
                "{n} tokens: layer {l}'s top-k"
            );
        }
        // The attention layers' outputs equal in both captures.
        let o = "model.layers.1.self_attn";
        let (a, b) = (all.get(o).expect("attn"), some.0.get(o).expect("attn"));
        assert_eq!(differ(a, b), 0, "{n} tokens: {o}");
        eprintln!("{n} tokens (every key selected: {selects_all}): the same logits three ways");
    }
}

#[test]
fn the_profiles_timeline_marks_module_boundaries_in_order_without_the_indexer() {
    let (model, wc) = load("tiny-Q8_0", ComputeDtype::F32, DsaMode::Sparse);
    // 6 tokens ≤ index_topk (8): the timed forwards skip the indexer, so must the timeline's.
    let ids = [1u32, 7, 42, 99, 5, 300];
    let mut s = spec(ComputeDtype::F32, wc, 0);
    s.bench = 1;
    s.profile = true;
    let out = forward::run(&model, None, &ids, None, &s).expect("run");
    let t = out
        .bench
        .and_then(|b| b.timeline)
        .expect("--profile gives a timeline");
    assert!(!t.gpu_events, "a CPU forward has no device clock");
    let marks: Vec<&str> = t.marks.iter().map(|m| m.module.as_str()).collect();
    // Every mark is a capture of the full forward, once.
    let all: Vec<&str> = out.capture.order.iter().map(String::as_str).collect();
    for (i, m) in marks.iter().enumerate() {
        assert!(all.contains(m), "{m} is not a capture");
        assert!(!marks[..i].contains(m), "{m} twice");
    }
    assert!(marks.iter().all(|m| !m.contains("indexer")), "{marks:?}");
    // Marked as enqueued, not in transformers' order: a MoE layer's shared expert runs before
    // its routed experts (their routing on its way to the host meanwhile).
    let at = |k: &str| marks.iter().position(|m| *m == k);
    let mut moe_layers = 0;
    for l in 0..3 {
        let (shared, experts) = (
            at(&format!("model.layers.{l}.mlp.shared_experts")),
            at(&format!("model.layers.{l}.mlp.experts")),
        );
        if let (Some(s), Some(e)) = (shared, experts) {
            assert!(s < e, "layer {l}: {marks:?}");
            moe_layers += 1;
        }
    }
    assert!(moe_layers > 0, "{marks:?}");
    for l in 0..3 {
        for within in ["self_attn", "mlp", "input_layernorm"] {
            let key = format!("model.layers.{l}.{within}");
            assert!(marks.contains(&key.as_str()), "{key} missing: {marks:?}");
        }
    }
    assert_eq!(marks.first(), Some(&"model.embed_tokens"));
    assert_eq!(marks.last(), Some(&"lm_head"));

    // Simulated TP of 2 ranks: the ranks run one after another and their captures reach the sink
    // when merged, so marks would time the merges: the profile, and no timeline.
    let m = GgufModel::open(&gguf("tiny-Q8_0")).expect("open");
    let cfg = ConfigReader::read(&m, "glm-dsa").expect("config").config;
    let w = Weights::new(&m, &cfg, Device::Cpu);
    let plan = glmcheck::plan::ShardPlan::new(&m, &cfg, 2);
    let tpm = Glm5::sharded(&w, &plan, None, model.options()).expect("tp model");
    let b = forward::run(&tpm, None, &ids, None, &s)
        .expect("tp run")
        .bench
        .expect("bench");
    assert!(b.profile.is_some(), "--profile still splits by module");
    assert!(b.timeline.is_none(), "no timeline under simulated TP");
}
