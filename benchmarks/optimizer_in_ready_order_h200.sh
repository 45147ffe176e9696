#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1. The overlapped optimizer's
# side stream ran the modules' updates in module order, so the LLM's (ready first) queued
# behind the encoders' (ready last): no overlap in benchmarks/optimizer_side_stream_h200.sh.
# Now they run in the order their gradients became final:
#  1. Unified-IO 2 `paper` b4, megatron's plan: fp32, bf16 weights, bf16 weights with the
#     overlapped update; traced (the kernels' overlap);
#  2. the overlapped optimizer's GPU tests (fused and bf16 weights; own and side streams);
#  3. Qwen3-VL `small` b8 (megatron's plan is the planner's) the same three ways beside the
#     user's torch.compile program (the bf16 column of the targets table).
set -u
OUT=${1:?usage: optimizer_in_ready_order_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
variants=(--engine-variant bf16_weights=true
          --engine-variant bf16_weights=true,optimizer_overlap=true)
name=bench_unified-io-2_paper_1gpu_b4_bf16_ready_order
timeout 170 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 3 --plans-at-once 1 "${variants[@]}" --torch-trace /tmp/u2trace \
  --out /tmp/u2bench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
for dir in /tmp/u2trace/*/; do
  label=$(basename "$dir"); cp "$dir/kernel-time-rank0.json" "$OUT/kernel-time-u2-$label.json"
  echo "== $label"; python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 4
done
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k overlapped > "$OUT/gpu_tests_overlapped.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_tests_overlapped.log" | tail -n 6
name=bench_qwen3-vl_small_1gpu_b8_bf16_ready_order
timeout 210 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --compile-scope module --planners megatron,mosaic \
  --user-programs torch-compile --rounds 3 "${variants[@]}" \
  --out /tmp/qwbench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
tar czf "$OUT/logs.tar.gz" -C /tmp logs
