#!/usr/bin/env bash
# PREPARED, NOT YET RUN. OFASys `paper` on one H200, results under $1: the four plans against
# the user's torch.compile program, one torch.profiler trace of mosaic's plan, and the MFU
# (target 35% of 989 TF/s). Eight modules are compiled twice (engine and user program), which
# took more than 330 s on a cold Inductor cache; the start-up phases are in the JSON
# (checks.phases) and on stderr, so a run stopped by its limit shows where it was. If it is
# stopped, run it again at once: the machine stays warm for 30 s and keeps Inductor's cache.
# SCOPE=blocks compiles each module's repeated layers once instead of whole (engine and user
# program alike): run it both ways for the start-up and step-time A/B of --compile-scope.
set -u
OUT=${1:?usage: ofasys_paper_1gpu_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
SCOPE=${SCOPE:-module}
timeout 560 python -m mosaic bench ofasys --gpus 1 --preset paper --perf-model profiled \
  --compile-scope "$SCOPE" --user-programs torch-compile --rounds 3 --out /tmp/of --json \
  > "$OUT/bench_ofasys_paper_1gpu_$SCOPE.json" 2> /tmp/logs/bench_ofasys_paper_1gpu.err
echo "ofasys paper rc=$?"; grep "^mosaic bench" /tmp/logs/bench_ofasys_paper_1gpu.err | tail -n 4
cp /tmp/of/mosaic.trace.json "$OUT/" 2> /dev/null
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
