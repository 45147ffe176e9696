#!/usr/bin/env bash
# One H200, one device call (about 8 minutes), results under $1 (one archive comes back).
# Prepared in the twenty-fourth session (2026-12-03). `mosaic train` now plans and predicts
# for the engine it runs (compile scope, the bf16 update's layout), and the shipped per-weight
# update entries were measured again with the tuned kernel: Unified-IO 2 `paper` b4 trained
# with bf16 weights by blocks (the model predicts 69.6 ms a weight at a time; the last run
# measured 75.2 with a prediction of 85.3 made for module scope), then every one-GPU test file
# but the main weights' (run in this session's call before) with their durations.
set -u
OUT=${1:?usage: gpu_tests_and_train_prediction_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 170 python -m mosaic train unified-io-2 --preset paper --batch 4 --bf16-weights \
  --compile-scope blocks --steps 40 --out /tmp/train_u2 > "$OUT/train_unified-io-2_paper_b4_bf16.log" 2>&1
echo "train rc=$?"; grep -E "bf16 update|plan=|Error" "$OUT/train_unified-io-2_paper_b4_bf16.log" | cut -c1-240
cp /tmp/train_u2/summary.json "$OUT/train_unified-io-2_paper_b4_bf16_summary.json" 2>/dev/null
python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('predicted %.2f ms, measured %.2f ms (p10 %.2f), guard %s' % (s['predicted_iteration_s']*1e3, s['step_time_median_s']*1e3, s['step_time_p10_s']*1e3, s.get('nan_guard')))" "$OUT/train_unified-io-2_paper_b4_bf16_summary.json"
timeout 400 python -m pytest -m gpu -q -p no:cacheprovider --durations=0 tests/gpu \
  --ignore=tests/gpu/test_main_weights_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/gpu_tests.log" | tail -n 8
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
