#!/usr/bin/env bash
# One H200, one device call (about 8 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-second session (2026-12-03), not yet run. In that session's bench,
# Unified-IO 2 `paper` b4's bf16 update a weight at a time took 40.96 ms a step (477 Inductor
# kernels, about 2.5 TB/s) and the step 85-86 ms, against 74.4 ms flat; the profiler's own
# measurement of the same update (session 28) was 25.6 ms for the LLM, and `mosaic train`
# with that layout stepped 74.9 ms. Which of the three is off, and why:
#  1. the profiler's measurement again (each module's update alone, both layouts);
#  2. `mosaic train` flat and a weight at a time, each with its last 3 steps traced (the
#     update's kernels, their time and count);
#  3. the bench's per-weight variant alone, traced.
set -u
OUT=${1:?usage: uio2_per_weight_diagnosis_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 120 python benchmarks/main_weights_flat_or_per_weight.py unified-io-2 paper \
  --out "$OUT/main_weights_flat_or_per_weight_unified-io-2_paper.json" 2> /tmp/logs/upd.err
echo "update rc=$?"; tail -n 4 /tmp/logs/upd.err
for layout in bf16-flat-grads no-bf16-flat-grads; do
  timeout 150 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
    --"$layout" --compile-scope blocks --steps 20 --torch-trace "/tmp/trace-$layout" \
    --out "/tmp/train-$layout" > "/tmp/logs/train-$layout.log" 2>&1
  echo "train $layout rc=$?"; grep -E "plan=|Error" "/tmp/logs/train-$layout.log" | cut -c1-240
  cp "/tmp/train-$layout/summary.json" "$OUT/train_$layout.json" 2>/dev/null
  ls /tmp/trace-$layout; head -n 12 /tmp/trace-$layout/kernels-rank0.txt 2>/dev/null
done
n=bench_unified-io-2_paper_1gpu_b4_per_weight_traced
timeout 140 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 2 --plans-at-once 1 --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --torch-trace /tmp/btrace --out /tmp/u2d --json > "$OUT/$n.json" 2> "/tmp/logs/$n.err"
echo "bench rc=$?"; python3 benchmarks/bench_summary.py "$OUT/$n.json"
for dir in /tmp/btrace/*/; do python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 4; done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
