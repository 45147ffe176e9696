#!/usr/bin/env bash
# The issue-7 proof on one GPU, in two halves (plans made on a CPU machine and carried as
# JSON, as a user would; the GPU machine could plan too: the planner is pure Python):
#   benchmarks/bench_h200.sh plan          # CPU: plans every zoo model into benchmarks/plans/
#   benchmarks/bench_h200.sh run OUTDIR    # GPU: measures every plan, one process per model
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS="clip imagebind qwen3-vl unified-io-2 ofasys"
PLANNERS="megatron,distmm,spindle,mosaic,mosaic-partition,mosaic-unaware"
PLANS=benchmarks/plans/h200-small
MOSAIC="${MOSAIC:-python3 -m mosaic}"
case "${1:-}" in
  plan)
    for m in $MODELS; do
      $MOSAIC plan "$m" --gpus 1 --preset small --planners "$PLANNERS" --out "$PLANS/$m" --json \
        > /dev/null
      rm -f "$PLANS/$m"/*.png "$PLANS/$m"/*.trace.json
    done ;;
  run)
    out=${2:?usage: bench_h200.sh run OUTDIR}
    mkdir -p "$out"
    for m in $MODELS; do
      $MOSAIC bench "$m" --gpus 1 --preset small --planners "$PLANNERS" --plans "$PLANS/$m" \
        --perf-model profiled --out "/tmp/bench-$m" --json > "$out/bench_$m.json"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['model'], *[f\"{r['planner']}={r['measured_iteration_s']*1e3:.2f}ms({r['predicted_iteration_s']*1e3:.2f})\" for r in d['results']], f\"speedup={d['mosaic_speedup_vs_best_baseline']:.3f}\")" "$out/bench_$m.json"
    done ;;
  *) echo "usage: $0 plan | run OUTDIR" >&2; exit 2 ;;
esac
