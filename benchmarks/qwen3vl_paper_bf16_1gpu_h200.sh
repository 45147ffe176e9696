#!/usr/bin/env bash
# One H200, one device call (about 8 minutes), results under $1 (one archive comes back).
# Qwen3-VL `paper` (8.6 B parameters) on one GPU: with fp32 weights it needs 130.1 GiB (memory
# model) of the 125 usable; with bf16 GEMM weights and bf16 moments the memory model counts
# 12-14 bytes a bf16 parameter, not 18, and places it (`mosaic plan qwen3-vl --gpus 1 --preset
# paper --bf16-weights --bf16-moments`). 1. the GPU test that the compiled update rounds bf16
# moments as the CPU's does; 2. `mosaic train` of it at the preset batch, the layout train picks.
# BATCH (default 2) and TRAIN_FLAGS (e.g. --no-bf16-flat-grads) change the run.
set -u
OUT=${1:?usage: qwen3vl_paper_bf16_1gpu_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
BATCH=${BATCH:-2}
LIMIT=150 TESTS=tests/gpu/test_main_weights_gpu.py \
  bash benchmarks/gpu_tests_h200.sh "$OUT" -k round_on_the_gpu | head -n 8
python -m mosaic plan qwen3-vl --gpus 1 --preset paper --batch "$BATCH" --bf16-weights \
  --bf16-moments --planners megatron,mosaic --json > "$OUT/plan.json" 2> "$OUT/plan.err"
echo "plan rc=$?"
timeout -k 10 ${TRAIN_LIMIT:-360} python -m mosaic train qwen3-vl --preset paper --batch "$BATCH" \
  --bf16-weights --bf16-moments ${TRAIN_FLAGS:-} --compile-scope blocks --steps 30 \
  --out /tmp/train-q-b$BATCH > "$OUT/train.log" 2>&1
echo "train rc=$?"; grep -E "plan=|bf16 update|Error|error|GiB" "$OUT/train.log" | cut -c1-260
cp /tmp/train-q-b$BATCH/summary.json "$OUT/train_qwen3-vl_paper_b${BATCH}_bf16_moments_summary.json" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
