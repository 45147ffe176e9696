#!/usr/bin/env bash
# One H200, one device call (about 5 minutes), results under $1. Thirty-third session
# (2026-12-04, written on a CPU, not yet run): the two probes that say which change to the
# update (engine/rounded_weights.py, so every profiled update entry measured again) pays
# before it is made:
# 1. benchmarks/update_streams.py: Unified-IO 2 `paper`'s LLM updated a weight at a time over
#    1 and 2 captured streams, and same-shaped weights 4 and 8 at a time through Inductor's
#    combo kernels, beside the flat launch (14.37 against 12.67 ms in the profile);
# 2. benchmarks/rounded_update_bits.py: the flat update's kernels over 2^28 parameters, the
#    first moment in block-scaled e4m3 among them (12 bytes a parameter against 14).
# LIMIT_STREAMS and LIMIT_BITS (s) bound the two.
set -u
OUT=${1:?usage: update_probes_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -k 10 "${LIMIT_STREAMS:-330}" python benchmarks/update_streams.py unified-io-2 paper \
  llm --lanes 1,2 --groups 4,8 --out "$OUT/update_streams.json" > "$OUT/update_streams.log" 2>&1
echo "update_streams rc=$?"; tail -n 8 "$OUT/update_streams.log" | cut -c1-200
timeout -k 10 "${LIMIT_BITS:-200}" python benchmarks/rounded_update_bits.py --numel 268435456 \
  --out "$OUT/rounded_update_bits.json" > "$OUT/rounded_update_bits.log" 2>&1
echo "rounded_update_bits rc=$?"; tail -n 8 "$OUT/rounded_update_bits.log" | cut -c1-200
