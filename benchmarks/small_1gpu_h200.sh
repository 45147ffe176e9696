#!/usr/bin/env bash
# One H200, one device call, results under $1:
#  1. TESTS: GPU test files to run first (their log comes back in logs.tar.gz);
#  2. PROFILE: zoo models whose compiled `small` surfaces the shipped DB lacks, profiled with
#     --update into OUT/h200.sqlite (a stopped run resumes next time) and installed as this
#     working tree's shipped DB, so that
#  3. ROWS ("MODEL:BATCH ..."): each bench plans with them in the run (every planner) and
#     measures the plans beside the user's torch.compile program.
#   TESTS="tests/gpu/test_profiler_gpu.py" PROFILE="ofasys qwen3-vl" PROFILE_BUDGET=250 \
#   ROWS="imagebind:128" ROW_TIMEOUT=170 benchmarks/small_1gpu_h200.sh OUT
set -u
OUT=${1:?usage: small_1gpu_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
DB=src/mosaic/profile/data/h200.sqlite
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_TIMEOUT:-120}" python -m pytest -q -m gpu $TESTS > /tmp/logs/gpu_tests.log 2>&1
  echo "gpu tests rc=$?"; tail -n 2 /tmp/logs/gpu_tests.log
fi
if [ -n "${PROFILE:-}" ]; then
  cp "$DB" "$OUT/h200.sqlite"
  budget=${PROFILE_BUDGET:-250}
  timeout $((budget + 25)) python -m mosaic profile $PROFILE --preset small \
    --kernels compile-default --surfaces-only --update --budget "$budget" \
    --db "$OUT/h200.sqlite" > /tmp/logs/profile_small.log 2>&1
  echo "profile rc=$?"; grep -E "^\[|kept|surface" /tmp/logs/profile_small.log | tail -n 12
  cp "$OUT/h200.sqlite" "$DB"
fi
for row in ${ROWS:-}; do
  model=${row%%:*}; batch=${row##*:}; name=bench_${model}_small_1gpu_b${batch}
  timeout "${ROW_TIMEOUT:-170}" python -m mosaic bench "$model" --gpus 1 --preset small \
    --batch "$batch" --perf-model profiled --user-programs torch-compile --rounds 3 \
    --out "/tmp/$name" --json > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
  echo "$row rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
