#!/usr/bin/env bash
# Ran 2026-12-02 (results/compiled-colocations-h200/): CLIP's 8 colocations, then ImageBind's
# replay faulted (the profiler freed cuBLAS workspaces between captures; fixed since, and
# ImageBind's 32 were measured by the same profile command alone). One H200, one device call
# (about 9 minutes), results under $1.
# At 4x the preset batch the model predicted colocated plans 2-8% faster than the sequential
# ones, and they measured between 0.7% slower and 1.5% faster: its interference coefficients
# were fitted on eager colocations only. This measures colocations of the compiled modules
# (the engine's kernels),
# which the profiled model fits its own interference on once there are 12 of them, then
# re-plans ImageBind at batch 128 with them, with measured plan selection (--autotune 3) on:
#  1. bandwidth signatures and colocations of compiled CLIP and ImageBind at `small` (their
#     surfaces are kept: --update; about 40 colocations: pairs and the triple of ImageBind's
#     encoders, four sharing modes, two batches), into OUT/h200.sqlite; `mosaic profile`
#     stores the compiled interference fit it makes of them;
#  2. the held-out colocation error of that fit (model_error_compile-default.json);
#  3. ImageBind b128 planned with the new DB, autotune's start-up cost in its JSON.
set -u
OUT=${1:?usage: compiled_colocations_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
DB=src/mosaic/profile/data/h200.sqlite
cp "$DB" "$OUT/h200.sqlite"
timeout 300 python -m mosaic profile clip imagebind --preset small \
  --kernels compile-default --update --budget 280 --db "$OUT/h200.sqlite" \
  > /tmp/logs/profile_colocations.log 2>&1
echo "profile rc=$?"; grep -E "^\[|colocations" /tmp/logs/profile_colocations.log | tail -n 8
python -m mosaic model-error --db "$OUT/h200.sqlite" --kernels compile-default --json \
  > "$OUT/model_error_compile-default.json" 2> /tmp/logs/model_error.err
echo "model-error rc=$?"
cp "$OUT/h200.sqlite" "$DB"
timeout 200 python -m mosaic bench imagebind --gpus 1 --preset small --batch 128 \
  --perf-model profiled --autotune 3 --user-programs torch-compile --rounds 3 \
  --out /tmp/ib --json > "$OUT/bench_imagebind_small_1gpu_b128_autotune.json" \
  2> /tmp/logs/bench_imagebind_autotune.err
echo "imagebind autotune rc=$?"; grep "^mosaic bench" /tmp/logs/bench_imagebind_autotune.err | tail -n 3
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
