#!/usr/bin/env bash
# One H200, one device call (about 6 minutes), results under $1 (one archive comes back).
# Twenty-sixth session (2026-12-04). Unified-IO 2 `paper` b4 with bf16 weights updated a
# weight at a time ran 87.77 ms in a bench whose first plan group also compiled the user's
# torch.compile program (its traced step: forward + backward 42.9 ms, so about 45 ms of
# update), against 71.84 ms in the twenty-third session's bench without it. The same bench
# without and with the user program, each with an Inductor cache of its own, Dynamo's
# recompiles logged, and the update kernels' autotuned configs kept.
set -u
OUT=${1:?usage: uio2_per_weight_user_program_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
for users in none torch-compile; do
  programs=$([ "$users" = none ] || echo "$users")
  export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$users
  timeout -k 10 "$([ "$users" = none ] && echo 150 || echo 300)" python -m mosaic bench \
    unified-io-2 --gpus 1 --preset paper --batch 4 --perf-model profiled \
    --compile-scope blocks --planners megatron --user-programs "$programs" --rounds 2 \
    --plans-at-once 1 --engine-variant bf16_weights=true,bf16_flat_grads=false \
    --out "/tmp/bench-$users" --json > "$OUT/bench_users_$users.json" 2> "$OUT/bench_users_$users.err"
  echo "users=$users rc=$?"; grep -E "^mosaic bench.*(done|captured)|Recompil|recompil" \
    "$OUT/bench_users_$users.err" | cut -c1-200 | tail -n 12
  python3 - "$OUT/bench_users_$users.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    print(f"  {r['planner']:55s} {r['median_s'] * 1e3:7.2f} ms  host {r['host_launch_share']:.1%}")
PY
  # Each autotuned Inductor kernel: its size hints, signature and the config kept.
  for f in $(find "$TORCHINDUCTOR_CACHE_DIR" -name "*.best_config"); do
    src=${f%.best_config}.py
    echo "== $f"; cat "$f"; echo
    grep -m3 -E "size_hints|^def triton" "$src" 2>/dev/null | cut -c1-300
  done > "$OUT/best_configs_$users.txt"
  grep -c "==" "$OUT/best_configs_$users.txt"
done
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
