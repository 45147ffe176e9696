#!/usr/bin/env bash
# One device call on 2 x H200, results under $1:
#  GPU 0: the GPU tests of the bench (graphed plans beside the reduce-overhead user program)
#         and of compile (the audio encoder's workaround); then CLIP `paper` megatron at 16
#         per GPU on one GPU, the 1-GPU side of weak scaling.
#  GPU 1: OFASys `paper` on one GPU, four plans and both user programs (timed out at 250 s
#         before: eight modules compiled twice at `paper` size).
#  Then both GPUs: CLIP `paper`, the gradient-sync A/B in one run: today's default DDP, DDP with
#  bucket views, the old bucketed all-reduce and flat gradient buffers, beside torch-compile.
set -u
OUT=${1:?usage: ddp_variants_and_ofasys_paper_h200x2.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PLANS=benchmarks/plans/h200-paper-compiled
(
  CUDA_VISIBLE_DEVICES=0 timeout 210 python -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_bench_gpu.py tests/gpu/test_compile_gpu.py > /tmp/logs/gpu_tests.log 2>&1
  echo "gpu tests rc=$?" | tee -a /tmp/logs/gpu_tests.log
  # Weak scaling's 1-GPU side: the 2-GPU run below trains batch 32, 16 per GPU.
  CUDA_VISIBLE_DEVICES=0 timeout 110 python -m mosaic bench clip --gpus 1 --preset paper \
    --batch 16 --perf-model profiled --planners megatron --user-programs torch-compile \
    --rounds 4 --out /tmp/c1 --json > "$OUT/bench_clip_paper_1gpu_b16.json" \
    2> /tmp/logs/bench_clip_paper_1gpu_b16.err
  echo "clip 1gpu b16 rc=$?"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 330 python -m mosaic bench ofasys --gpus 1 --preset paper \
    --perf-model profiled --plans $PLANS/ofasys-1gpu --rounds 3 --out /tmp/o1 --json \
    > "$OUT/bench_ofasys_paper_1gpu.json" 2> /tmp/logs/bench_ofasys_paper_1gpu.err
  echo "ofasys 1gpu rc=$?"
) &
wait
timeout 220 torchrun --standalone --nproc-per-node 2 -m mosaic bench clip --gpus 2 --preset paper \
  --perf-model profiled --plans $PLANS/clip-2gpu --planners megatron,mosaic --rounds 4 \
  --user-programs torch-compile --engine-variant bucket_view=true \
  --engine-variant grad_sync=bucketed --engine-variant grad_sync=flat --out /tmp/p2 --json \
  > "$OUT/bench_clip_paper_2gpu_ddp_variants.json" 2> /tmp/logs/bench_clip_paper_2gpu.err
echo "clip 2gpu rc=$?"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
grep -E "passed|failed" /tmp/logs/gpu_tests.log | tail -n 2
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
