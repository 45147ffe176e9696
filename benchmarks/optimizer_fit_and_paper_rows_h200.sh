#!/usr/bin/env bash
# One H200, one device call (at most about 9.5 minutes), results under $1; $2 is the ProfileDB
# to complete (the one paper_blocks_reprofile_h200.sh wrote); then MODEL:BATCH:LIMIT_S rows
# to bench (default: the two below).
#  1. the optimizer-step fit into that DB: `mosaic profile clip --update` keeps every surface
#     it holds and measures only what every profile run measures, the engine's fused AdamW
#     over 25 M to 1.6 B parameters (the model priced Unified-IO 2 `paper`'s step at 22 ms
#     from the datasheet bandwidth; the trace measured 30);
#  2. with that DB installed, two rows of the one-GPU targets table never measured: ImageBind
#     `paper` at its preset batch 8 and CLIP `paper` at 32, every planner against the user's
#     torch.compile program (the engine compiled by blocks, the user program whole).
set -u
OUT=${1:?usage: optimizer_fit_and_paper_rows_h200.sh OUT DB}
DB=${2:?usage: optimizer_fit_and_paper_rows_h200.sh OUT DB}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp "$DB" "$OUT/h200.sqlite"
timeout 120 python -m mosaic profile clip --preset small --surfaces-only --update \
  --db "$OUT/h200.sqlite" > /tmp/logs/profile_optimizer.log 2>&1
echo "optimizer profile rc=$?"; grep -E "optimizer|kept" /tmp/logs/profile_optimizer.log
cp "$OUT/h200.sqlite" src/mosaic/profile/data/h200.sqlite
shift 2
ROWS=("$@"); [ ${#ROWS[@]} -gt 0 ] || ROWS=(imagebind:8:300 clip:32:150)
for row in "${ROWS[@]}"; do
  IFS=: read -r model batch limit <<< "$row"; name=bench_${model}_paper_1gpu_b${batch}
  timeout "$limit" python -m mosaic bench "$model" --gpus 1 --preset paper --batch "$batch" \
    --perf-model profiled --compile-scope blocks --user-programs torch-compile --rounds 3 \
    --out "/tmp/$name" --json > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
  echo "$model paper b$batch rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
