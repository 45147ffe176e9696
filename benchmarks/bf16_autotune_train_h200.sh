#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One H200, one device call (under 10 minutes), results under $1.
# `mosaic train --bf16-weights --autotune K` since the candidates share one bf16 copy and the
# best predicted plan is also measured updating a weight at a time (2026-12-03; CPU-tested):
# does it run on the GPU, what does it choose, and what does its start-up cost? CLIP `small`
# b32 and OFASys `paper` b8 (whose bf16 mosaic plan ran 72.51 ms in `mosaic bench`).
set -u
OUT=${1:?usage: bf16_autotune_train_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
for row in clip:small:32:2:50:module:200 ofasys:paper:8:1:30:blocks:360; do
  IFS=: read -r model preset batch k steps scope limit <<< "$row"
  name=train_${model}_${preset}_b${batch}_bf16_autotune
  timeout "$limit" python -m mosaic train "$model" --preset "$preset" --batch "$batch" \
    --bf16-weights --autotune "$k" --steps "$steps" --compile-scope "$scope" \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  echo "$model $preset b$batch rc=$?"
  grep -E "^autotune: chose|plan=|^mosaic: error" "$OUT/$name.log" | tail -n 3
done
