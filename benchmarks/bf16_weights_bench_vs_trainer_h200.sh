#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1. Qwen3-VL `small` b8 with bf16
# weights measured 21.73 ms in `mosaic bench` (fp32 weights: 21.75) but 19.60 ms in the
# trainer (fp32: 21.81): which one is wrong, and where the bench's step spends the time.
#  1. `mosaic bench`, megatron's plan (mosaic's is the same) with and without bf16 weights,
#     each contender's timed steps traced (`--torch-trace`): kernel time by class per step;
#  2. the trainer in flight with fp32 and bf16 weights, both traced (the trace now waits for
#     the steps in flight before its window, so per-step kernel times are exact).
set -u
OUT=${1:?usage: bf16_weights_bench_vs_trainer_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --planners megatron --user-programs "" --rounds 3 \
  --engine-variant bf16_weights=true --torch-trace /tmp/btrace \
  --json > "$OUT/bench_qwen3-vl_small_1gpu_b8_bf16_weights_traced.json" 2> /tmp/logs/bench.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/bench.err | tail -n 2
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
for dir in /tmp/btrace/*/; do
  label=$(basename "$dir"); cp "$dir/kernel-time-rank0.json" "$OUT/bench-kernel-time-$label.json"
  echo "== bench, $label"; python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 12
done
timeout 240 python benchmarks/train_in_flight.py qwen3-vl --preset small --batch 8 --steps 30 \
  --rounds 1 --bf16-weights --trace-dir /tmp/qtrace \
  --out "$OUT/train_bf16_weights_qwen3-vl_small_b8_traced.json" > /tmp/logs/train.log 2>&1
echo "train rc=$?"; grep -E "^round|ms:" /tmp/logs/train.log
cp /tmp/qtrace/kernel-time-rank0.json "$OUT/train-kernel-time-fp32.json"
cp /tmp/qtrace/bf16-weights/kernel-time-rank0.json "$OUT/train-kernel-time-bf16-weights.json"
for kind in . bf16-weights; do
  echo "== trainer, $kind"; python -m mosaic kernel-time /tmp/qtrace/$kind/trace-rank0.json.gz | head -n 12
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
