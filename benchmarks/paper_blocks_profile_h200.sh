#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One H200, one device call (at most about 9.5 minutes), results under $1.
# Unified-IO 2 `paper` has no measured surface (every module is predicted by the analytic
# fallback: -1.5% to +3.6% at b4-b16 with the nearest-points calibration, +9 to +13% with one
# mean factor) and neither has ImageBind's `paper` vision encoder. The
# engine runs `paper` compiled by blocks (35 s of compiling where whole modules took 174 s),
# so this profiles those kernels (`compile-default-blocks`), then benches Unified-IO 2
# `paper` at its preset batch 4 with the new surfaces, every planner, one plan at a time
# (`--plans-at-once 1`: four plans' graph pools did not fit side by side; first GPU run of that
# mode), and keeps mosaic's traced step: its MFU there was 21.8% (target 35%), and the trace
# shows what bounds it.
#  1. profile into OUT/h200.sqlite (a copy of the shipped DB; --update resumes a stopped run,
#     so a second call finishes what the first's budget left), installed in this tree;
#  2. the bench, whose predictions use the new surfaces (the gate re-predicts it on CPU too).
set -u
OUT=${1:?usage: paper_blocks_profile_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
DB=src/mosaic/profile/data/h200.sqlite
cp "$DB" "$OUT/h200.sqlite"
timeout 320 python -m mosaic profile unified-io-2 imagebind --preset paper \
  --kernels compile-default-blocks --surfaces-only --update --budget 290 \
  --db "$OUT/h200.sqlite" > /tmp/logs/profile_paper_blocks.log 2>&1
echo "profile rc=$?"; grep -E "^\[|surface|kept" /tmp/logs/profile_paper_blocks.log | tail -n 6
cp "$OUT/h200.sqlite" "$DB"
timeout 240 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --plans-at-once 1 \
  --perf-model profiled --compile-scope blocks --user-programs "" \
  --rounds 3 --out /tmp/u2p --json > "$OUT/bench_unified-io-2_paper_1gpu_b4_blocks.json" \
  2> /tmp/logs/bench_u2p.err
echo "unified-io-2 paper b4 rc=$?"; grep "^mosaic bench" /tmp/logs/bench_u2p.err | tail -n 2
cp /tmp/u2p/mosaic.trace.json "$OUT/unified-io-2_paper_b4_mosaic.trace.json" 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
