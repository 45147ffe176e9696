#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1. Twenty-second session
# (2026-12-03): the GPU tests not run since the split's groups became a GPU fact
# (GPUSpec.split_groups) and since the bf16 update was profiled per module: the green-context
# pool's (with the start-up GEMM check, forced onto the split's leftover alone) and the main
# weights' (their profile's measurement included).
set -u
OUT=${1:?usage: gpu_tests_after_split_groups_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout "${LIMIT:-500}" python -m pytest -m gpu -q -p no:cacheprovider \
  tests/gpu/test_green_gpu.py tests/gpu/test_main_weights_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|Error" "$OUT/gpu_tests.log" | tail -n 8
