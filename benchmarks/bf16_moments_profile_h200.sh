#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1 (one archive comes back).
# Twenty-seventh session (2026-12-04): `mosaic profile --main-weights-only` now measures each
# module's bf16 update with bf16 moments too (both layouts), so the model prices
# `--bf16-moments` from measurements rather than bytes. Into a copy of the shipped DB,
# `paper` first (Unified-IO 2 first: its bench row is the one measured), each model stored as
# it finishes; the limits keep the call inside the session's device time.
set -u
OUT=${1:?usage: bf16_moments_profile_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout -k 5 190 python -m mosaic profile unified-io-2 ofasys clip imagebind --preset paper \
  --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/paper.log" 2>&1
echo "paper rc=$?"; grep -E "llm|stored|Error|error" "$OUT/paper.log" | cut -c1-220
timeout -k 5 120 python -m mosaic profile qwen3-vl unified-io-2 ofasys clip imagebind \
  --preset small --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/small.log" 2>&1
echo "small rc=$?"; grep -E "llm|stored|Error|error" "$OUT/small.log" | cut -c1-220
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
