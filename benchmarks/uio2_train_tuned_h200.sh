#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-third session (2026-12-03), not yet run. With the per-weight update
# kernel tuned on a large update first (main_weights.TUNING_LENGTH): `mosaic train
# --bf16-weights` on Unified-IO 2 `paper` b4 as a user runs it (it chooses the layout from the
# model; the bench measured 71.84 ms a weight at a time, 74.74 flat), then the main-weights
# GPU tests. Run `main_weights_profile_h200.sh` in another call to measure the shipped
# per-weight entries again with the tuned kernel.
set -u
OUT=${1:?usage: uio2_train_tuned_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
  --compile-scope blocks --steps 30 --out /tmp/train_u2 > /tmp/logs/train_u2.log 2>&1
echo "train rc=$?"; grep -E "bf16 update|plan=|host-bound|Error" /tmp/logs/train_u2.log | cut -c1-300
cp /tmp/train_u2/summary.json "$OUT/train_unified-io-2_paper_tuned_summary.json" 2>/dev/null
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_main_weights_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests.log"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
