#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1.
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
# First call (2026-12-03, eighteenth session, SETS=first): every set of mosaic's and the
# baselines' plans trained (launches blocking), while `mosaic train` failed again; its top
# candidate was gahc's plan, whose seven encoders share one `free` stage. Second call
# (SETS=gahc): gahc's plan alone fails in 2-6 s, bf16 weights or fp32 (launches not
# blocking). Third call (SETS=bisect): fp32 weights, eager modules: fails with launches
# blocking, without CUDA graphs, with video's stream at normal priority, and with the six
# encoders but motion at once; trains with motion+structured or vision+text+audio at once.
# Fourth call (SETS=fewer): fails with structured+imu+video at once and with all but
# structured (then in motion's first GEMM), trains with structured+vision+text+audio; a fixed
# cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG) or 32 hardware queues do not help. Default
# (SETS=pairs): imu or video, and is it their convolutions' cuDNN? SETS=sanitize: the
# structured+imu+video plan without the caching allocator (every tensor its own cudaMalloc,
# so no block is reused across streams), then the same under compute-sanitizer's memcheck,
# which names the first kernel that touches memory outside its allocations.
# Found (twentieth session, gahc_green_probe_h200.sh): the failing encoders' caps got a green
# context of only the SM split's leftover, where cluster launches (cuBLAS's GEMMs) fail; the
# pool no longer lays a quota there, and these sets now train.
# gahc's plan alone with fp32 weights and eager modules (each run short), launches not
# blocking: name, then the plan's reshaping flags (shared_bf16_plans.py).
EAGER="--fp32 --compile none"
gahc() { local name=$1; shift; CUDA_LAUNCH_BLOCKING=0 run "gahc_$name" 60 gahc "$EAGER $*"; }
case "${SETS:-pairs}" in
first)
  run mosaic 75 mosaic "--compile none"
  run all_baselines 75 mosaic,megatron,distmm,spindle "--compile none"
  run autotune_set 75 mosaic,megatron,distmm,spindle "--per-weight mosaic --compile none"
  run all_baselines_fp32 75 mosaic,megatron,distmm,spindle "--fp32 --compile none"
  run autotune_set_compiled 200 mosaic,megatron,distmm,spindle "--per-weight mosaic --scope blocks";;
gahc)
  CUDA_LAUNCH_BLOCKING=0 run gahc_bf16 50 gahc "--compile none"
  CUDA_LAUNCH_BLOCKING=0 run gahc_fp32 50 gahc "--fp32 --compile none";;
bisect)
  run gahc_blocking 60 gahc "$EAGER"
  gahc no_graphs --no-graphs
  gahc priority_0 --priority 0
  gahc motion_structured --concurrent motion,structured
  gahc without_motion --concurrent structured,vision,text,audio,imu,video
  gahc vision_text_audio --concurrent vision,text,audio;;
fewer)
  gahc structured_imu_video --concurrent structured,imu,video
  gahc structured_vision_text_audio --concurrent structured,vision,text,audio
  gahc without_structured --concurrent motion,vision,text,audio,imu,video
  CUBLAS_WORKSPACE_CONFIG=:4096:8 gahc fixed_workspace
  CUDA_DEVICE_MAX_CONNECTIONS=32 gahc 32_connections;;
pairs)
  gahc structured_imu --concurrent structured,imu
  gahc structured_video --concurrent structured,video
  gahc imu_video --concurrent imu,video
  gahc no_cudnn --no-cudnn;;
sanitize)
  THREE="--concurrent structured,imu,video --no-graphs"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 gahc no_caching $THREE
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
    /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
  echo "compute-sanitizer: ${sanitizer:-not found}"
  [ -n "$sanitizer" ] && PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 280 "$sanitizer" \
    --tool memcheck --print-limit 20 --log-file "$OUT/memcheck.txt" \
    python benchmarks/shared_bf16_plans.py ofasys paper 8 gahc $EAGER $THREE \
    --out "$OUT/shared_bf16_memcheck.json" > "$OUT/shared_bf16_memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "^=+ (Invalid|Program hit|ERROR SUMMARY)|^=+ +at " \
    "$OUT/memcheck.txt" 2>/dev/null | head -n 12 | cut -c1-250;;
esac
