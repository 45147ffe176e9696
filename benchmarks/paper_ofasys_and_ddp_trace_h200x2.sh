#!/usr/bin/env bash
# One device call on 2 x H200, results under $1:
#  GPU 0: OFASys `paper`, 1-GPU plans and both user programs (mosaic vs torch.compile, MFU).
#  GPU 1: OFASys `paper` compiled surfaces, resuming the DB (the vision encoder is missing).
#  Then both GPUs: the megatron (DDP) plan of CLIP `paper` under torch.profiler (what bounds a
#  2-GPU data-parallel step), and OFASys `paper` 2-GPU plans with both user programs.
set -u
OUT=${1:?usage: paper_ofasys_and_ddp_trace_h200x2.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PLANS=benchmarks/plans/h200-paper-compiled
(
  CUDA_VISIBLE_DEVICES=0 timeout 250 python -m mosaic bench ofasys --gpus 1 --preset paper \
    --perf-model profiled --plans $PLANS/ofasys-1gpu --rounds 3 --out /tmp/o1 --json \
    > "$OUT/bench_ofasys_paper_1gpu.json" 2> /tmp/logs/bench_ofasys_paper_1gpu.err
  echo "ofasys 1gpu rc=$?"
) &
(
  cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
  CUDA_VISIBLE_DEVICES=1 timeout 240 python -m mosaic profile ofasys --preset paper \
    --kernels compile-default --surfaces-only --update --budget 200 --db "$OUT/h200.sqlite" \
    > /tmp/logs/profile_ofasys_paper.log 2>&1
  echo "profile rc=$?" | tee -a /tmp/logs/profile_ofasys_paper.log
) &
wait
timeout 110 torchrun --standalone --nproc-per-node 2 -m mosaic train clip --preset paper --gpus 2 \
  --plan $PLANS/clip-2gpu/megatron.json --steps 8 --graphs --compile default \
  --torch-trace /tmp/trace > /tmp/logs/trace_megatron_clip_paper_2gpu.log 2>&1
echo "trace rc=$?"
cp /tmp/trace/kernels-rank*.txt /tmp/logs/ 2>/dev/null
tar czf "$OUT/traces.tar.gz" -C /tmp trace 2>/dev/null
timeout 230 torchrun --standalone --nproc-per-node 2 -m mosaic bench ofasys --gpus 2 --preset paper \
  --perf-model profiled --plans $PLANS/ofasys-2gpu --rounds 3 --out /tmp/o2 --json \
  > "$OUT/bench_ofasys_paper_2gpu.json" 2> /tmp/logs/bench_ofasys_paper_2gpu.err
echo "ofasys 2gpu rc=$?"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
grep -E "^\[|kept|rc=" /tmp/logs/profile_ofasys_paper.log | tail -n 4
head -n 16 /tmp/logs/kernels-rank0.txt 2>/dev/null | cut -c1-160
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
