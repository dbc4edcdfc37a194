//! Every renderer. Commands never format output themselves: they hand a report value to one of these.

pub mod config;
pub mod forward;
pub mod hf_config;
pub mod shards;

pub use shards::{against_text, shards_text, verify_text};

use comfy_table::{presets, ContentArrangement, Table};

use crate::inspect::InspectReport;
use crate::scan::TensorStats;

/// A table in glmcheck's house style (plain ASCII/UTF-8 borders, no colour: NO_COLOR-safe by design).
pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.iter().copied());
    t
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

fn shape(s: &[usize]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Human output of `inspect`. `all_tensors` lists every tensor instead of layer 0's and the globals.
pub fn inspect_text(r: &InspectReport, all_tensors: bool) -> String {
    let mut out = String::new();
    let files = r.files.len();
    out.push_str(&format!(
        "{} ({} file{}, {}), architecture {}\n\n",
        r.files.first().map_or("", |f| f.path.as_str()),
        files,
        if files == 1 { "" } else { "s" },
        human_bytes(r.files.iter().map(|f| f.bytes).sum()),
        if r.arch.is_empty() { "(none)" } else { &r.arch }
    ));

    let mut cfg = table(&["config (HF name)", "value", "from"]);
    let json = serde_json::to_value(&r.config).unwrap_or_default();
    if r.config.is_none() {
        out.push_str(&format!(
            "architecture {}: glmcheck checks {} models; tensors inventoried only\n\n",
            r.arch,
            crate::arch::ARCH
        ));
    } else if let Some(map) = json.as_object() {
        for (k, v) in map {
            let from = match r.config_sources.get(k) {
                Some(crate::arch::config::Source::Metadata(key)) => key.clone(),
                Some(crate::arch::config::Source::Derived(how)) => format!("derived: {how}"),
                Some(crate::arch::config::Source::Default(key)) => format!("DEFAULT (no {key})"),
                None => String::new(),
            };
            cfg.add_row(vec![k.clone(), v.to_string(), from]);
        }
    }
    if r.config.is_some() {
        out.push_str(&cfg.to_string());
        out.push_str("\n\n");
    }

    let mut types = table(&["type", "tensors", "elements", "bytes", "dequantizable"]);
    for t in &r.types {
        types.add_row(vec![
            t.dtype.to_string(),
            t.tensors.to_string(),
            t.elements.to_string(),
            human_bytes(t.bytes),
            if t.dequantizable { "yes" } else { "no" }.to_string(),
        ]);
    }
    types.add_row(vec![
        "total".to_string(),
        r.tensor_count.to_string(),
        r.types.iter().map(|t| t.elements).sum::<u64>().to_string(),
        human_bytes(r.total_bytes),
        String::new(),
    ]);
    out.push_str(&types.to_string());
    out.push_str("\n\n");

    if let Some(tok) = &r.tokenizer {
        out.push_str(&format!(
            "tokenizer: {} (pre {}), {} tokens, {} merges, chat template {}\n",
            tok.model.as_deref().unwrap_or("?"),
            tok.pre.as_deref().unwrap_or("?"),
            tok.tokens,
            tok.merges,
            if tok.chat_template {
                "present"
            } else {
                "absent"
            }
        ));
        let specials: Vec<String> = tok
            .special
            .iter()
            .map(|(k, v)| format!("{k}={} {:?}", v.id, v.text.as_deref().unwrap_or("?")))
            .collect();
        if !specials.is_empty() {
            out.push_str(&format!("  special: {}\n", specials.join(", ")));
        }
        out.push('\n');
    }

    let mut tensors = table(&["tensor", "type", "shape (PyTorch)", "HF parameter"]);
    let mut hidden = 0;
    for t in &r.tensors {
        let layer = crate::arch::glm_dsa::gguf_layer(&t.name);
        let show = all_tensors
            || layer.is_none()
            || layer == Some(0)
            || layer == r.config.as_ref().map(|c| c.first_k_dense_replace);
        if !show {
            hidden += 1;
            continue;
        }
        tensors.add_row(vec![
            t.name.clone(),
            t.dtype.to_string(),
            shape(&t.shape),
            t.hf.clone().unwrap_or_else(|| "-".into()),
        ]);
    }
    out.push_str(&tensors.to_string());
    out.push('\n');
    if hidden > 0 {
        out.push_str(&format!(
            "({hidden} tensors of other layers not shown; --all-tensors lists them)\n"
        ));
    }
    out.push('\n');

    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    if !r.defaulted.is_empty() {
        out.push_str(&format!(
            "note: missing metadata, GLM-5 defaults used for: {}\n",
            r.defaulted.join(", ")
        ));
    }
    if r.config.is_none() {
        out.push_str(&format!(
            "not checked: architecture {} is not {}\n",
            r.arch,
            crate::arch::ARCH
        ));
    } else if r.problems.is_empty() {
        out.push_str(&format!(
            "consistency: all {} tensors agree with the config (no missing, unexpected or mis-shaped tensors)\n",
            r.tensor_count
        ));
    } else {
        out.push_str(&format!("consistency: {} problem(s)\n", r.problems.len()));
        let mut p = table(&["problem", "tensor", "detail"]);
        for pr in &r.problems {
            p.add_row(vec![
                serde_json::to_value(&pr.kind)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                pr.tensor.clone().unwrap_or_default(),
                pr.message.clone(),
            ]);
        }
        out.push_str(&p.to_string());
        out.push('\n');
    }
    out
}

/// Human output of `dequant`.
pub fn dequant_text(rows: &[TensorStats]) -> String {
    let mut t = table(&[
        "tensor",
        "type",
        "shape",
        "absmax",
        "mean",
        "std",
        "NaN",
        "Inf",
        "GB/s (f32 out)",
    ]);
    for r in rows {
        if let Some(e) = &r.error {
            t.add_row(vec![
                r.name.clone(),
                r.dtype.to_string(),
                shape(&r.shape),
                format!("error: {e}"),
            ]);
            continue;
        }
        t.add_row(vec![
            r.name.clone(),
            r.dtype.to_string(),
            shape(&r.shape),
            num(r.absmax),
            num(r.mean),
            num(r.std),
            r.nan.to_string(),
            r.inf.to_string(),
            format!("{:.2}", r.out_gbps),
        ]);
    }
    let mut out = t.to_string();
    out.push('\n');
    let ok: Vec<_> = rows.iter().filter(|r| r.error.is_none()).collect();
    let bytes: f64 = ok.iter().map(|r| (r.elements * 4) as f64).sum();
    let secs: f64 = ok.iter().map(|r| r.seconds).sum();
    out.push_str(&format!(
        "{} tensors decoded ({} failed), {} of f32 in {:.3} s: {:.2} GB/s\n",
        ok.len(),
        rows.len() - ok.len(),
        human_bytes(bytes as u64),
        secs,
        bytes / secs.max(1e-12) / 1e9
    ));
    out
}

/// A number for tables: plain in the usual range, scientific outside it.
pub fn num(x: f64) -> String {
    if x == 0.0 || (1e-3..1e5).contains(&x.abs()) {
        format!("{x:.4}")
    } else {
        format!("{x:.3e}")
    }
}
