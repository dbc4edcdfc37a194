//! The logical HF tensors rebuilt from the GGUFs against the transformers checkpoint they came from.

mod common;
use common::*;
use glmcheck::arch::config::ConfigReader;
use glmcheck::arch::glm_dsa;
use glmcheck::gguf::{GgmlType, GgufModel};
use glmcheck::weights::Weights;

fn weights_of(stem: &str) -> (GgufModel, glmcheck::arch::Config) {
    let model = GgufModel::open(&gguf(stem)).expect("open");
    let cfg = ConfigReader::read(&model, "glm-dsa")
        .expect("config")
        .config;
    (model, cfg)
}

fn values(t: &candle_core::Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("f32 values")
}

#[test]
fn every_hf_parameter_rebuilt_from_f32_equals_the_checkpoint_exactly() {
    let (model, cfg) = weights_of("tiny-F32");
    let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
    let want = json("hf_tensors.json");
    let want = want.as_object().unwrap();
    let params = glm_dsa::hf_params(&cfg);
    assert_eq!(
        params.len(),
        want.len(),
        "the name table implies every checkpoint tensor, no more"
    );
    for p in params {
        let w_entry = want
            .get(&p.name)
            .unwrap_or_else(|| panic!("{} not in the HF checkpoint", p.name));
        let t = w.hf(&p.name).unwrap_or_else(|e| panic!("{e}"));
        let shape: Vec<usize> = w_entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.dims(), shape.as_slice(), "{}", p.name);
        assert_eq!(
            sha256_f32(&values(&t)),
            w_entry["sha256"].as_str().unwrap(),
            "{}: values differ",
            p.name
        );
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Relative L2 error a weight of this type may carry against its f32 original. Uniform rounding on a
/// b-bit grid scaled to a block's absmax gives rel-L2 ≈ absmax / (2^(b-1) · √3 · σ); these bounds are
/// that with absmax ≈ 3.5σ, rounded up, and were checked against the fixtures (measured values are in
/// fixtures/README.md).
fn bound(t: GgmlType) -> f64 {
    match t.name {
        "F32" => 0.0,
        "F16" => 1e-3,
        "BF16" => 4e-3,
        "Q8_0" => 1e-2,
        "Q6_K" => 4e-2,
        "Q5_0" | "Q5_1" | "Q5_K" => 8e-2,
        "Q4_0" | "Q4_1" | "Q4_K" => 0.15,
        other => panic!("no bound for {other}"),
    }
}

#[test]
fn kv_b_proj_from_quantized_files_is_within_the_types_error() {
    let st_bytes = std::fs::read(fixture("hf_kv_b_proj.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&st_bytes).expect("safetensors");
    for stem in ["tiny-F32", "tiny-BF16", "tiny-Q8_0", "tiny-Q4_K_M"] {
        let (model, cfg) = weights_of(stem);
        let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
        for l in 0..cfg.num_hidden_layers {
            let name = format!("model.layers.{l}.self_attn.kv_b_proj.weight");
            let hf = st.tensor(&name).expect("kv_b in safetensors");
            let hf: Vec<f32> = hf
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let got = values(&w.hf(&name).expect("rebuild"));
            let k_b = model
                .tensor(&format!("blk.{l}.attn_k_b.weight"))
                .unwrap()
                .info
                .dtype;
            let v_b = model
                .tensor(&format!("blk.{l}.attn_v_b.weight"))
                .unwrap()
                .info
                .dtype;
            let b = bound(k_b).max(bound(v_b));
            let e = rel_l2(&got, &hf);
            assert!(
                e <= b,
                "{stem} {name} ({k_b}/{v_b}): rel-L2 {e:.3e} > {b:.1e}"
            );
            if stem == "tiny-F32" {
                assert_eq!(got, hf, "F32 kv_b_proj must equal the checkpoint exactly");
            }
            // A wrong row order (all K rows, then all V rows) has the right shape and must not pass.
            let (h, nope, v, lr) = (
                cfg.num_attention_heads,
                cfg.qk_nope_head_dim,
                cfg.v_head_dim,
                cfg.kv_lora_rank,
            );
            let mut concat = Vec::with_capacity(hf.len());
            for part in [(0, nope), (nope, v)] {
                for head in 0..h {
                    for r in 0..part.1 {
                        let row = head * (nope + v) + part.0 + r;
                        concat.extend_from_slice(&hf[row * lr..(row + 1) * lr]);
                    }
                }
            }
            assert!(
                rel_l2(&concat, &hf) > 1.0,
                "the all-K-then-all-V layout must be far from the truth"
            );
        }
    }
}

#[test]
fn vllm_fused_views_concatenate_their_hf_parts() {
    let (model, cfg) = weights_of("tiny-F32");
    let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
    let fused = w
        .vllm("model.layers.1.self_attn.fused_qkv_a_proj.weight")
        .unwrap();
    assert_eq!(
        fused.dims(),
        &[
            cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            cfg.hidden_size
        ]
    );
    let q_a = values(&w.hf("model.layers.1.self_attn.q_a_proj.weight").unwrap());
    let f = values(&fused);
    assert_eq!(&f[..q_a.len()], q_a.as_slice());
    let w13 = w.vllm("model.layers.2.mlp.experts.w13_weight").unwrap();
    assert_eq!(
        w13.dims(),
        &[
            cfg.n_routed_experts,
            2 * cfg.moe_intermediate_size,
            cfg.hidden_size
        ]
    );
    // Expert 5's up rows sit after its gate rows.
    let up5 = values(&w.hf("model.layers.2.mlp.experts.5.up_proj.weight").unwrap());
    let e5 = values(&w13.get(5).unwrap());
    assert_eq!(&e5[up5.len()..], up5.as_slice());
    let w2 = w.vllm("model.layers.2.mlp.experts.w2_weight").unwrap();
    assert_eq!(
        w2.dims(),
        &[
            cfg.n_routed_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size
        ]
    );
    assert!(
        w.vllm("model.layers.0.mlp.experts.w13_weight").is_err(),
        "layer 0 is dense"
    );
    let gu = w.vllm("model.layers.0.mlp.gate_up_proj.weight").unwrap();
    assert_eq!(gu.dims(), &[2 * cfg.intermediate_size, cfg.hidden_size]);
}
