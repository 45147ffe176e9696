#!/usr/bin/env bash
# PREPARED, NOT YET RUN. One device call on 2 x H200 (up to LIMIT seconds, default 580),
# results under $1.
# Qwen3-VL `paper` (8.6 B parameters) fits no H200 whole: its LLM's states are 113 GiB and
# autocast's bf16 copies of its weights 14 GiB more. Two ways to split it over two GPUs, in one
# bench run, one plan at a time (each trains its own copy of the modules, and the two do not fit
# side by side): the megatron-style plan with the LLM's states sharded by FSDP2, and the plan
# every planner now makes, the LLM tensor-parallel over both GPUs (benchmarks/plans/
# h200-paper-compiled/qwen3-vl-2gpu/). Compiled by blocks (an 8 B LLM compiled whole takes
# minutes), the LLM too: its TP shards and FSDP2 units are traced after the split (they ran
# eagerly before 2026-12-05; a compile failure falls back to eager and the JSON's
# checks.compile says why); each plan's graph memory and the group peaks come back in the JSON, against the
# memory model's estimate (which now counts the bf16 weight copies).
# Beside them, what the user runs when DDP's replicas do not fit: their torch.compile program
# on FSDP2 (USERS, default torch-compile-fsdp; USERS="" for none), set up, checked and timed
# in a group of its own first (`--user-rounds alone`: it and a plan do not fit together), the
# reference both plans are checked against. If the run runs out of time, run it again with
# USERS="" and then PLANNERS=megatron, each a call of its own.
# BATCH (default: the preset's, 2) runs both plans at another global batch: at 16 the planners
# predict the sharded LLM faster than the TP one (255.7 against 277.3 ms, `mosaic plan
# qwen3-vl --preset paper --gpus 2 --batch 16 --perf-model profiled`), at 2 the TP one.
set -u
OUT=${1:?usage: qwen3vl_paper_tp_vs_fsdp_h200x2.sh OUT}
USERS=${USERS-torch-compile-fsdp}
PLANNERS=${PLANNERS:-megatron,mosaic}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -k 10 "${LIMIT:-580}" torchrun --standalone --nproc-per-node 2 -m mosaic bench qwen3-vl \
  --gpus 2 --preset paper ${BATCH:+--batch "$BATCH"} --perf-model profiled \
  --plans benchmarks/plans/h200-paper-compiled/qwen3-vl-2gpu --planners "$PLANNERS" \
  --plans-at-once 1 --compile-scope blocks --user-programs "$USERS" --user-rounds alone \
  --rounds 3 --out /tmp/q2 --json > "$OUT/bench_qwen3-vl_paper_2gpu${BATCH:+_b$BATCH}_tp_vs_fsdp.json" \
  2> /tmp/logs/bench_q2.err
echo "qwen3-vl paper 2gpu rc=$?"; grep "^mosaic bench" /tmp/logs/bench_q2.err | tail -n 4
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
