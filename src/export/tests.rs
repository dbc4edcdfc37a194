use super::*;

fn spec(layers: Option<LayerRange>, dtype: ExportDtype, max_shard_bytes: u64) -> ExportSpec {
    ExportSpec {
        layers,
        dtype,
        max_shard_bytes,
        force: false,
    }
}

fn range(s: &str) -> LayerRange {
    s.parse().expect("a layer range")
}

#[test]
fn layer_ranges_are_inclusive_and_checked() {
    assert_eq!(range("1..2"), LayerRange { first: 1, last: 2 });
    assert_eq!(range("1..1").count(), 1);
    assert_eq!(range("4"), LayerRange { first: 4, last: 4 });
    for bad in ["", "2..1", "a..b", "1..", "..2", "-1..2", "1..=2"] {
        assert!(
            matches!(bad.parse::<LayerRange>(), Err(ExportError::LayerSyntax(_))),
            "{bad}"
        );
    }
    let c = Config::tiny();
    let e = plan(
        &c,
        &spec(Some(range("1..3")), ExportDtype::F32, MAX_SHARD_BYTES),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "--layers 1..3: the model has decoder layers 0..2 (both included; its MTP layers are not \
         exported)"
    );
}

#[test]
fn a_subset_keeps_each_layers_kind_and_renumbers_from_zero() {
    let c = Config::glm5(); // layers 0-2 dense, 3-77 MoE, one MTP layer
    let sub = |s: &str| subset_config(&c, range(s));
    assert_eq!(sub("0..77").first_k_dense_replace, 3);
    assert_eq!(sub("0..77").num_hidden_layers, 78);
    assert_eq!(sub("0..77").num_nextn_predict_layers, 0);
    assert_eq!(sub("2..4").first_k_dense_replace, 1);
    assert_eq!(sub("3..5").first_k_dense_replace, 0);
    assert_eq!(sub("0..1").first_k_dense_replace, 2);
    assert_eq!(sub("10..10").num_hidden_layers, 1);

    let p = plan(
        &c,
        &spec(Some(range("2..3")), ExportDtype::Bf16, MAX_SHARD_BYTES),
    )
    .expect("plan");
    let find = |n: &str| p.tensors().find(|t| t.name == n).cloned();
    // Layer 2 (dense) becomes layer 0, layer 3 (MoE) layer 1; nothing of other layers.
    let dense = find("model.layers.0.mlp.gate_proj.weight").expect("dense layer 0");
    assert_eq!(dense.source, "model.layers.2.mlp.gate_proj.weight");
    let e = find("model.layers.1.mlp.experts.255.down_proj.weight").expect("expert");
    assert_eq!(e.source, "model.layers.3.mlp.experts.255.down_proj.weight");
    assert_eq!(e.shape, [6144, 2048]);
    assert!(find("model.layers.1.mlp.gate_proj.weight").is_none());
    assert!(find("model.layers.2.input_layernorm.weight").is_none());
    for g in [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert_eq!(find(g).map(|t| t.source), Some(g.to_string()), "{g}");
    }
    // The correction bias stays f32, everything else is bf16.
    let bias = find("model.layers.1.mlp.gate.e_score_correction_bias").expect("bias");
    assert_eq!(bias.dtype, Dtype::F32);
    assert!(p
        .tensors()
        .filter(|t| t.name != bias.name)
        .all(|t| t.dtype == Dtype::BF16));
}

/// GLM-5's real dimensions, 3 layers (1 dense + 2 MoE, as `synth --dims glm5 --layers 3`): the
/// ~45 GB bf16 checkpoint is cut into shards of at most 5 GB, every tensor in exactly one.
#[test]
fn a_three_layer_glm5_export_is_cut_into_5_gb_shards() {
    let c = Config {
        num_hidden_layers: 3,
        first_k_dense_replace: 1,
        num_nextn_predict_layers: 0,
        ..Config::glm5()
    };
    let p = plan(&c, &spec(None, ExportDtype::Bf16, MAX_SHARD_BYTES)).expect("plan");
    let n = p.tensors().count();
    // 3 globals + 17 dense-layer + 2 × (19 + 3 × 256) MoE-layer tensors.
    assert_eq!(n, 3 + 17 + 2 * (19 + 3 * 256));
    let total = p.data_bytes();
    assert!((44_000_000_000..45_000_000_000).contains(&total), "{total}");
    assert_eq!(p.shards.len(), 9);
    assert!(p.shards.iter().all(|s| s.data_bytes() <= MAX_SHARD_BYTES));
    assert_eq!(p.shards[8].file, "model-00009-of-00009.safetensors");
    let mut names: Vec<&str> = p.tensors().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), n);
    // A tensor larger than the limit gets a shard of its own rather than failing.
    let p = plan(&c, &spec(None, ExportDtype::F32, 1_000_000_000)).expect("plan");
    assert_eq!(p.shards[0].tensors.len(), 1, "embed_tokens (3.8 GB) alone");
    assert_eq!(p.shards[0].tensors[0].name, "model.embed_tokens.weight");
    assert!(matches!(
        plan(&c, &spec(None, ExportDtype::F32, 0)),
        Err(ExportError::ZeroShard)
    ));
}

#[test]
fn an_existing_output_or_one_holding_the_input_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("m.gguf");
    std::fs::write(&input, b"GGUF").expect("write");
    let out = dir.path().join("out");
    assert!(check_output(&out, &[&input], false).is_ok());
    std::fs::create_dir(&out).expect("mkdir");
    assert!(matches!(
        check_output(&out, &[&input], false),
        Err(ExportError::Exists(_))
    ));
    assert!(check_output(&out, &[&input], true).is_ok());
    for over in [dir.path().to_path_buf(), input.clone()] {
        assert!(
            matches!(
                check_output(&over, &[&input], true),
                Err(ExportError::OverInput { .. })
            ),
            "{}",
            over.display()
        );
    }
}

#[test]
fn a_failed_write_leaves_neither_a_temp_dir_nor_a_changed_output() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("out");
    std::fs::create_dir(&out).expect("mkdir");
    std::fs::write(out.join("keep"), b"old").expect("write");
    let r = write_dir_atomically(&out, true, |tmp| {
        std::fs::write(tmp.join("half"), b"x").map_err(io_at(tmp))?;
        Err(ExportError::ZeroShard)
    });
    assert!(r.is_err());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["out"]);
    assert_eq!(std::fs::read(out.join("keep")).expect("kept"), b"old");
    // With force, a finished write replaces the old directory whole.
    write_dir_atomically(&out, true, |tmp| {
        std::fs::write(tmp.join("new"), b"y").map_err(io_at(tmp))
    })
    .expect("replaced");
    assert!(!out.join("keep").exists());
    assert_eq!(std::fs::read(out.join("new")).expect("new"), b"y");
    assert_eq!(std::fs::read_dir(dir.path()).expect("ls").count(), 1);
}
