#!/usr/bin/env bash
# One H200, one device call (about 9 minutes), results under $1.
# 1. The blocks-scope capture GPU test, rewritten to go through the engine's own capture path
#    (the first version built its own capture and failed on 2026-12-01 with
#    cudaErrorStreamCaptureImplicit, while the bench captured the same modules fine).
# 2. OFASys `small` b32 benched again: its gate row ran masked attention, the model now
#    predicts the unmasked kernels. Unified-IO 2 b8 after it, if time is left.
set -u
OUT=${1:?usage: small_rerun_and_blocks_test_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
source benchmarks/bench_small_rows.sh
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_compile_gpu.py \
  -k blocks > "$OUT/gpu_test_blocks.log" 2>&1
echo "gpu test rc=$?"; tail -n 2 "$OUT/gpu_test_blocks.log"
bench_small_rows "$OUT" ofasys:32:320 unified-io-2:8:90
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
