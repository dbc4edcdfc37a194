//! `shards`: the plan, `--verify`, `inject` and `--against` on the fixtures, tp ∈ {1, 2, 4, 8}.

mod common;
use common::*;
use std::collections::BTreeSet;
use std::time::Instant;

use glmcheck::arch::config::ConfigReader;
use glmcheck::gguf::{GgmlType, GgufModel};
use glmcheck::plan::{check_reassembly, ShardPlan};
use glmcheck::weights::Weights;

const TPS: [usize; 4] = [1, 2, 4, 8];

fn json_of(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(out), stderr(out)))
}

#[test]
fn every_shard_set_concatenates_back_to_the_hf_tensor() {
    let model = GgufModel::open(&gguf("tiny-F32")).unwrap();
    let cfg = ConfigReader::read(&model, "glm-dsa").unwrap().config;
    let w = Weights::new(&model, &cfg, candle_core::Device::Cpu);
    for tp in TPS {
        let plan = ShardPlan::new(&model, &cfg, tp);
        assert_eq!(
            plan.params.len(),
            3 + 14 + 2 * 18,
            "tp={tp}: parameter count"
        );
        for p in &plan.params {
            assert!(
                p.problems.is_empty(),
                "tp={tp} {}: {:?}",
                p.param,
                p.problems
            );
            let full = w.vllm(&p.param).unwrap();
            check_reassembly(p, &full, tp).unwrap_or_else(|e| panic!("tp={tp} {}: {e}", p.param));
            if !p.cuts.is_empty() {
                let s = p.shard(&full, tp - 1).unwrap();
                assert_eq!(s.dims(), p.shard_shape.as_slice(), "tp={tp} {}", p.param);
            }
        }
    }
    let out = glmcheck(&[
        "shards",
        gguf("tiny-Q4_K_M").to_str().unwrap(),
        "--tp",
        "4",
        "--verify",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = json_of(&out);
    assert_eq!(r["ok"], true);
    assert!(r["params"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["reassembles"] == true && p["nan"] == 0));
}

#[test]
fn the_plan_flags_cuts_that_split_quant_blocks() {
    let out = glmcheck(&[
        "shards",
        gguf("tiny-Q4_K_M").to_str().unwrap(),
        "--json",
        "--layer",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let r = json_of(&out);
    assert_eq!(r["tp"], 8);
    let p = r["params"].as_array().unwrap();
    let o = p
        .iter()
        .find(|p| p["param"] == "model.layers.1.self_attn.o_proj.weight")
        .unwrap();
    assert_eq!(o["style"], "row");
    assert_eq!(o["shard_dim"], 1);
    assert_eq!(o["shard_shape"], serde_json::json!([256, 64]));
    assert_eq!(
        o["splits_quant_blocks"], true,
        "64-wide slices of a K-quant's 256-value blocks"
    );
    let kvb = p
        .iter()
        .find(|p| p["param"] == "model.layers.1.self_attn.kv_b_proj.weight")
        .unwrap();
    assert_eq!(
        kvb["gguf"],
        serde_json::json!(["blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"])
    );
    assert_eq!(
        kvb["splits_quant_blocks"], false,
        "a column cut takes whole rows"
    );
    for key in [
        "param",
        "gguf",
        "dtype",
        "full_shape",
        "style",
        "shard_dim",
        "shard_shape",
        "notes",
    ] {
        assert!(o.get(key).is_some(), "missing {key}");
    }
}

#[test]
fn real_glm5_dimensions_give_the_published_shards_fast() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("glm5.gguf");
    write_real_dims(&path, GgmlType::Q4_K);
    let start = Instant::now();
    let out = glmcheck(&[
        "shards",
        path.to_str().unwrap(),
        "--tp",
        "8",
        "--layer",
        "5",
        "--json",
    ]);
    let secs = start.elapsed().as_secs_f64();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(secs < 1.0, "took {secs:.2} s");
    let r = json_of(&out);
    let shape = |name: &str| {
        r["params"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["param"] == name)
            .unwrap()["shard_shape"]
            .clone()
    };
    assert_eq!(
        shape("model.layers.5.self_attn.kv_b_proj.weight"),
        serde_json::json!([3584, 512])
    );
    assert_eq!(
        shape("model.layers.5.self_attn.o_proj.weight"),
        serde_json::json!([6144, 2048])
    );
    assert_eq!(
        shape("model.layers.5.mlp.experts.w13_weight"),
        serde_json::json!([256, 512, 6144])
    );
    assert_eq!(
        shape("model.layers.5.mlp.experts.w2_weight"),
        serde_json::json!([256, 6144, 256])
    );
    // Real GLM-5 cuts land on 256-value blocks: o_proj 2048, w2 256 per rank.
    assert!(r["params"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["splits_quant_blocks"] == false));
    // tp=16 would put 4 heads per rank and cut w2 into 128-wide slices of Q4_K blocks.
    let out = glmcheck(&[
        "shards",
        path.to_str().unwrap(),
        "--tp",
        "16",
        "--layer",
        "5",
        "--json",
    ]);
    let r = json_of(&out);
    let w2 = r["params"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["param"] == "model.layers.5.mlp.experts.w2_weight")
        .unwrap()
        .clone();
    assert_eq!(w2["splits_quant_blocks"], true);
    // tp=48 cannot split 64 heads.
    let out = glmcheck(&[
        "shards",
        path.to_str().unwrap(),
        "--tp",
        "48",
        "--layer",
        "5",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains("64 attention heads cannot be split over tp=48"),
        "{}",
        stdout(&out)
    );
}

fn inject(src: &str, fault: &str, tp: usize, extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let tps = tp.to_string();
    let mut args = vec![
        "inject",
        gguf(src).to_str().unwrap().to_string().leak() as &str,
        "--fault",
        fault,
        "--tp",
        &tps,
        "--out",
        dir.path().to_str().unwrap(),
        "-q",
    ];
    args.extend_from_slice(extra);
    let out = glmcheck(&args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "inject {fault} tp={tp}: {}",
        stderr(&out)
    );
    dir
}

fn against(
    gguf_stem: &str,
    dir: &tempfile::TempDir,
    tp: usize,
) -> (Option<i32>, serde_json::Value) {
    let out = glmcheck(&[
        "shards",
        gguf(gguf_stem).to_str().unwrap(),
        "--tp",
        &tp.to_string(),
        "--against",
        dir.path().to_str().unwrap(),
        "--json",
        "-q",
    ]);
    (out.status.code(), json_of(&out))
}

#[test]
fn the_correct_dump_passes_at_every_tp() {
    for tp in TPS {
        let dir = inject("tiny-F32", "none", tp, &[]);
        let (code, r) = against("tiny-F32", &dir, tp);
        assert_eq!(code, Some(0), "tp={tp}: {}", r["findings"]);
        assert_eq!(r["verdict"], "pass");
        assert_eq!(r["missing"].as_array().unwrap().len(), 0);
        assert_eq!(r["unexpected"].as_array().unwrap().len(), 0);
        assert!(
            r["checked"]
                .as_array()
                .unwrap()
                .iter()
                .all(|c| c["class"] == "match"),
            "tp={tp}"
        );
    }
    // bf16-rounded values are not corruption either.
    let dir = inject("tiny-F32", "none", 2, &["--dtype", "bf16"]);
    let (code, r) = against("tiny-F32", &dir, 2);
    assert_eq!(code, Some(0), "{}", r["findings"]);
}

#[test]
fn quantized_ggufs_against_the_f32_originals_pass() {
    let dir = inject("tiny-F32", "none", 8, &[]);
    for stem in ["tiny-Q8_0", "tiny-Q4_K_M", "tiny-BF16"] {
        let (code, r) = against(stem, &dir, 8);
        assert_eq!(code, Some(0), "{stem}: {}", r["findings"]);
        let quant = r["checked"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["class"] == "quantization")
            .count();
        assert!(
            quant > 0,
            "{stem}: the quantized weights differ from the f32 originals by noise"
        );
    }
}

/// (fault, extra inject args, expected param set, expected ranks (None: all), cause)
type Case = (
    String,
    Vec<&'static str>,
    Vec<&'static str>,
    Option<Vec<usize>>,
    &'static str,
);

fn cases(tp: usize) -> Vec<Case> {
    let mut v: Vec<Case> = vec![
        (
            "kvb-concat".into(),
            vec!["--layer", "1"],
            vec!["model.layers.1.self_attn.kv_b_proj.weight"],
            None,
            "kvb-concat",
        ),
        (
            "kvb-untransposed".into(),
            vec!["--layer", "2"],
            vec!["model.layers.2.self_attn.kv_b_proj.weight"],
            None,
            "kvb-untransposed",
        ),
        (
            "param-zeroed:model.layers.2.mlp.gate.e_score_correction_bias".into(),
            vec![],
            vec!["model.layers.2.mlp.gate.e_score_correction_bias"],
            None,
            "param-zeroed",
        ),
        (
            "vocab-unpadded".into(),
            vec![],
            vec!["model.embed_tokens.weight", "lm_head.weight"],
            None,
            "vocab-unpadded",
        ),
        (
            "bf16-as-f16".into(),
            vec!["--param", "model.layers.0.mlp.down_proj.weight"],
            vec!["model.layers.0.mlp.down_proj.weight"],
            None,
            "bf16-as-f16",
        ),
    ];
    if tp > 1 {
        let last = tp - 1;
        v.push((
            format!("rank-swap:0,{last}"),
            vec!["--layer", "1"],
            vec!["model.layers.1.self_attn.o_proj.weight"],
            Some(vec![0, last]),
            "rank-swap",
        ));
        v.push((
            "merged-rank0".into(),
            vec!["--layer", "1"],
            vec![
                "model.layers.1.mlp.experts.w13_weight",
                "model.layers.1.mlp.shared_experts.gate_up_proj.weight",
            ],
            Some((1..tp).collect()),
            "merged-rank0",
        ));
        v.push((
            "merged-midsplit".into(),
            vec!["--layer", "0"],
            vec!["model.layers.0.mlp.gate_up_proj.weight"],
            None,
            "merged-midsplit",
        ));
        v.push((
            "wrong-dim".into(),
            vec!["--layer", "2"],
            vec!["model.layers.2.self_attn.o_proj.weight"],
            None,
            "wrong-dim",
        ));
    }
    v
}

#[test]
fn every_injected_fault_is_found_named_and_explained() {
    for tp in TPS {
        for (fault, extra, params, ranks, cause) in cases(tp) {
            let dir = inject("tiny-F32", &fault, tp, &extra);
            let (code, r) = against("tiny-F32", &dir, tp);
            let what = format!("{fault} tp={tp}");
            assert_eq!(code, Some(1), "{what}: {}", r);
            assert_eq!(r["verdict"], "fail");
            let findings = r["findings"].as_array().unwrap();
            let got: BTreeSet<&str> = findings
                .iter()
                .map(|f| f["param"].as_str().unwrap())
                .collect();
            let want: BTreeSet<&str> = params.iter().copied().collect();
            assert_eq!(
                got, want,
                "{what}: flagged parameters; findings {}",
                r["findings"]
            );
            let want_ranks: Vec<usize> = ranks.clone().unwrap_or_else(|| (0..tp).collect());
            for p in &params {
                let of_p: Vec<&serde_json::Value> =
                    findings.iter().filter(|f| f["param"] == *p).collect();
                for f in &of_p {
                    assert_eq!(f["cause"], cause, "{what}: {p}: {f}");
                }
                let mut got_ranks: Vec<usize> = of_p
                    .iter()
                    .flat_map(|f| {
                        f["ranks"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|r| r.as_u64().unwrap() as usize)
                    })
                    .collect();
                got_ranks.sort_unstable();
                assert_eq!(got_ranks, want_ranks, "{what}: {p}: ranks");
            }
        }
    }
}

#[test]
fn the_human_report_names_the_cause() {
    let dir = inject("tiny-F32", "kvb-concat", 8, &["--layer", "1"]);
    let out = glmcheck(&[
        "shards",
        gguf("tiny-F32").to_str().unwrap(),
        "--against",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("kvb-concat")
            && text.contains("model.layers.1.self_attn.kv_b_proj.weight")
            && text.contains("verdict: fail"),
        "{text}"
    );
}

#[test]
fn a_missing_rank_is_incomplete_unless_narrowed_and_inject_refuses_no_ops() {
    let dir = inject("tiny-F32", "none", 2, &[]);
    // Drop a rank file: reported, the other rank still checked, and the run is not a pass.
    std::fs::remove_file(dir.path().join("rank1.safetensors")).unwrap();
    let (code, r) = against("tiny-F32", &dir, 2);
    assert_eq!(code, Some(1), "{r}");
    assert_eq!(r["verdict"], "incomplete");
    assert_eq!(r["missing_ranks"], serde_json::json!([1]));
    let out = glmcheck(&[
        "shards",
        gguf("tiny-F32").to_str().unwrap(),
        "--tp",
        "2",
        "--against",
        dir.path().to_str().unwrap(),
        "--ranks",
        "0",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let out = glmcheck(&[
        "inject",
        gguf("tiny-F32").to_str().unwrap(),
        "--fault",
        "merged-rank0",
        "--tp",
        "1",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("changes nothing at tp=1"),
        "{}",
        stderr(&out)
    );
    let out = glmcheck(&[
        "inject",
        gguf("tiny-F32").to_str().unwrap(),
        "--fault",
        "bogus",
        "--tp",
        "2",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("unknown fault"), "{}", stderr(&out));
}

#[test]
fn faults_are_still_named_when_the_gguf_is_quantized_and_the_dump_is_not() {
    for (fault, extra, param, cause) in [
        (
            "kvb-concat",
            vec!["--layer", "1"],
            "model.layers.1.self_attn.kv_b_proj.weight",
            "kvb-concat",
        ),
        (
            "rank-swap:2,5",
            vec!["--layer", "2"],
            "model.layers.2.self_attn.o_proj.weight",
            "rank-swap",
        ),
        (
            "merged-midsplit",
            vec!["--layer", "1"],
            "model.layers.1.mlp.experts.w13_weight",
            "merged-midsplit",
        ),
    ] {
        let dir = inject("tiny-F32", fault, 8, &extra);
        let (code, r) = against("tiny-Q4_K_M", &dir, 8);
        assert_eq!(code, Some(1), "{fault}: {r}");
        let f = r["findings"].as_array().unwrap();
        assert!(
            f.iter().any(|f| f["param"] == param && f["cause"] == cause),
            "{fault}: {}",
            r["findings"]
        );
        assert!(
            f.iter().all(|f| f["cause"] == cause),
            "{fault}: only the injected cause: {}",
            r["findings"]
        );
    }
}

#[test]
fn verify_works_on_a_read_only_gguf_and_inject_never_writes_over_an_input() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let ro = dir.path().join("ro.gguf");
    std::fs::copy(gguf("tiny-Q8_0"), &ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    let before = std::fs::read(&ro).unwrap();
    let out = glmcheck(&[
        "shards",
        ro.to_str().unwrap(),
        "--tp",
        "2",
        "--verify",
        "-q",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        std::fs::read(&ro).unwrap(),
        before,
        "the model file is untouched"
    );
    // An output directory that holds the input under a rank file's name: refused, input intact.
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let victim = out_dir.join("rank0.safetensors");
    std::fs::copy(gguf("tiny-Q8_0"), &victim).unwrap();
    let out = glmcheck(&[
        "inject",
        victim.to_str().unwrap(),
        "--fault",
        "none",
        "--tp",
        "2",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("refusing to overwrite"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        std::fs::read(gguf("tiny-Q8_0")).unwrap()
    );
}

#[test]
fn report_is_written_atomically_and_never_over_an_input() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    std::fs::copy(gguf("tiny-Q8_0"), &model).unwrap();
    let before = std::fs::read(&model).unwrap();
    // Into the input itself: refused, exit 2, input intact.
    let out = glmcheck(&[
        "shards",
        model.to_str().unwrap(),
        "--tp",
        "2",
        "--verify",
        "-q",
        "--report",
        model.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("refusing to overwrite an input"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read(&model).unwrap(), before);
    // Into another model file: refused too.
    let other = dir.path().join("other.gguf");
    std::fs::copy(gguf("tiny-F32"), &other).unwrap();
    let out = glmcheck(&[
        "inspect",
        model.to_str().unwrap(),
        "--report",
        other.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("existing GGUF"), "{}", stderr(&out));
    // Into a new file: the same JSON as --json prints, and no temp file left behind.
    let rep = dir.path().join("verify.json");
    let out = glmcheck(&[
        "shards",
        model.to_str().unwrap(),
        "--tp",
        "2",
        "--verify",
        "--json",
        "-q",
        "--report",
        rep.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(&rep).unwrap()).unwrap();
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(written["params"], printed["params"]);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
}

/// `shards tiny-F32.gguf --tp 2 --against DIR` plus `extra`, within the malformed-input budget.
fn against_tp2(dir: &tempfile::TempDir, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "shards",
        gguf("tiny-F32").to_str().unwrap().to_string().leak() as &str,
        "--tp",
        "2",
        "--against",
        dir.path().to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    glmcheck_bounded(&args)
}

/// Cuts the file at `path` to `len` bytes (a half-written dump).
fn cut(path: &std::path::Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

#[test]
fn a_dump_with_a_wrong_shape_or_a_non_float_dtype_is_reported_and_the_rest_checked() {
    let dir = inject("tiny-F32", "none", 2, &[]);
    let norm = "model.layers.0.input_layernorm.weight";
    let q_b = "model.layers.2.self_attn.q_b_proj.weight";
    let rank0 = dir.path().join("rank0.safetensors");
    rewrite_safetensors(&rank0, &rank0, |n, dtype, shape, _| {
        if n == norm {
            *dtype = safetensors::Dtype::I32; // same bytes, declared as integers
        }
        if n == q_b {
            shape.reverse(); // same values, the transposed shape
        }
        true
    });
    let out = against_tp2(&dir, &["--json", "-q"]);
    let (code, r) = (out.status.code(), json_of(&out));
    assert_eq!(code, Some(1), "{r}");
    assert_eq!(r["verdict"], "fail");
    let unchecked = r["unchecked"].as_array().unwrap();
    assert_eq!(unchecked.len(), 1, "{r}");
    assert_eq!(unchecked[0]["param"], norm);
    assert_eq!(unchecked[0]["ranks"], serde_json::json!([0]));
    assert!(
        unchecked[0]["reason"]
            .as_str()
            .unwrap()
            .contains("I32, not a float tensor"),
        "{r}"
    );
    let findings = r["findings"].as_array().unwrap();
    assert_eq!(findings.len(), 1, "{r}");
    assert_eq!(findings[0]["param"], q_b);
    assert_eq!(findings[0]["ranks"], serde_json::json!([0]));
    // Everything else was still compared: rank 1's copy of the norm, every other parameter.
    let checked = r["checked"].as_array().unwrap();
    assert!(checked.iter().any(|c| c["param"] == norm && c["rank"] == 1));
    let n_params = checked
        .iter()
        .map(|c| c["param"].as_str().unwrap())
        .collect::<BTreeSet<_>>()
        .len();
    assert!(n_params > 40, "{n_params} parameters checked");
    // The human report says it too.
    let out = against_tp2(&dir, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains(&format!("not checked: {norm} on rank(s) 0:")),
        "{}",
        stdout(&out)
    );
    // A rank file cut short (a crashed worker): named, the other rank still checked; exit 1.
    let rank1 = dir.path().join("rank1.safetensors");
    let len = std::fs::metadata(&rank1).unwrap().len();
    cut(&rank1, len / 2);
    let out = against_tp2(&dir, &["--json", "-q"]);
    let r1 = json_of(&out);
    assert_eq!(out.status.code(), Some(1), "{r1}");
    let u = &r1["unreadable_ranks"];
    assert_eq!(u.as_array().map(Vec::len), Some(1), "{r1}");
    assert_eq!(u[0]["rank"], 1);
    assert!(
        u[0]["error"]
            .as_str()
            .unwrap()
            .contains("rank1.safetensors"),
        "{r1}"
    );
    assert_eq!(r1["missing_ranks"], serde_json::json!([]));
    assert!(r1["missing"].as_array().unwrap().is_empty(), "{r1}");
    assert!(r1["checked"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["rank"] == 0));
    assert_eq!(r1["findings"].as_array().map(Vec::len), Some(1), "{r1}");
    // Both cut: nothing to check, exit 2 naming the file.
    let rank0 = dir.path().join("rank0.safetensors");
    cut(&rank0, 100);
    let out = against_tp2(&dir, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("rank0.safetensors"),
        "{}",
        stderr(&out)
    );
}

/// A copy of the F32 fixture with `name` retyped (its bytes zero) and a NaN and an Inf written
/// into `nan_in`.
fn doctored_copy(
    dir: &std::path::Path,
    retype: Option<(&str, GgmlType)>,
    nan_in: Option<&str>,
) -> std::path::PathBuf {
    let model = GgufModel::open(&gguf("tiny-F32")).unwrap();
    let path = dir.join("doctored.gguf");
    write_edited(
        &model,
        &path,
        |_, v| v.clone(),
        |name, dtype, bytes| {
            let mut out = (dtype, bytes.to_vec());
            if let Some((_, ty)) = retype.filter(|(n, _)| *n == name) {
                let n = bytes.len() as u64 / 4; // F32 source: 4 bytes a value
                out = (ty, vec![0u8; ty.bytes_for(n).unwrap() as usize]);
            }
            if nan_in == Some(name) {
                out.1[0..4].copy_from_slice(&f32::NAN.to_le_bytes());
                out.1[8..12].copy_from_slice(&f32::INFINITY.to_le_bytes());
            }
            out
        },
    );
    path
}

/// `shards FILE --tp 2 --verify --json` within the malformed-input budget.
fn verify_json(path: &std::path::Path) -> (Option<i32>, serde_json::Value) {
    let out = glmcheck_bounded(&[
        "shards",
        path.to_str().unwrap(),
        "--tp",
        "2",
        "--verify",
        "--json",
        "-q",
    ]);
    (out.status.code(), json_of(&out))
}

#[test]
fn an_undecodable_gguf_tensor_is_reported_and_the_rest_checked() {
    let dump = inject("tiny-F32", "none", 2, &[]);
    let tmp = tempfile::tempdir().unwrap();
    let path = doctored_copy(
        tmp.path(),
        Some(("blk.0.attn_q_a.weight", GgmlType::IQ2_XXS)),
        None,
    );
    let out = glmcheck_bounded(&[
        "shards",
        path.to_str().unwrap(),
        "--tp",
        "2",
        "--against",
        dump.path().to_str().unwrap(),
        "--json",
        "-q",
    ]);
    let r = json_of(&out);
    assert_eq!(out.status.code(), Some(1), "{r}");
    let unchecked = r["unchecked"].as_array().unwrap();
    assert_eq!(unchecked.len(), 1, "{r}");
    assert_eq!(
        unchecked[0]["param"],
        "model.layers.0.self_attn.fused_qkv_a_proj.weight"
    );
    assert_eq!(unchecked[0]["ranks"], serde_json::json!([0, 1]));
    assert!(
        unchecked[0]["reason"].as_str().unwrap().contains("IQ2_XXS"),
        "{r}"
    );
    assert!(r["findings"].as_array().unwrap().is_empty(), "{r}");
    assert!(r["checked"].as_array().unwrap().len() > 80, "{r}");
    // --verify: the same parameter fails alone, the others are verified.
    let (code, v) = verify_json(&path);
    assert_eq!(code, Some(1), "{v}");
    let params = v["params"].as_array().unwrap();
    let bad: Vec<_> = params
        .iter()
        .filter(|p| !p["problems"].as_array().unwrap().is_empty())
        .collect();
    assert_eq!(bad.len(), 1, "{v}");
    assert_eq!(
        bad[0]["param"],
        "model.layers.0.self_attn.fused_qkv_a_proj.weight"
    );
    assert!(bad[0]["problems"].to_string().contains("IQ2_XXS"), "{v}");
}

#[test]
fn nan_and_inf_in_weights_are_findings_not_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let path = doctored_copy(tmp.path(), None, Some("blk.2.attn_output.weight"));
    let (code, v) = verify_json(&path);
    assert_eq!(code, Some(1), "{v}");
    let bad: Vec<_> = v["params"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["nan"] != 0 || p["inf"] != 0)
        .collect();
    assert_eq!(bad.len(), 1, "{v}");
    assert_eq!(bad[0]["param"], "model.layers.2.self_attn.o_proj.weight");
    assert_eq!(
        (bad[0]["nan"].as_u64(), bad[0]["inf"].as_u64()),
        (Some(1), Some(1))
    );
    let out = glmcheck_bounded(&["dequant", path.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = d["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.2.attn_output.weight")
        .unwrap();
    assert_eq!(
        (row["nan"].as_u64(), row["inf"].as_u64()),
        (Some(1), Some(1))
    );
}
