#!/usr/bin/env bash
# One H200, one device call (about 7 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-sixth session (2026-12-04), not yet run: the bf16 update a weight at
# a time compiles a kernel per weight length since that session (main_weights.MAX_STATIC_KERNELS),
# checked on the GPU then only by a bench and the profiler. 1. the main-weights GPU tests
# (the per-length test new); 2. the trained step of Unified-IO 2 `paper` b4 with bf16 weights
# (train picks the update a weight at a time; 74.4-75.1 ms with the one kernel for every length,
# the bench 71.05 ms with the per-length kernels).
set -u
OUT=${1:?usage: per_length_followup_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
LIMIT=300 TESTS=tests/gpu/test_main_weights_gpu.py bash benchmarks/gpu_tests_h200.sh "$OUT" \
  | head -n 16
timeout -k 10 180 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
  --compile-scope blocks --steps 40 --out /tmp/train-u2 > "$OUT/train_u2.log" 2>&1
echo "train rc=$?"; grep -E "plan=|bf16 update|Error" "$OUT/train_u2.log" | cut -c1-240
cp /tmp/train-u2/summary.json "$OUT/train_unified-io-2_paper_b4_bf16_summary.json" 2>/dev/null
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
