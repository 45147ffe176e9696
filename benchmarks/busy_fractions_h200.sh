#!/usr/bin/env bash
# One H200, results under $1: each compiled module's busy fraction (two CUDA graphs of it side
# by side on the whole GPU against one alone) at the grid's middle, preset and largest per-GPU
# batches, added to a copy of the shipped DB; the profiler's GPU tests of it first.
#   bash benchmarks/busy_fractions_h200.sh OUT clip imagebind qwen3-vl unified-io-2
#   PRESET=paper bash benchmarks/busy_fractions_h200.sh OUT clip imagebind
# PRESET (default small): `paper` modules are compiled by blocks, as the engine runs them there.
# The budget stops a call in time; what it measured stays (run the rest next call).
# Pairs the shipped DB holds already are skipped. BUDGET (seconds, default 460); TESTS=0
# skips the GPU tests. Run on 2026-12-02: CLIP, ImageBind (not its vision encoder: budget),
# Qwen3-VL, Unified-IO 2's LLM and text in one call, the rest in a second.
set -u
OUT=${1:?usage: busy_fractions_h200.sh OUT MODEL...}; shift
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
[ "${TESTS:-1}" = 0 ] || timeout 100 python -m pytest -q -m gpu tests/gpu/test_profiler_gpu.py -k "busy or two_copies" \
  > "$OUT/gpu_tests_busy.log" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests_busy.log"
BUDGET=${BUDGET:-460}
PRESET=${PRESET:-small}
kernels=compile-default; [ "$PRESET" = paper ] && kernels=compile-default-blocks
timeout $((BUDGET + 40)) python -m mosaic profile "$@" --preset "$PRESET" --kernels "$kernels" \
  --busy-only --update --budget "$BUDGET" --db "$OUT/h200.sqlite" > /tmp/logs/busy.log 2>&1
echo "profile rc=$?"; grep -E "^\[|busy fractions|wrote" /tmp/logs/busy.log | tail -n 12
python benchmarks/export_busy.py "$OUT/h200.sqlite" "$OUT/busy.json" --preset "$PRESET" --kernels "$kernels"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
