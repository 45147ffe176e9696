#!/usr/bin/env bash
# One H200, one device call (about 4 minutes), results under $1 (one archive comes back).
# Twenty-third session (2026-12-03): the per-weight bf16 update's streaming rate by the length
# its kernel was compiled for (update_size_hint.py), then `mosaic train` Unified-IO 2 `paper`
# b4 with bf16 weights updated a weight at a time and flat, the last 3 steps traced.
set -u
OUT=${1:?usage: update_size_hint_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python benchmarks/update_size_hint.py --out "$OUT/update_size_hint.json" --kernels /tmp/logs/kernels
echo "size hint rc=$?"
for layout in no-bf16-flat-grads bf16-flat-grads; do
  timeout 150 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
    --"$layout" --compile-scope blocks --steps 20 --torch-trace "/tmp/trace-$layout" \
    --out "/tmp/train-$layout" > "/tmp/logs/train-$layout.log" 2>&1
  echo "train $layout rc=$?"; grep -E "plan=|Error|launching" "/tmp/logs/train-$layout.log" | cut -c1-240
  cp "/tmp/train-$layout/summary.json" "$OUT/train_$layout.json" 2>/dev/null
  cp "/tmp/trace-$layout/kernels-rank0.txt" "/tmp/logs/kernels-$layout.txt" 2>/dev/null
  grep -E "MainWeightsAdamW|triton_poi_fused__to_copy_add_copy" "/tmp/logs/kernels-$layout.txt" | cut -c1-60,170-400
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
