//! A dump that does not say in which order its modules ran (a hook dump written without
//! `execution_order` metadata) is compared in GLM-5's execution order, not alphabetically: else
//! the routed experts are compared before their router's near-tie exclusion exists, and a fault
//! in `self_attn` would be found after `mlp` and `post_attention_layernorm`.

mod common;

use std::collections::HashMap;

#[test]
fn a_dump_without_execution_order_is_compared_in_glm5_order() {
    let dir = tempfile::tempdir().expect("tmp");
    let (own, bare) = (
        dir.path().join("own.safetensors"),
        dir.path().join("bare.safetensors"),
    );
    let out = common::glmcheck(&[
        "forward",
        common::path_str(&common::gguf("tiny-Q8_0")),
        "--tokens",
        common::PROMPT0_IDS,
        "--max-new-tokens",
        "0",
        "--dump",
        common::path_str(&own),
    ]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let bytes = std::fs::read(&own).expect("read dump");
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let meta: HashMap<String, String> = header.metadata().clone().expect("metadata");
    let order: Vec<String> = serde_json::from_str(
        meta.get("execution_order")
            .expect("glmcheck declares its order"),
    )
    .expect("a JSON list");
    // The same tensors with every metadata key but the tokens dropped.
    common::rewrite_safetensors(&own, &bare, |_, _, _, _| true);
    let bytes = std::fs::read(&bare).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("deserialize");
    let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    let tokens = HashMap::from([("token_ids".to_string(), meta["token_ids"].clone())]);
    safetensors::serialize_to_file(tensors, Some(tokens), &bare).expect("write");

    let out = common::glmcheck(&[
        "diff",
        common::path_str(&bare),
        common::path_str(&bare),
        "--json",
    ]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let rows: Vec<String> = common::json_of(&out)["modules"]
        .as_array()
        .expect("modules")
        .iter()
        .filter_map(|m| m["name"].as_str().map(str::to_string))
        .collect();
    let declared: Vec<&String> = order.iter().filter(|k| rows.contains(k)).collect();
    assert!(declared.len() > 100, "{} rows compared", declared.len());
    let got: Vec<&String> = rows.iter().filter(|k| order.contains(k)).collect();
    assert_eq!(
        got, declared,
        "the bare dump's rows are not in execution order"
    );
    let mut alphabetical = declared.clone();
    alphabetical.sort();
    assert_ne!(
        alphabetical, declared,
        "the case must not be sortable by name alone"
    );
}
