#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1 (one archive comes back).
# Twenty-second session (2026-12-03). Unified-IO 2 `paper` b4 with bf16 weights on today's
# engine (the update captured with its gradients; the per-weight row before was measured
# before that capture): megatron's plan (the planner's at b4) with the update flat and a
# weight at a time, in one process; then `mosaic train --bf16-weights`, which should choose a
# weight at a time (the profiled model predicts it about 4% of a step faster). BENCH_ONLY=1:
# the bench alone (run again so, after the bf16 group's out-of-memory fix, as its own call).
set -u
OUT=${1:?usage: uio2_paper_layout_choice_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
n=bench_unified-io-2_paper_1gpu_b4_bf16_flat_or_per_weight
timeout 320 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 3 --plans-at-once 1 --engine-variant bf16_weights=true \
  --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --out /tmp/u2bench --json > "$OUT/$n.json" 2> "/tmp/logs/$n.err"
echo "bench rc=$?"; grep -E "^mosaic( bench|: error)" "/tmp/logs/$n.err" | tail -n 2
python3 benchmarks/bench_summary.py "$OUT/$n.json"
if [ -z "${BENCH_ONLY:-}" ]; then
  timeout 250 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
    --compile-scope blocks --steps 30 --out /tmp/train_u2 > /tmp/logs/train_u2.log 2>&1
  echo "train rc=$?"; grep -E "bf16 update|plan=|host-bound|Error" /tmp/logs/train_u2.log | cut -c1-300
  cp /tmp/train_u2/summary.json "$OUT/train_unified-io-2_paper_summary.json" 2>/dev/null
fi
tar czf "$OUT/logs.tar.gz" -C /tmp logs
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
