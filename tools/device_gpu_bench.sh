#!/usr/bin/env bash
# On the GPU machine (H200, no network): glmcheck's CUDA forward against its peers on the same
# GLM-5-sized model, in two device calls (each under the 600 s limit, each self-sufficient).
#   A: synth (3-layer GLM-5 Q4_K_M, ~100 s) -> export to HF bf16 (~45 GB) -> transformers 5.23 bench
#      at 16 and 256 tokens (+ device copy bandwidth, + hook dump of the 16-token forward)
#      -> glmcheck forward --reference <that dump> (module-by-module agreement, logits KL)
#   B: llama.cpp build (background, nice) || synth -> glmcheck forward --bench 5 for --matmul
#      dequant|q8 at 16 and 256 tokens -> glmcheck dequant --device cuda --repeat 5 -> llama-bench
#   AB: both, one after the other (only where one call may run ~15 minutes)
#   Q: synth, B's glmcheck forwards, then A (no llama.cpp, no dequant throughput): glmcheck against
#      transformers in one call (~6 min on an H200), when device time is short; A's module
#      agreement comes last, so a short GPU_BENCH_DEADLINE drops it first
# Reuses what a previous phase left in the work dir when the machine was still warm (markers *.done).
# Usage: tools/device_gpu_bench.sh GLMCHECK OUTDIR A|B|AB
#   results: OUTDIR/*.json, *.log, times.txt; packed at exit (also on failure) into $PACK
#   (default $OUT/x.tar.xz when OUT is set, else OUTDIR.tar.xz). OUTDIR must not be under $OUT.
# Env: GPU_BENCH_A_BUILD=1 (phase A also starts the llama.cpp build, left running for a B on a warm
#      machine; default off), GPU_BENCH_WORK (default /tmp/gpub), GPU_BENCH_DEADLINE (s from start, default 540),
#      PEERS (dir with the wheels and llama.cpp.tar.xz, default target-cuda/bin), GLMCHECK_COMMIT,
#      GPU_BENCH_HF_DIR (where the export goes; default WORK/hf, or /dev/shm/gpub-hf if WORK lacks 50 GB).
#   For a dry run of the flow on a machine without a GPU (nothing measured): GPU_BENCH_MODEL (an
#   existing GGUF instead of synth), GPU_BENCH_HF (an existing HF dir instead of the export),
#   GPU_BENCH_DEVICE=cpu, GPU_BENCH_TOKEN_START (default 1000), GPU_BENCH_LLAMA_CUDA=OFF.
set -uo pipefail
bin=$(readlink -f "$1"); out=$2; phase=${3:-A}
mkdir -p "$out"; out=$(readlink -f "$out")
repo=$(pwd)
work=${GPU_BENCH_WORK:-/tmp/gpub}; mkdir -p "$work"
peers=$(readlink -f "${PEERS:-target-cuda/bin}")
pack=${PACK:-${OUT:+$OUT/x.tar.xz}}; pack=${pack:-$out.tar.xz}
T0=$(date +%s); DEADLINE=${GPU_BENCH_DEADLINE:-540}; RESERVE=15
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
model=${GPU_BENCH_MODEL:-$work/m.gguf}; hfdump=$work/hf-16.safetensors
dev=${GPU_BENCH_DEVICE:-cuda}; ts=${GPU_BENCH_TOKEN_START:-1000}
t16=$(seq -s, "$ts" $((ts + 15))); t256=$(seq -s, "$ts" $((ts + 255)))
tf=/tmp/tf523; py=${GPU_BENCH_PYTHON:-python3}

