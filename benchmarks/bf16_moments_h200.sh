#!/usr/bin/env bash
# One H200, one device call (about 7 minutes), results under $1 (one archive comes back).
# Twenty-seventh session (2026-12-04): bf16 AdamW moments for the bf16 weights
# (`--bf16-moments`, main_weights moments="bf16", stochastic rounding). 1. their GPU tests
# (rounding afresh each graph replay; the captured compiled update against fp32 moments);
# 2. Unified-IO 2 `paper` b4, megatron's plan (the planner's there), updated a weight at a
# time with fp32 and with bf16 moments, one process, and the fp32 plan beside them; 3. the
# shipped DB's bf16 update entries measured again (main_weights.py changed: their key), into
# a copy of the DB, `paper` first.
set -u
OUT=${1:?usage: bf16_moments_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
LIMIT=150 TESTS=tests/gpu/test_main_weights_gpu.py bash benchmarks/gpu_tests_h200.sh "$OUT" \
  -k "moments or stochastic or per_length or captured_compiled or one_graph" | head -n 8
n=bench_unified-io-2_paper_1gpu_b4_bf16_moments
timeout -k 10 300 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 3 --plans-at-once 1 --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --engine-variant bf16_weights=true,bf16_flat_grads=false,bf16_moments=true \
  --out /tmp/u2 --json > "$OUT/$n.json" 2> "$OUT/$n.err"
echo "bench rc=$?"; grep -E "^mosaic bench|Error" "$OUT/$n.err" | tail -n 4 | cut -c1-200
python3 benchmarks/bench_summary.py "$OUT/$n.json" | tail -n 6
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout -k 5 150 python -m mosaic profile unified-io-2 ofasys clip imagebind --preset paper \
  --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/paper.log" 2>&1
echo "paper rc=$?"; grep -E "ms, flat|stored|Error|error" "$OUT/paper.log" | cut -c1-150
timeout -k 5 110 python -m mosaic profile qwen3-vl unified-io-2 ofasys clip imagebind \
  --preset small --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/small.log" 2>&1
echo "small rc=$?"; grep -E "ms, flat|stored|Error|error" "$OUT/small.log" | cut -c1-150
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
