#!/usr/bin/env bash
# One H200, one device call (about 9 minutes), results under $1. The zoo's transformers
# modules no longer build mask tensors (mosaic/zoo/common.py unpadded_sdpa), which changes
# the LLMs' kernels under torch.compile and their cost facts, so their profiled surfaces no
# longer apply:
#  1. A/B in one process of transformers' SDPA (explicit mask when compiled) against the zoo's
#     (none): compiled fwd+bwd of the LLMs and the audio encoder at `small`, preset batch;
#  2. the compiled `small` surfaces of the three LLMs again (--update profiles only modules
#     whose signature the DB lacks), into OUT/h200.sqlite.
set -u
OUT=${1:?usage: unmasked_attention_h200.sh OUT}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 220 python benchmarks/attention_mask_ab.py ofasys:llm:small:8 qwen3-vl:llm:small:8 \
  unified-io-2:llm:small:8 ofasys:audio:small:8 --rounds 4 --steps 5 \
  --out "$OUT/attention_mask_ab.json" 2> /tmp/logs/attention_mask_ab.err
echo "a/b rc=$?"; tail -n 3 /tmp/logs/attention_mask_ab.err
cp src/mosaic/profile/data/h200.sqlite "$OUT/h200.sqlite"
budget=${PROFILE_BUDGET:-270}
timeout $((budget + 25)) python -m mosaic profile ofasys qwen3-vl unified-io-2 --preset small \
  --kernels compile-default --surfaces-only --update --budget "$budget" \
  --db "$OUT/h200.sqlite" > /tmp/logs/profile_small_llms.log 2>&1
echo "profile rc=$?"; grep -E "^\[|kept|surface" /tmp/logs/profile_small_llms.log | tail -n 8
tar czf "$OUT/logs.tar.gz" -C /tmp logs
