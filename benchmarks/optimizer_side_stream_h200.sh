#!/usr/bin/env bash
# One H200, one device call (under 10 minutes), results under $1. The overlapped optimizer
# (`--engine-variant optimizer_overlap=true`) stepped each module on the module's own stream,
# which in megatron's temporal stages is the caller's: Unified-IO 2 `paper` b4 traced at 1.00x
# kernel overlap with it (benchmarks/uio2_paper_bf16_overlap_h200.sh). Now such a module's
# update runs on a side stream, under the backward of the modules after it:
#  1. Unified-IO 2 `paper` b4, megatron's plan (the planner's at b4): fp32, bf16 weights, bf16
#     weights with the overlapped update; traced (the update's overlap with the encoders);
#  2. OFASys `paper` b8, megatron's and mosaic's plans the same three ways, beside the user's
#     torch.compile program (the bf16 column of the targets table).
set -u
OUT=${1:?usage: optimizer_side_stream_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
variants=(--engine-variant bf16_weights=true
          --engine-variant bf16_weights=true,optimizer_overlap=true)
name=bench_unified-io-2_paper_1gpu_b4_bf16_side_stream
timeout 200 python -m mosaic bench unified-io-2 --gpus 1 --preset paper --batch 4 \
  --perf-model profiled --compile-scope blocks --planners megatron --user-programs "" \
  --rounds 3 --plans-at-once 1 "${variants[@]}" --torch-trace /tmp/u2trace \
  --out /tmp/u2bench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
for dir in /tmp/u2trace/*/; do
  label=$(basename "$dir"); cp "$dir/kernel-time-rank0.json" "$OUT/kernel-time-u2-$label.json"
  echo "== $label"; python -m mosaic kernel-time "$dir/trace-rank0.json.gz" | head -n 6
done
name=bench_ofasys_paper_1gpu_b8_bf16_side_stream
timeout 370 python -m mosaic bench ofasys --gpus 1 --preset paper --batch 8 \
  --perf-model profiled --compile-scope blocks --planners megatron,mosaic \
  --user-programs torch-compile --rounds 3 --plans-at-once 2 "${variants[@]}" \
  --out /tmp/ofbench --json > "$OUT/$name.json" 2> /tmp/logs/$name.err
echo "bench rc=$?"; grep "^mosaic bench" /tmp/logs/$name.err | tail -n 1
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
tar czf "$OUT/logs.tar.gz" -C /tmp logs
