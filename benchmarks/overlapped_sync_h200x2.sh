#!/usr/bin/env bash
# PREPARED, NOT YET RUN (forty-fourth session, 2026-12-05; no two-GPU kind lent since the
# twelfth). 2 x H200, one device call (limits add up to 550 s), results under $1: the first GPU
# measurement of grad_sync='overlapped' (engine/bucket_reduce.py: each data-parallel module's
# flat buffer all-reduced bucket by bucket inside its backward CUDA graph):
#   1. the probe (benchmarks/captured_reduce_probe.py): a stack of 24 layers, the all-reduce
#      after the backward graph against captured inside it in 1, 4 and 12 buckets, fp32 and
#      bf16 gradients: does the captured sum hide, and does it slow the backward?
#   2. its GPU tests: the captured sums on one GPU (a one-rank NCCL group), the toy plans
#      trained over NCCL by two processes as one process trains them;
#   3. CLIP `paper` weak scaling of megatron's plan at 16 samples a GPU: a 1-GPU bench, then a
#      2-GPU bench measuring `flat` and `overlapped` (fp32 weights, and bf16 weights summed in
#      bf16) in the same rounds, the user's torch.compile program beside them. Predicted
#      (composed, no fitted term): 1.64x flat, 1.95x overlapped; bf16 1.76x / 1.95x.
# Checked on the CPU (`--preset tiny --cpu-smoke`, two gloo processes) before shipping.
set -u
OUT=${1:?usage: overlapped_sync_h200x2.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
for dtype in fp32 bf16; do
  timeout -k 10 70 torchrun --standalone --nproc-per-node 2 benchmarks/captured_reduce_probe.py \
    --grad-dtype "$dtype" --out "$OUT/captured_reduce_$dtype.json" > "$OUT/probe_$dtype.log" 2>&1
  echo "probe $dtype rc=$?"; grep -E "^(compute|after|captured)" "$OUT/probe_$dtype.log"
done
timeout -k 10 120 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_graphed_gpu.py \
  tests/gpu/test_engine_gpu.py -k "buckets_inside or (nccl_processes_equal and overlapped)" \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 8
COMMON=(clip --preset paper --perf-model profiled --compile-scope blocks --planners megatron
        --user-programs torch-compile --rounds 4 --json)
CUDA_VISIBLE_DEVICES=0 timeout -k 10 100 python -m mosaic bench "${COMMON[@]}" --gpus 1 \
  --batch 16 --engine-variant bf16_weights=true --out /tmp/b-1gpu \
  > "$OUT/bench_clip_paper_1gpu_b16.json" 2> "$OUT/bench_1gpu.err"
echo "1 gpu rc=$?"; grep "^mosaic bench" "$OUT/bench_1gpu.err" | tail -n 2
timeout -k 10 190 torchrun --standalone --nproc-per-node 2 -m mosaic bench "${COMMON[@]}" \
  --gpus 2 --batch 32 --engine-variant grad_sync=overlapped \
  --engine-variant grad_sync=overlapped,bf16_weights=true,reduce_dtype=bf16 \
  --engine-variant bf16_weights=true,reduce_dtype=bf16 --out /tmp/b-2gpu \
  > "$OUT/bench_clip_paper_2gpu_b32.json" 2> "$OUT/bench_2gpu.err"
echo "2 gpu rc=$?"; grep "^mosaic bench" "$OUT/bench_2gpu.err" | tail -n 2
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
