#!/usr/bin/env bash
# One H200, one device call (at most about 9 minutes), results under $1.
# The first run of paper_blocks_profile_h200.sh ran the GPU out of memory while profiling
# (Unified-IO 2's LLM at batch 4, then ImageBind's vision encoder at batch 1: the profiler
# held failed captures' tensors and idle cache across modules and models). Again with the
# fix, memory printed per model:
#  1. profile Unified-IO 2 and ImageBind `paper` (compiled by blocks) into OUT/h200.sqlite,
#     a copy of the shipped DB (--update keeps its other surfaces);
#  2. the pinned-rows GPU test, and OFASys `paper` b8 traced again: its step had spent
#     5.2 ms uploading the batch from pageable memory.
set -u
OUT=${1:?usage: paper_blocks_reprofile_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout 330 python -m mosaic profile unified-io-2 imagebind --preset paper \
  --kernels compile-default-blocks --surfaces-only --update --budget 300 \
  --db "$OUT/h200.sqlite" > /tmp/logs/profile_paper_blocks.log 2>&1
echo "profile rc=$?"; grep -E "^\[|surface|kept|wrote" /tmp/logs/profile_paper_blocks.log | cut -c1-400
python -m pytest -q -p no:cacheprovider -m gpu tests/test_prefetch.py 2>&1 | tail -n 1
timeout 150 python -m mosaic train ofasys --preset paper --planner mosaic --steps 10 \
  --graphs --compile default --compile-scope blocks --torch-trace /tmp/oftrace \
  > /tmp/logs/train_ofasys.log 2>&1
echo "train rc=$?"; tail -n 1 /tmp/logs/train_ofasys.log
mkdir -p "$OUT/ofasys-b8-trace"
cp /tmp/oftrace/kernel-time-rank0.json /tmp/oftrace/kernels-rank0.txt "$OUT/ofasys-b8-trace/" 2> /dev/null
grep -i "memcpy" "$OUT/ofasys-b8-trace/kernels-rank0.txt" | cut -c1-160
tar czf "$OUT/logs.tar.gz" -C /tmp logs
