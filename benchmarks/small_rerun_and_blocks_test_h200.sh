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
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_compile_gpu.py \
  -k blocks > "$OUT/gpu_test_blocks.log" 2>&1
echo "gpu test rc=$?"; tail -n 2 "$OUT/gpu_test_blocks.log"
for row in ofasys:32:320 unified-io-2:8:90; do
  IFS=: read -r model batch limit <<< "$row"; name=bench_${model}_small_1gpu_b${batch}
  timeout "$limit" python -m mosaic bench "$model" --gpus 1 --preset small --batch "$batch" \
    --perf-model profiled --user-programs torch-compile --rounds 3 --out "/tmp/$name" --json \
    > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
  echo "$model b$batch rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
