#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1.
# `mosaic train` used to wait for every step before launching the next (its NaN check read
# the gradients' norms on the host before the optimizer): a trace of OFASys `paper` b8 found
# the GPU idle 13.4 of 90 ms a step, and the trained step 15% slower than `mosaic bench`'s.
# Steps are now kept in flight (src/mosaic/engine/steps.py). This runs:
#  1. the GPU tests of the trainer (in flight = read one by one; a NaN step skipped on the GPU);
#  2. benchmarks/train_in_flight.py on CLIP `small` b32 (a short, host-heavy step) and OFASys
#     `paper` b8 compiled by blocks: both modes, alternating, one process each;
#  3. a trace of the OFASys run in flight (kernel time by class, GPU idle per step);
#  4. `mosaic bench` of the same plan on the same machine: the step without the trainer.
set -u
OUT=${1:?usage: train_in_flight_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
SKIP_TESTS=${SKIP_TESTS:-0}
[ "$SKIP_TESTS" = 1 ] || timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k "in_flight or nan_step or graphs_agree" > "$OUT/gpu_tests_in_flight.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests_in_flight.log"
timeout 120 python benchmarks/train_in_flight.py clip --preset small --batch 32 --steps 40 \
  --rounds 2 --out "$OUT/train_in_flight_clip_small_b32.json" > /tmp/logs/clip.log 2>&1
echo "clip rc=$?"; grep -E "^round|ms:" /tmp/logs/clip.log
timeout 360 python benchmarks/train_in_flight.py ofasys --preset paper --batch 8 \
  --compile-scope blocks --steps 30 --rounds 2 --trace-dir /tmp/oftrace \
  --out "$OUT/train_in_flight_ofasys_paper_b8.json" > /tmp/logs/ofasys.log 2>&1
echo "ofasys rc=$?"; grep -E "^round|ms:" /tmp/logs/ofasys.log
mkdir -p "$OUT/ofasys-b8-trace-in-flight"
cp /tmp/oftrace/kernel-time-rank0.json /tmp/oftrace/kernels-rank0.txt \
  "$OUT/ofasys-b8-trace-in-flight/" 2> /dev/null
python -m mosaic kernel-time /tmp/oftrace/trace-rank0.json.gz --steps 3 2> /dev/null | head -n 14
timeout 200 python -m mosaic bench ofasys --gpus 1 --preset paper --batch 8 --planners mosaic \
  --perf-model profiled --compile-scope blocks --user-programs "" --rounds 3 --out /tmp/ofbench \
  --json > "$OUT/bench_ofasys_paper_1gpu_b8_blocks_mosaic.json" 2> /tmp/logs/bench_ofasys.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/bench_ofasys.err | tail -n 2
tar czf "$OUT/logs.tar.gz" -C /tmp logs
