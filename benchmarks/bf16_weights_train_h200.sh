#!/usr/bin/env bash
# One H200, one device call (about 7 minutes), results under $1.
# bf16 weights with fp32 main weights, in the trainer (`mosaic train --bf16-weights`): the
# bench measured them as a variant of a plan; this runs
#  1. their GPU tests (the captured optimizer step = the CPU's; a bf16 plan passes the
#     bench's gradient check; training follows fp32 weights and resumes from a checkpoint);
#  2. benchmarks/train_in_flight.py --bf16-weights on CLIP `small` b32 and OFASys `paper` b8
#     (compiled by blocks): fp32 weights read each step / in flight, then bf16 weights in
#     flight, one process each model.
set -u
OUT=${1:?usage: bf16_weights_train_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_main_weights_gpu.py \
  > "$OUT/gpu_tests_main_weights.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|Error|fp32 weights:" "$OUT/gpu_tests_main_weights.log" | tail -n 6
timeout 100 python benchmarks/train_in_flight.py clip --preset small --batch 32 --steps 40 \
  --rounds 1 --bf16-weights --out "$OUT/train_bf16_weights_clip_small_b32.json" > /tmp/logs/clip.log 2>&1
echo "clip rc=$?"; grep -E "^round|ms:" /tmp/logs/clip.log
timeout 280 python benchmarks/train_in_flight.py ofasys --preset paper --batch 8 \
  --compile-scope blocks --steps 30 --rounds 1 --bf16-weights \
  --out "$OUT/train_bf16_weights_ofasys_paper_b8.json" > /tmp/logs/ofasys.log 2>&1
echo "ofasys rc=$?"; grep -E "^round|ms:" /tmp/logs/ofasys.log
tar czf "$OUT/logs.tar.gz" -C /tmp logs
