#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One H200, one device call (under 10 minutes), results under $1.
# 1. `mosaic train --bf16-weights --autotune 2` on CLIP `small` b32 again, now that every
#    bf16 candidate warms up until its update is captured: its per-weight candidate measured
#    18.86 ms against 8.24 flat on 2026-12-03, likely timed while still updating eagerly.
# 2. The Qwen3-VL `small` b8 targets-table row with bf16 weights (one launch a module),
#    megatron's and mosaic's plans beside the user's torch.compile program (the sixteenth
#    session's run had megatron's plan only).
set -u
OUT=${1:?usage: bf16_autotune_rerun_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
name=train_clip_small_b32_bf16_autotune
timeout 150 python -m mosaic train clip --preset small --batch 32 --bf16-weights --autotune 2 \
  --steps 50 --out "$OUT/$name" > "$OUT/$name.log" 2>&1
echo "clip small b32 autotune rc=$?"; grep -E "^autotune: chose|plan=|Error" "$OUT/$name.log" | tail -n 3
cp "$OUT/$name/plan.json" "$OUT/${name}_plan.json" && cp "$OUT/$name/summary.json" "$OUT/${name}_summary.json"
VARIANT=bf16_weights=true PLANNERS=megatron,mosaic bash benchmarks/target_rows_h200.sh "$OUT" \
  qwen3-vl:small:8:380
