#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1. The main-weights optimizer
# now updates each module's bf16 weights in one launch over flat buffers (it launched one
# kernel a weight: 6.3 ms of Qwen3-VL `small`'s step, at 2.4 TB/s):
#  1. Qwen3-VL `small` b8 in `mosaic bench` with and without bf16 weights, traced
#     (`--torch-trace`): the step and the update's kernel time against the run before
#     (benchmarks/bf16_weights_bench_vs_trainer_h200.sh: 21.64 vs 21.62 ms);
#  2. the GPU tests of bf16 weights (the one-launch update against the CPU's; the trainer's
#     resume; the plan's gradients against the fp32 user program);
#  3. Unified-IO 2 `paper` b4, mosaic's plan with fp32 and with bf16 weights (the MFU target).
set -u
OUT=${1:?usage: bf16_weights_one_launch_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 170 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --planners megatron --user-programs "" --rounds 3 \
  --engine-variant bf16_weights=true --torch-trace /tmp/btrace \
  --json > "$OUT/bench_qwen3-vl_small_1gpu_b8_bf16_weights_one_launch.json" 2> /tmp/logs/bench.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/bench.err | tail -n 1
python3 benchmarks/bench_summary.py "$OUT"/bench_qwen3-vl_*.json
for dir in /tmp/btrace/*/; do
  label=$(basename "$dir"); cp "$dir/kernel-time-rank0.json" "$OUT/bench-kernel-time-$label.json"
  echo "== bench, $label"; python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 11
done
timeout 220 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_main_weights_gpu.py \
  -k "not nccl" > "$OUT/gpu_tests_main_weights.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_tests_main_weights.log" | tail -n 6
PLANNERS=mosaic PLANS_AT_ONCE=1 USER_PROGRAMS="" VARIANT=bf16_weights=true \
  bash benchmarks/target_rows_h200.sh "$OUT" unified-io-2:paper:4:180
tar czf "$OUT/logs_one_launch.tar.gz" -C /tmp logs
