#!/usr/bin/env bash
# One H200, one device call (about 7 minutes), results under $1. Ran 2026-12-03 (results in
# benchmarks/results/bf16-qwen-eager-floor-h200/) with the session's last 338 s of device
# time: part 1 finished, part 2 did not start.
#  1. Qwen3-VL `small` b8, bf16 weights flat and a weight at a time, beside the user's
#     torch-eager and torch-compile programs: its gradient check against the fp32 plan refused
#     the bf16 contenders (text 0.0189, tolerance 0.00291 = 4 x torch-compile's difference
#     from the compiled plan) on 2026-12-03; with torch-eager the reference is eager and the
#     floor is compiled-vs-eager, the difference the tolerance is meant to measure.
#  2. Unified-IO 2 `paper`: the main-weights update per module, flat or a weight at a time
#     (benchmarks/main_weights_flat_or_per_weight.py; its first run outlasted 60 s).
set -u
OUT=${1:?usage: bf16_qwen_eager_floor_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
name=bench_qwen3-vl_small_1gpu_b8_bf16_eager_floor
timeout 300 python -m mosaic bench qwen3-vl --gpus 1 --preset small --batch 8 \
  --perf-model profiled --compile-scope module --planners megatron \
  --user-programs torch-eager,torch-compile --rounds 3 --engine-variant bf16_weights=true \
  --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --out /tmp/qwbench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep -E "^mosaic( bench|: error)" /tmp/logs/$name.err | tail -n 2
python3 benchmarks/bench_summary.py "$OUT/$name.json"
python3 -c "
import json, sys
report = json.load(open(sys.argv[1]))
print(json.dumps(report['checks'].get('gradients'))[:600])
for r in report['results']:
    print(r['planner'], {m: round(e, 5) for m, e in r.get('grad_error', {}).items()})" "$OUT/$name.json"
timeout 170 python benchmarks/main_weights_flat_or_per_weight.py unified-io-2 paper \
  --out "$OUT/main_weights_flat_or_per_weight_unified-io-2_paper.json" 2> /tmp/logs/update_u2.err
echo "update rc=$?"; tail -n 3 /tmp/logs/update_u2.err
tar czf "$OUT/logs.tar.gz" -C /tmp logs
