//! Shared helpers for the integration tests: fixture paths, the binary, checksums, GGUF building.
#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use glmcheck::gguf::writer::{write_gguf, WriteTensor};
use glmcheck::gguf::{GgufModel, Value};
use sha2::{Digest, Sha256};

/// The four GGUFs made from the tiny HF model (see fixtures/README.md).
pub const FIXTURE_GGUFS: [&str; 4] = ["tiny-F32", "tiny-BF16", "tiny-Q8_0", "tiny-Q4_K_M"];

pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/tiny")
        .join(rel)
}

pub fn gguf(stem: &str) -> PathBuf {
    fixture(&format!("{stem}.gguf"))
}

pub fn json(rel: &str) -> serde_json::Value {
    let path = fixture(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn glmcheck(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_glmcheck"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("run glmcheck")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn sha256_f32(v: &[f32]) -> String {
    let mut h = Sha256::new();
    for x in v {
        h.update(x.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Re-writes `model` (all parts) as one or more files with `write_gguf`, keeping every metadata entry
/// and tensor byte. `split_at` are tensor indices where a new part starts (empty: one file).
pub fn rewrite(model: &GgufModel, out: &Path, split_at: &[usize]) -> Vec<PathBuf> {
    let tensors: Vec<_> = model.tensors().collect();
    let mut bounds = vec![0];
    bounds.extend_from_slice(split_at);
    bounds.push(tensors.len());
    let n_parts = bounds.len() - 1;
    let stem = out.to_string_lossy().trim_end_matches(".gguf").to_string();
    let mut paths = Vec::new();
    for p in 0..n_parts {
        let path = if n_parts == 1 {
            out.to_path_buf()
        } else {
            PathBuf::from(format!("{stem}-{:05}-of-{:05}.gguf", p + 1, n_parts))
        };
        let mut meta: Vec<(String, Value)> = Vec::new();
        if p == 0 {
            meta.extend(
                model
                    .metadata()
                    .iter()
                    .filter(|e| !e.key.starts_with("split."))
                    .map(|e| (e.key.clone(), e.value.clone())),
            );
        }
        if n_parts > 1 {
            meta.push(("split.no".into(), Value::U16(p as u16)));
            meta.push(("split.count".into(), Value::U16(n_parts as u16)));
            meta.push((
                "split.tensors.count".into(),
                Value::I32(tensors.len() as i32),
            ));
        }
        let part: Vec<WriteTensor> = tensors[bounds[p]..bounds[p + 1]]
            .iter()
            .map(|t| WriteTensor {
                name: t.info.name.clone(),
                ne: t.info.ne.clone(),
                dtype: t.info.dtype,
                data: Some(t.bytes()),
            })
            .collect();
        let mut f = File::create(&path).expect("create");
        write_gguf(&mut f, &meta, &part, 32).expect("write gguf");
        paths.push(path);
    }
    paths
}
