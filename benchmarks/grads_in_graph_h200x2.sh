#!/usr/bin/env bash
# One device call on 2 x H200, results under $1: backward graphs that leave the parameter
# gradients themselves (engine/graphed.py) against autograd's per-parameter AccumulateGrad, in
# one bench run per model and GPU count (variant label PLAN@grads_in_graph=false).
#  GPU 0: CLIP `small` at batch 128, every planner and torch-compile.
#  GPU 1: the GPU test of the graphed module; CLIP `paper` megatron at 16 per GPU (weak
#         scaling's 1-GPU side).
#  Then both GPUs: CLIP `paper` at 32 (16 per GPU), flat gradient buffers, against DDP.
set -u
OUT=${1:?usage: grads_in_graph_h200x2.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PLANS=benchmarks/plans/h200-paper-compiled
OLD=(--engine-variant grads_in_graph=false)
(
  CUDA_VISIBLE_DEVICES=0 timeout 170 python -m mosaic bench clip --gpus 1 --preset small \
    --batch 128 --perf-model profiled --user-programs torch-compile "${OLD[@]}" --rounds 4 \
    --out /tmp/c2 --json > "$OUT/bench_clip_small_1gpu_b128.json" \
    2> /tmp/logs/bench_clip_small_1gpu_b128.err
  echo "clip small 1gpu b128 rc=$?"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 60 python -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_graphed_gpu.py > /tmp/logs/gpu_tests.log 2>&1
  echo "gpu tests rc=$?" | tee -a /tmp/logs/gpu_tests.log
  CUDA_VISIBLE_DEVICES=1 timeout 100 python -m mosaic bench clip --gpus 1 --preset paper \
    --batch 16 --perf-model profiled --planners megatron --user-programs torch-compile \
    "${OLD[@]}" --rounds 4 --out /tmp/c1 --json > "$OUT/bench_clip_paper_1gpu_b16.json" \
    2> /tmp/logs/bench_clip_paper_1gpu_b16.err
  echo "clip paper 1gpu b16 rc=$?"
) &
wait
timeout 170 torchrun --standalone --nproc-per-node 2 -m mosaic bench clip --gpus 2 --preset paper \
  --perf-model profiled --plans $PLANS/clip-2gpu --planners megatron,mosaic --rounds 4 \
  --grad-sync flat --user-programs torch-compile "${OLD[@]}" --engine-variant grad_sync=ddp \
  --out /tmp/p2 --json > "$OUT/bench_clip_paper_2gpu_flat.json" \
  2> /tmp/logs/bench_clip_paper_2gpu.err
echo "clip paper 2gpu rc=$?"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
grep -E "passed|failed" /tmp/logs/gpu_tests.log | tail -n 2
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
