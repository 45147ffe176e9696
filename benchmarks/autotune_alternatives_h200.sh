#!/usr/bin/env bash
# One H200, one device call (about 8 minutes), results under $1 (one archive comes back).
# Prepared in the twentieth session (2026-12-03): `--autotune K` now measures the mosaic
# search's next-best plans too (mosaic#2...: other sharing modes, groupings one move away).
# Do they find a plan >= 1.05x the best baseline where the planner's own plan fell short?
# CLIP `small` b32 (1.030x) and Unified-IO 2 `small` b8 (1.026x), each bench with K=4 beside
# every planner's plan and the user's torch.compile program, in one process per model.
set -u
OUT=${1:?usage: autotune_alternatives_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
for row in clip:small:32:200 unified-io-2:small:8:220; do
  IFS=: read -r model preset batch limit <<< "$row"
  name=bench_${model}_${preset}_1gpu_b${batch}_autotune4
  timeout "$limit" python -m mosaic bench "$model" --gpus 1 --preset "$preset" --batch "$batch" \
    --perf-model profiled --autotune 4 --user-programs torch-compile --rounds 3 \
    --out "/tmp/$name" --json > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
  echo "$model $preset b$batch rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
  grep -E "^autotune" "/tmp/logs/$name.err" | tail -n 3 | cut -c1-300
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
