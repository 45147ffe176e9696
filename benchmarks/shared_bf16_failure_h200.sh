#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One H200, one device call (under 10 minutes), results under $1.
# OFASys `paper` b8's `mosaic train --bf16-weights --autotune 1` failed in cuBLAS on
# 2026-12-03 (the `structured` encoder's first GEMM, in the candidates' first step) while the
# planner's plan alone trained. Which set of plans on the shared bf16 copy fails? Each set in
# its own process (a CUDA error ends a process's use of the GPU), eager to keep compiles out
# of the time, launches blocking so an error names its kernel; then the whole set compiled.
set -u
OUT=${1:?usage: shared_bf16_failure_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
run() {  # name, seconds, planners, extra flags
  timeout "$2" python benchmarks/shared_bf16_plans.py ofasys paper 8 "$3" ${4:-} \
    --out "$OUT/shared_bf16_$1.json" > "$OUT/shared_bf16_$1.log" 2>&1
  echo "$1 rc=$?"; tail -n 1 "$OUT/shared_bf16_$1.log" | cut -c1-300
}
run mosaic 75 mosaic "--compile none"
run all_baselines 75 mosaic,megatron,distmm,spindle "--compile none"
run autotune_set 75 mosaic,megatron,distmm,spindle "--per-weight mosaic --compile none"
run all_baselines_fp32 75 mosaic,megatron,distmm,spindle "--fp32 --compile none"
run autotune_set_compiled 200 mosaic,megatron,distmm,spindle "--per-weight mosaic --scope blocks"
