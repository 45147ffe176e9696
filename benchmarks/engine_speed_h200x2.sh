#!/usr/bin/env bash
# Two H200s (NVLink): measured collectives into a copy of the shipped ProfileDB, the 1-GPU
# weak-scaling base, and 2-GPU benches with DDP, the hand-written bucketed all-reduce and bf16
# gradient reduction. Plans are made on a CPU machine and carried in benchmarks/plans/.
#   PYTHONPATH=src benchmarks/engine_speed_h200x2.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: engine_speed_h200x2.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared hosts
cp src/mosaic/profile/data/h200.sqlite "$out/h200.sqlite"
timeout 120 torchrun --standalone --nproc-per-node 2 -m mosaic.profile.collectives \
  --db "$out/h200.sqlite" > "$out/collectives.log" 2>&1 || echo "collectives FAILED"
tail -3 "$out/collectives.log"
bench() {  # NAME GPUS ARGS...
  local name=$1 gpus=$2; shift 2
  local run="python3 -m mosaic"
  [ "$gpus" -gt 1 ] && run="torchrun --standalone --nproc-per-node $gpus -m mosaic"
  CUDA_VISIBLE_DEVICES=$([ "$gpus" -gt 1 ] && echo 0,1 || echo 0) timeout "${ROW_TIMEOUT:-200}" \
    $run bench clip --gpus "$gpus" --preset small --perf-model profiled --rounds 4 \
    --out "/tmp/$name" --json "$@" > "$out/$name.json" 2> "/tmp/$name.err" \
    || { echo "$name FAILED"; grep -v "Warn\|warn" "/tmp/$name.err" | tail -4; return; }
  python3 - "$out/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[1].split("/")[-1], d["gpus"], d["global_batch"], *[
    f"{r['planner']}={r['measured_iteration_s'] * 1e3:.2f}ms" for r in d["results"]])
PY
}
bench clip_1gpu_b64 1 --batch 64 --planners megatron,mosaic --plans benchmarks/plans/h200-small/clip \
  --user-programs torch-compile
P2=benchmarks/plans/h200x2-small-b128/clip
bench clip_2gpu_b128_ddp 2 --batch 128 --planners megatron,distmm,spindle,mosaic --plans $P2
bench clip_2gpu_b128_bucketed 2 --batch 128 --planners megatron,mosaic --plans $P2 \
  --grad-sync bucketed --user-programs none
bench clip_2gpu_b128_ddp_bf16 2 --batch 128 --planners megatron,mosaic --plans $P2 \
  --reduce-dtype bf16 --user-programs none
