#!/usr/bin/env bash
# One H200, one device call (about 3 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-fourth session (2026-12-03), after early_guard_h200.sh: its GPU test
# of the early check failed (the check's first launch loads its kernels, which synchronises
# the context; the test now warms up) and the trained step gained 0.3 ms a weight at a time.
# The test again, then the trained step traced: does the LLM's check run beside the
# encoders' backward?
# Run in that session; the early check they measured was not kept (no gain: BENCHMARKS.md,
# twenty-fourth session), so run again they measure the guard checked after every backward.
set -u
OUT=${1:?usage: early_guard_trace_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 60 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k early > "$OUT/gpu_tests_early.log" 2>&1
echo "gpu test rc=$?"; tail -n 1 "$OUT/gpu_tests_early.log"
timeout 120 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
  --no-bf16-flat-grads --compile-scope blocks --steps 16 --torch-trace /tmp/trace \
  --out /tmp/train > "$OUT/train_traced.log" 2>&1
echo "train rc=$?"; grep -E "plan=|Error" "$OUT/train_traced.log" | cut -c1-200
python benchmarks/trace_overlap.py /tmp/trace/trace-rank0.json.gz --pattern "norm|reduce_kernel" \
  --out "$OUT/trace_overlap_guard.json"
cp /tmp/trace/kernels-rank0.txt "$OUT/" 2>/dev/null
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
