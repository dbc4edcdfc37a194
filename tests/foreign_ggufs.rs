//! Issue 9, part 5, on real files of other architectures: llama.cpp's own vocab-only GGUFs
//! (`models/ggml-vocab-*.gguf`, copied byte for byte into fixtures/foreign/; see its README for
//! where they come from). `inspect` must inventory them and name their architecture, inventing no
//! GLM-5 default and demanding no GLM-5 key; the commands that need a GLM-5 model must refuse them
//! (exit 2) naming the architecture, within the malformed-input budget.
//!
//! The expected values (architecture, tokenizer model, token and merge counts) were read with
//! llama.cpp's own gguf-py, not with glmcheck.

mod common;

use std::path::PathBuf;

use common::{glmcheck_bounded, glmcheck_measured, stderr, stdout, MAX_RSS_MIB, MAX_SECONDS};
use serde_json::{json, Value as Json};
use sha2::{Digest, Sha256};

/// One committed file and what gguf-py reads in it.
struct Foreign {
    file: &'static str,
    sha256: &'static str,
    bytes: u64,
    arch: &'static str,
    tokenizer: &'static str,
    pre: &'static str,
    tokens: u64,
    merges: u64,
    chat_template: bool,
}

const FOREIGN: [Foreign; 3] = [
    Foreign {
        file: "ggml-vocab-bert-bge.gguf",
        sha256: "fbcbe22278fb302694d5f4a41bfe48c5f90e8e3554eab1c0435387dff654a854",
        bytes: 627_549,
        arch: "bert",
        tokenizer: "bert",
        pre: "bert-bge",
        tokens: 30522,
        merges: 0,
        chat_template: false,
    },
    Foreign {
        file: "ggml-vocab-phi-3.gguf",
        sha256: "967d7190d11c4842eab697079d98d56c2116e10eb617be355a2733bfc132e326",
        bytes: 726_019,
        arch: "phi3",
        tokenizer: "llama",
        pre: "default",
        tokens: 32064,
        merges: 0,
        chat_template: true,
    },
    Foreign {
        file: "ggml-vocab-deepseek-coder.gguf",
        sha256: "91cb1379f2e33af1c4866b194622b7a0e12e8f0c9dba7ba2f10d55978730bec1",
        bytes: 1_156_067,
        arch: "llama",
        tokenizer: "gpt2",
        pre: "deepseek-coder",
        tokens: 32256,
        merges: 31757,
        chat_template: false,
    },
];

impl Foreign {
    fn path(&self) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/foreign")
            .join(self.file)
    }

    fn p(&self) -> String {
        self.path().to_str().expect("utf-8 path").to_string()
    }

    /// The sentence issue 9 asks for.
    fn named(&self) -> String {
        format!("architecture {}: glmcheck checks glm-dsa models", self.arch)
    }
}

/// Text that would mean a GLM-5 config was read, defaulted or demanded for a file that has none.
const GLM5_TRACES: [&str; 8] = [
    "GLM-5 default",
    "DEFAULT",
    "glm-dsa.",
    "key_length_mla",
    "config (HF name)",
    "num_hidden_layers",
    "kv_lora_rank",
    "consistency: all",
];

