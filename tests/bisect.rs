//! `glmcheck bisect` over a pile of loader patches, and `git bisect run glmcheck gate` over a
//! scripted history of patch files.

mod common;

use common::{fixture, glmcheck, path_str as s};

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value as Json;

const P0: &str = "294,266,220,17,10,17,30,220,468,478,68,286,262,414,13,278,286,266";
/// Five tokens: no longer than the fixture's index_topk (8).
const SHORT: &str = "294,266,220,17,10";

const PILE: &str = r#"
[[patch]]
fault = "force-dequant:*"

[[patch]]
fault = "dsa-dense"

[[patch]]
fault = "kvb-concat"
layers = [1]
"#;

fn bisect(dir: &Path, patches: &str, tokens: &str) -> (i32, Json) {
    let file = dir.join("patches.toml");
    std::fs::write(&file, patches).expect("write patches");
    let f32 = fixture("tiny-F32.gguf");
    let out = glmcheck(&[
        "bisect",
        s(&f32),
        "--patches",
        s(&file),
        "--tokens",
        tokens,
        "--tp",
        "4",
        "--json",
    ]);
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), json)
}

fn names(v: &Json) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x["fault"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_short_prompt_names_only_kvb_concat_and_says_why_the_rest_is_harmless() {
    let d = tempfile::tempdir().expect("temp dir");
    let (code, j) = bisect(d.path(), PILE, SHORT);
    assert_eq!(code, 1, "{j}");
    assert_eq!(names(&j["culprits"]), ["kvb-concat"]);
    let c = &j["culprits"][0];
    assert_eq!(c["layers"], serde_json::json!([1]));
    assert_eq!(c["first_divergence"]["layer"], 1);
    assert!(
        c["first_divergence"]["module"]
            .as_str()
            .is_some_and(|m| m.ends_with("kv_b_proj")),
        "{c}"
    );
    let mut harmless = names(&j["harmless"]);
    harmless.sort();
    assert_eq!(harmless, ["dsa-dense", "force-dequant:*"]);
    let why: Vec<&str> = j["harmless"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|h| h["why"].as_str())
        .collect();
    assert!(
        why.iter()
            .any(|w| w.contains("prompt of 5 tokens ≤ index_topk 8")),
        "{why:?}"
    );
    assert!(j["forwards"].as_u64().is_some_and(|n| n >= 4), "{j}");
}

#[test]
fn a_longer_prompt_also_names_dsa_dense() {
    let d = tempfile::tempdir().expect("temp dir");
    let (code, j) = bisect(d.path(), PILE, P0);
    assert_eq!(code, 1, "{j}");
    let mut culprits = names(&j["culprits"]);
    culprits.sort();
    assert_eq!(culprits, ["dsa-dense", "kvb-concat"]);
    assert_eq!(names(&j["harmless"]), ["force-dequant:*"]);
    let dense = j["culprits"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["fault"] == "dsa-dense")
        .expect("dsa-dense");
    assert_eq!(
        dense["first_divergence"]["signature"]["fault"], "dsa-dense",
        "{dense}"
    );
}

#[test]
fn no_culprit_exits_0_and_bad_patch_files_exit_2() {
    let d = tempfile::tempdir().expect("temp dir");
    let (code, j) = bisect(d.path(), "[[patch]]\nfault = \"force-dequant:*\"\n", SHORT);
    assert_eq!(code, 0, "{j}");
    assert!(names(&j["culprits"]).is_empty());
    let f32 = fixture("tiny-F32.gguf");
    for bad in [
        "[[patch]]\nfault = \"no-such-fault\"\n",
        "[[patch]]\nfault = \"kvb-concat\"\nlayers = [7]\n",
        "[[patch]]\nfault = \"kvb-concat\"\nlayer = 1\n",
        "",
    ] {
        let file = d.path().join("bad.toml");
        std::fs::write(&file, bad).expect("write");
        let out = glmcheck(&[
            "bisect",
            s(&f32),
            "--patches",
            s(&file),
            "--tokens",
            SHORT,
            "--tp",
            "4",
        ]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{bad:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn git(repo: &Path, args: &[&str]) -> Output {
    let out = Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "-c",
            "commit.gpgsign=false",
        ])
        .args(args)
        .current_dir(repo)
        .output()
        .expect("git");
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A loader's history as patch files: each commit changes the patch set; the fourth adds
/// kvb-concat. The check script writes what the loader at that commit holds (`inject
/// --patches`) and gates it; commit 2 leaves the patches unreadable, so the script exits 125 and
/// `git bisect run` skips it.
#[test]
fn git_bisect_run_finds_the_commit_that_broke_the_weights() {
    if Command::new("git").arg("--version").output().is_err() {
        eprintln!("git not found: skipped");
        return;
    }
    let d = tempfile::tempdir().expect("temp dir");
    let repo = d.path().join("loader");
    std::fs::create_dir_all(&repo).expect("mkdir");
    git(&repo, &["init", "-q", "-b", "main"]);
    let history = [
        "[[patch]]\nfault = \"force-dequant:*\"\n",
        "this is not toml [[[",
        "[[patch]]\nfault = \"force-dequant:*\"\n[[patch]]\nfault = \"force-dequant:*kv_a*\"\nlayers = [0]\n",
        "[[patch]]\nfault = \"force-dequant:*\"\n[[patch]]\nfault = \"kvb-concat\"\nlayers = [1]\n",
        "[[patch]]\nfault = \"force-dequant:*\"\n[[patch]]\nfault = \"kvb-concat\"\nlayers = [1]\n[[patch]]\nfault = \"merged-rank0\"\nlayers = [2]\n",
    ];
    let bin = env!("CARGO_BIN_EXE_glmcheck");
    let f32 = fixture("tiny-F32.gguf");
    let check = format!(
        "#!/bin/sh\nout=$(mktemp -d)\n\"{bin}\" inject -q --patches patches.toml --tp 4 --out \"$out/r\" \"{gguf}\" || {{ rm -rf \"$out\"; exit 125; }}\n\"{bin}\" gate -q \"{gguf}\" --tp 4 --against \"$out/r\"\nrc=$?\nrm -rf \"$out\"\nexit $rc\n",
        gguf = s(&f32)
    );
    std::fs::write(repo.join("check.sh"), check).expect("write");
    for (i, p) in history.iter().enumerate() {
        std::fs::write(repo.join("patches.toml"), p).expect("write");
        git(&repo, &["add", "-A"]);
        git(
            &repo,
            &["commit", "-q", "-m", &format!("patch set {}", i + 1)],
        );
    }
    let log = String::from_utf8(git(&repo, &["log", "--format=%H %s"]).stdout).expect("utf-8");
    let bad_commit = log
        .lines()
        .find(|l| l.ends_with("patch set 4"))
        .and_then(|l| l.split(' ').next())
        .expect("commit 4")
        .to_string();
    git(&repo, &["bisect", "start", "HEAD", "HEAD~4"]);
    let run = git(&repo, &["bisect", "run", "sh", "check.sh"]);
    let text = String::from_utf8_lossy(&run.stdout);
    assert!(
        text.contains(&format!("{bad_commit} is the first bad commit")),
        "{text}"
    );
}
