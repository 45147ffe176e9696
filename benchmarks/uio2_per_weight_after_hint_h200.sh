#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1 (one archive comes back).
# Twenty-third session (2026-12-03). The per-weight bf16 update kernel is now compiled and
# autotuned on a large update of zeros before any weight (main_weights.TUNING_LENGTH):
# its streaming rate by case (update_size_hint.py), then, if the engine's kernel streams a
# 16M-element weight within 5% of one compiled on such a weight, Unified-IO 2 `paper` b4's
# bench with the update flat and a weight at a time (the rows the model missed by 19%).
set -u
OUT=${1:?usage: uio2_per_weight_after_hint_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 100 python benchmarks/update_size_hint.py --out "$OUT/update_size_hint.json" --cases first-large,tuned-large
echo "size hint rc=$?"
python3 - "$OUT/update_size_hint.json" <<'PY' || { echo "engine kernel still slow: no bench"; exit 0; }
import json, sys
rate = {c["case"]: c["lengths"][str(1 << 24)]["tb_per_s"] for c in json.load(open(sys.argv[1]))["cases"]}
sys.exit(0 if rate["tuned-large"] >= 0.95 * rate["first-large"] else 1)
PY
n=bench_unified-io-2_paper_1gpu_b4_bf16_flat_or_per_weight
timeout 330 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 2 --plans-at-once 1 --engine-variant bf16_weights=true \
  --engine-variant bf16_weights=true,bf16_flat_grads=false \
  --out /tmp/u2bench --json > "$OUT/$n.json" 2> "/tmp/logs/$n.err"
echo "bench rc=$?"; grep -E "^mosaic( bench|: error)" "/tmp/logs/$n.err" | tail -n 2
python3 benchmarks/bench_summary.py "$OUT/$n.json"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
