#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One H200, one device call (about 9 minutes), results under $1.
#  1. The bf16 main-weights update per module, flat or a weight at a time (one kernel for
#     every size, as the engine runs it, and one per size), for Unified-IO 2 `paper` (whose
#     whole step ran 1.035x faster a weight at a time, 2026-12-03; its first try outlasted
#     60 s) and again for ImageBind `paper` (its audio and text encoders, alike in weights,
#     measured 1.25x and 1.96x per-weight / flat: the per-weight figure is measured twice,
#     and the modules once more in reverse order: every model's first module measured
#     1.16-1.36x, later ones 0.83-2.32x).
#  2. A targets-table bf16 row that predates the one-launch update: CLIP `paper` b32,
#     megatron's and mosaic's plans, both gradient layouts, beside the user's torch.compile
#     program (ImageBind `paper` b8 and OFASys `small` b32 next: `target_rows_h200.sh` with
#     VARIANT=bf16_weights=true).
#  3. The GPU test of plans sharing one bf16 copy and one main-weights optimizer (autotune
#     under `mosaic train --bf16-weights`; CPU-tested only so far).
set -u
OUT=${1:?usage: bf16_layout_and_rows_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
for pair in unified-io-2:paper:150 imagebind:paper:50; do
  IFS=: read -r model preset limit <<< "$pair"
  timeout "$limit" python benchmarks/main_weights_flat_or_per_weight.py "$model" "$preset" \
    --out "$OUT/main_weights_flat_or_per_weight_${model}_${preset}.json" \
    2> "/tmp/logs/update_${model}_${preset}.err"
  echo "$model $preset rc=$?"
done
timeout 50 python benchmarks/main_weights_flat_or_per_weight.py imagebind paper --reverse \
  --out "$OUT/main_weights_flat_or_per_weight_imagebind_paper_reversed.json" \
  2> /tmp/logs/update_imagebind_paper_reversed.err
echo "imagebind paper reversed rc=$?"
for row in clip:paper:32:200; do
  IFS=: read -r model preset batch limit <<< "$row"
  name=bench_${model}_${preset}_1gpu_b${batch}_bf16_layouts
  timeout "$limit" python -m mosaic bench "$model" --gpus 1 --preset "$preset" \
    --batch "$batch" --perf-model profiled --compile-scope blocks --planners megatron,mosaic \
    --user-programs torch-compile --rounds 3 --engine-variant bf16_weights=true \
    --engine-variant bf16_weights=true,bf16_flat_grads=false \
    --out "/tmp/$name" --json > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
  echo "$model $preset b$batch rc=$?"; grep -E "^mosaic( bench|: error)" "/tmp/logs/$name.err" | tail -n 2
done
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_main_weights_gpu.py \
  -k "share_one" > "$OUT/gpu_tests_shared_bf16.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED" "$OUT/gpu_tests_shared_bf16.log" | tail -n 3
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
tar czf "$OUT/logs.tar.gz" -C /tmp logs
