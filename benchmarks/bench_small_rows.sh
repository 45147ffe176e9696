#!/usr/bin/env bash
# Sourced by the device scripts: bench_small_rows OUT MODEL:BATCH:LIMIT_S ...
# Benches each zoo model at `small` on one GPU at BATCH, planned in the run with every planner
# against the user's torch.compile program, stopped after LIMIT_S (budget at least 2.5x the
# engine's compile time on a cold Inductor cache); OUT/bench_MODEL_small_1gpu_bBATCH.json,
# stderr in /tmp/logs.
bench_small_rows() {
  local out=$1 row model batch limit name; shift
  mkdir -p /tmp/logs
  for row in "$@"; do
    IFS=: read -r model batch limit <<< "$row"; name=bench_${model}_small_1gpu_b${batch}
    timeout "$limit" python -m mosaic bench "$model" --gpus 1 --preset small --batch "$batch" \
      --perf-model profiled --user-programs torch-compile --rounds 3 --out "/tmp/$name" --json \
      > "$out/$name.json" 2> "/tmp/logs/$name.err"
    echo "$model b$batch rc=$?"; grep "^mosaic bench" "/tmp/logs/$name.err" | tail -n 2
  done
}
