#!/usr/bin/env bash
# One H200, one device call (about 4 minutes), results under $1.
# 1. Where does `mosaic train`'s host time go? CLIP `small` b32 with bf16 weights trained at
#    10.1 ms a step with 9.5 ms of it launching on the host (2026-12-03), while `mosaic bench`
#    timed the same plan at 8.15 ms: the steady steps' launches under cProfile.
# 2. OFASys `paper` b8 with gahc's plan (its encoders in one `free` stage), bf16 and fp32,
#    launches not blocking: autotune's cuBLAS failure had gahc's plan as its top candidate.
set -u
OUT=${1:?usage: train_host_profile_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
for weights in bf16 fp32; do
  flag=$([ "$weights" = fp32 ] && echo --fp32)
  timeout 50 python benchmarks/shared_bf16_plans.py ofasys paper 8 gahc --compile none $flag \
    --out "$OUT/gahc_$weights.json" > "$OUT/gahc_$weights.log" 2>&1
  echo "gahc $weights rc=$?"; tail -n 1 "$OUT/gahc_$weights.log" | cut -c1-300
done
timeout 110 python benchmarks/train_host_profile.py "$OUT/train.prof" --from-step 50 -- \
  train clip --preset small --batch 32 --bf16-weights --planner mosaic --steps 300 \
  --out "$OUT/train" > "$OUT/train_profile.txt" 2>&1
echo "train rc=$?"; grep -E "plan=|host-bound" "$OUT/train_profile.txt"
grep -v "^$" "$OUT/train_profile.txt" | grep -vi warning | head -c 7000
cp "$OUT/train/summary.json" "$OUT/train_summary.json"; rm -rf "$OUT/train"
