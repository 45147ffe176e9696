#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1 (one archive comes back).
# Prepared in the twentieth session (2026-12-03), after its device time ran out:
# 1. Are the GPU machine's plans the CPU's now that the ProfileDB stores its surface fits?
#    (gahc's OFASys `paper` plan differed before.) plan_fingerprints.py against the CPU's file.
# 2. The GEMM probe with partitions laid smallest first (120 + 8: the 120 takes the leftover).
# 3. The one-GPU tests that did not finish on 2026-12-03 (compile, profiler, sharding) and the
#    green-context tests after the partition order changed.
set -u
OUT=${1:?usage: plans_and_gpu_tests_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 120 python benchmarks/plan_fingerprints.py "$OUT/fingerprints_gpu.json" \
  --against benchmarks/plans/fingerprints_cpu.json > "$OUT/fingerprints.txt" 2>&1
echo "fingerprints rc=$?"; head -c 1500 "$OUT/fingerprints.txt"
CUDA_LAUNCH_BLOCKING=1 timeout 100 python benchmarks/green_gemm_probe.py "$OUT/probe.jsonl" \
  > "$OUT/probe.log" 2>&1
echo "probe rc=$?"; grep -c '"n256": "ok", "n392": "ok"' "$OUT/probe.jsonl"
grep -v '"n256": "ok", "n392": "ok"' "$OUT/probe.jsonl" | cut -c1-200
grep '"part' "$OUT/probe.jsonl" | cut -c1-160
timeout 330 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_green_gpu.py \
  tests/gpu/test_compile_gpu.py tests/gpu/test_profiler_gpu.py tests/gpu/test_sharding_gpu.py \
  --durations 8 -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -n 12
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
