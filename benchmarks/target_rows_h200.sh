#!/usr/bin/env bash
# One H200, one device call, results under $1; then MODEL:PRESET:BATCH:LIMIT_S rows to bench,
# each with every planner against the user's torch.compile program (compiled whole), the
# engine compiled by blocks at `paper` and whole at `small`. The default rows are the one-GPU
# targets table's combinations that fit and were never measured with the user's program
# beside the plans (BENCHMARKS.md, "Where the one-GPU engine-speed targets stand"):
#   clip:small:32:150 ofasys:small:8:400      (one call, about 9 minutes with cold caches)
#   ofasys:paper:32:560                        (a call of its own; PLANS_AT_ONCE=2 if memory
#                                               runs out: four plans' graph pools at b32)
# Optional: VARIANT=bf16_weights=true measures every plan again with that engine variant
# (`--engine-variant`, results named ..._<field> after the first; several, space-separated,
# each its own variant: "bf16_weights=true,bf16_flat_grads=false
# bf16_weights=true,bf16_flat_grads=false,bf16_moments=true,fp32_main_weights=false");
# PLANNERS=megatron,mosaic fewer planners
# (each variant plan of bf16 weights trains its own copy of the model: memory);
# USER_PROGRAMS="" no user program (Unified-IO 2 `paper`: the whole-model compile).
set -u
OUT=${1:?usage: target_rows_h200.sh OUT [MODEL:PRESET:BATCH:LIMIT_S ...]}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
shift
ROWS=("$@"); [ ${#ROWS[@]} -gt 0 ] || ROWS=(clip:small:32:150 ofasys:small:8:400)
for row in "${ROWS[@]}"; do
  IFS=: read -r model preset batch limit <<< "$row"
  name=bench_${model}_${preset}_1gpu_b${batch}${VARIANT:+_${VARIANT%%=*}}
  scope=module; [ "$preset" = paper ] && scope=blocks
  # Each plan's traced step comes back for `small` (a few MB); `paper` traces stay behind.
  runs=$OUT/$name; [ "$preset" = paper ] && runs=/tmp/$name
  extra=(); [ -n "${PLANS_AT_ONCE:-}" ] && extra+=(--plans-at-once "$PLANS_AT_ONCE")
  for variant in ${VARIANT:-}; do extra+=(--engine-variant "$variant"); done
  [ -n "${PLANNERS:-}" ] && extra+=(--planners "$PLANNERS")
  timeout "$limit" python -m mosaic bench "$model" --gpus 1 --preset "$preset" --batch "$batch" \
    --perf-model profiled --compile-scope "$scope" \
    --user-programs "${USER_PROGRAMS-torch-compile}" --rounds 3 \
    "${extra[@]}" --out "$runs" --json > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
  echo "$model $preset b$batch rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
  rm -f "$runs/bench.json"  # the same JSON as $OUT/$name.json: one copy under results/
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
