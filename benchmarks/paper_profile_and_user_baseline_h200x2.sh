#!/usr/bin/env bash
# One device call on 2 x H200, three jobs, results under $1:
#  GPU 0: (a) CLIP small b32, four plans beside both user programs, interleaved, with
#         CUDA_LAUNCH_BLOCKING=1: which contender's launch faults (the known torch-compile crash);
#         (b) CLIP small b128 (the table), the user programs in their own rounds.
#  GPU 1: compiled (Inductor, then graphed) surfaces of CLIP and OFASys at `paper`, added to a
#         copy of the shipped ProfileDB.
#  Both GPUs afterwards: the tensor-parallel GPU test.
set -u
OUT=${1:?usage: paper_profile_and_user_baseline_h200x2.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
bench() {  # name, then mosaic bench arguments
  local name=$1; shift
  timeout "$BENCH_LIMIT" python -m mosaic bench clip --gpus 1 --preset small --perf-model profiled \
    --planners megatron,distmm,spindle,mosaic --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "$name rc=$?"
}
(
  export CUDA_VISIBLE_DEVICES=0
  BENCH_LIMIT=170 CUDA_LAUNCH_BLOCKING=1 bench bench_clip_b32_blocking --batch 32 \
    --plans benchmarks/plans/h200-small-compiled/clip-b32 --rounds 2 --steps-per-round 3 --warmup 2 --out /tmp/b32
  BENCH_LIMIT=230 bench bench_clip_b128_apart --batch 128 --user-rounds apart \
    --plans benchmarks/plans/h200-small-compiled/clip-b128 --rounds 4 --out /tmp/b128
) &
(
  export CUDA_VISIBLE_DEVICES=1
  cp src/mosaic/profile/data/h200.sqlite "$OUT/h200_paper.sqlite"
  timeout 420 python -m mosaic profile clip ofasys --preset paper --kernels compile-default \
    --surfaces-only --update --budget 360 --db "$OUT/h200_paper.sqlite" > "$OUT/profile_paper.log" 2>&1
  echo "profile rc=$?" | tee -a "$OUT/profile_paper.log"
) &
wait
timeout 100 python -m pytest -q -m gpu tests/gpu/test_tensor_parallel_gpu.py -p no:cacheprovider \
  > "$OUT/gpu_tests_tp.log" 2>&1
echo "tp rc=$?" | tee -a "$OUT/gpu_tests_tp.log"
grep -E "passed|failed" "$OUT/gpu_tests_tp.log" | tail -n 3
grep -E "raised while timing|Error" "$OUT/bench_clip_b32_blocking.err" | head -n 5
tail -n 3 "$OUT/profile_paper.log"
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
