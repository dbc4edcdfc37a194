//! `glmcheck bisect`: the culprits, each with where its forward first diverges, and the patches
//! proven harmless with the reason.

use std::fmt::Write as _;

use crate::bisect::{BisectReport, Patch, Why};

fn patch_text(p: &Patch) -> String {
    p.injection().to_string()
}

/// Why a patch is harmless, in words.
pub fn why_text(p: &Patch, w: &Why) -> String {
    match w {
        Why::PromptWithinTopk { tokens, index_topk } => format!(
            "{}: harmless here, prompt of {tokens} tokens ≤ index_topk {index_topk} (dense and \
             sparse attention see the same keys)",
            patch_text(p)
        ),
        Why::WithinTolerance { worst, rel_l2 } => format!(
            "{}: harmless here, its forward stays within the bounds of bf16 weights{}",
            patch_text(p),
            match (worst, rel_l2) {
                (Some(m), Some(x)) => format!(" (worst {m}, rel-L2 {x:.2e})"),
                _ => String::new(),
            }
        ),
    }
}

pub fn bisect_text(r: &BisectReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} patch(es), simulated tp={}, {} tokens: {} forward(s) run",
        r.patches.len(),
        r.tp,
        r.tokens,
        r.forwards
    );
    if r.culprits.is_empty() {
        out.push_str("no culprit: the forward with every patch stays within tolerance\n");
    }
    for c in &r.culprits {
        let names: Vec<String> = c.patches.iter().map(patch_text).collect();
        let _ = writeln!(
            out,
            "culprit: {}{}",
            names.join(" + "),
            if c.patches.len() > 1 {
                " (only together)"
            } else {
                ""
            }
        );
        if let Some(f) = &c.first_divergence {
            let _ = writeln!(
                out,
                "  first divergence: {}{}\n  {}",
                f.module,
                f.layer.map_or(String::new(), |l| format!(" (layer {l})")),
                f.reading
            );
            if let Some(s) = &f.signature {
                let _ = writeln!(out, "  {}", super::reading::signature_line(s));
            }
        }
    }
    for h in &r.harmless {
        let _ = writeln!(out, "{}", why_text(&h.patch, &h.why));
    }
    out
}

/// `bisect --json`: `{"culprits": [{"fault", "layers", "first_divergence"}], "harmless":
/// [{"fault", "why"}], "forwards"}` (a culprit that needs several patches lists them in
/// `"patches"`).
pub fn bisect_json(r: &BisectReport) -> serde_json::Value {
    let culprits: Vec<serde_json::Value> = r
        .culprits
        .iter()
        .map(|c| {
            let first = c.patches.first();
            serde_json::json!({
                "fault": first.map(|p| p.fault.to_string()),
                "layers": first.map(|p| p.layers.clone()),
                "patches": c.patches.iter().map(patch_text).collect::<Vec<_>>(),
                "first_divergence": c.first_divergence,
            })
        })
        .collect();
    let harmless: Vec<serde_json::Value> = r
        .harmless
        .iter()
        .map(|h| {
            serde_json::json!({
                "fault": h.patch.fault.to_string(),
                "layers": h.patch.layers,
                "why": why_text(&h.patch, &h.why),
                "reason": h.why,
            })
        })
        .collect();
    serde_json::json!({
        "tp": r.tp,
        "tokens": r.tokens,
        "culprits": culprits,
        "harmless": harmless,
        "forwards": r.forwards,
    })
}

/// `--report DIR`'s report.html of a bisection.
pub fn bisect_html(r: &BisectReport) -> String {
    let text = bisect_text(r);
    let mut rows: Vec<(String, String, String)> = r
        .culprits
        .iter()
        .map(|c| {
            let names: Vec<String> = c.patches.iter().map(patch_text).collect();
            let why = c.first_divergence.as_ref().map_or(String::new(), |f| {
                format!("first divergence {}: {}", f.module, f.reading)
            });
            (names.join(" + "), "FAIL".to_string(), why)
        })
        .collect();
    rows.extend(r.harmless.iter().map(|h| {
        (
            patch_text(&h.patch),
            "harmless".to_string(),
            why_text(&h.patch, &h.why),
        )
    }));
    super::html::table_html("bisect", text.lines().next().unwrap_or_default(), &rows)
}

/// findings.jsonl of a bisection: one patch per line.
pub fn bisect_jsonl(r: &BisectReport) -> String {
    let json = bisect_json(r);
    let lines = json["culprits"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| serde_json::json!({"culprit": true, "patch": c}))
        .chain(
            json["harmless"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|h| serde_json::json!({"culprit": false, "patch": h})),
        )
        .collect::<Vec<_>>();
    super::html::jsonl(lines)
}
