#!/usr/bin/env bash
# One H200, one device call (about 7 minutes), results under $1 (one archive comes back).
# gahc's OFASys `paper` b8 plan fails in cuBLAS when `structured` and `video` share its
# concurrent stage (2026-12-03, twentieth session: not with the caching allocator off, not a
# cuDNN kernel, not under memcheck's first 20 reports, which were all cuGetProcAddress).
# 1. green_gemm_probe.py: the failing GEMM on each of the plan's streams, and on single green
#    contexts of 8-132 SMs at the front and at the tail of the GPU, launches blocking.
# 2. memcheck again on structured+video, every report printed, so the failing launch's own
#    API error shows.
# 3. `mosaic train ... --autotune 1 --autotune-skip gahc`, the way on autotune's error names.
set -u
OUT=${1:?usage: gahc_green_probe_h200.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
CUDA_LAUNCH_BLOCKING=1 timeout 150 python benchmarks/green_gemm_probe.py "$OUT/probe.jsonl" \
  > "$OUT/probe.log" 2>&1
echo "probe rc=$?"
python3 - "$OUT/probe.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["case"], r.get("module"), r.get("share"), r.get("mode"), r.get("num_sms"),
          r.get("sm_range"), r.get("n256", r.get("crashed")), r.get("n392", "")[:60])
PY
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 100 /usr/local/cuda/bin/compute-sanitizer \
  --tool memcheck --print-limit 400 --log-file "$OUT/memcheck.txt" \
  python benchmarks/shared_bf16_plans.py ofasys paper 8 gahc --fp32 --compile none \
  --no-graphs --concurrent structured,video > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"
grep -E "^=+ (Invalid|Program hit|ERROR SUMMARY)" "$OUT/memcheck.txt" | grep -v cuGetProcAddress \
  | sort | uniq -c | head -n 12 | cut -c1-250
name=train_ofasys_paper_b8_bf16_autotune_skip_gahc
timeout 230 python -m mosaic train ofasys --preset paper --batch 8 --bf16-weights --autotune 1 \
  --autotune-skip gahc --steps 30 --compile-scope blocks --out "$OUT/$name" > "$OUT/$name.log" 2>&1
echo "train skip gahc rc=$?"
grep -E "^autotune|plan=|^mosaic: error|Error" "$OUT/$name.log" | tail -n 8 | cut -c1-300
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
