#!/usr/bin/env bash
# One H200, one device call (at most about 5 minutes), results under $1.
# CLIP's `paper` rows ran compiled by blocks but were predicted from surfaces of the modules
# compiled whole (the shipped DB had no CLIP `paper` surfaces compiled by blocks), so their
# busy fractions bounded nothing. Into OUT/h200.sqlite, a copy of the shipped DB:
#  1. CLIP `paper` surfaces compiled by blocks (--surfaces-only: no colocations, as for the
#     other `paper` models); the optimizer-step fit is measured again with them;
#  2. their busy fractions (--busy-only).
set -u
OUT=${1:?usage: clip_paper_blocks_profile_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
kernels=(--preset paper --kernels compile-default-blocks --update --db "$OUT/h200.sqlite")
timeout 200 python -m mosaic profile clip "${kernels[@]}" --surfaces-only --budget 170 \
  > /tmp/logs/profile_clip_paper_blocks.log 2>&1
echo "surfaces rc=$?"; grep -E "^\[|surface|optimizer|wrote" /tmp/logs/profile_clip_paper_blocks.log | cut -c1-300
timeout 80 python -m mosaic profile clip "${kernels[@]}" --busy-only --budget 50 \
  > /tmp/logs/busy_clip_paper_blocks.log 2>&1
echo "busy rc=$?"; grep -E "^\[|busy fractions|wrote" /tmp/logs/busy_clip_paper_blocks.log | tail -n 4
python benchmarks/export_busy.py "$OUT/h200.sqlite" "$OUT/busy.json" --preset paper \
  --kernels compile-default-blocks
tar czf "$OUT/logs.tar.gz" -C /tmp logs
