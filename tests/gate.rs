//! `glmcheck gate`: passes on a correct setup, fails (exit 1) on every weight fault with a JUnit
//! testcase naming the parameter, names a behaviour fault in a deployment's activations, and
//! exits 125 when it cannot evaluate (what `git bisect run` skips) and 2 on bad arguments.

mod common;

use common::{fixture, glmcheck, path_str as s};

use std::path::Path;

use glmcheck::faults::{Hits, Make, FAULTS};
use serde_json::Value as Json;

const P0: &str = "294,266,220,17,10,17,30,220,468,478,68,286,262,414,13,278,286,266";

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// `gate` with `args` and `--json --junit DIR/gate.xml`: exit code, JSON, JUnit text.
fn gate(dir: &Path, args: &[&str]) -> (i32, Json, String) {
    let junit = dir.join("gate.xml");
    let mut all = vec!["gate"];
    all.extend_from_slice(args);
    all.extend(["--json", "--junit", s(&junit)]);
    let out = glmcheck(&all);
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let xml = std::fs::read_to_string(&junit).unwrap_or_default();
    (out.status.code().unwrap_or(-1), json, xml)
}

#[test]
fn a_correct_setup_passes_with_every_case_in_the_junit_file() {
    let d = tmp();
    let f32 = fixture("tiny-F32.gguf");
    let reference = fixture("activations/prompt0.safetensors");
    let (code, j, xml) = gate(d.path(), &[s(&f32), "--reference", s(&reference)]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(j["verdict"], "pass");
    assert!(xml.contains("<testsuite name=\"forward\""), "{xml}");
    assert!(xml.contains("name=\"model.layers.1\""), "{xml}");
    assert!(xml.contains("name=\"logits\""), "{xml}");
    assert!(!xml.contains("<failure"), "{xml}");
    // The tokens came from the reference's metadata.
    assert_eq!(j["suites"][0]["suite"], "forward");
}

/// A command-line spelling of a weight fault of the table, parameters filled in.
fn spelled(name: &str, make: &Make) -> String {
    match make {
        Make::Plain(_) => name.to_string(),
        Make::Ranks(_) => format!("{name}:1,3"),
        Make::Glob(_) => format!("{name}:*q_b_proj*"),
    }
}

#[test]
fn every_weight_fault_fails_the_gate_with_the_parameter_named() {
    let f32 = fixture("tiny-F32.gguf");
    for spec in FAULTS
        .iter()
        .filter(|f| !matches!(f.hits, Hits::Forward | Hits::Nothing))
    {
        let fault = spelled(spec.name, &spec.make);
        // force-dequant only rounds to bf16: right values, the gate passes (tested below).
        if spec.name == "force-dequant" {
            continue;
        }
        let d = tmp();
        let ranks = d.path().join("ranks");
        let out = glmcheck(&[
            "inject",
            "--fault",
            &fault,
            "--tp",
            "4",
            "--out",
            s(&ranks),
            s(&f32),
        ]);
        assert!(
            out.status.success(),
            "{fault}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (code, j, xml) = gate(d.path(), &[s(&f32), "--tp", "4", "--against", s(&ranks)]);
        assert_eq!(code, 1, "{fault}: {j}");
        assert_eq!(j["verdict"], "fail", "{fault}");
        let failed: Vec<&str> = xml
            .lines()
            .filter(|l| l.contains("classname=\"glmcheck.weights\"") && l.contains("<failure"))
            .collect();
        assert!(
            !failed.is_empty(),
            "{fault}: no failing parameter in\n{xml}"
        );
        assert!(
            failed
                .iter()
                .all(|l| l.contains("name=\"model.") || l.contains("name=\"lm_head")),
            "{fault}: a failure names a parameter: {failed:?}"
        );
    }
}

#[test]
fn weights_rounded_to_bf16_pass_the_weights_check() {
    let d = tmp();
    let f32 = fixture("tiny-F32.gguf");
    let ranks = d.path().join("ranks");
    let out = glmcheck(&[
        "inject",
        "--fault",
        "force-dequant:*",
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
    let (code, j, _) = gate(d.path(), &[s(&f32), "--tp", "4", "--against", s(&ranks)]);
    assert_eq!(code, 0, "{j}");
}

#[test]
fn a_deployments_activations_with_a_behaviour_fault_fail_with_its_name() {
    let d = tmp();
    let f32 = fixture("tiny-F32.gguf");
    for (fault, code_want) in [(Some("router-softmax@1"), 1), (None, 0)] {
        let cand = d.path().join("cand.safetensors");
        let mut args = vec![
            "forward",
            s(&f32),
            "--tokens",
            P0,
            "--max-new-tokens",
            "0",
            "--dump",
            s(&cand),
        ];
        if let Some(f) = fault {
            args.extend(["--fault", f]);
        }
        let out = glmcheck(&args);
        assert!(
            out.status.code().is_some_and(|c| c <= 1),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (code, j, xml) = gate(d.path(), &[s(&f32), "--candidate", s(&cand)]);
        assert_eq!(code, code_want, "{fault:?}: {j}");
        if fault.is_some() {
            let layer1 = xml
                .lines()
                .find(|l| l.contains("glmcheck.candidate") && l.contains("name=\"model.layers.1\""))
                .expect("layer 1's case");
            assert!(layer1.contains("<failure"), "{layer1}");
            assert!(layer1.contains("router-softmax"), "{layer1}");
        }
    }
}

#[test]
fn missing_or_unreadable_inputs_cannot_be_evaluated_125() {
    let d = tmp();
    let f32 = fixture("tiny-F32.gguf");
    let reference = fixture("activations/prompt0.safetensors");
    let junk = d.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").expect("write");
    let missing = d.path().join("missing.gguf");
    for args in [
        vec![s(&missing), "--reference", s(&reference)],
        vec![s(&f32), "--reference", "/nonexistent/ref.safetensors"],
        vec![s(&f32), "--reference", s(&junk)],
        vec![s(&f32), "--against", "/nonexistent/ranks"],
    ] {
        let (code, j, xml) = gate(d.path(), &args);
        assert_eq!(code, 125, "{args:?}: {j}");
        assert_eq!(j["verdict"], "cannot_evaluate");
        assert!(j["cannot_evaluate"].as_str().is_some_and(|w| !w.is_empty()));
        assert!(xml.contains("<error"), "{xml}");
    }
}

#[test]
fn bad_arguments_exit_2() {
    let d = tmp();
    let f32 = fixture("tiny-F32.gguf");
    let reference = fixture("activations/prompt0.safetensors");
    let toml = d.path().join("gate.toml");
    std::fs::write(&toml, "[tolerances]\nkl_mean = 0.01\nklmean = 3\n").expect("write");
    for args in [
        vec!["gate", s(&f32)],
        vec![
            "gate",
            s(&f32),
            "--reference",
            s(&reference),
            "--config",
            s(&toml),
        ],
    ] {
        let out = glmcheck(&args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn gate_toml_thresholds_apply_and_flags_override_them() {
    let d = tmp();
    let f32 = fixture("tiny-Q4_K_M.gguf");
    let reference = fixture("activations/prompt0.safetensors");
    // Q4_K_M against the original weights passes at its measured bounds, and fails at bounds
    // meant for identical weights.
    let strict = d.path().join("strict.toml");
    std::fs::write(
        &strict,
        "[tolerances]\nrel_l2 = 1e-6\nkl_mean = 1e-9\nkl_max = 1e-9\n",
    )
    .expect("write");
    let (code, _, _) = gate(d.path(), &[s(&f32), "--reference", s(&reference)]);
    assert_eq!(code, 0);
    let (code, j, _) = gate(
        d.path(),
        &[
            s(&f32),
            "--reference",
            s(&reference),
            "--config",
            s(&strict),
        ],
    );
    assert_eq!(code, 1, "{j}");
    let (code, _, _) = gate(
        d.path(),
        &[
            s(&f32),
            "--reference",
            s(&reference),
            "--config",
            s(&strict),
            "--rel-l2",
            "0.6",
            "--kl-mean",
            "1",
            "--kl-max",
            "1",
        ],
    );
    assert_eq!(code, 0, "the flags win over the file");
}

#[test]
fn rel_l2_bounds_per_module_class_apply() {
    let d = tmp();
    let q4 = fixture("tiny-Q4_K_M.gguf");
    let reference = fixture("activations/prompt0.safetensors");
    // Every module at a bound meant for identical weights fails Q4_K_M against the originals; the
    // same file with every class given Q4's measured bound back passes.
    let strict = d.path().join("strict.toml");
    std::fs::write(&strict, "[tolerances]\nrel_l2 = 1e-6\n").expect("write");
    let (code, _, _) = gate(
        d.path(),
        &[s(&q4), "--reference", s(&reference), "--config", s(&strict)],
    );
    assert_eq!(code, 1);
    let classes = d.path().join("classes.toml");
    std::fs::write(
        &classes,
        "[tolerances]\nrel_l2 = 1e-6\n[tolerances.rel_l2_by_class]\n\"*\" = 0.6\n",
    )
    .expect("write");
    let (code, j, _) = gate(
        d.path(),
        &[
            s(&q4),
            "--reference",
            s(&reference),
            "--config",
            s(&classes),
        ],
    );
    assert_eq!(code, 0, "{j}");
    // A class that matches nothing leaves the strict bound in force.
    std::fs::write(
        &classes,
        "[tolerances]\nrel_l2 = 1e-6\n[tolerances.rel_l2_by_class]\n\"no.such.module\" = 0.6\n",
    )
    .expect("write");
    let (code, _, _) = gate(
        d.path(),
        &[
            s(&q4),
            "--reference",
            s(&reference),
            "--config",
            s(&classes),
        ],
    );
    assert_eq!(code, 1);
}
