//! With `--features cuda`: compiles `cuda/moe_mmq.cu` (glmcheck's grouped MoE kernel over
//! llama.cpp's MMQ tiles, as vendored in candle-kernels) and `cuda/dequant_experts.cu` (the active
//! experts of a stack decoded in one launch by candle-kernels' own dequantize kernels) and
//! `cuda/dequant_gemm.cu` (dequant mode's tiled kernel: blocks decoded in shared memory and
//! multiplied there) and `cuda/q8_moe.cu` (q8 mode's experts on int8 tensor cores, fragments built
//! from the raw blocks) and `cuda/rope.cu` (RoPE with transformers' per-op roundings) and
//! `cuda/q8_quantize.cu` (q8 mode's Q8_1 quantizer reading bf16) and `cuda/fused.cu` (the fused
//! masked softmax, MoE combine and MLA keys/values) and `cuda/dequant_wgmma.cu` (dequant mode's
//! dense matmuls of many tokens on Hopper's wgmma) with nvcc into a static library.
//! Without the feature this does nothing: CI and the README's commands never need nvcc.
//!
//! Environment: `CUDA_COMPUTE_CAP` (default 90), nvcc from `$CUDA_HOME/bin` or `PATH`, and
//! `GLMCHECK_MMQ_INCLUDE` to point at candle-kernels' `src/mmq_gguf` when it is not in cargo's
//! registry (a vendored build). tools/build-cuda.sh sets the first two.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda/moe_mmq.cu");
    println!("cargo::rerun-if-changed=cuda/dequant_experts.cu");
    println!("cargo::rerun-if-changed=cuda/dequant_gemm.cu");
    println!("cargo::rerun-if-changed=cuda/q8_moe.cu");
    println!("cargo::rerun-if-changed=cuda/rope.cu");
    println!("cargo::rerun-if-changed=cuda/q8_quantize.cu");
    println!("cargo::rerun-if-changed=cuda/fused.cu");
    println!("cargo::rerun-if-changed=cuda/dequant_wgmma.cu");
    println!("cargo::rerun-if-changed=cuda/elementwise.cuh");
    println!("cargo::rerun-if-changed=cuda/gguf_blocks.cuh");
    println!("cargo::rerun-if-changed=cuda/dq_decode.cuh");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=GLMCHECK_MMQ_INCLUDE");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    if let Err(e) = build_moe_kernel() {
        panic!("building glmcheck's CUDA kernels (cuda/*.cu): {e}");
    }
}

fn build_moe_kernel() -> Result<(), String> {
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let include = mmq_include()?;
    let cap = env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    // Both compile at once (the MMQ file takes minutes on two cores). dequant_experts.cu includes
    // candle-kernels' src/quantized.cu, the directory above src/mmq_gguf.
    let kernels_src = include.parent().unwrap_or(&include).to_path_buf();
    let sources = [
        ("cuda/moe_mmq.cu", &include),
        ("cuda/dequant_experts.cu", &kernels_src),
        ("cuda/dequant_gemm.cu", &kernels_src),
        ("cuda/q8_moe.cu", &kernels_src),
        ("cuda/rope.cu", &kernels_src),
        ("cuda/q8_quantize.cu", &kernels_src),
        ("cuda/fused.cu", &kernels_src),
        ("cuda/dequant_wgmma.cu", &kernels_src),
    ];
    let mut jobs = Vec::new();
    for (src, inc) in sources {
        let stem = Path::new(src).file_stem().unwrap_or_default();
        let obj = out.join(stem).with_extension("o");
        let child = Command::new(&nvcc)
            .args(["-c", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
            .args(arch_args(src, &cap))
            .args(["-Xcompiler", "-fPIC", "-w"])
            .arg("-I")
            .arg(inc)
            .arg(src)
            .arg("-o")
            .arg(&obj)
            .spawn()
            .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
        jobs.push((src, obj, child));
    }
    let mut objs = Vec::new();
    for (src, obj, mut child) in jobs {
        let status = child.wait().map_err(|e| format!("nvcc on {src}: {e}"))?;
        if !status.success() {
            return Err(format!("{} failed on {src} ({status})", nvcc.display()));
        }
        objs.push(obj);
    }
    let lib = out.join("libglmcheck_moe.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .args(&objs)
        .status()
        .map_err(|e| format!("running ar: {e}"))?;
    if !status.success() {
        return Err(format!("ar failed ({status})"));
    }
    println!("cargo::rustc-link-search=native={}", out.display());
    println!("cargo::rustc-link-lib=static=glmcheck_moe");
    println!("cargo::rustc-link-lib=dylib=cudart");
    println!("cargo::rustc-link-lib=dylib=stdc++");
    Ok(())
}

/// nvcc's target for `src`: `sm_<cap>`, except the wgmma kernel on compute capability 9.0, which
/// needs the arch-specific sm_90a (wgmma has no sm_90 encoding) and is told so (`GLMCHECK_WGMMA`;
/// elsewhere its launcher answers "no kernel").
fn arch_args(src: &str, cap: &str) -> Vec<String> {
    if src.ends_with("dequant_wgmma.cu") && cap == "90" {
        vec![
            "-gencode=arch=compute_90a,code=sm_90a".into(),
            "-DGLMCHECK_WGMMA".into(),
        ]
    } else {
        vec![format!("-arch=sm_{cap}")]
    }
}

/// candle-kernels' `src/mmq_gguf`, of the version Cargo.lock pins, in cargo's registry.
fn mmq_include() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("GLMCHECK_MMQ_INCLUDE") {
        return Ok(PathBuf::from(dir));
    }
    let lock = std::fs::read_to_string("Cargo.lock").map_err(|e| format!("Cargo.lock: {e}"))?;
    let version = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-kernels\""))
        .and_then(|p| p.lines().find_map(|l| l.strip_prefix("version = \"")))
        .map(|v| v.trim_end_matches('"').to_string())
        .ok_or("no candle-kernels in Cargo.lock")?;
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))
        .ok_or("neither CARGO_HOME nor HOME is set")?;
    let registry = cargo_home.join("registry/src");
    let entries =
        std::fs::read_dir(&registry).map_err(|e| format!("{}: {e}", registry.display()))?;
    for entry in entries.flatten() {
        let dir = entry
            .path()
            .join(format!("candle-kernels-{version}/src/mmq_gguf"));
        if dir.join("mmq_gguf.cuh").exists() {
            return Ok(dir);
        }
    }
    Err(format!(
        "candle-kernels {version}'s src/mmq_gguf not under {}; set GLMCHECK_MMQ_INCLUDE",
        registry.display()
    ))
}
