#!/usr/bin/env bash
# One H200, one device call (about 9 minutes), results under $1. Prepared in the twenty-ninth
# session (2026-12-04). 1. the update-gates GPU tests (the event mechanism between two CUDA
# graphs; a deferred gated update against MainWeightsAdamW) and the capture-memory test the
# session before could not run; 2. Unified-IO 2 `paper` b4 (the MFU target's row): megatron's
# plan (the planner's at b4) with bf16 weights and moments a weight at a time, with and
# without `update_under_forward`, beside the user's torch.compile program, one plan group at a
# time (each bf16 variant trains its own copy of the model). TESTS="" skips the GPU tests;
# USER_PROGRAMS="" the user's program; UPDATE_SMS (default "0"): the update stream's SMs per
# gated variant (0: a plain stream; else a green context of that many); LIMIT_TESTS and
# LIMIT_BENCH (s) bound the two parts.
set -u
OUT=${1:?usage: update_under_forward_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
TESTS=${TESTS-tests/gpu/test_update_gates_gpu.py tests/gpu/test_graphed_gpu.py}
[ -n "$TESTS" ] && LIMIT=${LIMIT_TESTS:-200} TESTS=$TESTS bash benchmarks/gpu_tests_h200.sh "$OUT" | head -n 8
BF16=bf16_weights=true,bf16_flat_grads=false,bf16_moments=true
variants=(--engine-variant "$BF16")
for sms in ${UPDATE_SMS:-0}; do
  sized=""; [ "$sms" != 0 ] && sized=",update_sms=$sms"
  variants+=(--engine-variant "$BF16,update_under_forward=true$sized")
done
name=bench_unified-io-2_paper_1gpu_b4_update_under_forward
timeout -k 10 "${LIMIT_BENCH:-330}" python -m mosaic bench unified-io-2 --gpus 1 --preset paper \
  --batch 4 --perf-model profiled --compile-scope blocks --user-programs "${USER_PROGRAMS-torch-compile}" \
  --rounds 3 --plans-at-once 1 --planners megatron "${variants[@]}" --out "/tmp/$name" --json \
  --torch-trace /tmp/traces > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
echo "bench rc=$?"; grep -E "^mosaic bench|Error" "/tmp/logs/$name.err" | tail -n 4
for summary in /tmp/traces/*/kernel-time-rank0.json; do  # the traces stay behind (large)
  cp "$summary" "$OUT/kernel-time-$(basename "$(dirname "$summary")").json"
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
