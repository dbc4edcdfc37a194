//! The `--json` output of every command on the fixtures, recorded before the restructuring of issue 11
//! and held since: a refactor that changes what a command reports fails here, field by field.
//!
//! Goldens live in `fixtures/golden/<case>.json` as `{"args", "exit", "json"}`. Volatile fields
//! (timings, throughputs) are dropped and temporary / repository paths replaced by `<TMP>` / `<REPO>`
//! before comparison; numbers compare to a relative 1e-5 (absolute 1e-9 near zero), since a
//! reordered sum is not a behaviour change. Re-record after an intended change with
//! `GLMCHECK_BLESS=1 cargo test --test json_golden` and name every changed field in the commit.

mod common;

use std::path::{Path, PathBuf};

use common::{fixture, gguf, glmcheck, path_str, stderr, PROMPT0_IDS};
use serde_json::Value;

/// Keys whose values depend on the machine or the moment, never on what was computed.
fn volatile(key: &str) -> bool {
    key == "seconds"
        || key.ends_with("_seconds")
        || key.ends_with("_ms")
        || key.contains("gbps")
        || key.ends_with("_per_s")
        || key == "elapsed"
        || key == "threads"
}

fn normalize(v: &Value, tmp: &str, repo: &str) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !volatile(k))
                .map(|(k, v)| (k.clone(), normalize(v, tmp, repo)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|x| normalize(x, tmp, repo)).collect()),
        Value::String(s) => Value::String(s.replace(tmp, "<TMP>").replace(repo, "<REPO>")),
        other => other.clone(),
    }
}

/// Where `got` differs from `want` (a JSON path and both values), numbers within tolerance.
fn differences(want: &Value, got: &Value, path: &str, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, va) in a {
                match b.get(k) {
                    Some(vb) => differences(va, vb, &format!("{path}.{k}"), out),
                    None => out.push(format!("{path}.{k}: missing (was {va})")),
                }
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                out.push(format!("{path}.{k}: new field ({})", b[k]));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            if a.len() != b.len() {
                out.push(format!("{path}: length {} → {}", a.len(), b.len()));
            }
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(x, y, &format!("{path}[{i}]"), out);
            }
        }
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (
                x.as_f64().unwrap_or(f64::NAN),
                y.as_f64().unwrap_or(f64::NAN),
            );
            let close = x == y || (x - y).abs() <= 1e-9 + 1e-5 * x.abs().max(y.abs());
            if !close {
                out.push(format!("{path}: {x} → {y}"));
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: {a} → {b}")),
    }
}

struct Case {
    name: String,
    args: Vec<String>,
}

fn case(name: &str, args: &[&str]) -> Case {
    Case {
        name: name.to_string(),
        args: args.iter().map(|s| s.to_string()).collect(),
    }
}

fn s(p: &Path) -> &str {
    path_str(p)
}

/// The faults `inject` knows, each with the layer it is put on (None: every parameter it hits).
const FAULTS: [(&str, Option<&str>); 10] = [
    ("none", None),
    ("kvb-concat", Some("1")),
    ("kvb-untransposed", Some("1")),
    ("rank-swap:1,3", None),
    ("merged-rank0", Some("2")),
    ("merged-midsplit", Some("1")),
    ("param-zeroed:*.mlp.gate.weight", None),
    ("wrong-dim", Some("0")),
    ("vocab-unpadded", None),
    ("bf16-as-f16", None),
];