stamp() { echo "$(date +%s.%N) $*" >> "$out/times.txt"; }
left() { echo $(( DEADLINE - RESERVE - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); if [ "$1" -lt "$l" ]; then echo "$1"; else echo "$l"; fi; }
finish() {
  if [ "$phase" = A ] && [ "${GPU_BENCH_A_BUILD:-0}" = 1 ] && lb_running; then
    lb_signal CONT; echo "llama-build left running (setsid) for a phase B on this machine while warm" >> "$out/times.txt"
  elif lb_running; then lb_signal CONT; lb_signal TERM; fi
  stamp "end phase=$phase"
  ls -la "$work" >> "$out/work-ls.txt" 2>&1
  df -h "$work" /dev/shm >> "$out/work-ls.txt" 2>&1
  tar -C "$(dirname "$out")" -cJf "$pack" "$(basename "$out")" 2>> "$out/pack.err" \
    || tar -C "$(dirname "$out")" -czf "$pack" "$(basename "$out")"
  ls -la "$pack"
}
trap finish EXIT

# step NAME MAX_S CMD...: stdout -> NAME.json, stderr -> NAME.log, rc and start/end to times.txt
step() {
  local name=$1 max=$2; shift 2
  local t; t=$(cap "$max")
  if [ "$t" -lt 5 ]; then echo "$name skipped (deadline, ${t}s left)" >> "$out/times.txt"; return 99; fi
  stamp "$name-start"
  timeout "$t" "$@" > "$out/$name.json" 2> "$out/$name.log"
  local rc=$?
  echo "$name rc=$rc limit=${t}s" >> "$out/times.txt"
  stamp "$name-end"
  return $rc
}
# like step, with nvidia-smi sampling the GPU's used memory every 250 ms into NAME.mem
gstep() {
  local name=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$out/$name.mem" 2>/dev/null &
  local w=$!
  step "$name" "$@"; local rc=$?
  kill "$w" 2>/dev/null; wait "$w" 2>/dev/null
  return $rc
}

env_info() {
  { echo "phase=$phase start=$(date -u +%FT%TZ) deadline=${DEADLINE}s work=$work"
    echo "commit=${GLMCHECK_COMMIT:-$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)}"
    "$bin" --version 2>&1
    nproc; free -g; df -h "$work" /dev/shm
    "$py" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1
    "$py" -m pip list 2>/dev/null | grep -i -E '^(transformers|huggingface.hub|tokenizers|safetensors|accelerate|regex|numpy|torch) '
    nvcc --version 2>&1 | tail -2; cmake --version 2>&1 | head -1; ninja --version 2>&1
    ls -la "$peers"
  } > "$out/env.txt" 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.csv" 2>&1
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
}

has_flag() { "$bin" "$1" --help 2>/dev/null | grep -q -- "$2"; }

synth() {
  if [ -n "${GPU_BENCH_MODEL:-}" ]; then
    [ -f "$model" ] && touch "$work/synth.done"; echo "model given: $model (no synth)" >> "$out/times.txt"
  elif [ -f "$work/synth.done" ] && [ -f "$model" ]; then
    echo "synth reused" >> "$out/times.txt"; cp "$work/synth.json" "$out/" 2>/dev/null
  else
    rm -f "$work/synth.done"
    GLMCHECK_PEAK_RSS=1 step synth 220 "$bin" synth --dims glm5 --layers 3 --qtype q4_k_m --out "$model" --force --json \
      && cp "$out/synth.json" "$work/synth.json" && touch "$work/synth.done"
  fi
  [ -f "$work/synth.done" ] && step inspect 60 "$bin" inspect "$model" --json
  return 0
}

install_tf() {
  [ -f "$tf/.done" ] && return 0
  step tf-install 90 "$py" -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade --target "$tf" \
    "$peers/transformers-5.23.0-py3-none-any.whl"
  if ! step tf-import 90 env PYTHONPATH="$tf" "$py" -c 'import json, torch, transformers, huggingface_hub, tokenizers
from transformers import GlmMoeDsaForCausalLM
print(json.dumps({"transformers": transformers.__version__, "huggingface_hub": huggingface_hub.__version__, "tokenizers": tokenizers.__version__, "torch": torch.__version__}))'; then
    # the likeliest cause: huggingface_hub below 5.23's floor (>=1.31.0); install the carried one beside it
    if [ -f "$peers/huggingface_hub-1.33.0-py3-none-any.whl" ]; then
      step hub-install 60 "$py" -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade --target "$tf" \
        "$peers/huggingface_hub-1.33.0-py3-none-any.whl"
      step tf-import2 90 env PYTHONPATH="$tf" "$py" -c 'import transformers; from transformers import GlmMoeDsaForCausalLM; print(transformers.__version__)' || return 1
    else
      return 1
    fi
  fi
  touch "$tf/.done"
}

# llama.cpp's llama-bench, built in the background in its own session (setsid: its process group can be
# paused while glmcheck is timed, and ended by its id if it overruns), at nice 10.
lbpid=
start_llama_build() {
  local src=$work/llama/llama.cpp b=$work/llama/build
  if [ -x "$b/bin/llama-bench" ]; then echo "llama-build reused" >> "$out/times.txt"; return 0; fi
  local old; old=$(cat "$work/llama-build.pid" 2>/dev/null)
  if [ -n "$old" ] && kill -0 "$old" 2>/dev/null; then   # a build an earlier phase left running: adopt it
    lbpid=$old; echo "llama-build adopted pid=$lbpid" >> "$out/times.txt"; return 0
  fi
  [ -f "$peers/llama.cpp.tar.xz" ] || { echo "llama-build skipped: no $peers/llama.cpp.tar.xz" >> "$out/times.txt"; return 1; }
  local gen=; command -v ninja > /dev/null && gen="-G Ninja"
  local nv=; command -v nvcc > /dev/null || nv="export PATH=/usr/local/cuda-13.0/bin:/usr/local/cuda/bin:\$PATH"
  cat > "$work/llama-build.sh" <<EOS
set -o pipefail
$nv
s() { echo "\$(date +%s.%N) \$*" >> "$out/times.txt"; }
s llama-build-start
mkdir -p "$work/llama" && tar -xJf "$peers/llama.cpp.tar.xz" -C "$work/llama" \\
 && cmake -S "$src" -B "$b" $gen -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=${GPU_BENCH_LLAMA_CUDA:-ON} -DCMAKE_CUDA_ARCHITECTURES=90 \\
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \\
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CCACHE=OFF \\
 && cmake --build "$b" --target llama-bench llama-quantize -j 16
echo "llama-build rc=\$?" >> "$out/times.txt"
s llama-build-end
EOS
  setsid nice -n 10 bash "$work/llama-build.sh" > "$out/llama-build.log" 2>&1 &
  lbpid=$!; echo "$lbpid" > "$work/llama-build.pid"
  echo "llama-build started pid=$lbpid" >> "$out/times.txt"
}
lb_running() { [ -n "$lbpid" ] && kill -0 "$lbpid" 2>/dev/null; }
lb_signal() { lb_running && kill "-$1" -- "-$lbpid" 2>/dev/null && echo "llama-build $1 $(date +%s.%N)" >> "$out/times.txt"; }
# wait for the build until `left` drops to $1 seconds, then end it
lb_wait() {
  stamp llama-wait-start
  while lb_running && [ "$(left)" -gt "$1" ]; do sleep 2; done
  if lb_running; then lb_signal CONT; lb_signal TERM; sleep 2; lb_signal KILL; echo "llama-build ended (deadline)" >> "$out/times.txt"; fi
  wait "$lbpid" 2>/dev/null
  stamp llama-wait-end
}

phase_a() {
  # opt-in: start the llama.cpp build here too; it only pays off if phase B runs on this machine while
  # it is still warm (30 s idle): it is paused while anything is timed and left running at the end
  [ "${GPU_BENCH_A_BUILD:-0}" = 1 ] && start_llama_build
  install_tf; local tf_ok=$?
  synth
  [ -f "$work/synth.done" ] || { echo "no model: phase A stops" >> "$out/times.txt"; return 1; }
  # the bf16 export (~45 GB) beside the 13.5 GB GGUF: on the work disk if it has room, else /dev/shm
  local hf=${GPU_BENCH_HF_DIR:-$work/hf} need=$((50 * 1000 * 1000 * 1000)) avail
  avail=$(df --output=avail -B1 "$work" | tail -1)
  if [ ! -f "$hf/.done" ] && [ "$avail" -lt "$need" ]; then
    local shm; shm=$(df --output=avail -B1 /dev/shm | tail -1)
    [ "$shm" -ge "$need" ] && hf=/dev/shm/gpub-hf
    echo "work fs avail $avail B, /dev/shm avail $shm B: HF export to $hf" >> "$out/times.txt"
  fi
  if [ -n "${GPU_BENCH_HF:-}" ]; then hf=$GPU_BENCH_HF; echo "HF dir given: $hf" >> "$out/times.txt"
  elif [ -f "$hf/.done" ]; then echo "export reused" >> "$out/times.txt"
  else
    GLMCHECK_PEAK_RSS=1 step export 280 "$bin" export "$model" --hf "$hf" --dtype bf16 --force --json \
      && touch "$hf/.done"
    du -sb "$hf" >> "$out/times.txt" 2>&1; ls -la "$hf" > "$out/hf-ls.txt" 2>&1
    cp "$hf/config.json" "$out/hf-config.json" 2>/dev/null
  fi
  if [ "$tf_ok" -eq 0 ] && { [ -f "$hf/.done" ] || [ -n "${GPU_BENCH_HF:-}" ]; }; then
    # leave ~60 s for glmcheck's run against the dump
    local t; t=$(( $(left) - 60 )); [ "$t" -gt 330 ] && t=330
    lb_signal STOP; rm -f "$hfdump"
    gstep hf-bench "$t" env PYTHONPATH="$tf" "$py" "$repo/tools/hf_bench.py" "$hf" --device "$dev" --dtype bf16 \
      --seq 16,256 --token-start "$ts" --repeat 5 --warmup 2 --copy-gib "$([ "$dev" = cpu ] && echo 0 || echo 4)" \
      --dump "$hfdump" --out "$out/hf-bench.out.json"
  else
    echo "hf-bench skipped (tf_ok=$tf_ok, export done: $([ -f "$hf/.done" ] && echo yes || echo no))" >> "$out/times.txt"
  fi
  if [ -f "$hfdump" ]; then
    local mm=() m=default; has_flag forward --matmul && mm=(--matmul dequant) && m=dequant
    GLMCHECK_PEAK_RSS=1 gstep "cuda-bf16-$m-16-vs-hf" 150 "$bin" forward "$model" --tokens "$t16" --device "$dev" --dtype bf16 \
      "${mm[@]}" --max-new-tokens 0 --reference "$hfdump" --json
    if [ "$m" = dequant ] && [ "$(left)" -gt 40 ]; then
      GLMCHECK_PEAK_RSS=1 gstep "cuda-bf16-q8-16-vs-hf" 60 "$bin" forward "$model" --tokens "$t16" --device "$dev" --dtype bf16 \
        --matmul q8 --max-new-tokens 0 --reference "$hfdump" --json
    fi
  fi
  lb_signal CONT
  return 0
}

# glmcheck's timed forwards: --bench 5 for each matmul mode at 16 and 256 tokens, then each
# GPU_BENCH_EXTRA entry ('NAME:VAR=V[,VAR=V…]', entries separated by spaces, NAME in [a-z0-9]) as
# mode dequant_NAME under that environment (e.g. 'always:GLMCHECK_INDEXER=always': transformers' work beside the default's, so
# both ratios come from one call).
glmcheck_benches() {
  local modes=(dequant q8)
  has_flag forward --matmul || modes=(default)
  for seq in 16 256; do
    local toks=$t16; [ "$seq" = 256 ] && toks=$t256
    for m in "${modes[@]}"; do
      local mm=(); [ "$m" != default ] && mm=(--matmul "$m")
      GLMCHECK_PEAK_RSS=1 gstep "cuda-bf16-$m-$seq" 120 "$bin" forward "$model" --tokens "$toks" --device "$dev" \
        --dtype bf16 "${mm[@]}" --max-new-tokens 0 --bench 5 --json $(has_flag forward --profile && echo --profile)
    done
    [ "${modes[0]}" = default ] && continue   # a binary without --matmul: no extras
    local extras extra name envs
    read -ra extras <<< "${GPU_BENCH_EXTRA:-}"   # entries split on spaces, never globbed
    for extra in "${extras[@]}"; do
      name=${extra%%:*}; IFS=, read -ra envs <<< "${extra#*:}"
      # the summary reads modes dequant_[a-z0-9]+; every environment entry VAR=V
      if [[ $extra != *:* || ! $name =~ ^[a-z0-9]+$ ]] || printf '%s\n' "${envs[@]}" | grep -qv '^[A-Z0-9_]*='; then
        echo "GPU_BENCH_EXTRA entry '$extra' skipped: NAME:VAR=V[,VAR=V…] with NAME in [a-z0-9]" >> "$out/times.txt"
        continue
      fi
      GLMCHECK_PEAK_RSS=1 gstep "cuda-bf16-dequant_$name-$seq" 120 env "${envs[@]}" "$bin" forward "$model" \
        --tokens "$toks" --device "$dev" --dtype bf16 --matmul dequant --max-new-tokens 0 --bench 5 --json \
        $(has_flag forward --profile && echo --profile)
    done
  done
}

phase_b() {
  start_llama_build
  synth
  lb_signal STOP   # glmcheck is timed with the build paused
  if [ -f "$work/synth.done" ]; then
    glmcheck_benches
    lb_signal CONT   # dequant's throughput is GPU-bound; let the build go on meanwhile
    if has_flag dequant --device; then
      gstep dequant-cuda 120 "$bin" dequant "$model" --device "$dev" --repeat 5 --json
    else
      echo "dequant-cuda skipped: this glmcheck's dequant has no --device" >> "$out/times.txt"
    fi
  else
    echo "no model: glmcheck runs skipped" >> "$out/times.txt"
  fi
  lb_signal CONT
  lb_wait 70       # keep ~70 s for llama-bench
  local lbench=$work/llama/build/bin/llama-bench
  if [ -x "$lbench" ] && [ -f "$work/synth.done" ]; then
    gstep llama-bench 200 "$lbench" -m "$model" -p 16,256 -n 0 -ngl 99 -r 5 -o json
  else
    echo "llama-bench skipped (binary: $([ -x "$lbench" ] && echo yes || echo no))" >> "$out/times.txt"
  fi
}

stamp "start phase=$phase"
env_info
case $phase in
  A) phase_a ;;
  B) phase_b ;;
  AB) phase_a; phase_b ;;
  Q) synth; [ -f "$work/synth.done" ] && glmcheck_benches; phase_a ;;
  *) echo "phase must be A, B, AB or Q" >&2; exit 2 ;;
esac
exit 0
