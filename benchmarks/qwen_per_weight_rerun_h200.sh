#!/usr/bin/env bash
# One H200, one device call (about 4 minutes), results under $1. Run in the twenty-first
# session (2026-12-03) as one command line; kept here so it can be run again as it ran.
# Qwen3-VL `small` b8, megatron's plan (the planner's), fp32 and bf16 weights with the update
# flat and a weight at a time, beside the user's torch.compile program; then the bf16 update
# of each module alone (benchmarks/main_weights_flat_or_per_weight.py).
set -u
OUT=${1:?usage: qwen_per_weight_rerun_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
n=bench_qwen3-vl_small_1gpu_b8_bf16_flat_or_per_weight
timeout 400 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --compile-scope module --planners megatron --user-programs torch-compile \
  --rounds 3 --engine-variant bf16_weights=true \
  --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --out /tmp/qwbench --json > "$OUT/$n.json" 2> "/tmp/logs/$n.err"
echo "bench rc=$?"; grep -E "^mosaic( bench|: error)" "/tmp/logs/$n.err" | tail -n 2
python3 benchmarks/bench_summary.py "$OUT/$n.json"
timeout 100 python benchmarks/main_weights_flat_or_per_weight.py qwen3-vl small \
  --out "$OUT/main_weights_flat_or_per_weight_qwen3-vl_small.json" 2> /tmp/logs/upd.err
echo "update rc=$?"; tail -n 3 /tmp/logs/upd.err
tar czf "$OUT/logs.tar.gz" -C /tmp logs
