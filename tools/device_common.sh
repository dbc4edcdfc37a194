# Sourced by the single-call device scripts (tools/device_*_check.sh, device_moe_grouped.sh,
# device_kernel_profile.sh, device_ncu_kernel.sh) once `out` (the result dir, absolute) is set: the driver's libcuda on the
# library path, the GPU (gpu.txt) and GLMCHECK_COMMIT (commit.txt) written into OUTDIR, OUTDIR
# packed into $OUT/x.tar.xz at exit when OUT is set, and
# `step NAME MAX_S CMD…`: stdout → NAME.json, stderr → NAME.log, rc and seconds → rc.txt.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
pack() { [ -n "${OUT:-}" ] && tar -C "$(dirname "$out")" -cJf "$OUT/x.tar.xz" "$(basename "$out")"; }
trap pack EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt" 2>&1
echo "${GLMCHECK_COMMIT:-unknown}" > "$out/commit.txt"
step() {
  local name=$1 max=$2; shift 2; local t0; t0=$(date +%s.%N)
  timeout "$max" "$@" > "$out/$name.json" 2> "$out/$name.log"
  local rc=$?; echo "$name rc=$rc $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" >> "$out/rc.txt"
}
