//! `--report DIR`: report.json (versioned), findings.jsonl and a self-contained report.html whose
//! plots show the first divergence at the right layer — checked in the file, and, where Debian's
//! `chromium` is installed, in the DOM headless Chromium builds from it and its screenshot.

mod common;

use common::{fixture, glmcheck, path_str as s};

use std::path::{Path, PathBuf};
use std::process::Command;

const P0: &str = "294,266,220,17,10,17,30,220,468,478,68,286,262,414,13,278,286,266";

/// The kvb-concat fixture run (4 simulated ranks, layer 1's kv_b_proj rebuilt wrong) against
/// transformers' dump, reported into DIR/report.
fn kvb_concat_report(dir: &Path) -> PathBuf {
    let f32 = fixture("tiny-F32.gguf");
    let ranks = dir.join("ranks");
    let out = glmcheck(&[
        "inject",
        "-q",
        "--fault",
        "kvb-concat",
        "--layer",
        "1",
        "--tp",
        "4",
        "--out",
        s(&ranks),
        s(&f32),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = dir.join("report");
    let reference = fixture("activations/prompt0.safetensors");
    let out = glmcheck(&[
        "forward",
        s(&f32),
        "--tokens",
        P0,
        "--max-new-tokens",
        "0",
        "--tp",
        "4",
        "--weights-from",
        s(&ranks),
        "--reference",
        s(&reference),
        "--report",
        s(&report),
        "-q",
    ]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    report
}

#[test]
fn a_report_dir_holds_json_findings_and_html_with_the_divergence_marked() {
    let d = tempfile::tempdir().expect("temp dir");
    let report = kvb_concat_report(d.path());
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report.join("report.json")).expect("report.json"))
            .expect("JSON");
    assert_eq!(json["schema"], "glmcheck-report");
    assert_eq!(json["schema_version"], 1);
    assert_eq!(json["report"]["first_divergence"]["layer"], 1);
    let findings = std::fs::read_to_string(report.join("findings.jsonl")).expect("findings");
    let lines: Vec<serde_json::Value> = findings
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON value per line"))
        .collect();
    let firsts: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["first_divergence"] == true)
        .collect();
    assert_eq!(firsts.len(), 1);
    assert_eq!(firsts[0]["module"], "model.layers.1.self_attn.kv_b_proj");
    assert_eq!(firsts[0]["diverged"], true);
    let html = std::fs::read_to_string(report.join("report.html")).expect("html");
    assert!(!html.contains("<script"), "self-contained, no scripts");
    assert!(
        !html.contains("src=\"http"),
        "nothing fetched from the network"
    );
    assert!(
        html.contains("id=\"first-divergence\" data-layer=\"1\""),
        "heat map cell"
    );
    assert!(
        html.matches("<svg").count() >= 3,
        "two plots and the heat map"
    );
    let diagnosis = html
        .lines()
        .find(|l| l.contains("id=\"diagnosis\""))
        .expect("the one-line diagnosis");
    assert!(
        diagnosis.contains("kv_b_proj") && diagnosis.contains("layer 1"),
        "{diagnosis}"
    );
    // A report is never written over an input: here the dump named DIR/report.json.
    let input = d.path().join("report.json");
    let reference = fixture("activations/prompt0.safetensors");
    std::fs::copy(&reference, &input).expect("copy");
    let before = std::fs::read(&input).expect("read");
    let out = glmcheck(&[
        "diff",
        s(&input),
        s(&reference),
        "--report",
        &format!("{}/", s(d.path())),
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read(&input).expect("read"),
        before,
        "the input is untouched"
    );
}

#[test]
fn headless_chromium_renders_the_plot() {
    let chromium = std::env::var("CHROMIUM").ok().or_else(|| {
        ["chromium", "chromium-browser"]
            .into_iter()
            .find(|c| {
                Command::new(c)
                    .arg("--version")
                    .output()
                    .is_ok_and(|o| o.status.success())
            })
            .map(str::to_string)
    });
    let Some(chromium) = chromium else {
        eprintln!("chromium not installed (Debian: apt-get install chromium): skipped");
        return;
    };
    let d = tempfile::tempdir().expect("temp dir");
    let report = kvb_concat_report(d.path());
    let url = format!("file://{}", s(&report.join("report.html")));
    let flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
    ];
    let dom = Command::new(&chromium)
        .args(flags)
        .args(["--dump-dom", &url])
        .output()
        .expect("chromium");
    let dom = String::from_utf8_lossy(&dom.stdout);
    // The DOM Chromium built: the plots' SVG parsed into elements, the divergence marked.
    assert!(dom.contains("<svg"), "{}", &dom[..dom.len().min(500)]);
    assert!(dom.contains("rel-L2 per layer"));
    assert!(dom.contains("data-layer=\"1\""));
    let shot = d.path().join("shot.png");
    let out = Command::new(&chromium)
        .args(flags)
        .args([
            "--window-size=1200,1500",
            &format!("--screenshot={}", s(&shot)),
            &url,
        ])
        .output()
        .expect("chromium");
    let png = std::fs::read(&shot).unwrap_or_else(|e| {
        panic!(
            "no screenshot ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // A blank page compresses to a few kB; the plots and the heat map do not.
    assert!(png.len() > 40_000, "{} bytes", png.len());
}

#[test]
fn gate_bisect_and_verify_write_the_three_files_too() {
    let d = tempfile::tempdir().expect("temp dir");
    let f32 = fixture("tiny-F32.gguf");
    let reference = fixture("activations/prompt0.safetensors");
    let patches = d.path().join("p.toml");
    std::fs::write(
        &patches,
        "[[patch]]\nfault = \"kvb-concat\"\nlayers = [1]\n",
    )
    .expect("write");
    for (name, args, code) in [
        (
            "gate",
            vec!["gate", s(&f32), "--reference", s(&reference)],
            0,
        ),
        (
            "bisect",
            vec![
                "bisect",
                s(&f32),
                "--patches",
                s(&patches),
                "--tokens",
                "294,266,220",
                "--tp",
                "2",
            ],
            1,
        ),
        (
            "verify",
            vec!["shards", s(&f32), "--tp", "2", "--verify"],
            0,
        ),
    ] {
        let dir = d.path().join(name);
        let mut all = args.clone();
        let report = format!("{}/", s(&dir));
        all.extend(["--report", &report, "-q"]);
        let out = glmcheck(&all);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for f in ["report.json", "findings.jsonl", "report.html"] {
            let body =
                std::fs::read_to_string(dir.join(f)).unwrap_or_else(|e| panic!("{name} {f}: {e}"));
            assert!(!body.is_empty(), "{name} {f}");
        }
        let lines = std::fs::read_to_string(dir.join("findings.jsonl")).expect("findings");
        for l in lines.lines() {
            serde_json::from_str::<serde_json::Value>(l)
                .unwrap_or_else(|e| panic!("{name}: {e}: {l}"));
        }
    }
}
