#!/usr/bin/env bash
# One H200, one device call (at most about 6 minutes), results under $1.
# OFASys `paper` runs compiled by blocks, but the DB held only its module-scope surfaces,
# measured while transformers still built attention masks under compile: with the optimizer
# step measured, its iterations came out 7-13% long. Profile its blocks-compiled modules
# (unmasked) into a copy of the shipped DB (--update keeps everything else).
set -u
OUT=${1:?usage: ofasys_paper_blocks_profile_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout 380 python -m mosaic profile ofasys --preset paper --kernels compile-default-blocks \
  --surfaces-only --update --budget 340 --db "$OUT/h200.sqlite" \
  > /tmp/logs/profile_ofasys_paper_blocks.log 2>&1
echo "profile rc=$?"; grep -E "^\[|optimizer|kept|wrote" /tmp/logs/profile_ofasys_paper_blocks.log | cut -c1-600
tar czf "$OUT/logs.tar.gz" -C /tmp logs
