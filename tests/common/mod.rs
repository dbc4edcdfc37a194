//! Shared helpers for the integration tests: fixture paths, the binary, checksums, GGUF building.
#![allow(dead_code)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use glmcheck::arch::glm_dsa::{self, Idx, Scope};
use glmcheck::arch::Config;
use glmcheck::gguf::writer::{string_array, write_gguf, WriteTensor};
use glmcheck::gguf::{GgmlType, GgufModel, Value};
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

/// A run of the binary with its wall time and peak resident memory (from `wait4`'s rusage: the
/// child's own maximum RSS, not the test process's).
pub struct Measured {
    pub out: Output,
    pub wall: std::time::Duration,
    pub max_rss_mib: f64,
}

/// Malformed-input budget (issue 3): every case ends within this many seconds …
pub const MAX_SECONDS: f64 = 2.0;
/// … and this peak RSS.
pub const MAX_RSS_MIB: f64 = 100.0;

// The child is reaped by `wait4` below (std's `wait` would not return its rusage).
#[allow(clippy::zombie_processes)]
pub fn glmcheck_measured(args: &[&str]) -> Measured {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let start = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_glmcheck"))
        .args(args)
        .env("NO_COLOR", "1")
        .env("GLMCHECK_PEAK_RSS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run glmcheck");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            r.read_to_end(&mut v).expect("read child output");
            v
        })
    };
    let so = drain(Box::new(child.stdout.take().expect("stdout")));
    let se = drain(Box::new(child.stderr.take().expect("stderr")));
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: plain syscall on our own child; `rusage` is plain old data, zeroed is valid.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let got = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(got, pid, "wait4: {}", std::io::Error::last_os_error());
    let wall = start.elapsed();
    let stderr = se.join().expect("stderr thread");
    // The child's own peak (VmHWM, printed at exit with GLMCHECK_PEAK_RSS): wait4's ru_maxrss
    // would include this test process's peak, which a spawned child inherits on Linux. A run that
    // dies before printing it (a panic, a signal) falls back to ru_maxrss, an upper bound.
    let text = String::from_utf8_lossy(&stderr);
    let own_kib = text
        .lines()
        .find_map(|l| l.strip_prefix("glmcheck: peak RSS "))
        .and_then(|v| v.trim_end_matches(" KiB").parse::<i64>().ok());
    let kib = own_kib.unwrap_or(usage.ru_maxrss);
    // A measurement of zero would make every bound pass: any real process maps more than this.
    assert!(kib > 512, "implausible peak RSS {kib} KiB");
    Measured {
        out: Output {
            status: std::process::ExitStatus::from_raw(status),
            stdout: so.join().expect("stdout thread"),
            stderr,
        },
        wall,
        max_rss_mib: kib as f64 / 1024.0,
    }
}

/// Runs the binary on a malformed input and checks the budget: no panic, within [`MAX_SECONDS`] and
/// [`MAX_RSS_MIB`].
pub fn glmcheck_bounded(args: &[&str]) -> Output {
    let m = glmcheck_measured(args);
    let err = stderr(&m.out);
    assert!(!err.contains("panicked"), "panic: {args:?}: {err}");
    assert!(
        m.wall.as_secs_f64() < MAX_SECONDS,
        "{args:?} took {:.2} s: {err}",
        m.wall.as_secs_f64()
    );
    assert!(
        m.max_rss_mib < MAX_RSS_MIB,
        "{args:?} peaked at {:.1} MiB RSS: {err}",
        m.max_rss_mib
    );
    m.out
}

/// Copies the safetensors file `src` to `dst` (the same path is fine) with `edit` applied to each
/// tensor's name, dtype, shape and bytes; tensors for which `edit` returns false are dropped. The
/// header's metadata is kept.
pub fn rewrite_safetensors(
    src: &Path,
    dst: &Path,
    mut edit: impl FnMut(&str, &mut safetensors::Dtype, &mut Vec<usize>, &mut Vec<u8>) -> bool,
) {
    let bytes = std::fs::read(src).expect("read safetensors");
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).expect("header");
    let metadata = header.metadata().clone();
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("deserialize");
    let mut owned = Vec::new();
    for (name, view) in st.tensors() {
        let (mut dtype, mut shape, mut data) =
            (view.dtype(), view.shape().to_vec(), view.data().to_vec());
        if edit(&name, &mut dtype, &mut shape, &mut data) {
            owned.push((name, dtype, shape, data));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, metadata, dst).expect("write safetensors");
}

/// The token ids of fixtures/tiny/activations/prompt0.safetensors.
pub const PROMPT0_IDS: &str = "294,266,220,17,10,17,30,220,468,478,68,286,262,414,13,278,286,266";

/// `forward MODEL --tokens <prompt0> --reference REFERENCE --max-new-tokens 0 --json EXTRA…`:
/// the exit code and the JSON.
pub fn forward_prompt0(
    model: &Path,
    reference: &Path,
    extra: &[&str],
) -> (Option<i32>, serde_json::Value) {
    let mut args = vec![
        "forward",
        path_str(model),
        "--tokens",
        PROMPT0_IDS,
        "--reference",
        path_str(reference),
        "--max-new-tokens",
        "0",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = glmcheck(&args);
    (out.status.code(), json_of(&out))
}

/// A path as a command-line argument.
pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The command's stdout as JSON (the panic shows both streams).
pub fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(out), stderr(out)))
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

