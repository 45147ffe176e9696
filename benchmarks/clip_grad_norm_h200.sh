#!/usr/bin/env bash
# One H200, one device call (about 7 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-fourth session (2026-12-03), not yet run. `mosaic train
# --clip-grad-norm MAX` clips the global gradient norm: one norm per gradient tensor (which
# also serves as the NaN guard) and one scaling pass over the gradients. Its GPU tests first,
# then its cost on a trained step: Unified-IO 2 `paper` b4 with bf16 weights by blocks,
# without and with clipping (the guard alone took 3.2 ms of 74.7 a weight at a time).
set -u
OUT=${1:?usage: clip_grad_norm_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  -k clip > "$OUT/gpu_tests_clip.log" 2>&1
echo "gpu tests rc=$?"; tail -n 1 "$OUT/gpu_tests_clip.log"
for clip in none 1.0; do
  flag=$([ "$clip" = none ] || echo "--clip-grad-norm $clip")
  timeout 140 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
    --compile-scope blocks --steps 40 $flag --out "/tmp/train-$clip" > "$OUT/train_clip_$clip.log" 2>&1
  echo "train clip=$clip rc=$?"; grep -E "plan=|Error" "$OUT/train_clip_$clip.log" | cut -c1-220
  cp "/tmp/train-$clip/summary.json" "$OUT/train_unified-io-2_paper_b4_clip_${clip}_summary.json" 2>/dev/null
  tail -n 1 "/tmp/train-$clip/metrics.jsonl" | cut -c1-200
done
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
