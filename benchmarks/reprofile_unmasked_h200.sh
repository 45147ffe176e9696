#!/usr/bin/env bash
# One H200, one device call per few models, results under $1. Run on 2026-12-02 for
# ImageBind `paper` (80 points in 377 s; audio 50.8 -> 24.6 ms at b32); the other models
# not yet (CLIP `small` was measured again by hand, 66 points in 114 s).
#   bash benchmarks/reprofile_unmasked_h200.sh OUT clip imagebind
#   PRESET=paper bash benchmarks/reprofile_unmasked_h200.sh OUT imagebind   (KERNELS likewise)
# Found on 2026-12-02: ImageBind's compiled audio surface says 66 ms at batch 128 where the
# encoder ran 33 ms beside every colocation (the model scales it to them until remeasured).
# The compiled `small` surfaces of the zoo's transformers encoders were measured while
# transformers still built all-true attention masks under compile (2026-12-01 removed them:
# the audio encoder ran 1.055x faster unmasked); their cost facts did not change, so their
# signatures did not either and `--update` alone would keep the old points. `--remeasure`
# measures the named models' modules again and replaces each surface whole. About a minute
# per module on a warm Inductor cache (CLIP 3 modules, ImageBind 4, Unified-IO 2 4, Qwen3-VL 3,
# OFASys 8): two or three models fit one call. The budget stops a call in time; what it
# measured stays (run the rest next call). BUDGET (seconds, default 520) and TIMEOUT (default
# BUDGET + 40) size it for a call that does more afterwards (stage_trace_h200.sh,
# imagebind_remeasure_h200.sh).
set -u
OUT=${1:?usage: reprofile_unmasked_h200.sh OUT MODEL...}; shift
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
DB=src/mosaic/profile/data/h200.sqlite
cp "$DB" "$OUT/h200.sqlite"
BUDGET=${BUDGET:-520}
timeout "${TIMEOUT:-$((BUDGET + 40))}" python -m mosaic profile "$@" --preset "${PRESET:-small}" \
  --kernels "${KERNELS:-compile-default}" --surfaces-only --update --remeasure \
  --budget "$BUDGET" --db "$OUT/h200.sqlite" \
  > /tmp/logs/reprofile_unmasked.log 2>&1
echo "profile rc=$?"; grep -E "^\[|points of|wrote" /tmp/logs/reprofile_unmasked.log | tail -n 12
tar czf "$OUT/logs.tar.gz" -C /tmp logs
