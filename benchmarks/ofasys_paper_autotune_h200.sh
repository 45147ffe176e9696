#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1 (one archive comes back).
# Twenty-second session (2026-12-03). OFASys `paper` b8 with fp32 weights is the one-GPU
# preset row closest to its target (mosaic's plan 1.047x megatron's, 1.071x torch-compile):
# does `--autotune 4` (the mosaic search's next-best plans measured too) find a plan >= 1.05x
# the best baseline? Every planner's plan and the user's torch.compile program, one process.
set -u
OUT=${1:?usage: ofasys_paper_autotune_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
n=bench_ofasys_paper_1gpu_b8_autotune4
timeout "${LIMIT:-550}" python -m mosaic bench ofasys --gpus 1 --preset paper --batch 8 \
  --perf-model profiled --compile-scope blocks --autotune 4 --user-programs torch-compile \
  --rounds 3 --plans-at-once 2 --out /tmp/ofbench --json > "$OUT/$n.json" 2> "/tmp/logs/$n.err"
echo "bench rc=$?"; grep -E "^mosaic( bench|: error)" "/tmp/logs/$n.err" | tail -n 2
grep -E "^autotune" "/tmp/logs/$n.err" | tail -n 3 | cut -c1-300
python3 benchmarks/bench_summary.py "$OUT/$n.json"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
