#!/usr/bin/env bash
# Engine speed on one H200: every plan (compiled modules, CUDA graphs on each module's stream)
# beside the user's own program (eager, and torch.compile(mode="reduce-overhead") per module),
# one process, one `mosaic bench` per row. Plans are made on a CPU machine and
# carried as JSON in benchmarks/plans/h200-small/.
#   PYTHONPATH=src benchmarks/engine_speed_h200.sh OUTDIR "clip:128 imagebind:32 ..."
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: engine_speed_h200.sh OUTDIR "MODEL:BATCH ..."}
rows=${2:-"clip:128"}
mkdir -p "$out"
for row in $rows; do
  model=${row%%:*}; batch=${row##*:}
  timeout "${ROW_TIMEOUT:-300}" python3 -m mosaic bench "$model" --gpus 1 --preset small \
    --batch "$batch" --planners megatron,mosaic --plans "benchmarks/plans/h200-small/$model" \
    --perf-model profiled --rounds "${ROUNDS:-4}" --out "/tmp/bench-$model-$batch" --json \
    > "$out/bench_${model}_small_b${batch}.json" 2> "/tmp/bench-$model-$batch.err" \
    || { echo "$row FAILED"; tail -5 "/tmp/bench-$model-$batch.err"; continue; }
  python3 - "$out/bench_${model}_small_b${batch}.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
cells = [f"{r['planner']}={r['measured_iteration_s'] * 1e3:.2f}ms mfu={r['mfu'] * 100:.1f}%"
         for r in d["results"]]
print(d["model"], d["global_batch"], *cells, "vs torch-compile:",
      d["mosaic_speedup_vs_torch_compile"], "compile:", d["checks"]["compile"]["eager"],
      "grad tol:", d["checks"]["gradients"]["tolerance"])
PY
done
