#!/usr/bin/env bash
# One H200, one device call (about 5 minutes), results under $1.
# The trainer's NaN guard starts with a norm per gradient and turns to AMP's fused check where
# launching a step takes >= 80% of its time (engine/steps.py GuardChoice). This runs:
#  1. the GPU tests of the trainer: the switch on a host-bound run (a NaN step is still skipped
#     after it), steps in flight = steps read one by one, a NaN step skipped on the GPU;
#  2. benchmarks/train_in_flight.py on CLIP `small` b32 (host-bound: launching its step is most
#     of its 9-11 ms): read each step vs in flight, then in flight with 1 row thread, with rows
#     made once, and with the guard held at 'norms' and at 'check'.
set -u
OUT=${1:?usage: guard_switch_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k "host_bound or in_flight or nan_step" > "$OUT/gpu_tests_guard_switch.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests_guard_switch.log"
timeout 200 python benchmarks/train_in_flight.py clip --preset small --batch 32 --steps 40 \
  --rounds 2 --row-variants --guard-variants \
  --out "$OUT/train_in_flight_clip_small_b32_guards.json" > "$OUT/clip.log" 2>&1
echo "clip rc=$?"; grep -E "^round|ms" "$OUT/clip.log" | tail -n 12
