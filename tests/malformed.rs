//! Truncated and lying GGUFs: exit 2 with a message naming the file, the field and the offset.

mod common;
use common::*;
use std::io::Cursor;

use glmcheck::gguf::writer::{write_gguf, WriteTensor};
use glmcheck::gguf::{GgmlType, Value};

/// A small valid GGUF: 2 metadata entries, 2 F32 tensors.
fn small() -> Vec<u8> {
    let a: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let meta = vec![
        (
            "general.architecture".to_string(),
            Value::String("glm-dsa".into()),
        ),
        ("general.alignment".to_string(), Value::U32(32)),
    ];
    let tensors = vec![
        WriteTensor {
            name: "blk.0.attn_norm.weight".into(),
            ne: vec![64],
            dtype: GgmlType::F32,
            data: Some(&a),
        },
        WriteTensor {
            name: "blk.0.ffn_norm.weight".into(),
            ne: vec![64],
            dtype: GgmlType::F32,
            data: Some(&a),
        },
    ];
    let mut c = Cursor::new(Vec::new());
    write_gguf(&mut c, &meta, &tensors, 32).unwrap();
    c.into_inner()
}

/// Byte offsets in `small()`: after the 24-byte header come the kvs, then the tensor infos.
fn offsets(b: &[u8]) -> (usize, usize, usize) {
    let key1 = 24;
    let len = u64::from_le_bytes(b[key1..key1 + 8].try_into().unwrap()) as usize;
    let val1 = key1 + 8 + len + 4; // string value: u64 len + bytes
    let vlen = u64::from_le_bytes(b[val1..val1 + 8].try_into().unwrap()) as usize;
    let key2 = val1 + 8 + vlen;
    let len2 = u64::from_le_bytes(b[key2..key2 + 8].try_into().unwrap()) as usize;
    let tinfo = key2 + 8 + len2 + 4 + 4;
    (key1, val1, tinfo)
}

fn run_on(bytes: &[u8]) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.gguf");
    std::fs::write(&path, bytes).unwrap();
    // Within 2 s and 100 MiB of peak RSS, no panic.
    let out = glmcheck_bounded(&["inspect", path.to_str().unwrap()]);
    let err = stderr(&out);
    if out.status.code() == Some(2) {
        assert!(
            err.contains("bad.gguf"),
            "the message names the file: {err}"
        );
    }
    (out.status.code(), err)
}

fn expect_error(bytes: &[u8], needles: &[&str]) {
    let (code, err) = run_on(bytes);
    assert_eq!(code, Some(2), "exit 2 expected: {err}");
    for n in needles {
        assert!(err.contains(n), "message should contain {n:?}: {err}");
    }
}

