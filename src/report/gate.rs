//! `glmcheck gate`: its verdict in words, its cases as a table, and as JUnit XML (one testsuite
//! per check, one testcase per parameter / layer / logits; a failure carries the finding and its
//! reading).

use std::fmt::Write as _;

use crate::gate::{Case, CaseResult, Detail, GateReport, GateVerdict, SuiteResult, SuiteVerdict};

fn verdict_word(v: GateVerdict) -> &'static str {
    match v {
        GateVerdict::Pass => "pass",
        GateVerdict::Fail => "fail",
        GateVerdict::CannotEvaluate => "cannot evaluate",
    }
}

fn suite_word(v: SuiteVerdict) -> &'static str {
    match v {
        SuiteVerdict::Pass => "pass",
        SuiteVerdict::Fail => "fail",
        SuiteVerdict::Incomplete => "incomplete (not everything expected was checked)",
    }
}

/// Why a case failed (or what it checked), in one paragraph.
pub fn case_message(c: &Case) -> String {
    match &c.detail {
        Detail::Param { findings } if findings.is_empty() => {
            "every rank holds the expected shard".into()
        }
        Detail::Param { findings } => findings
            .iter()
            .map(|f| {
                format!(
                    "ranks {:?}: {}: {} (rel-L2 {:.3e}, cosine {:.4})",
                    f.ranks,
                    super::shards::cause_name(&f.cause),
                    super::shards::cause_detail(&f.cause),
                    f.rel_l2,
                    f.cosine
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
        Detail::Layer {
            compared,
            worst,
            first_divergence,
            downstream_of,
        } => {
            let mut s = match downstream_of {
                Some(m) if c.result == CaseResult::Fail => {
                    format!("downstream of the first divergence ({m}): ")
                }
                _ => String::new(),
            };
            s += &match worst {
                Some(w) => format!(
                    "{compared} captures compared; worst {} rel-L2 {} ({})",
                    w.name,
                    w.rel_l2.map_or("-".into(), |x| format!("{x:.3e}")),
                    w.status.name()
                ),
                None => format!("{compared} captures compared"),
            };
            if let Some(f) = first_divergence {
                let _ = write!(s, ". First divergence: {}: {}", f.module, f.reading);
                if let Some(sig) = &f.signature {
                    let _ = write!(s, ". {}", super::reading::signature_line(sig));
                }
            }
            s
        }
        Detail::Logits { row } => match row {
            Some(r) => format!(
                "logits {}{}",
                r.status.name(),
                r.note.as_ref().map_or(String::new(), |n| format!(" ({n})"))
            ),
            None => "the logits are not in both dumps".into(),
        },
    }
}

fn result_word(r: CaseResult) -> &'static str {
    match r {
        CaseResult::Pass => "pass",
        CaseResult::Fail => "FAIL",
        CaseResult::Skipped => "skipped",
    }
}

/// The text report: the verdict line first, then each check and its failing cases.
pub fn gate_text(r: &GateReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "gate {}: {}", r.model, verdict_word(r.verdict));
    if let Some(why) = &r.cannot_evaluate {
        let _ = writeln!(out, "  {why}");
    }
    for s in &r.suites {
        let failed: Vec<&Case> = s
            .cases
            .iter()
            .filter(|c| c.result == CaseResult::Fail)
            .collect();
        let _ = writeln!(
            out,
            "{}: {} — {} cases, {} failed; {} against {}",
            s.suite.name(),
            suite_word(s.verdict),
            s.cases.len(),
            failed.len(),
            s.candidate,
            s.reference
        );
        for c in failed {
            let _ = writeln!(
                out,
                "  {} {}: {}",
                result_word(c.result),
                c.name,
                case_message(c)
            );
        }
    }
    out
}

fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\n' | '\t' | '\r') => {}
            c => o.push(c),
        }
    }
    o
}

