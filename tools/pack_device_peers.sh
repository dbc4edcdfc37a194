#!/usr/bin/env bash
# Here (not on the GPU machine): prepares the peers that tools/device_gpu_bench.sh needs on a machine
# with no network, under target-cuda/bin/ (ignored; carried to the device with the glmcheck binary).
#   target-cuda/bin/transformers-5.23.0-py3-none-any.whl   (installed there with pip --no-deps --target)
#   target-cuda/bin/huggingface_hub-1.33.0-py3-none-any.whl  (fallback only: installed beside it when the
#                                      image's huggingface_hub is older than 5.23's floor, >=1.31.0)
#   target-cuda/bin/llama.cpp.tar.xz   the llama.cpp that llama-cpp-python==0.3.36 vendors, trimmed to
#                                      what CMake needs to configure and build `llama-bench` (no models/,
#                                      docs/, tests/, examples/, server/UI, unused ggml backends)
# Usage: tools/pack_device_peers.sh [WHEEL_DIR] [SDIST_DIR]
#   WHEEL_DIR holds transformers-5.23.0-py3-none-any.whl (default /work/scratch/wheels; else downloaded)
#   SDIST_DIR holds llama_cpp_python-0.3.36.tar.gz (default /work/scratch/dl; else downloaded). The sdist
#   download needs `--no-build-isolation` with scikit-build-core + cmake importable, or pip builds cmake
#   from source to prepare its metadata: `pip install --target /tmp/sbc scikit-build-core cmake ninja`,
#   then `PATH=/tmp/sbc/bin:$PATH PYTHONPATH=/tmp/sbc pip download --no-binary :all: --no-deps
#   --no-build-isolation llama-cpp-python==0.3.36 -d SDIST_DIR`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
wheels=${1:-/work/scratch/wheels}; sdists=${2:-/work/scratch/dl}
bin=$root/target-cuda/bin; mkdir -p "$bin" "$wheels" "$sdists"
whl=transformers-5.23.0-py3-none-any.whl
[ -f "$wheels/$whl" ] || pip download --no-deps --only-binary=:all: transformers==5.23.0 -d "$wheels"
cp "$wheels/$whl" "$bin/$whl"
hub=huggingface_hub-1.33.0-py3-none-any.whl
[ -f "$wheels/$hub" ] || pip download --no-deps --only-binary=:all: huggingface_hub==1.33.0 -d "$wheels"
cp "$wheels/$hub" "$bin/$hub"
sd=$sdists/llama_cpp_python-0.3.36.tar.gz
[ -f "$sd" ] || { echo "missing $sd (see the header of this script)"; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar -xzf "$sd" -C "$tmp" llama_cpp_python-0.3.36/vendor/llama.cpp
src=$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp
( cd "$src"
  # Not needed to configure with -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  # -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF, nor to build llama-bench (.git: a submodule pointer
  # to a parent repo that is not there; build-info then says "unknown").
  rm -rf models docs tests examples pocs benches media gguf-py conversion skills ci requirements grammars \
         scripts app .github .devops .git tools/ui tools/server vendor/miniaudio/miniaudio.h \
         tools/mtmd/test-* tools/mtmd/tests tools/mtmd/legacy-models convert_*.py
  # ggml backends are add_subdirectory'd only when enabled (GGML_<NAME>=ON): keep CPU and CUDA.
  for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
    rm -rf "ggml/src/ggml-$b"
  done )
tar -C "$(dirname "$src")" -cf - llama.cpp | xz -9e -T2 > "$bin/llama.cpp.tar.xz"
ls -la "$bin"
