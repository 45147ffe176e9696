#!/usr/bin/env bash
# One device call on 2 x H200: CLIP at its preset batch (four planners' plans, the eager user
# program; one GPU), then the sharded-state (FSDP2) tests on both GPUs. Results under $1.
set -u
OUT=${1:?usage: gpu_session3_call4.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src NCCL_NVLS_ENABLE=0
CUDA_VISIBLE_DEVICES=0 timeout 200 python -m mosaic bench clip --gpus 1 --preset small \
  --batch 32 --planners megatron,distmm,spindle,mosaic --user-programs torch-eager \
  --plans benchmarks/plans/h200-small-compiled/clip-b32 --perf-model profiled --rounds 3 \
  --out /tmp/bench-clip-32 --json > "$OUT/bench_clip_small_b32.json" 2> "$OUT/bench_clip_small_b32.err"
echo "bench rc=$?"
timeout 220 python -m pytest -q -m gpu tests/gpu/test_sharding_gpu.py -p no:cacheprovider \
  > "$OUT/gpu_tests_sharding.log" 2>&1
echo "rc=$?" >> "$OUT/gpu_tests_sharding.log"
grep -E "passed|failed|FAILED|rc=|Error:" "$OUT/gpu_tests_sharding.log" | tail -n 8
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print(d['model'], d['global_batch'], [(r['planner'], round(r['measured_iteration_s']*1e3,2), round((r.get('predicted_iteration_s') or 0)*1e3,2)) for r in d['results']])" "$OUT/bench_clip_small_b32.json" 2>/dev/null || grep -v '^frame' "$OUT/bench_clip_small_b32.err" | tail -n 4