/// Writes `model` as one file at `out`, every metadata value passed through `meta` and every
/// tensor's (type, bytes) through `tensor` (the tensor's name, type and bytes in, what to write out).
pub fn write_edited(
    model: &GgufModel,
    out: &Path,
    meta: impl Fn(&str, &Value) -> Value,
    tensor: impl Fn(&str, GgmlType, &[u8]) -> (GgmlType, Vec<u8>),
) {
    let kvs: Vec<(String, Value)> = model
        .metadata()
        .iter()
        .map(|e| (e.key.clone(), meta(&e.key, &e.value)))
        .collect();
    let edited: Vec<_> = model
        .tensors()
        .map(|t| {
            let (dtype, data) = tensor(&t.info.name, t.info.dtype, t.bytes());
            (t, dtype, data)
        })
        .collect();
    let tensors: Vec<WriteTensor> = edited
        .iter()
        .map(|(t, dtype, data)| WriteTensor {
            name: t.info.name.clone(),
            ne: t.info.ne.clone(),
            dtype: *dtype,
            data: Some(data),
        })
        .collect();
    let mut f = File::create(out).expect("create");
    write_gguf(&mut f, &kvs, &tensors, 32).expect("write gguf");
}

/// Writes a sparse GGUF with GLM-5's real tensor list and metadata (no tensor data).
pub fn write_real_dims(path: &std::path::Path, big: GgmlType) {
    let c = Config::glm5();
    let mut tensors = Vec::new();
    let mut add = |name: String, shape: Vec<usize>| {
        let ne: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let dtype = if shape.len() == 1 || !ne[0].is_multiple_of(big.block_size) {
            GgmlType::F32
        } else {
            big
        };
        tensors.push(WriteTensor {
            name,
            ne,
            dtype,
            data: None,
        });
    };
    // The decoder layers and the MTP layer GLM-5 files carry as blk.78: a full MoE layer plus its
    // nextn tensors (inventoried and shape-checked, never run).
    for layer in std::iter::once(None).chain((0..c.gguf_block_count()).map(Some)) {
        for d in glm_dsa::HF_TABLE {
            let applies = match layer {
                None => d.scope == Scope::Global,
                Some(l) => d.scope.has_layer(&c, l),
            };
            if applies {
                for s in d.gguf {
                    add(
                        glm_dsa::name(
                            s.name,
                            Idx {
                                layer,
                                expert: None,
                            },
                        ),
                        glm_dsa::resolve(s.shape, &c),
                    );
                }
            }
        }
    }
    add("blk.78.nextn.eh_proj.weight".into(), vec![6144, 12288]);
    for n in ["enorm", "hnorm", "shared_head_norm"] {
        add(format!("blk.78.nextn.{n}.weight"), vec![6144]);
    }
    let u = |v: usize| Value::U32(v as u32);
    let k = |s: &str| format!("glm-dsa.{s}");
    let meta: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("glm-dsa".into()),
        ),
        (k("block_count"), u(79)),
        (k("nextn_predict_layers"), u(1)),
        (k("context_length"), u(202752)),
        (k("embedding_length"), u(6144)),
        (k("feed_forward_length"), u(12288)),
        (k("attention.head_count"), u(64)),
        (k("attention.head_count_kv"), u(1)),
        (k("attention.q_lora_rank"), u(2048)),
        (k("attention.kv_lora_rank"), u(512)),
        (k("attention.key_length"), u(576)),
        (k("attention.value_length"), u(512)),
        (k("attention.key_length_mla"), u(256)),
        (k("attention.value_length_mla"), u(256)),
        (k("rope.dimension_count"), u(64)),
        (k("rope.freq_base"), Value::F32(1e6)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (k("leading_dense_block_count"), u(3)),
        (k("expert_count"), u(256)),
        (k("expert_used_count"), u(8)),
        (k("expert_shared_count"), u(1)),
        (k("expert_feed_forward_length"), u(2048)),
        (k("expert_weights_scale"), Value::F32(2.5)),
        (k("expert_weights_norm"), Value::Bool(true)),
        (k("expert_group_count"), u(1)),
        (k("expert_group_used_count"), u(1)),
        (k("expert_gating_func"), u(2)),
        (k("attention.indexer.head_count"), u(32)),
        (k("attention.indexer.key_length"), u(128)),
        (k("attention.indexer.top_k"), u(2048)),
        (k("vocab_size"), u(154880)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("glm4".into())),
        (
            "tokenizer.ggml.tokens".into(),
            string_array(&(0..154880).map(|i| format!("t{i}")).collect::<Vec<_>>()),
        ),
    ];
    let mut f = File::create(path).unwrap();
    write_gguf(&mut f, &meta, &tensors, 32).unwrap();
}
