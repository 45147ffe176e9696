#!/usr/bin/env bash
# One H200, one short device call, results under $1. Twenty-first session (2026-12-03):
# `mosaic train --bf16-weights` now updates a weight at a time where the profiled model
# predicts it at least 1.5% faster. Qwen3-VL `small` b8 is such a row (predicted 2.0%,
# the bench measured 19.59 ms a weight at a time against 20.09 flat): does training say so
# and step at the bench's speed?
set -u
OUT=${1:?usage: train_layout_choice_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout "${LIMIT:-200}" python -m mosaic train qwen3-vl --preset small --batch 8 --bf16-weights \
  --steps 60 --out /tmp/train_qwen > "$OUT/train_qwen.log" 2>&1
echo "train rc=$?"; grep -E "bf16 update|plan=|host-bound|Error" "$OUT/train_qwen.log" | cut -c1-300
cp /tmp/train_qwen/summary.json "$OUT/train_qwen_summary.json" 2>/dev/null
