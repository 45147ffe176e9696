#!/usr/bin/env bash
# One H200, one device call, results under $1: every GPU test file (`pytest -m gpu tests/gpu`),
# with the slowest durations, under a hard limit. `timeout -k 10` kills what SIGTERM leaves
# alive: Inductor's compile workers can outlive it (BENCHMARKS.md, twenty-fifth session).
# LIMIT (s, default 540) bounds the pytest run; TESTS (default tests/gpu) names the files;
# extra arguments go to pytest (e.g. -k nccl). The whole suite took 463 s on 2026-12-04 before
# the thirtieth session added ~60 s of update-gate tests, so it no longer fits one call: PART=1
# runs the optimizer-side files (about 260 s), PART=2 every other file (about 280 s).
set -u
OUT=${1:?usage: gpu_tests_h200.sh OUT [PYTEST_ARGS...]}
shift
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PART1="tests/gpu/test_main_weights_gpu.py tests/gpu/test_update_gates_gpu.py
  tests/gpu/test_graphed_gpu.py tests/gpu/test_green_gpu.py"
case "${PART:-}" in
  1) TESTS=$PART1 ;;
  2) TESTS="tests/gpu $(for f in $PART1; do printf -- '--ignore=%s ' "$f"; done)" ;;
  "") ;;
  *) echo "PART=$PART: use 1 or 2 (or leave it unset for TESTS)" >&2; exit 2 ;;
esac
timeout -k 10 "${LIMIT:-540}" python -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/gpu} \
  --durations 15 "$@" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|skipped" "$OUT/gpu_tests.log" | tail -n 14
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch; print(torch.__version__)"
