//! Every renderer. Commands never format output themselves: they hand a report value to one of these.

pub mod bisect;
pub mod config;
pub mod forward;
pub mod gate;
pub mod hf_config;
pub mod html;
pub mod notes;
pub mod reading;
pub mod shards;

pub use shards::{against_text, shards_text, verify_text};

use comfy_table::{presets, ContentArrangement, Table};

pub use notes::*;

use crate::gguf::stats::TensorStats;
use crate::inspect::InspectReport;

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
    out.push_str(&inspect_types(r));
    out.push_str(&inspect_tokenizer(r));
    out.push_str(&inspect_tensors(r, all_tensors));
    out.push_str(&inspect_verdict(r));
    out
}

fn inspect_types(r: &InspectReport) -> String {
    let mut out = String::new();
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
    out
}

fn inspect_tokenizer(r: &InspectReport) -> String {
    let mut out = String::new();
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
    out
}

fn inspect_tensors(r: &InspectReport, all_tensors: bool) -> String {
    let mut out = String::new();
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
    out
}

/// The notes and the consistency verdict.
fn inspect_verdict(r: &InspectReport) -> String {
    let mut out = String::new();
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
                inspect_problem(pr),
            ]);
        }
        out.push_str(&p.to_string());
        out.push('\n');
    }
    out
}

/// Human output of `dequant`.
/// `dequant --device`: decode throughput per type against the device's copy throughput.
pub fn device_decode_text(
    device: &str,
    types: &[crate::gguf::device_decode::TypeDecode],
) -> String {
    let mut t = table(&[
        "type",
        "tensors",
        "decode GB/s",
        "copy GB/s",
        "decode / copy",
    ]);
    for r in types {
        t.add_row(vec![
            r.dtype.name.to_string(),
            r.tensors.to_string(),
            format!("{:.0}", r.gbps),
            format!("{:.0}", r.copy_gbps),
            format!("{:.0} %", 100.0 * r.gbps / r.copy_gbps.max(1e-12)),
        ]);
    }
    format!(
        "decode on {device} (blocks read + f32 written per second, against a device copy of the \
         f32 result; best of --repeat):\n{t}\n"
    )
}

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

/// One `inspect` problem in words (the JSON's `message`).
pub fn inspect_problem(p: &crate::inspect::Problem) -> String {
    use crate::arch::ARCH;
    use crate::inspect::Cause;
    let tensor = p.tensor.as_deref().unwrap_or_default();
    match &p.cause {
        Cause::ForeignArch { arch } => format!(
            "architecture {arch}: glmcheck checks {ARCH} models; its tensors are \
             inventoried, no GLM-5 config is read or assumed"
        ),
        Cause::NoArch => {
            format!("no general.architecture: read as {ARCH} (GLM-5) with `{ARCH}.*` keys")
        }
        Cause::MtpKey {
            key_says,
            blocks,
            decoder_layers,
        } => format!(
            "`{ARCH}.nextn_predict_layers` says {key_says} MTP layer(s), but {} trailing block(s) \
             hold nextn.* tensors ({}): the tensors decide, so the model has {decoder_layers} \
             decoder layers",
            blocks.len(),
            crate::inspect::block_list(blocks),
        ),
        Cause::StrayNextn {
            blocks,
            block_count,
        } => format!(
            "nextn.* (MTP) tensors in block(s) {} that are not trailing MTP blocks below \
             block_count {block_count}",
            crate::inspect::block_list(blocks),
        ),
        Cause::Missing { for_param } => {
            format!("`{tensor}` (for {for_param}) is not in the file")
        }
        Cause::WrongShape { for_param } => format!(
            "`{tensor}` has shape {:?}, the config implies {:?} (for {for_param})",
            p.found.clone().unwrap_or_default(),
            p.expected.clone().unwrap_or_default(),
        ),
        Cause::AbsentLayers {
            first,
            last,
            expected,
        } => {
            let which = if first == last {
                format!("layer {first} has")
            } else {
                format!("layers {first}–{last} have")
            };
            format!(
                "{which} no tensors in the file ({expected} expected from the config; \
                 is `block_count` right, is a part of the split set missing?)"
            )
        }
        Cause::PastBlockCount {
            block,
            block_count,
            decoder_layers,
            mtp_layers,
        } => format!(
            "`{tensor}` belongs to block {block}, but the file has {block_count} blocks \
             ({decoder_layers} decoder + {mtp_layers} MTP)"
        ),
        Cause::Unknown => format!("`{tensor}` is not a glm-dsa tensor glmcheck knows"),
    }
}

/// `inspect`'s problems serialize with their sentence: `{kind, tensor, expected?, found?, message}`.
impl serde::Serialize for crate::inspect::Problem {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("kind", &self.kind)?;
        m.serialize_entry("tensor", &self.tensor)?;
        if let Some(e) = &self.expected {
            m.serialize_entry("expected", e)?;
        }
        if let Some(f) = &self.found {
            m.serialize_entry("found", f)?;
        }
        m.serialize_entry("message", &inspect_problem(self))?;
        m.end()
    }
}

#[cfg(test)]
mod inspect_problem_tests {
    use super::*;
    use crate::inspect::{Cause, Problem, ProblemKind};

    fn problem(cause: Cause, tensor: Option<&str>) -> Problem {
        Problem {
            kind: ProblemKind::Missing,
            tensor: tensor.map(str::to_string),
            expected: Some(vec![4, 8]),
            found: Some(vec![8, 4]),
            cause,
        }
    }

    #[test]
    fn problems_are_worded_from_their_numbers() {
        let p = problem(
            Cause::AbsentLayers {
                first: 3,
                last: 5,
                expected: 60,
            },
            None,
        );
        assert!(
            inspect_problem(&p).starts_with("layers 3–5 have no tensors in the file (60 expected")
        );
        let p = problem(
            Cause::WrongShape {
                for_param: "model.layers.1.self_attn.o_proj.weight".into(),
            },
            Some("blk.1.attn_output.weight"),
        );
        assert_eq!(
            inspect_problem(&p),
            "`blk.1.attn_output.weight` has shape [8, 4], the config implies [4, 8] (for model.layers.1.self_attn.o_proj.weight)"
        );
        let json = serde_json::to_value(&p).expect("json");
        assert_eq!(json["kind"], "missing");
        assert_eq!(json["expected"], serde_json::json!([4, 8]));
        assert_eq!(json["message"], inspect_problem(&p));
        let p = Problem {
            expected: None,
            found: None,
            ..problem(Cause::NoArch, None)
        };
        let json = serde_json::to_value(&p).expect("json");
        assert!(json.get("expected").is_none() && json.get("found").is_none());
    }
}
