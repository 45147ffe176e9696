#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1. Unified-IO 2 `paper` b4
# with bf16 weights ran 72.21 ms updating a weight at a time against 74.75 ms over flat
# buffers (2026-12-03, bf16-flat-or-per-weight-h200/), the reverse of Qwen3-VL `small` b8's
# 1.084x for the flat update (2026-12-02). So, per module of five zoo models:
#  1. the captured update a weight at a time, over the flat buffer, and the backward's
#     gradient copy into it (benchmarks/main_weights_flat_or_per_weight.py);
#  2. Qwen3-VL `small` b8, flat and a weight at a time, traced, beside the user's
#     torch.compile program (its first try, in the run above, ran out of time compiling).
set -u
OUT=${1:?usage: bf16_update_per_module_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
for pair in unified-io-2:paper qwen3-vl:small ofasys:small ofasys:paper clip:paper imagebind:paper; do
  model=${pair%%:*} preset=${pair##*:}
  timeout 60 python benchmarks/main_weights_flat_or_per_weight.py "$model" "$preset" \
    --out "$OUT/main_weights_flat_or_per_weight_${model}_${preset}.json" \
    2> "/tmp/logs/update_${model}_${preset}.err" | tail -n +1
  echo "rc=$?"
done
name=bench_qwen3-vl_small_1gpu_b8_bf16_flat_or_per_weight
timeout 330 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --compile-scope module --planners megatron,mosaic \
  --user-programs torch-compile --rounds 3 --engine-variant bf16_weights=true \
  --engine-variant bf16_weights=true,bf16_flat_grads=false --torch-trace /tmp/qwtrace \
  --out /tmp/qwbench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
for dir in /tmp/qwtrace/*/; do
  label=$(basename "$dir"); cp "$dir/kernel-time-rank0.json" "$OUT/kernel-time-qwen-$label.json"
  echo "== $label"; python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 7
done
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
tar czf "$OUT/logs.tar.gz" -C /tmp logs
