#!/usr/bin/env bash
# The CPU forward of a real-dimension GLM-5 file against the GPU forward of the same file (issue 12:
# "on this 2-core CPU machine, forward of a 2-layer synth model ... matches the GPU forward").
# The file is never carried: both machines write it with the same `synth` command (fixed seed), and
# its sha256 on each side is kept beside the result.
#   here:   tools/device_cpu_gpu_check.sh prepare MODEL DIR
#           (MODEL: `glmcheck synth --dims glm5 --layers 2 --dense 1 --qtype q4_k_m`; ~1 min on 2 cores)
#           writes DIR/cpu-2l.safetensors.xz (the CPU's f32 dump of tokens 1000..1015, its `lm_head`
#           key dropped: the same tensor as `logits`, and the device call's 64 MiB would not hold both)
#           and DIR/sha.txt. DIR must be a carried path, e.g. target-cuda/cpu2l.
#   device: tools/device_cpu_gpu_check.sh run GLMCHECK OUTDIR DIR
#           synthesizes the same file, records its sha256, runs `forward --device cuda` (f32) with
#           --reference the CPU's dump; packs OUTDIR into $OUT/x.tar.xz.
#   then:   tools/cpu_glm5_memory.sh MODEL OUTDIR   (adds the comparison to reports/cpu-glm5.*)
set -uo pipefail
toks=$(seq -s, 1000 1015)
case "${1:-}" in
prepare)
  model=$2; dir=$3; mkdir -p "$dir"; bin=target/release/glmcheck
  [ -x "$bin" ] || cargo build --release --quiet
  "$bin" forward "$model" --tokens "$toks" --max-new-tokens 0 --dump "$dir/full.safetensors" --json > "$dir/cpu.json" || exit 2
  python3 - "$dir/full.safetensors" "$dir/cpu-2l.safetensors" <<'PY'
import json, struct, sys
src, dst = sys.argv[1:]
f = open(src, "rb"); n = struct.unpack("<Q", f.read(8))[0]; head = json.loads(f.read(n)); data = f.read()
out, parts, off = {}, [], 0
for k, v in head.items():
    if k == "lm_head":
        continue
    if k != "__metadata__":
        a, b = v["data_offsets"]; parts.append(data[a:b]); v = dict(v, data_offsets=[off, off + b - a]); off += b - a
    out[k] = v
h = json.dumps(out).encode(); h += b" " * (-len(h) % 8)
with open(dst, "wb") as g:
    g.write(struct.pack("<Q", len(h))); g.write(h); [g.write(p) for p in parts]
PY
  rm -f "$dir/full.safetensors" "$dir/cpu-2l.safetensors.xz"; xz -T2 -6 "$dir/cpu-2l.safetensors"
  sha256sum "$model" > "$dir/sha.txt"; ls -la "$dir" ;;
run)
  bin=$(readlink -f "$2"); out=$3; dir=$(readlink -f "$4"); w=/tmp/cpugpu
  mkdir -p "$out" "$w"; out=$(readlink -f "$out")
  export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
  trap 'tar -C "$(dirname "$out")" -cJf "${OUT:-/tmp}/x.tar.xz" "$(basename "$out")"' EXIT
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
  "$bin" synth --dims glm5 --layers 2 --dense 1 --qtype q4_k_m --out "$w/m2.gguf" --force -q > "$out/synth2.log" 2>&1
  sha256sum "$w/m2.gguf" > "$out/sha-gpu.txt"; cp "$dir/sha.txt" "$out/sha-cpu.txt"
  xz -dc "$dir/cpu-2l.safetensors.xz" > "$w/cpu-2l.safetensors"
  "$bin" forward "$w/m2.gguf" --tokens "$toks" --device cuda --max-new-tokens 0 \
    --reference "$w/cpu-2l.safetensors" --json > "$out/gpu2l-f32-vs-cpu.json" 2> "$out/gpu2l-f32-vs-cpu.log"
  echo "forward rc=$?" >> "$out/rc.txt"; cat "$out/rc.txt" ;;
*) echo "usage: $0 prepare MODEL DIR | run GLMCHECK OUTDIR DIR" >&2; exit 2 ;;
esac
