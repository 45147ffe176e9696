#!/usr/bin/env bash
# Ran 2026-12-03 (nineteenth session; results captured-optimizer-h200/). One H200, one
# device call (under 10 minutes), results under $1.
# The eighteenth session captured torch's fused AdamW as a CUDA graph (fp32 runs, and the fp32
# parameters of bf16 runs) and cut a trained step's per-step host walks, on the CPU only:
# 1. the GPU tests of the captured update (also on a module's own stream: overlapped) and of
#    the NaN guard over flat gradient buffers;
# 2. `mosaic train clip --preset small --batch 32`, fp32 and bf16 weights, 300 steps: step and
#    host-launch medians (bf16 before: 10.1 ms a step, 9.5 launching), then the bf16 run's
#    steady steps under cProfile (before: train-host-profile-h200/);
# 3. CLIP `small` b32's targets row again (its plans' steps are host-bound).
set -u
OUT=${1:?usage: captured_optimizer_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 180 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_main_weights_gpu.py \
  tests/gpu/test_engine_gpu.py -k "captured or one_launch or nan or overlapped" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -n 2 "$OUT/gpu_tests.log"
for weights in fp32 bf16; do
  flag=(); [ "$weights" = bf16 ] && flag=(--bf16-weights)
  timeout 80 python -m mosaic train clip --preset small --batch 32 "${flag[@]}" --planner mosaic \
    --steps 300 --out "/tmp/train_$weights" > "$OUT/train_$weights.log" 2>&1
  echo "train $weights rc=$?"; grep -E "plan=|host-bound|eagerly" "$OUT/train_$weights.log"
  cp "/tmp/train_$weights/summary.json" "$OUT/train_${weights}_summary.json"
done
timeout 80 python benchmarks/train_host_profile.py "$OUT/train.prof" --from-step 50 -- \
  train clip --preset small --batch 32 --bf16-weights --planner mosaic --steps 300 \
  --out /tmp/train_profiled > "$OUT/train_profile.txt" 2>&1
echo "profiled rc=$?"; grep -v "^$" "$OUT/train_profile.txt" | grep -vi warning | tail -n 40
bash benchmarks/target_rows_h200.sh "$OUT" clip:small:32:150
# At most 8 files come back from a device call: everything in one archive.
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
