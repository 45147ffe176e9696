#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One device call on 2 x H200, results under $1:
#  GPU 0: CLIP `paper` megatron at 16 per GPU on one GPU alone (weak scaling's 1-GPU side,
#         with start-up phases now in its JSON).
#  GPU 1: ImageBind `paper` vision surface again (it ran out of memory at its first capture;
#         the profiler now empties the allocator's cache and retries).
#  Then both GPUs: Qwen3-VL `paper` megatron plan (the 7.6B LLM sharded with FSDP2) against
#  the unsharded plans that fit, and CLIP `paper` with bf16 gradient reduction as a variant
#  (a second run of the default 2-GPU engine too, for its engine term).
# OFASys `paper` on one GPU needs more than 330 s on a cold Inductor cache (eight modules
# compiled twice): benchmarks/ofasys_paper_1gpu_h200.sh runs it alone.
set -u
OUT=${1:?usage: paper_sharded_and_bf16_h200x2.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PLANS=benchmarks/plans/h200-paper-compiled
(
  CUDA_VISIBLE_DEVICES=0 timeout 200 python -m mosaic bench clip --gpus 1 --preset paper \
    --batch 16 --perf-model profiled --planners megatron --user-programs torch-compile \
    --rounds 6 --out /tmp/c1 --json > "$OUT/bench_clip_paper_1gpu_b16.json" \
    2> /tmp/logs/bench_clip_paper_1gpu_b16.err
  echo "clip paper 1gpu b16 rc=$?"
) &
(
  cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
  CUDA_VISIBLE_DEVICES=1 timeout 300 python -m mosaic profile imagebind --preset paper \
    --kernels compile-default --surfaces-only --update --budget 280 --db "$OUT/h200.sqlite" \
    > /tmp/logs/profile_imagebind_paper.log 2>&1
  echo "profile rc=$?" | tee -a /tmp/logs/profile_imagebind_paper.log
) &
wait
timeout 150 torchrun --standalone --nproc-per-node 2 -m mosaic bench qwen3-vl --gpus 2 \
  --preset paper --perf-model profiled --plans $PLANS/qwen3-vl-2gpu --planners megatron \
  --user-programs "" --rounds 3 --out /tmp/q2 --json > "$OUT/bench_qwen3vl_paper_2gpu.json" \
  2> /tmp/logs/bench_qwen3vl_paper_2gpu.err
echo "qwen3-vl 2gpu rc=$?"
timeout 110 torchrun --standalone --nproc-per-node 2 -m mosaic bench clip --gpus 2 --preset paper \
  --perf-model profiled --plans $PLANS/clip-2gpu --planners megatron,mosaic --rounds 4 \
  --user-programs "" --engine-variant reduce_dtype=bf16 --out /tmp/p2 --json \
  > "$OUT/bench_clip_paper_2gpu_bf16.json" 2> /tmp/logs/bench_clip_paper_2gpu_bf16.err
echo "clip 2gpu bf16 rc=$?"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
grep -h "^mosaic bench" /tmp/logs/*.err | tail -n 12
grep -E "^\[|kept|rc=" /tmp/logs/profile_imagebind_paper.log | tail -n 4
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
