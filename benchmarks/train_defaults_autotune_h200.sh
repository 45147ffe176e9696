#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1.
# 1. `mosaic train --bf16-weights --autotune 1` on OFASys `paper` b8 stopped on
#    2026-12-03 with CUBLAS_STATUS_EXECUTION_FAILED in an eager forward (train then ran eagerly
#    by default). Is it the eager path on green-context streams, or the shared bf16 copy?
#    The planner's plan, eager, fp32 and bf16, with launches made blocking so the error
#    names its kernel.
# 2. The same autotune runs with train's new defaults (CUDA graphs, Inductor on a GPU):
#    CLIP `small` b32 K=2 and OFASys `paper` b8 K=1 (by blocks).
set -u
OUT=${1:?usage: train_defaults_autotune_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
for weights in fp32 bf16; do
  flag=$([ "$weights" = bf16 ] && echo --bf16-weights)
  name=train_ofasys_paper_b8_eager_${weights}
  CUDA_LAUNCH_BLOCKING=1 timeout 90 python -m mosaic train ofasys --preset paper --batch 8 \
    $flag --no-graphs --compile none --planner mosaic --steps 3 > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"; grep -E "plan=|Error|error" "$OUT/$name.log" | tail -n 3 | cut -c1-300
done
for row in clip:small:32:2:50:module:150 ofasys:paper:8:1:30:blocks:300; do
  IFS=: read -r model preset batch k steps scope limit <<< "$row"
  name=train_${model}_${preset}_b${batch}_bf16_autotune
  timeout "$limit" python -m mosaic train "$model" --preset "$preset" --batch "$batch" \
    --bf16-weights --autotune "$k" --steps "$steps" --compile-scope "$scope" \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$model $preset b$batch rc=$?"
  grep -E "^autotune: chose|plan=|^mosaic: error|Error" "$OUT/$name.log" | tail -n 3 | cut -c1-300
done
