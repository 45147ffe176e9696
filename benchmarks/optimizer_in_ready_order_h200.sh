#!/usr/bin/env bash
# One H200, one device call (about 3 minutes), results under $1. The overlapped optimizer's
# side stream ran the modules' updates in module order, so the LLM's (ready first) queued
# behind the encoders' (ready last): no overlap in benchmarks/optimizer_side_stream_h200.sh.
# Now they run in the order their gradients became final:
#  1. Unified-IO 2 `paper` b4, megatron's plan: fp32, bf16 weights, bf16 weights with the
#     overlapped update;
#  2. the overlapped optimizer's GPU tests (fused and bf16 weights; own and side streams).
set -u
OUT=${1:?usage: optimizer_in_ready_order_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
name=bench_unified-io-2_paper_1gpu_b4_bf16_ready_order
timeout 150 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 3 --plans-at-once 1 --engine-variant bf16_weights=true \
  --engine-variant bf16_weights=true,optimizer_overlap=true \
  --out /tmp/u2bench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
python3 benchmarks/bench_summary.py "$OUT/$name.json"
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k overlapped > "$OUT/gpu_tests_overlapped.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_tests_overlapped.log" | tail -n 6
