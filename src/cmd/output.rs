//! What every command shares at its edge: printing the human or JSON form, `--report FILE`
//! (atomic, never over an input or model data), the `--hf-config` table added to either, and the
//! progress bar.

use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use super::{CmdError, Ctx};
use crate::arch::hf_config::HfConfigCheck;
use crate::report;

/// A byte-counting progress bar on stderr, hidden when quiet or when stderr is not a terminal.
pub fn progress(quiet: bool, total: u64) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {wide_msg}",
    ) {
        bar.set_style(style);
    }
    bar
}

fn print_json(value: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, value).context("writing JSON to stdout")?;
    writeln!(out).context("writing to stdout")?;
    Ok(())
}

fn print_text(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .context("writing to stdout")?;
    Ok(())
}

/// Prints the human or JSON form of a command's result and, with `--report`, writes the JSON form.
pub fn emit(
    ctx: &Ctx,
    json: bool,
    value: &impl serde::Serialize,
    text: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    if let Some(path) = &ctx.report {
        let inputs = with_dir_entries(&ctx.inputs);
        match report_dir(ctx) {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating the report directory {}", dir.display()))?;
                let wrapped = serde_json::json!({
                    "schema": "glmcheck-report",
                    "schema_version": 1,
                    "glmcheck": env!("CARGO_PKG_VERSION"),
                    "report": value,
                });
                write_report(&dir.join("report.json"), &wrapped, &inputs)?;
            }
            None => write_report(path, value, &inputs)?,
        }
    }
    if json {
        print_json(value)
    } else {
        print_text(&text())
    }
}

/// `--report DIR`: the directory, when the path names one (an existing directory, a path ending
/// in `/`, or a name without an extension); `--report FILE.json` writes the JSON report alone.
pub fn report_dir(ctx: &Ctx) -> Option<&Path> {
    let p = ctx.report.as_deref()?;
    let dir =
        p.is_dir() || p.as_os_str().to_string_lossy().ends_with('/') || p.extension().is_none();
    dir.then_some(p)
}

/// With `--report DIR`, writes `files` (name, contents) into it beside report.json: each atomic,
/// never over an input or model data. Nothing without a report directory.
pub fn emit_extras(ctx: &Ctx, files: &[(&str, String)]) -> anyhow::Result<()> {
    let Some(dir) = report_dir(ctx) else {
        return Ok(());
    };
    let inputs = with_dir_entries(&ctx.inputs);
    for (name, body) in files {
        write_output(&dir.join(name), body.as_bytes(), &inputs)?;
    }
    Ok(())
}

/// [`emit`] with the `--hf-config` check, if any, added: its table after the text and
/// `"hf_config"` in the JSON.
pub fn emit_hf(
    ctx: &Ctx,
    json: bool,
    value: &impl serde::Serialize,
    hf: Option<&HfConfigCheck>,
    text: impl FnOnce() -> String,
) -> anyhow::Result<()> {
    let Some(hf) = hf else {
        return emit(ctx, json, value, text);
    };
    let mut v = serde_json::to_value(value).context("encoding the JSON report")?;
    if !v.is_object() {
        v = serde_json::json!({ "result": v });
    }
    if let Some(m) = v.as_object_mut() {
        m.insert("hf_config".into(), report::hf_config::hf_config_json(hf));
    }
    emit(ctx, json, &v, || {
        text() + &report::hf_config::hf_config_text(hf)
    })
}

/// `inputs` with the entries of those that are directories added.
fn with_dir_entries(inputs: &[PathBuf]) -> Vec<PathBuf> {
    let mut v = inputs.to_vec();
    for d in inputs.iter().filter(|p| p.is_dir()) {
        if let Ok(rd) = std::fs::read_dir(d) {
            v.extend(rd.flatten().map(|e| e.path()));
        }
    }
    v
}

/// Whether the file at `path` starts like a GGUF or a safetensors file.
fn holds_model_data(path: &Path) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = [0u8; 8];
    let n = f.read(&mut head).unwrap_or(0);
    let st_header = n == 8 && u64::from_le_bytes(head) < (1 << 27) && {
        let mut brace = [0u8; 1];
        f.read(&mut brace).unwrap_or(0) == 1 && brace[0] == b'{'
    };
    (n >= 4 && &head[..4] == b"GGUF") || st_header
}

/// Writes `value` as JSON to `path` atomically. Refuses a path that is one of `inputs`, or an existing
/// GGUF or safetensors file (a report never replaces model or dump data).
fn write_report(
    path: &Path,
    value: &impl serde::Serialize,
    inputs: &[PathBuf],
) -> anyhow::Result<()> {
    let body = serde_json::to_vec_pretty(value).context("encoding the report")?;
    write_output(path, &body, inputs)
}

/// Writes `body` to `path` atomically, with [`write_report`]'s refusals (an input, model or dump
/// data): a report of any format (JSON, JUnit XML).
pub fn write_output(path: &Path, body: &[u8], inputs: &[PathBuf]) -> anyhow::Result<()> {
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    if let Some(target) = canon(path) {
        if inputs.iter().any(|i| canon(i).as_ref() == Some(&target)) {
            return Err(CmdError::ReportOverInput(path.to_path_buf()).into());
        }
        if holds_model_data(path) {
            return Err(CmdError::ReportOverModelData(path.to_path_buf()).into());
        }
    }
    crate::outputs::write_atomically(path, |tmp| std::fs::write(tmp, body))
        .with_context(|| format!("writing the report {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_never_replaces_an_input_or_model_data() {
        let dir = tempfile::tempdir().expect("tempdir");
        let input = dir.path().join("in.json");
        std::fs::write(&input, "{}").expect("write");
        let v = serde_json::json!({"a": 1});
        let e = write_report(&input, &v, std::slice::from_ref(&input)).unwrap_err();
        assert!(e.to_string().contains("an input of this command"), "{e}");

        let gguf = dir.path().join("m.bin");
        std::fs::write(&gguf, b"GGUF\x03\0\0\0rest").expect("write");
        let e = write_report(&gguf, &v, &[]).unwrap_err();
        assert!(e.to_string().contains("GGUF or safetensors"), "{e}");

        let st = dir.path().join("d.bin");
        let mut bytes = 2u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&st, bytes).expect("write");
        assert!(holds_model_data(&st));

        let out = dir.path().join("report.json");
        write_report(&out, &v, std::slice::from_ref(&input)).expect("a fresh path is written");
        let back: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out).expect("read")).expect("json");
        assert_eq!(back, v);
    }

    #[test]
    fn a_directory_input_protects_its_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("rank0.json");
        std::fs::write(&f, "{}").expect("write");
        let inputs = with_dir_entries(&[dir.path().to_path_buf()]);
        assert_eq!(inputs, vec![dir.path().to_path_buf(), f]);
    }
}