fn suite_xml(out: &mut String, s: &SuiteResult) {
    let failures = s
        .cases
        .iter()
        .filter(|c| c.result == CaseResult::Fail)
        .count();
    let skipped = s
        .cases
        .iter()
        .filter(|c| c.result == CaseResult::Skipped)
        .count();
    let _ = writeln!(
        out,
        "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" skipped=\"{skipped}\">",
        s.suite.name(),
        s.cases.len()
    );
    let _ = writeln!(
        out,
        "    <properties><property name=\"candidate\" value=\"{}\"/><property name=\"reference\" value=\"{}\"/><property name=\"verdict\" value=\"{}\"/></properties>",
        xml(&s.candidate),
        xml(&s.reference),
        xml(suite_word(s.verdict))
    );
    for c in &s.cases {
        let head = format!(
            "    <testcase classname=\"glmcheck.{}\" name=\"{}\"",
            s.suite.name(),
            xml(&c.name)
        );
        let msg = xml(&case_message(c));
        match c.result {
            CaseResult::Pass => {
                let _ = writeln!(out, "{head}/>");
            }
            CaseResult::Skipped => {
                let _ = writeln!(out, "{head}><skipped message=\"{msg}\"/></testcase>");
            }
            CaseResult::Fail => {
                let _ = writeln!(
                    out,
                    "{head}><failure message=\"{msg}\" type=\"{}\">{msg}</failure></testcase>",
                    s.suite.name()
                );
            }
        }
    }
    if s.verdict == SuiteVerdict::Incomplete {
        let _ = writeln!(
            out,
            "    <testcase classname=\"glmcheck.{0}\" name=\"complete\"><failure message=\"{1}\" type=\"incomplete\">{1}</failure></testcase>",
            s.suite.name(),
            xml(suite_word(s.verdict))
        );
    }
    out.push_str("  </testsuite>\n");
}

/// JUnit XML of the gate (a gate that could not evaluate is one errored testcase).
pub fn gate_junit(r: &GateReport) -> String {
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let tests: usize = r.suites.iter().map(|s| s.cases.len()).sum();
    let failures: usize = r
        .suites
        .iter()
        .flat_map(|s| &s.cases)
        .filter(|c| c.result == CaseResult::Fail)
        .count();
    let errors = usize::from(r.verdict == GateVerdict::CannotEvaluate);
    let _ = writeln!(
        out,
        "<testsuites name=\"glmcheck gate {}\" tests=\"{}\" failures=\"{failures}\" errors=\"{errors}\">",
        xml(&r.model),
        tests + errors
    );
    if let Some(why) = &r.cannot_evaluate {
        let why = xml(why);
        let _ = writeln!(
            out,
            "  <testsuite name=\"gate\" tests=\"1\" errors=\"1\">\n    <testcase classname=\"glmcheck.gate\" name=\"evaluate\"><error message=\"{why}\" type=\"cannot-evaluate\">{why}</error></testcase>\n  </testsuite>"
        );
    }
    for s in &r.suites {
        suite_xml(&mut out, s);
    }
    out.push_str("</testsuites>\n");
    out
}

/// `--report DIR`'s report.html of a gate: the verdict line and every failing (or skipped) case.
pub fn gate_html(r: &GateReport) -> String {
    let rows: Vec<(String, String, String)> = r
        .suites
        .iter()
        .flat_map(|s| {
            s.cases
                .iter()
                .filter(|c| c.result != CaseResult::Pass)
                .map(move |c| {
                    (
                        format!("{}: {}", s.suite.name(), c.name),
                        result_word(c.result).to_string(),
                        case_message(c),
                    )
                })
        })
        .collect();
    let first = gate_text(r);
    let line = first.lines().next().unwrap_or_default();
    super::html::table_html("gate", line, &rows)
}

/// findings.jsonl of a gate: one case per line.
pub fn gate_jsonl(r: &GateReport) -> String {
    super::html::jsonl(r.suites.iter().flat_map(|s| {
        s.cases.iter().map(move |c| {
            serde_json::json!({
                "suite": s.suite.name(),
                "case": c.name,
                "result": result_word(c.result),
                "message": case_message(c),
            })
        })
    }))
}
