#!/usr/bin/env bash
# One H200, one device call (about 5 minutes), results under $1.
# On a GPU `mosaic train` draws the zoo's synthetic rows on the device (engine/rows.py
# RowsOnDevice). First run (2026-12-02, results/rows-on-device-h200/), rows drawn sample by
# sample: CLIP `small` b32 stepped in 12.58 ms (14.27 in flight) against 16.82 ms with eight
# host threads and 8.41 ms with rows made once. Each module's whole global batch is now one
# draw: run again (2026-12-02, results/rows-on-device-whole-batch-h200/) it stepped in 8.12 ms
# in flight, as with rows made once (8.13). It runs:
#  1. the GPU tests of the rows (every split draws the same samples on the GPU) and of the
#     trainer (steps in flight = read one by one; a NaN step skipped on the GPU);
#  2. benchmarks/train_in_flight.py on CLIP `small` b32: read each step vs in flight with rows
#     on the GPU, then with rows on the host (the trainer's threads, and one thread) and with
#     rows made once: whether rows on the GPU reach the made-once step.
set -u
OUT=${1:?usage: rows_on_device_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_prefetch.py \
  tests/gpu/test_engine_gpu.py -k "split or pinned or in_flight or nan_step" \
  > "$OUT/gpu_tests_rows.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests_rows.log"
timeout 240 python benchmarks/train_in_flight.py clip --preset small --batch 32 --steps 40 \
  --rounds 2 --row-variants --out "$OUT/train_in_flight_clip_small_b32_rows.json" \
  > "$OUT/clip.log" 2>&1
echo "clip rc=$?"; grep -E "^round|ms" "$OUT/clip.log" | tail -n 10