#[test]
fn the_valid_file_is_valid() {
    // It parses: both tensors are listed with their shapes and bytes, and the only problems are
    // what a 2-tensor file lacks against GLM-5's default dims (a finding, exit 1), never a read
    // error.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.gguf");
    std::fs::write(&path, small()).unwrap();
    let out = glmcheck_bounded(&["inspect", path.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let tensors = r["tensors"].as_array().expect("tensors");
    assert_eq!(tensors.len(), 2);
    for t in tensors {
        assert_eq!(t["shape"], serde_json::json!([64]), "{t}");
        assert_eq!(t["bytes"], 256, "{t}");
        assert_eq!(t["dtype"], "F32", "{t}");
    }
    // No block_count key: the layer count comes from the tensors (one block), not a GLM-5 default.
    assert_eq!(r["config"]["num_hidden_layers"], 1);
    let problems = r["problems"].as_array().expect("problems");
    assert!(!problems.is_empty());
    assert!(
        problems
            .iter()
            .all(|p| p["kind"] == "missing" || p["kind"] == "wrong_shape"),
        "{problems:?}"
    );
}

#[test]
fn truncated_at_every_section_boundary_and_inside_each() {
    let b = small();
    let (key1, val1, tinfo) = offsets(&b);
    let data_start = b.len() - 2 * 256; // two 256-byte tensors at the end
    let cases: Vec<(usize, &str)> = vec![
        (0, "is empty"),
        (2, "header.magic"),
        (4, "header.version"),
        (8, "header.tensor_count"),
        (16, "header.metadata_kv_count"),
        (key1 + 3, "metadata[0].key"),
        (val1, "metadata `general.architecture`"),
        (tinfo, "tensor_info[0].name"),
        (tinfo + 8 + 22 + 2, "n_dims"),
        (tinfo + 8 + 22 + 4 + 3, "ne[0]"),
        (data_start + 10, "runs past the end"),
        (b.len() - 1, "runs past the end"),
    ];
    for (cut, field) in cases {
        let (code, err) = run_on(&b[..cut]);
        assert_eq!(code, Some(2), "cut at {cut}: {err}");
        assert!(
            err.contains(field),
            "cut at {cut}: expected {field:?} in: {err}"
        );
        // An empty file is named as such; every other cut names the byte offset.
        assert!(
            cut == 0 || err.contains("offset"),
            "cut at {cut}: names an offset: {err}"
        );
    }
}

#[test]
fn every_cut_of_the_file_exits_2_without_panicking() {
    let b = small();
    for cut in (0..b.len()).step_by(7) {
        let (code, err) = run_on(&b[..cut]);
        assert_eq!(code, Some(2), "cut at {cut}: {err}");
    }
}

#[test]
fn lying_counts_and_lengths() {
    let b = small();
    let (key1, val1, tinfo) = offsets(&b);
    let mut huge_tensors = b.clone();
    huge_tensors[8..16].copy_from_slice(&(1u64 << 63).to_le_bytes());
    expect_error(
        &huge_tensors,
        &["header.tensor_count", "9223372036854775808"],
    );

    let mut huge_kv = b.clone();
    huge_kv[16..24].copy_from_slice(&(u64::MAX).to_le_bytes());
    expect_error(&huge_kv, &["header.metadata_kv_count"]);

    let mut huge_key = b.clone();
    huge_key[key1..key1 + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    expect_error(
        &huge_key,
        &["metadata[0].key.length", "4611686018427387904"],
    );

    let mut huge_str = b.clone();
    huge_str[val1..val1 + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    expect_error(&huge_str, &["general.architecture", "length"]);

    let nd = tinfo + 8 + 22;
    let mut many_dims = b.clone();
    many_dims[nd..nd + 4].copy_from_slice(&100u32.to_le_bytes());
    expect_error(&many_dims, &["n_dims", "100 dimensions"]);

    let mut zero_dim = b.clone();
    zero_dim[nd + 4..nd + 12].copy_from_slice(&0u64.to_le_bytes());
    expect_error(&zero_dim, &["ne[0]", "zero-size"]);

    let mut huge_dim = b.clone();
    huge_dim[nd + 4..nd + 12].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_error(&huge_dim, &["runs past the end"]);

    let ty = nd + 12;
    let mut bad_type = b.clone();
    bad_type[ty..ty + 4].copy_from_slice(&77u32.to_le_bytes());
    expect_error(
        &bad_type,
        &["tensor_info[0]", ".type", "unknown GGML type id 77"],
    );

    let off = ty + 4;
    let mut past_eof = b.clone();
    past_eof[off..off + 8].copy_from_slice(&(1u64 << 20).to_le_bytes());
    expect_error(&past_eof, &["blk.0.attn_norm.weight", "runs past the end"]);

    let mut misaligned = b.clone();
    misaligned[off..off + 8].copy_from_slice(&4u64.to_le_bytes());
    expect_error(&misaligned, &["offset", "alignment"]);

    // The second tensor's info: point its data at the first one's.
    let t2 = off + 8;
    let off2 = t2 + 8 + 21 + 4 + 8 + 4;
    let mut overlap = b.clone();
    overlap[off2..off2 + 8].copy_from_slice(&0u64.to_le_bytes());
    expect_error(&overlap, &["overlaps"]);

    let mut dup = b.clone();
    dup[t2 + 8 + 6..t2 + 8 + 9].copy_from_slice(b"ttn"); // "blk.0.ffn_norm" -> "blk.0.ttnnorm"... keep length
                                                         // Make the second name equal to the first (different length): rebuild instead.
    let _ = dup;
    let a: Vec<u8> = vec![0; 256];
    let same = vec![
        WriteTensor {
            name: "x".into(),
            ne: vec![64],
            dtype: GgmlType::F32,
            data: Some(&a),
        },
        WriteTensor {
            name: "x".into(),
            ne: vec![64],
            dtype: GgmlType::F32,
            data: Some(&a),
        },
    ];
    let mut c = Cursor::new(Vec::new());
    write_gguf(&mut c, &[], &same, 32).unwrap();
    expect_error(&c.into_inner(), &["duplicate tensor name `x`"]);

    let mut magic = b.clone();
    magic[..4].copy_from_slice(b"GGML");
    expect_error(&magic, &["header.magic", "not a GGUF file"]);

    let mut version = b.clone();
    version[4..8].copy_from_slice(&3u32.to_be_bytes());
    expect_error(&version, &["header.version", "big-endian"]);

    let mut bad_align = b.clone();
    // general.alignment's value is the last 4 bytes of the kv section, just before the tensor infos.
    bad_align[tinfo - 4..tinfo].copy_from_slice(&48u32.to_le_bytes());
    expect_error(&bad_align, &["general.alignment", "power of two"]);
}

#[test]
fn metadata_of_the_wrong_type_for_a_known_key() {
    let meta = vec![
        (
            "general.architecture".to_string(),
            Value::String("glm-dsa".into()),
        ),
        (
            "glm-dsa.attention.head_count".to_string(),
            Value::String("sixty-four".into()),
        ),
    ];
    let mut c = Cursor::new(Vec::new());
    write_gguf(&mut c, &meta, &[], 32).unwrap();
    expect_error(
        &c.into_inner(),
        &[
            "glm-dsa.attention.head_count",
            "expected a non-negative integer",
            "string",
        ],
    );
}

#[test]
fn a_tiny_file_declaring_a_huge_tensor_exits_2_under_a_memory_limit() {
    // 1 KB file whose one F32 tensor claims 2^40 elements (4 TiB): must be refused from the header,
    // without allocating or mapping what it claims, even with 256 MiB of address space.
    let a: Vec<u8> = vec![0; 256];
    let t = vec![WriteTensor {
        name: "blk.0.attn_norm.weight".into(),
        ne: vec![64],
        dtype: GgmlType::F32,
        data: Some(&a),
    }];
    let mut c = Cursor::new(Vec::new());
    write_gguf(
        &mut c,
        &[(
            "general.architecture".to_string(),
            Value::String("glm-dsa".into()),
        )],
        &t,
        32,
    )
    .unwrap();
    let mut b = c.into_inner();
    // header 24 | key "general.architecture" (8 + 20) | type 4 | value "glm-dsa" (8 + 7) | tensor name
    // (8 + 22) | n_dims 4 | ne[0] …
    let tinfo = 24 + (8 + 20) + 4 + (8 + 7);
    let nd = tinfo + 8 + 22;
    b[nd + 4..nd + 12].copy_from_slice(&(1u64 << 40).to_le_bytes());
    b.resize(1024, 0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.gguf");
    std::fs::write(&path, &b).unwrap();
    let Ok(prlimit) = which("prlimit") else {
        panic!("prlimit (util-linux) is needed for this test");
    };
    let out = std::process::Command::new(prlimit)
        .arg("--as=268435456")
        .arg(env!("CARGO_BIN_EXE_glmcheck"))
        .args(["inspect", path.to_str().unwrap()])
        .output()
        .expect("run under prlimit");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("runs past the end"), "{err}");
    assert!(
        !err.contains("panicked") && !err.contains("memory allocation"),
        "{err}"
    );
}

fn which(cmd: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(cmd))
        .find(|p| p.is_file())
        .ok_or(())
}

#[test]
/// The signal lands mid-forward, before any write: exit 130 and no report. (That a write in flight
/// is removed is tested where the temp file can be caught: src/outputs.rs
/// `an_interrupt_mid_write_removes_the_temp_file`.)
fn ctrl_c_mid_forward_exits_130_and_writes_no_report() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny/tiny-F32.gguf");
    // A long greedy continuation keeps the process busy well past the signal.
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_glmcheck"))
        .args([
            "forward",
            gguf.to_str().unwrap(),
            "--tokens",
            "294,266,220,17",
            "--max-new-tokens",
            "2000",
            "-q",
        ])
        .arg("--report")
        .arg(&report)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    std::thread::sleep(std::time::Duration::from_millis(700));
    let killed = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let out = child.wait_with_output().expect("wait");
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "an interrupted run left {left:?}");
}
