#!/usr/bin/env bash
# One H200, one device call (about 5 minutes), results under $1 (one archive comes back).
# Twenty-sixth session (2026-12-04). The bf16 update a weight at a time now compiles a
# kernel for each weight length (main_weights.MAX_STATIC_KERNELS), each autotuned on its own
# length, instead of one kernel for every length, which ran about 2.5 TB/s in today's bench
# (benchmarks/uio2_per_weight_user_program_h200.sh): 1. the same bench again (fp32 weights
# and bf16 a weight at a time, one process); 2. the shipped DB's bf16 update entries measured
# again with this code (its digest changed), `paper` first, into a copy of the DB.
set -u
OUT=${1:?usage: update_per_length_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
n=bench_unified-io-2_paper_1gpu_b4_per_length
timeout -k 10 120 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 2 --plans-at-once 1 --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --out /tmp/u2 --json > "$OUT/$n.json" 2> "$OUT/$n.err"
echo "bench rc=$?"; grep "^mosaic bench" "$OUT/$n.err" | tail -n 3 | cut -c1-160
python3 benchmarks/bench_summary.py "$OUT/$n.json" | tail -n 4
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout -k 5 140 python -m mosaic profile unified-io-2 ofasys clip imagebind --preset paper \
  --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/paper.log" 2>&1
echo "paper rc=$?"; grep -E "ms, flat|stored|Error|error" "$OUT/paper.log" | cut -c1-150
timeout -k 5 100 python -m mosaic profile qwen3-vl unified-io-2 ofasys clip imagebind \
  --preset small --update --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/small.log" 2>&1
echo "small rc=$?"; grep -E "ms, flat|stored|Error|error" "$OUT/small.log" | cut -c1-150
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
