#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1.
# 1. `mosaic train --bf16-weights --autotune 1` on OFASys `paper` b8 stopped on
#    2026-12-03 with CUBLAS_STATUS_EXECUTION_FAILED in an eager forward (train then ran eagerly
#    by default). Is it the eager path on green-context streams, bf16 weights, or autotune's
#    shared bf16 copy? The planner's plan, eager, 3 steps, launches made blocking so the
#    error names its kernel; if it fails, again in fp32 and megatron's plan (no SM quotas).
# 2. The same autotune runs with train's new defaults (CUDA graphs, Inductor on a GPU):
#    CLIP `small` b32 K=2 and OFASys `paper` b8 K=1 (by blocks).
set -u
OUT=${1:?usage: train_defaults_autotune_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
eager() {  # name, planner, extra flags
  CUDA_LAUNCH_BLOCKING=1 timeout 80 python -m mosaic train ofasys --preset paper --batch 8 \
    --no-graphs --compile none --planner "$2" --steps 3 --out "$OUT/$1" ${3:-} \
    > "$OUT/$1.log" 2>&1
  local rc=$?
  echo "$1 rc=$rc"; grep -E "plan=|Error|error" "$OUT/$1.log" | tail -n 3 | cut -c1-300
  return $rc
}
if ! eager train_ofasys_paper_b8_eager_bf16_mosaic mosaic --bf16-weights; then
  eager train_ofasys_paper_b8_eager_fp32_mosaic mosaic
  eager train_ofasys_paper_b8_eager_bf16_megatron megatron --bf16-weights
fi
for row in clip:small:32:2:50:module:120 ofasys:paper:8:1:30:blocks:260; do
  IFS=: read -r model preset batch k steps scope limit <<< "$row"
  name=train_${model}_${preset}_b${batch}_bf16_autotune
  timeout "$limit" python -m mosaic train "$model" --preset "$preset" --batch "$batch" \
    --bf16-weights --autotune "$k" --steps "$steps" --compile-scope "$scope" \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$model $preset b$batch rc=$?"
  grep -E "^autotune: chose|plan=|^mosaic: error|Error" "$OUT/$name.log" | tail -n 3 | cut -c1-300
done
