#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1 (one archive comes back).
# 0. After the green-context layout fix (no quota on the split's leftover SMs alone): the
#    GEMM probe again, and gahc's OFASys `paper` b8 plan, which failed in cuBLAS, eager.
# 1. Unified-IO 2 `small` b8 (1.023x the best baseline on 2026-12-02) again, now that a step's
#    launches take half the host time, and `mosaic train`'s host profile after f31b80c (no
#    parameter walk for one-GPU gradient groups).
# 2. The one-GPU tests not run since the captured update: compile, green contexts, main
#    weights, profiler, sharding (its one-GPU tests).
set -u
OUT=${1:?usage: uio2_row_and_gpu_tests_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 100 python benchmarks/green_gemm_probe.py "$OUT/probe.jsonl" > "$OUT/probe.log" 2>&1
echo "probe rc=$?"; grep -c '"n256": "ok", "n392": "ok"' "$OUT/probe.jsonl"
grep -v '"n256": "ok", "n392": "ok"' "$OUT/probe.jsonl" | cut -c1-200
for weights in bf16 fp32; do
  flag=$([ "$weights" = fp32 ] && echo --fp32)
  timeout 60 python benchmarks/shared_bf16_plans.py ofasys paper 8 gahc --compile none $flag \
    --out "$OUT/gahc_$weights.json" > "$OUT/gahc_$weights.log" 2>&1
  echo "gahc $weights rc=$?"; tail -n 1 "$OUT/gahc_$weights.log" | cut -c1-100
  grep -o '"median_ms.*' "$OUT/gahc_$weights.log" | cut -c1-120
done
bash benchmarks/target_rows_h200.sh "$OUT/rows" unified-io-2:small:8:150 | tail -n 12
timeout 110 python benchmarks/train_host_profile.py "$OUT/train.prof" --from-step 50 -- \
  train clip --preset small --batch 32 --bf16-weights --planner mosaic --steps 300 \
  --out "$OUT/train" > "$OUT/train_profile.txt" 2>&1
echo "train profile rc=$?"; grep -E "plan=|host-bound" "$OUT/train_profile.txt" | cut -c1-300
cp "$OUT/train/summary.json" "$OUT/train_summary.json"; rm -rf "$OUT/train"
timeout 270 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_compile_gpu.py \
  tests/gpu/test_green_gpu.py tests/gpu/test_main_weights_gpu.py tests/gpu/test_profiler_gpu.py \
  tests/gpu/test_sharding_gpu.py --durations 8 > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|ERROR|skipped" "$OUT/gpu_tests.log" | tail -n 12
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
