#!/usr/bin/env bash
# One H200, results under $1: OFASys's compiled module-scope surfaces measured again at PRESET
# (small or paper) into a copy of the shipped ProfileDB ($1/h200.sqlite; a second call adds
# to it). They were measured while transformers still built attention masks under compile,
# and OFASys's module-scope runs are predicted +8..+15% since. BUDGET bounds the measuring,
# not the compiling: `small` with BUDGET 200 ran past 350 s on 2026-12-01 and wrote nothing,
# so give it a whole device call (the limit below is BUDGET + 380 s).
set -u
OUT=${1:?usage: ofasys_reprofile_h200.sh OUT PRESET BUDGET_S}
PRESET=${2:?preset}
BUDGET=${3:-200}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
[ -f "$OUT/h200.sqlite" ] || cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
timeout $((BUDGET + 380)) python -m mosaic profile ofasys --preset "$PRESET" \
  --kernels compile-default --surfaces-only --budget "$BUDGET" --update --remeasure \
  --db "$OUT/h200.sqlite" > "$OUT/profile_ofasys_${PRESET}.log" 2>&1
echo "profile ofasys $PRESET rc=$?"; tail -n 4 "$OUT/profile_ofasys_${PRESET}.log"
