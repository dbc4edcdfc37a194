#!/usr/bin/env bash
# On a GPU machine: the CUDA forward against the CPU forward of the same binary on the fixtures
# (issue 12's "CUDA f32 equals CPU to <= 1e-5 rel-L2 per module"), the HF reference, and simulated TP.
# Usage: tools/device_fixture_check.sh BINARY OUTDIR
# Env: PACK (a file path, e.g. $OUT/fix.tar.xz of the device tool): OUTDIR packed into it at exit, its
# dumps left out (the device tool returns a limited count of files; this script writes ~70).
set -uo pipefail
B="$1"; OUT="$2"; mkdir -p "$OUT"
if [ -n "${PACK:-}" ]; then
  trap 'tar -C "$(dirname "$OUT")" --exclude="*.safetensors" -cJf "$PACK" "$(basename "$OUT")"' EXIT
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-/usr/local/cuda-13.0/targets/x86_64-linux/lib}"
P0=294,266,220,17,10,17,30,220,468,478,68,286,262,414,13,278,286,266
F=fixtures/tiny/tiny-F32.gguf
REF=fixtures/tiny/activations/prompt0.safetensors
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
run() { local name="$1"; shift; "$B" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"; echo "$name rc=$?" >> "$OUT/rc.txt"; }
run cpu forward "$F" --tokens "$P0" --device cpu --max-new-tokens 4 --dump "$OUT/cpu.safetensors" --json
run cuda forward "$F" --tokens "$P0" --device cuda --max-new-tokens 4 --dump "$OUT/cuda.safetensors" --json
run diff-cpu-cuda diff "$OUT/cpu.safetensors" "$OUT/cuda.safetensors" --rel-l2 1e-5 --json
run cuda-ref forward "$F" --tokens "$P0" --device cuda --reference "$REF" --max-new-tokens 0 --json
run cuda-bf16-ref forward "$F" --tokens "$P0" --device cuda --dtype bf16 --reference "$REF" --max-new-tokens 0 --json
run cuda-tp8 forward "$F" --tokens "$P0" --device cuda --tp 8 --max-new-tokens 0 --json
run cuda-q4-ref forward fixtures/tiny/tiny-Q4_K_M.gguf --tokens "$P0" --device cuda --reference "$REF" --max-new-tokens 0 --json
# The quantized fixtures: weights stay as blocks on the GPU. dequant mode equals the CPU to 1e-5;
# q8 mode (CUDA: MMVQ/MMQ; the fixtures' experts, 128 wide, stay per expert: the grouped MoE
# kernel needs inputs in multiples of 256) against the CPU's dequant dump.
for q in Q4_K_M Q8_0; do
  G=fixtures/tiny/tiny-$q.gguf
  run cpu-$q forward "$G" --tokens "$P0" --device cpu --max-new-tokens 0 --dump "$OUT/cpu-$q.safetensors" --json
  run cuda-$q forward "$G" --tokens "$P0" --device cuda --max-new-tokens 0 --dump "$OUT/cuda-$q.safetensors" --json
  run diff-cpu-cuda-$q diff "$OUT/cpu-$q.safetensors" "$OUT/cuda-$q.safetensors" --rel-l2 1e-5 --json
  run cuda-q8-$q forward "$G" --tokens "$P0" --device cuda --matmul q8 --reference "$OUT/cpu-$q.safetensors" --max-new-tokens 0 --json
  run cuda-q8-$q-ref forward "$G" --tokens "$P0" --device cuda --matmul q8 --reference "$REF" --max-new-tokens 0 --json
done
rm -f "$OUT"/cpu-Q*.safetensors "$OUT"/cuda-Q*.safetensors
run cuda-bench forward "$F" --tokens "$P0" --device cuda --max-new-tokens 0 --bench 20 --json
run cpu-bench forward "$F" --tokens "$P0" --device cpu --max-new-tokens 0 --bench 20 --json
cat "$OUT/rc.txt"
