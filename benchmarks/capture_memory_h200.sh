#!/usr/bin/env bash
# One H200, one device call (about 4 minutes), results under $1. Graph capture without the
# eager step's gradients beside it and without two warm-up gradient sets at once (runner /
# graphed.py, 2026-12-04): Qwen3-VL `paper` peaked at 130.5 GiB in capture against 99.0 GiB in
# steady steps before. 1. memory after each phase at b2 and at b8 (the b8 run ran out of
# memory in its first step before); 2. the graphed-module GPU tests.
set -u
OUT=${1:?usage: capture_memory_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
for batch in 2 8; do
  timeout -k 10 100 python benchmarks/train_memory_phases.py qwen3-vl --preset paper \
    --batch "$batch" --bf16-weights --bf16-moments --no-bf16-flat-grads --compile-scope blocks \
    --steps 8 --out "/tmp/tm-b$batch" > "$OUT/phases_b$batch.log" 2>&1
  echo "b$batch rc=$?"; grep -E "^memory|plan=|rror" "$OUT/phases_b$batch.log" | cut -c1-220
  cp "/tmp/tm-b$batch/summary.json" "$OUT/train_qwen3-vl_paper_b${batch}_capture_summary.json" \
    2>/dev/null
done
LIMIT=60 TESTS=tests/gpu/test_graphed_gpu.py bash benchmarks/gpu_tests_h200.sh "$OUT" | head -n 6
