#!/usr/bin/env bash
# One H200, one device call (about 9 minutes), results under $1. Thirty-first session
# (2026-12-04): bf16 weights without fp32 main copies (`--no-fp32-main-weights`,
# engine/rounded_weights.py). 1. its GPU tests and the bf16-moment ones it builds on;
# 2. `mosaic profile unified-io-2 --preset paper --update --main-weights-only` into a copy of
# the shipped DB (each module's update now also without main weights); 3. Unified-IO 2
# `paper` b4 (the MFU target's row): mosaic's plan (megatron's at b4: the bench measures it
# once, megatron's label its twin, so the run lands in the README's and the targets' tables)
# with bf16 weights and moments a weight at a time, with and without main weights, beside the
# user's torch.compile program, one plan group at a time, traced. TESTS="" skips the tests, PROFILE="" the
# profile; LIMIT_TESTS, LIMIT_PROFILE and LIMIT_BENCH (s) bound the three parts. GROUP=K also
# measures the update without main weights with same-shaped weights K at a time in one launch
# (engine/grouped_update.py; thirty-third session, not yet run: give the bench ~80 s more);
# FP8=1 the same update with AdamW's first moment in 8 bits (engine/fp8_first_moment.py).
set -u
OUT=${1:?usage: rounded_weights_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
TESTS=${TESTS-tests/gpu/test_rounded_weights_gpu.py}
[ -n "$TESTS" ] && LIMIT=${LIMIT_TESTS:-150} TESTS=$TESTS bash benchmarks/gpu_tests_h200.sh \
  "$OUT" ${TEST_ARGS:-} | head -n 8
if [ -n "${PROFILE-unified-io-2}" ]; then
  cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
  timeout -k 5 "${LIMIT_PROFILE:-150}" python -m mosaic profile ${PROFILE-unified-io-2} \
    --preset "${PROFILE_PRESET:-paper}" --update --main-weights-only --db "$OUT/h200.sqlite" \
    > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; grep -E "without main|Error|error" "$OUT/profile.log" | cut -c1-200 | tail -n 12
fi
BF16=bf16_weights=true,bf16_flat_grads=false,bf16_moments=true
name=bench_unified-io-2_paper_1gpu_b4_rounded_weights
timeout -k 10 "${LIMIT_BENCH:-330}" python -m mosaic bench unified-io-2 --gpus 1 --preset paper \
  --batch 4 --perf-model profiled --compile-scope blocks --user-programs "${USER_PROGRAMS-torch-compile}" \
  --rounds 3 --plans-at-once 1 --planners mosaic,megatron --engine-variant "$BF16" \
  --engine-variant "$BF16,fp32_main_weights=false" \
  ${GROUP:+--engine-variant "$BF16,fp32_main_weights=false,update_group=$GROUP"} \
  ${FP8:+--engine-variant "$BF16,fp32_main_weights=false,fp8_first_moment=true"} \
  --out "/tmp/$name" --json \
  --torch-trace /tmp/traces > "$OUT/$name.json" 2> "/tmp/logs/$name.err"
echo "bench rc=$?"; grep -E "^mosaic bench|Error" "/tmp/logs/$name.err" | tail -n 4
for summary in /tmp/traces/*/kernel-time-rank0.json; do  # the traces stay behind (large)
  cp "$summary" "$OUT/kernel-time-$(basename "$(dirname "$summary")").json"
done
tar czf "$OUT/logs.tar.gz" -C /tmp logs
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
