#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1 (one archive comes back).
# After the nineteenth session's first call (captured_optimizer_h200.sh): the bf16 NaN test
# on math attention kernels, how far two clean runs drift (benchmarks/run_to_run_weights.py),
# which encoders at once make gahc's OFASys plan fail (shared_bf16_failure_h200.sh, fewer),
# and the GPU tests of the bench, checkpoints and graphed modules.
set -u
OUT=${1:?usage: nan_guard_followup_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k nan > "$OUT/gpu_nan_tests.log" 2>&1
echo "nan tests rc=$?"; tail -n 2 "$OUT/gpu_nan_tests.log"
timeout 120 python benchmarks/run_to_run_weights.py "$OUT/run_to_run_weights.json" 2>&1 \
  | grep -E "^(default|math)|Error"
SETS=fewer bash benchmarks/shared_bf16_failure_h200.sh "$OUT/fewer"
timeout 190 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_bench_gpu.py \
  tests/gpu/test_checkpoint_gpu.py tests/gpu/test_graphed_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "bench/checkpoint/graphed tests rc=$?"
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -n 5
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
