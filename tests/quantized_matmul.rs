//! The GGUF's quantized weights kept as blocks: `--matmul dequant` (the default) decodes them right
//! before each GEMM and equals the dense forward; `--matmul q8` runs candle's llama.cpp-derived
//! kernels (8-bit activations) and is judged at other-engine bounds against a reference from the
//! same weights, and at the quant type's bounds against transformers.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Device;
use glmcheck::arch::config::ConfigReader;
use glmcheck::gguf::GgufModel;
use glmcheck::model::{FeedForward, Glm5, MatmulMode, ModelOptions, VecCapture};
use glmcheck::weights::Weights;
use serde_json::Value as Json;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(rel)
}

fn run(args: &[&str]) -> (i32, Json, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_glmcheck"))
        .args(args)
        .output()
        .expect("run glmcheck");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Json::Null);
    (out.status.code().unwrap_or(-1), v, err)
}

const PROMPT: &str = "What is 2+2? Please answer the question. The answer is";

fn load(stem: &str, matmul: MatmulMode) -> Glm5 {
    let m = GgufModel::open(&fixture(&format!("{stem}.gguf"))).expect("open");
    let c = ConfigReader::read(&m, "glm-dsa").expect("config").config;
    // The model keeps no borrow of the file: the weights it holds are its own.
    let w = Weights::new(&m, &c, Device::Cpu);
    Glm5::load_with(
        &w,
        ModelOptions {
            matmul,
            ..ModelOptions::default()
        },
    )
    .expect("load")
}

/// What stays quantized: every weight the GGUF stores as it is in a quantized type (embedding,
/// lm_head, attention and MLP projections, experts); rebuilt or float ones are dense.
#[test]
fn quantized_weights_stay_blocks_and_float_ones_dense() {
    let m = load("tiny-Q4_K_M", MatmulMode::Dequant);
    let r = &m.ranks[0];
    assert!(r.embed.is_quantized(), "embedding");
    assert!(r.lm_head.weight.is_quantized(), "lm_head");
    let l = &m.layers()[1];
    assert!(l.attn.q_b.weight.is_quantized(), "q_b_proj");
    assert!(l.attn.o.weight.is_quantized(), "o_proj");
    // kv_b_proj is rebuilt from attn_k_b and attn_v_b: dense.
    assert!(!l.attn.kv_b.weight.is_quantized(), "kv_b_proj");
    let FeedForward::Moe(moe) = &l.ffn else {
        panic!("layer 1 is an MoE layer")
    };
    assert!(moe.shared.up.weight.is_quantized(), "shared expert");
    assert!(!moe.router.weight.weight.is_quantized(), "router (f32)");
    let f32 = load("tiny-F32", MatmulMode::Dequant);
    assert!(!f32.ranks[0].embed.is_quantized());
    assert!(!f32.layers()[1].attn.q_b.weight.is_quantized());
}

/// q8 differs from dequant (it is another computation) but only by 8-bit activation noise.
#[test]
fn q8_logits_differ_from_dequant_by_activation_rounding_only() {
    let ids = [294u32, 266, 220, 17, 10, 17, 30];
    for stem in ["tiny-Q8_0", "tiny-Q4_K_M"] {
        let a = load(stem, MatmulMode::Dequant)
            .forward(&ids, &mut VecCapture::new())
            .expect("dequant");
        let b = load(stem, MatmulMode::Q8)
            .forward(&ids, &mut VecCapture::new())
            .expect("q8");
        let values = |t: &candle_core::Tensor| {
            t.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("values")
        };
        let rel = glmcheck::compare::diff(&values(&b), &values(&a)).rel_l2;
        assert!(
            rel > 1e-6 && rel < 5e-2,
            "{stem}: q8 vs dequant rel-L2 {rel}"
        );
    }
}

/// Against glmcheck's own dequant dump, q8 is judged as another engine on the same GGUF and
/// passes; against transformers it passes the quant type's bounds.
#[test]
fn q8_passes_at_other_engine_bounds_and_against_transformers() {
    let dir = tempfile::tempdir().expect("tmp");
    for stem in ["tiny-Q8_0", "tiny-Q4_K_M"] {
        let file = fixture(&format!("{stem}.gguf"));
        let file = file.to_str().expect("utf-8");
        let dump = dir.path().join(format!("{stem}.safetensors"));
        let dump = dump.to_str().expect("utf-8");
        let base = ["forward", file, "--prompt", PROMPT, "--max-new-tokens", "0"];
        let (rc, _, err) = run(&[&base[..], &["--dump", dump, "-q"]].concat());
        assert_eq!(rc, 0, "{stem} dump: {err}");
        let q8 = [&base[..], &["--matmul", "q8", "--json", "--reference"]].concat();
        let (rc, v, err) = run(&[&q8[..], &[dump]].concat());
        assert_eq!(rc, 0, "{stem} q8 vs dequant: {err}\n{v}");
        assert_eq!(
            v["comparison"]["tolerances"]["reference"], "same-gguf",
            "{stem}: {v}"
        );
        let kl = v["logits"]["kl_mean"].as_f64().expect("kl_mean");
        assert!(kl > 0.0 && kl < 1e-3, "{stem}: KL {kl}");
        let hf = fixture("activations/prompt0.safetensors");
        let (rc, v, err) = run(&[&q8[..], &[hf.to_str().expect("utf-8")]].concat());
        assert_eq!(rc, 0, "{stem} q8 vs transformers: {err}\n{v}");
    }
}

#[test]
fn q8_with_simulated_tp_is_refused() {
    let file = fixture("tiny-Q8_0.gguf");
    let (rc, _, err) = run(&[
        "forward",
        file.to_str().expect("utf-8"),
        "--tokens",
        "1,2",
        "--matmul",
        "q8",
        "--tp",
        "2",
    ]);
    assert_eq!(rc, 2, "{err}");
    assert!(err.contains("--tp"), "{err}");
}
