#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1. Ran 2026-12-03: results in
# benchmarks/results/bf16-flat-or-per-weight-h200/ (the Qwen3-VL part outlasted its 200 s
# compiling on a fresh machine; bf16_update_per_module_h200.sh measured it again).
# Unified-IO 2 `paper` b4 with bf16 weights ran 72.10 ms when its optimizer went a weight at a
# time (2026-12-02) and 74.4-74.6 ms in three runs since it updates each module in one launch
# over flat buffers, whose gradients the backward graph copies (copy/cast +4.1 ms a step in
# its trace); Qwen3-VL `small` b8 gained 1.084x from the same change. One run measures both:
#  1. Unified-IO 2 `paper` b4, megatron's plan (the planner's): fp32; bf16 weights flat; bf16
#     weights a weight at a time (`bf16_flat_grads=false`); the latter with the overlapped
#     update; traced (update and copy kernels per step);
#  2. the GPU tests of the bf16 plans' gradients (flat and a weight at a time) against the
#     fp32 user program, and of the overlapped optimizer over six steps (its captured update);
#  3. Qwen3-VL `small` b8 the same ways beside the user's torch.compile program (the bf16
#     column of the targets table; its row there predates the one-launch update).
set -u
OUT=${1:?usage: bf16_flat_or_per_weight_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
variants=(--engine-variant bf16_weights=true
          --engine-variant bf16_weights=true,bf16_flat_grads=false
          --engine-variant bf16_weights=true,bf16_flat_grads=false,optimizer_overlap=true)
name=bench_unified-io-2_paper_1gpu_b4_bf16_flat_or_per_weight
timeout 230 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 3 --plans-at-once 1 "${variants[@]}" --torch-trace /tmp/u2trace \
  --out /tmp/u2bench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
for dir in /tmp/u2trace/*/; do
  label=$(basename "$dir"); cp "$dir/kernel-time-rank0.json" "$OUT/kernel-time-u2-$label.json"
  echo "== $label"; python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 7
done
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_main_weights_gpu.py \
  tests/gpu/test_engine_gpu.py -k "fp32_user_program or overlapped" \
  > "$OUT/gpu_tests_main_weights.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_tests_main_weights.log" | tail -n 4
name=bench_qwen3-vl_small_1gpu_b8_bf16_flat_or_per_weight
timeout 200 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --compile-scope module --planners megatron,mosaic \
  --user-programs torch-compile --rounds 3 "${variants[@]:0:4}" \
  --out /tmp/qwbench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
tar czf "$OUT/logs.tar.gz" -C /tmp logs
