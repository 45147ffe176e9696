#!/usr/bin/env bash
# One H200, about 4 minutes, results under $1. Twenty-second session (2026-12-03). Qwen3-VL
# `small` b8 has its LLM's backward first and the vision encoder's after it: with the update
# stepped in the order the gradients become final (`optimizer_overlap`), the LLM's update (3.3
# ms a weight at a time) can run under the vision encoder's backward. Never measured on this
# model: megatron's plan (the planner's), bf16 weights a weight at a time, with and without
# the overlap, beside the user's torch.compile program, one process.
set -u
OUT=${1:?usage: qwen_optimizer_overlap_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
n=bench_qwen3-vl_small_1gpu_b8_bf16_optimizer_overlap
timeout "${LIMIT:-300}" python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --compile-scope module --planners megatron --user-programs torch-compile \
  --rounds 3 --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --engine-variant bf16_weights=true,bf16_flat_grads=false,optimizer_overlap=true \
  --engine-variant optimizer_overlap=true \
  --out /tmp/qwoverlap --json > "$OUT/$n.json" 2> "/tmp/logs/$n.err"
echo "bench rc=$?"; grep -E "^mosaic( bench|: error)" "/tmp/logs/$n.err" | tail -n 2
python3 benchmarks/bench_summary.py "$OUT/$n.json"
