#!/usr/bin/env bash
# One device call on 2 x H200, results under $1:
#  GPU 0: CLIP small b128, four plans and both user programs interleaved (the table;
#         the torch-compile program beside graphed plans, after the cuBLAS-workspace fix).
#  GPU 1: OFASys `paper` compiled surfaces, resuming the shipped DB (--update skips modules
#         it holds).
#  Then both GPUs: CLIP `paper`, 2-GPU plans and both user programs (DDP), under torchrun.
set -u
OUT=${1:?usage: user_baseline_and_paper_clip_h200x2.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
(
  CUDA_VISIBLE_DEVICES=0 timeout 290 python -m mosaic bench clip --gpus 1 --preset small \
    --batch 128 --perf-model profiled --plans benchmarks/plans/h200-small-compiled/clip-b128 \
    --rounds 4 --out /tmp/b128 --json > "$OUT/bench_clip_small_b128.json" 2> "$OUT/bench_clip_small_b128.err"
  echo "b128 rc=$?"
) &
(
  cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
  CUDA_VISIBLE_DEVICES=1 timeout 290 python -m mosaic profile ofasys --preset paper \
    --kernels compile-default --surfaces-only --update --budget 240 --db "$OUT/h200.sqlite" \
    > "$OUT/profile_ofasys_paper.log" 2>&1
  echo "profile rc=$?" | tee -a "$OUT/profile_ofasys_paper.log"
) &
wait
timeout 250 torchrun --standalone --nproc-per-node 2 -m mosaic bench clip --gpus 2 --preset paper \
  --perf-model profiled --plans benchmarks/plans/h200-paper-compiled/clip-2gpu --rounds 4 \
  --out /tmp/p2 --json > "$OUT/bench_clip_paper_2gpu.json" 2> "$OUT/bench_clip_paper_2gpu.err"
echo "paper 2gpu rc=$?"
grep -E "^\[|kept|rc=" "$OUT/profile_ofasys_paper.log" | grep -v Warning | tail -n 6
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