/// stderr without the peak-RSS line that the measured runs ask for (`GLMCHECK_PEAK_RSS`).
fn diagnostics(out: &std::process::Output) -> String {
    stderr(out)
        .lines()
        .filter(|l| {
            !l.starts_with("glmcheck: peak RSS ") && !l.starts_with("glmcheck: peak anonymous RSS ")
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

fn assert_no_glm5_traces(what: &str, text: &str) {
    for t in GLM5_TRACES {
        assert!(!text.contains(t), "{what}: `{t}` in\n{text}");
    }
}

#[test]
fn the_committed_files_are_llama_cpps_own_and_the_readme_says_so() {
    let readme = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/foreign/README.md"),
    )
    .expect("fixtures/foreign/README.md");
    for f in &FOREIGN {
        let bytes = std::fs::read(f.path()).unwrap_or_else(|e| panic!("{}: {e}", f.file));
        // A Git LFS pointer or an edited copy would pass every test below for the wrong reason.
        assert_eq!(bytes.len() as u64, f.bytes, "{}", f.file);
        assert_eq!(&bytes[..4], b"GGUF", "{}", f.file);
        let sha: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(sha, f.sha256, "{}", f.file);
        assert!(
            readme.contains(f.file) && readme.contains(f.sha256),
            "README must name {} with its sha256",
            f.file
        );
    }
}

#[test]
fn inspect_json_inventories_the_file_under_its_own_architecture_and_invents_nothing() {
    for f in &FOREIGN {
        let p = f.p();
        let m = glmcheck_measured(&["inspect", &p, "--json"]);
        let err = diagnostics(&m.out);
        assert!(!err.contains("panicked"), "{}: {err}", f.file);
        assert!(
            m.wall.as_secs_f64() < MAX_SECONDS,
            "{}: {:?}",
            f.file,
            m.wall
        );
        assert!(m.max_rss_mib < MAX_RSS_MIB, "{}: {}", f.file, m.max_rss_mib);
        // Not a glm-dsa model is a finding (exit 1), not an unreadable file (2) nor a pass (0).
        assert_eq!(m.out.status.code(), Some(1), "{}: {err}", f.file);
        let r: Json = serde_json::from_slice(&m.out.stdout)
            .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {}", f.file, stdout(&m.out)));

        assert_eq!(r["arch"], f.arch, "{}", f.file);
        // No GLM-5 config read, defaulted or derived from the file's own keys.
        assert!(r["config"].is_null(), "{}: {}", f.file, r["config"]);
        assert_eq!(r["defaulted"], json!([]), "{}", f.file);
        assert_eq!(r["config_sources"], json!({}), "{}", f.file);
        assert_eq!(r["notes"], json!([]), "{}", f.file);
        // Exactly one problem: the architecture, named; no GLM-5 tensor demanded.
        let problems = r["problems"].as_array().expect("problems");
        assert_eq!(problems.len(), 1, "{}: {problems:?}", f.file);
        assert_eq!(problems[0]["kind"], "arch", "{}", f.file);
        assert!(problems[0]["tensor"].is_null(), "{}", f.file);
        let msg = problems[0]["message"].as_str().expect("message");
        assert!(msg.contains(&f.named()), "{}: {msg}", f.file);
        assert_no_glm5_traces(f.file, &r.to_string());

        // The inventory is the file's (gguf-py's reading): no tensors, its own tokenizer.
        assert_eq!(r["tensor_count"], 0, "{}", f.file);
        assert_eq!(r["tensors"], json!([]), "{}", f.file);
        assert_eq!(r["total_bytes"], 0, "{}", f.file);
        assert_eq!(r["files"][0]["bytes"], f.bytes, "{}", f.file);
        assert_eq!(r["files"][0]["gguf_version"], 3, "{}", f.file);
        assert_eq!(r["files"][0]["tensors"], 0, "{}", f.file);
        let t = &r["tokenizer"];
        assert_eq!(t["model"], f.tokenizer, "{}", f.file);
        assert_eq!(t["pre"], f.pre, "{}", f.file);
        assert_eq!(t["tokens"], f.tokens, "{}", f.file);
        assert_eq!(t["merges"], f.merges, "{}", f.file);
        assert_eq!(t["chat_template"], f.chat_template, "{}", f.file);
    }
    // A special token each file really has, with its text from the file's own token list.
    let p = FOREIGN[1].p();
    let r: Json =
        serde_json::from_slice(&glmcheck_bounded(&["inspect", &p, "--json"]).stdout).expect("JSON");
    assert_eq!(
        r["tokenizer"]["special"]["eos"],
        json!({"id": 32000, "text": "<|endoftext|>"})
    );
    let p = FOREIGN[0].p();
    let r: Json =
        serde_json::from_slice(&glmcheck_bounded(&["inspect", &p, "--json"]).stdout).expect("JSON");
    assert_eq!(
        r["tokenizer"]["special"]["unknown"],
        json!({"id": 100, "text": "[UNK]"})
    );
}

#[test]
fn inspect_text_names_the_architecture_and_checks_nothing_as_glm5() {
    for f in &FOREIGN {
        let p = f.p();
        for extra in [&[][..], &["--all-tensors"][..]] {
            let mut args = vec!["inspect", p.as_str()];
            args.extend_from_slice(extra);
            let out = glmcheck_bounded(&args);
            let (text, err) = (stdout(&out), diagnostics(&out));
            assert_eq!(out.status.code(), Some(1), "{args:?}: {text}{err}");
            let first = text.lines().next().unwrap_or_default();
            assert!(
                first.starts_with(&p) && first.ends_with(&format!("architecture {}", f.arch)),
                "{args:?}: first line {first:?}"
            );
            assert!(text.contains(&f.named()), "{args:?}: {text}");
            assert!(
                text.contains(&format!(
                    "not checked: architecture {} is not glm-dsa",
                    f.arch
                )),
                "{args:?}: {text}"
            );
            assert!(
                text.contains(&format!("tokenizer: {} (pre {})", f.tokenizer, f.pre)),
                "{args:?}: {text}"
            );
            assert_no_glm5_traces(&format!("{args:?}"), &text);
            // Nothing to warn about: a foreign file is a finding, not a malformed one.
            assert!(err.is_empty(), "{args:?}: stderr {err}");
        }
    }
}

#[test]
fn shards_and_forward_refuse_it_naming_the_architecture() {
    for f in &FOREIGN {
        let p = f.p();
        let runs: [&[&str]; 6] = [
            &["shards", &p],
            &["shards", &p, "--json"],
            &["shards", &p, "--tp", "8", "--verify"],
            &["forward", &p, "--tokens", "1,2,3", "--max-new-tokens", "0"],
            &[
                "forward",
                &p,
                "--tokens",
                "1,2,3",
                "--max-new-tokens",
                "0",
                "--json",
            ],
            &["forward", &p, "--tokens", "1", "--tp", "2"],
        ];
        for args in runs {
            let out = glmcheck_bounded(args);
            let err = diagnostics(&out);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            let last = err.lines().last().unwrap_or_default();
            assert!(
                last.starts_with("glmcheck: error: ") && last.contains(&f.named()),
                "{args:?}: {err}"
            );
            // Refused before any GLM-5 key is looked for.
            assert_no_glm5_traces(&format!("{args:?}"), &err);
            assert!(stdout(&out).is_empty(), "{args:?}: {}", stdout(&out));
        }
    }
}

#[test]
fn dequant_of_a_file_without_tensors_is_an_input_error_naming_the_file() {
    for f in &FOREIGN {
        let p = f.p();
        let out = glmcheck_bounded(&["dequant", &p]);
        let err = diagnostics(&out);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", f.file);
        assert!(err.contains(&p), "{}: {err}", f.file);
        assert_no_glm5_traces(f.file, &err);
    }
}

// ---------------------------------------------------------------------------------------------
// Found on these files (both failed before the fix they name).

#[test]
fn dequant_says_the_file_holds_no_tensors() {
    for f in &FOREIGN {
        let p = f.p();
        let out = glmcheck_bounded(&["dequant", &p]);
        let err = diagnostics(&out);
        assert!(!err.contains("[]"), "{}: {err}", f.file);
        assert!(err.contains("no tensors"), "{}: {err}", f.file);
    }
}

#[test]
fn forward_checks_the_architecture_first() {
    for f in &FOREIGN {
        let p = f.p();
        // --tokens given: no warning telling the user to pass --tokens.
        let out = glmcheck_bounded(&["forward", &p, "--tokens", "1,2,3"]);
        let err = diagnostics(&out);
        assert!(!err.contains("pass --tokens"), "{}: {err}", f.file);
        // --prompt: the architecture is what is wrong, not the tokenizer.
        let out = glmcheck_bounded(&["forward", &p, "--prompt", "hi"]);
        let err = diagnostics(&out);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", f.file);
        assert!(err.contains(&f.named()), "--prompt, {}: {err}", f.file);
        // --reference: the model is refused before the dump is read.
        let out = glmcheck_bounded(&[
            "forward",
            &p,
            "--tokens",
            "1",
            "--reference",
            "/nonexistent/ref.safetensors",
        ]);
        let err = diagnostics(&out);
        assert!(err.contains(&f.named()), "--reference, {}: {err}", f.file);
    }
}
