#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-first session (2026-12-03): `mosaic profile --main-weights-only`
# measures each module's bf16 weight update a weight at a time and over one flat buffer, so
# the model can price a plan that updates a weight at a time (Qwen3-VL `small` b8's row missed
# by -10.5% priced as the flat update). Into a copy of the shipped DB: every zoo model at
# `small`, then at `paper` (most useful first), each model stored as it finishes.
set -u
OUT=${1:?usage: main_weights_profile_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout 200 python -m mosaic profile qwen3-vl unified-io-2 ofasys clip imagebind --preset small \
  --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/small.log" 2>&1
echo "small rc=$?"; grep -E "ms, flat|stored|Error|error" "$OUT/small.log" | cut -c1-150
timeout 300 python -m mosaic profile unified-io-2 ofasys clip imagebind --preset paper \
  --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/paper.log" 2>&1
echo "paper rc=$?"; grep -E "ms, flat|stored|Error|error" "$OUT/paper.log" | cut -c1-150
python -m mosaic profile-recipe --db "$OUT/h200.sqlite" | grep -A1 main-weights
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
