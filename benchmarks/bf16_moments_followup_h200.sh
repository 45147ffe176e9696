#!/usr/bin/env bash
# One H200, one device call (about 9 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-seventh session (2026-12-04), not yet run. 1. every main-weights GPU
# test with the update code as it now is (that session ran only the five its change touched
# most, after the kernel gained the step argument); 2. the `paper` bf16 updates with bf16
# moments of the modules its profile did not reach (OFASys, CLIP, ImageBind: priced by bytes
# until then), each model now starting with a fresh kernel budget (fresh_kernel_budget), into
# a copy of the shipped DB. Then, in a call of its own, the Unified-IO 2 `paper` b4 row with
# bf16 moments beside the user's program:
#   VARIANT=bf16_weights=true,bf16_flat_grads=false,bf16_moments=true PLANNERS=megatron,mosaic \
#     PLANS_AT_ONCE=1 bash benchmarks/target_rows_h200.sh OUT unified-io-2:paper:4:560
set -u
OUT=${1:?usage: bf16_moments_followup_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
LIMIT=320 TESTS=tests/gpu/test_main_weights_gpu.py bash benchmarks/gpu_tests_h200.sh "$OUT" \
  | head -n 16
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout -k 5 200 python -m mosaic profile ofasys clip imagebind --preset paper --update \
  --main-weights-only --db "$OUT/h200.sqlite" > "$OUT/paper.log" 2>&1
echo "paper rc=$?"; grep -E "llm|vision|stored|Error|error" "$OUT/paper.log" | cut -c1-220
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
