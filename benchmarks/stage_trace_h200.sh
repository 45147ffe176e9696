#!/usr/bin/env bash
# One H200, one device call (6.6 minutes on 2026-12-02: results/stage-trace-h200/, its DB
# shipped), results under $1.
# Where do colocated plans lose the saving the model predicts at 4x the preset batch (8% of it
# realised for ImageBind `small` b128, 16-40% for CLIP b128)? Since 2026-12-02 `mosaic bench`
# keeps each plan's traced step in its results and `mosaic model-error --iterations DIR
# --stages` compares it with the model stage by stage. This call:
#  1. measures ImageBind's compiled `small` surfaces again with the profiler's new first pass
#     (96 SMs and the preset's batch 32 included; the last run's surfaces held no green-context
#     point between 64 SMs and the whole GPU, where the plans' caps sit);
#  2. benches ImageBind `small` at b128, the one-by-one plan (megatron) beside mosaic's,
#     predicted from that new DB, their traced steps kept in the results JSON (no user
#     program: this run is about where time goes, not a speed claim);
#  3. prints the whole-step and the stage-by-stage errors, old DB and new.
# Afterwards, on the CPU: if the new surfaces predict better, copy OUT/h200.sqlite over the
# shipped DB, refit the engine terms (`mosaic profile-recipe`, steps 7 to 9) and render.
set -u
OUT=${1:?usage: stage_trace_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
# The first pass is no longer cut by the budget (88 points, about 250 s, plus 80 s compiling).
BUDGET=300 TIMEOUT=390 bash benchmarks/reprofile_unmasked_h200.sh "$OUT" imagebind
name=bench_imagebind_small_1gpu_b128
timeout 170 python -m mosaic bench imagebind --gpus 1 --preset small --batch 128 \
  --planners megatron,mosaic --perf-model profiled --profile-db "$OUT/h200.sqlite" \
  --user-programs "" --rounds 3 --json > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
echo "bench rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
for db in src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"; do
  echo "== $db"
  python -m mosaic model-error --iterations "$OUT" --db "$db" 2>&1 | tail -n 2
  python -m mosaic model-error --iterations "$OUT" --stages --db "$db" 2>&1 | tail -n 8
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
