#!/usr/bin/env bash
# Run 2026-12-01 (results/paper-1gpu-h200/, 342 s). One H200, one device call, results under $1.
# The optimizer step is memory-bound and ran alone after every backward: about 8 of OFASys
# `paper`'s 77 ms (trace in results/paper-1gpu-h200/). `--engine-variant optimizer_overlap=true`
# steps each module's fused AdamW on the module's stream as soon as its backward ends, so the
# LLM's step runs under the encoders' backward. This measures it against the same plans in
# one process (compile scope blocks), then runs its GPU test and the blocks-scope capture
# tests (tests/gpu/test_compile_gpu.py), written on 2026-12-01 and not yet run.
set -u
OUT=${1:?usage: optimizer_overlap_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 330 python -m mosaic bench ofasys --gpus 1 --preset paper --perf-model profiled \
  --compile-scope blocks --planners megatron,mosaic --engine-variant optimizer_overlap=true \
  --user-programs torch-compile --rounds 4 --out /tmp/ov --json \
  > "$OUT/bench_ofasys_paper_1gpu_b8_optimizer_overlap.json" 2> /tmp/logs/bench_overlap.err
echo "ofasys paper overlap rc=$?"; grep "^mosaic bench" /tmp/logs/bench_overlap.err | tail -n 3
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_engine_gpu.py \
  tests/gpu/test_compile_gpu.py -k "overlapped or blocks" > "$OUT/gpu_test_overlap.log" 2>&1
echo "gpu test rc=$?"; tail -n 2 "$OUT/gpu_test_overlap.log"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
