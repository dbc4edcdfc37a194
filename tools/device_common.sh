# Sourced by the single-call device scripts (tools/device_*_check.sh, device_moe_grouped.sh,
# device_kernel_profile.sh, device_ncu_kernel.sh) once `out` (the result dir, absolute) is set: the driver's libcuda on the
# library path, the GPU (gpu.txt) and GLMCHECK_COMMIT (commit.txt) written into OUTDIR, OUTDIR
# packed into $OUT/$PACK_NAME.tar.xz (PACK_NAME default x; set it apart for each script of one call:
# the device tool returns a limited count of files, one archive per script comes back) at exit when
# OUT is set, and
# `step NAME MAX_S CMD…`: stdout → NAME.json, stderr → NAME.log, rc and seconds → rc.txt (capped by
# DEADLINE when T0 is set), and
# `ab_forwards OLD NEW ROUNDS FORWARD_ARGS…`: an OLD-vs-NEW pair on the same forward (see below), and
# `$ncu` / `${census[@]}`: Nsight Compute and the per-kernel census options.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
# Nsight Compute, and the census options: every kernel's time, grid and registers
ncu=$(command -v ncu || echo /usr/local/cuda-13.0/bin/ncu)
census=(--metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread --csv --print-units base
  --clock-control none)
pack() { [ -n "${OUT:-}" ] && tar -C "$(dirname "$out")" -cJf "$OUT/${PACK_NAME:-x}.tar.xz" "$(basename "$out")"; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt" 2>&1
echo "${GLMCHECK_COMMIT:-unknown}" > "$out/commit.txt"
# With T0 (the call's start, s) and DEADLINE (s from T0) set before sourcing, `left` is what is left of
# the call and a step's limit is capped by it: a step with less than MIN_S (default 5) s left is
# skipped, rc 99 (`MIN_S=25 step …` for a step that cannot finish in less: build Z's census, started
# with 6 s left, was killed and gave nothing).
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
step() {
  local name=$1 max=$2; shift 2
  if [ -n "${T0:-}" ] && [ -n "${DEADLINE:-}" ]; then
    local l; l=$(left); [ "$max" -gt "$l" ] && max=$l
    if [ "$max" -lt "${MIN_S:-5}" ]; then echo "$name skipped (deadline)" >> "$out/rc.txt"; return 99; fi
  fi
  local t0; t0=$(date +%s.%N)
  timeout "$max" "$@" > "$out/$name.json" 2> "$out/$name.log"
  local rc=$?; echo "$name rc=$rc $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> "$out/rc.txt"
}

# ab_forwards OLD NEW ROUNDS FORWARD_ARGS…: for 16 and 256 tokens (1000..), OLD's dump and NEW's
# forward against it (old-dump-N, new-vs-old-N), then ROUNDS interleaved `--bench 5` rounds of each
# (old-N-rR, new-N-rR). Dumps go to $work/dumps and are removed.
ab_forwards() {
  local old=$1 new=$2 rounds=$3; shift 3
  local t16 t256 d=$work/dumps n toks r; t16=$(seq -s, 1000 1015); t256=$(seq -s, 1000 1255)
  mkdir -p "$d"
  for n in 16 256; do
    toks=$t16; [ "$n" = 256 ] && toks=$t256
    step "old-dump-$n" 120 "$old" "$@" --tokens "$toks" --dump "$d/old-$n.safetensors"
    step "new-vs-old-$n" 120 "$new" "$@" --tokens "$toks" --reference "$d/old-$n.safetensors"
  done
  rm -rf "$d"
  for n in 16 256; do
    toks=$t16; [ "$n" = 256 ] && toks=$t256
    for r in $(seq 1 "$rounds"); do
      step "old-$n-r$r" 120 "$old" "$@" --tokens "$toks" --bench 5
      step "new-$n-r$r" 120 "$new" "$@" --tokens "$toks" --bench 5
    done
  done
}
