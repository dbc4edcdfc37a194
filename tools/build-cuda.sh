#!/usr/bin/env bash
# Builds glmcheck with `--features cuda` on a machine WITHOUT a GPU or a CUDA install, for an
# NVIDIA H200 (compute capability 9.0) whose driver speaks CUDA 13.0.
#
#   tools/build-cuda.sh                 # → target-cuda/release/glmcheck
#   CUDA_COMPUTE_CAP=80 tools/build-cuda.sh   # another GPU generation
#   tools/build-cuda.sh --tests         # also the unit tests (prints their binary)
#
# What it does (known to work with candle 0.11.1 / cudarc 0.19):
#  1. a venv with NVIDIA's CUDA 13.0 PyPI wheels (nvcc, runtime, crt, nvvm, cccl, cublas, nvrtc,
#     curand); they unpack into one `nvidia/cu13/` tree that serves as CUDA_HOME. Pinned to 13.0:
#     PTX from a newer nvcc does not load on a 13.0 driver.
#  2. a link directory of unversioned symlinks to the wheels' `.so.13` files, plus a stub
#     `libcuda.so` (soname libcuda.so.1) with one empty function per `cu*` driver symbol cudarc
#     references (`nm -u` on its rlib): the real libcuda comes from the GPU machine's driver.
#  3. cargo build --release --features cuda into target-cuda/ (a cold build takes ~14 min on 2 cores).
#
# On the GPU machine run the binary with the driver's libcuda and the toolkit's libraries:
#   LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib ./glmcheck forward … --device cuda
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${GLMCHECK_CUDA_VENV:-$HOME/venvs/cuda13}"
target="${CARGO_TARGET_DIR:-$root/target-cuda}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"

if [ ! -x "$venv/bin/nvcc-ok" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet \
        'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-crt==13.0.*' \
        'nvidia-nvvm==13.0.*' 'nvidia-cuda-cccl==13.0.*' 'nvidia-cublas==13.0.*' \
        'nvidia-cuda-nvrtc==13.0.*' 'nvidia-curand'
    printf '#!/bin/sh\n' > "$venv/bin/nvcc-ok" && chmod +x "$venv/bin/nvcc-ok"
fi
cu="$(echo "$venv"/lib/python3*/site-packages/nvidia/cu13)"
[ -x "$cu/bin/nvcc" ] || { echo "no nvcc under $cu" >&2; exit 2; }
export CUDA_HOME="$cu" CUDA_PATH="$cu" PATH="$cu/bin:$PATH"
# nvcc finds cicc under nvvm/bin and the crt headers next to its own include dir.
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$cu/include"

links="$target/cuda-link"
mkdir -p "$links"
for lib in cudart cublas cublasLt nvrtc; do
    ln -sf "$cu/lib/lib$lib.so.13" "$links/lib$lib.so"
done
ln -sf "$(ls "$cu"/lib/libcurand.so.* | head -1)" "$links/libcurand.so"

export CARGO_TARGET_DIR="$target"
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$links"
export LIBRARY_PATH="$links${LIBRARY_PATH:+:$LIBRARY_PATH}"

# The stub libcuda needs the symbols cudarc uses: build the dependencies first (the final link of
# glmcheck may fail without it), then write the stub and build again.
if [ ! -f "$links/libcuda.so" ]; then
    cargo build --release --features cuda --manifest-path "$root/Cargo.toml" 2>/dev/null || true
    rlib="$(ls -t "$target"/release/deps/libcudarc-*.rlib | head -1)"
    syms="$(nm -u "$rlib" 2>/dev/null | awk '$1 == "U" && $2 ~ /^cu[A-Z]/ {print $2}' | sort -u)"
    [ -n "$syms" ] || { echo "no cu* symbols in $rlib" >&2; exit 2; }
    stub="$links/libcuda_stub.c"
    : > "$stub"
    for s in $syms; do echo "void $s(void) {}" >> "$stub"; done
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$links/libcuda.so" "$stub"
fi
cargo build --release --features cuda --manifest-path "$root/Cargo.toml"
echo "$target/release/glmcheck"
# --tests: also the library's unit tests with the feature (the kernels against candle's decoders),
# built here and run on the GPU machine (they skip without a device); prints the test binary.
if [ "${1:-}" = "--tests" ]; then
    cargo test --release --features cuda --lib --no-run --manifest-path "$root/Cargo.toml" \
        --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])'
fi