fn slug(fault: &str) -> String {
    fault
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn cases(tmp: &Path) -> Vec<Case> {
    let f32 = gguf("tiny-F32");
    let q8 = gguf("tiny-Q8_0");
    let q4 = gguf("tiny-Q4_K_M");
    let mtp = gguf("tiny-mtp-Q8_0");
    let nonextn = gguf("tiny-nonextn-Q8_0");
    let hf_config = fixture("config.json");
    let tiny_vllm = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf_config/tiny-vllm.json");
    let prompt0 = fixture("activations/prompt0.safetensors");
    let prompt1 = fixture("activations/prompt1.safetensors");
    let hooks = fixture("activations/prompt0-hooks-bf16.safetensors");
    let vllm_tp8 = fixture("vllm033-tp8-originals");
    let vllm_faulty = fixture("vllm033-tp4-faulty");
    let mut v = vec![
        case("inspect-f32", &["inspect", s(&f32), "--json"]),
        case("inspect-q8", &["inspect", s(&q8), "--json"]),
        case(
            "inspect-q4km-hf-config",
            &["inspect", s(&q4), "--json", "--hf-config", s(&hf_config)],
        ),
        case(
            "inspect-q8-tiny-vllm-config",
            &["inspect", s(&q8), "--json", "--hf-config", s(&tiny_vllm)],
        ),
        case("inspect-mtp", &["inspect", s(&mtp), "--json"]),
        case("inspect-nonextn", &["inspect", s(&nonextn), "--json"]),
        case("shards-tp8", &["shards", s(&q4), "--tp", "8", "--json"]),
        case(
            "shards-tp4-layer1",
            &["shards", s(&f32), "--tp", "4", "--layer", "1", "--json"],
        ),
        case(
            "shards-tp8-verify",
            &["shards", s(&q4), "--tp", "8", "--verify", "--json"],
        ),
        case(
            "shards-against-vllm033-tp8",
            &[
                "shards",
                s(&f32),
                "--tp",
                "8",
                "--against",
                s(&vllm_tp8),
                "--json",
            ],
        ),
        case(
            "forward-f32",
            &["forward", s(&f32), "--tokens", PROMPT0_IDS, "--json"],
        ),
        case(
            "forward-q8-reference",
            &[
                "forward",
                s(&q8),
                "--tokens",
                PROMPT0_IDS,
                "--reference",
                s(&prompt0),
                "--max-new-tokens",
                "0",
                "--json",
            ],
        ),
        case(
            "forward-f32-dense-bf16",
            &[
                "forward",
                s(&f32),
                "--tokens",
                PROMPT0_IDS,
                "--dsa",
                "dense",
                "--dtype",
                "bf16",
                "--max-new-tokens",
                "2",
                "--json",
            ],
        ),
        case(
            "forward-f32-reference-hooks",
            &[
                "forward",
                s(&f32),
                "--tokens",
                PROMPT0_IDS,
                "--reference",
                s(&hooks),
                "--max-new-tokens",
                "0",
                "--json",
            ],
        ),
        case(
            "diff-prompt0-hooks",
            &["diff", s(&prompt0), s(&hooks), "--json"],
        ),
        case(
            "diff-prompt0-prompt1",
            &[
                "diff",
                s(&prompt0),
                s(&prompt1),
                "--allow-incomparable",
                "--json",
            ],
        ),
    ];
    for tp in ["1", "2", "4", "8"] {
        v.push(case(
            &format!("forward-tp{tp}"),
            &[
                "forward",
                s(&f32),
                "--tokens",
                PROMPT0_IDS,
                "--tp",
                tp,
                "--reference",
                s(&prompt0),
                "--max-new-tokens",
                "0",
                "--json",
            ],
        ));
    }
    v.push(case(
        "against-vllm033-tp4-faulty",
        &[
            "shards",
            s(&q8),
            "--tp",
            "4",
            "--against",
            s(&vllm_faulty),
            "--json",
        ],
    ));
    {
        let faulty_kvb = &vllm_faulty;
        v.push(case(
            "forward-weights-from-vllm033-tp4-faulty",
            &[
                "forward",
                s(&f32),
                "--tokens",
                PROMPT0_IDS,
                "--tp",
                "4",
                "--weights-from",
                s(faulty_kvb),
                "--reference",
                s(&prompt0),
                "--max-new-tokens",
                "0",
                "--json",
            ],
        ));
    }
    for (fault, layer) in FAULTS {
        let out = tmp.join(slug(fault));
        let mut inject = vec!["inject", s(&f32), "--fault", fault, "--tp", "4"];
        inject.extend_from_slice(&["--out", s(&out), "-q"]);
        if let Some(l) = layer {
            inject.extend_from_slice(&["--layer", l]);
        }
        let o = glmcheck(&inject);
        assert_eq!(o.status.code(), Some(0), "{inject:?}: {}", stderr(&o));
        v.push(case(
            &format!("against-{}", slug(fault)),
            &[
                "shards",
                s(&f32),
                "--tp",
                "4",
                "--against",
                s(&out),
                "--json",
            ],
        ));
        if fault == "kvb-concat" {
            v.push(case(
                "forward-tp4-weights-from-kvb-concat",
                &[
                    "forward",
                    s(&f32),
                    "--tokens",
                    PROMPT0_IDS,
                    "--tp",
                    "4",
                    "--weights-from",
                    s(&out),
                    "--reference",
                    s(&prompt0),
                    "--max-new-tokens",
                    "0",
                    "--json",
                ],
            ));
        }
    }
    // A dump glmcheck itself writes, diffed against the HF reference.
    let dumped = tmp.join("prompt0-glmcheck.safetensors");
    let o = glmcheck(&[
        "forward",
        s(&f32),
        "--tokens",
        PROMPT0_IDS,
        "--dump",
        s(&dumped),
        "--max-new-tokens",
        "0",
        "-q",
    ]);
    assert_eq!(o.status.code(), Some(0), "forward --dump: {}", stderr(&o));
    v.push(case(
        "diff-prompt0-glmcheck-dump",
        &["diff", s(&prompt0), s(&dumped), "--json"],
    ));
    v
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden")
}

#[test]
fn every_command_reports_what_it_reported_before() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let tmp_str = tmp.path().to_str().expect("utf-8").to_string();
    let repo = env!("CARGO_MANIFEST_DIR");
    let bless = std::env::var_os("GLMCHECK_BLESS").is_some();
    let mut failures = Vec::new();
    let cases = cases(tmp.path());
    assert!(cases.len() >= 30, "{} cases", cases.len());
    for c in &cases {
        let args: Vec<&str> = c.args.iter().map(String::as_str).collect();
        let out = glmcheck(&args);
        // A command that fails prints no JSON: its exit code and error line are the record.
        let json: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let error = match json {
            Value::Null => Value::String(stderr(&out).trim().to_string()),
            _ => Value::Null,
        };
        let got = serde_json::json!({
            "args": normalize(&serde_json::json!(c.args), &tmp_str, repo),
            "exit": out.status.code(),
            "json": normalize(&json, &tmp_str, repo),
            "error": normalize(&error, &tmp_str, repo),
        });
        let file = golden_dir().join(format!("{}.json", c.name));
        if bless {
            std::fs::create_dir_all(golden_dir()).expect("mkdir golden");
            let text = serde_json::to_string_pretty(&got).expect("json");
            std::fs::write(&file, text + "\n").expect("write golden");
            continue;
        }
        let want: Value = match std::fs::read_to_string(&file) {
            Ok(t) => serde_json::from_str(&t).expect("golden parses"),
            Err(e) => {
                failures.push(format!("{}: no golden ({e})", c.name));
                continue;
            }
        };
        let mut diffs = Vec::new();
        differences(&want, &got, "", &mut diffs);
        if !diffs.is_empty() {
            diffs.truncate(12);
            failures.push(format!("{}:\n    {}", c.name, diffs.join("\n    ")));
        }
    }
    // Every golden on disk is exercised (a renamed case would otherwise leave a stale file passing).
    if !bless {
        let names: std::collections::BTreeSet<String> =
            cases.iter().map(|c| format!("{}.json", c.name)).collect();
        for entry in std::fs::read_dir(golden_dir()).expect("fixtures/golden") {
            let name = entry
                .expect("entry")
                .file_name()
                .to_string_lossy()
                .into_owned();
            if name.ends_with(".json") && !names.contains(&name) {
                failures.push(format!("{name}: golden without a case"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_comparison_itself_can_fail() {
    let want = serde_json::json!({"a": 1.0, "b": [1, 2], "c": "x", "seconds": 3});
    let mut d = Vec::new();
    differences(
        &want,
        &serde_json::json!({"a": 1.0000001, "b": [1, 2], "c": "x", "seconds": 3}),
        "",
        &mut d,
    );
    assert!(d.is_empty(), "{d:?}");
    for got in [
        serde_json::json!({"a": 1.01, "b": [1, 2], "c": "x", "seconds": 3}),
        serde_json::json!({"a": 1.0, "b": [1], "c": "x", "seconds": 3}),
        serde_json::json!({"a": 1.0, "b": [1, 2], "c": "y", "seconds": 3}),
        serde_json::json!({"a": 1.0, "b": [1, 2], "seconds": 3}),
        serde_json::json!({"a": 1.0, "b": [1, 2], "c": "x", "d": 0, "seconds": 3}),
    ] {
        let mut d = Vec::new();
        differences(&want, &got, "", &mut d);
        assert!(!d.is_empty(), "{got}");
    }
    let n = normalize(
        &serde_json::json!({"seconds": 1, "x_seconds": 2, "p": "/t/a", "q": "/r/b"}),
        "/t",
        "/r",
    );
    assert_eq!(n, serde_json::json!({"p": "<TMP>/a", "q": "<REPO>/b"}));
}
