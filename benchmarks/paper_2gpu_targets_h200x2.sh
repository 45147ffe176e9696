#!/usr/bin/env bash
# PREPARED, NOT YET RUN (twenty-fifth session, 2026-12-04; no two-GPU kind lent since the
# twelfth). 2 x H200, results under $1 (one archive comes back): the model-fidelity issue's
# two-GPU targets at `paper`, one `torchrun` bench run per model named after $1 (default:
# clip imagebind; then `ofasys`, then `unified-io-2`, each a device call of its own: OFASys
# compiles eight modules, and its user program compiles them whole).
#   - the plans are made in the run by today's planners and shipped profile;
#   - the user's torch.compile program (DDP over both GPUs) beside them;
#   - each row records its host launch share, which the two-GPU CLIP rows of 2026-11-30 lack:
#     those rows miss the accuracy gate, host-bound (DDP's and the bucketing's per-parameter
#     work), and a host term needs them measured again;
#   - compiled by blocks (compile time independent of depth; the user program is compiled
#     whole, as users do).
#   - every plan measured again with its gradients summed inside the backward graphs
#     (`--engine-variant grad_sync=overlapped`, forty-fourth session; VARIANT="" leaves it
#     out): the model predicts 1.95x / 1.99x / 1.96x / 1.74x weak scaling with it, against
#     1.64x / 1.74x / 1.69x / 1.31x with `flat` (docs/engine.md); the ratio needs a 1-GPU
#     bench of the same model at half the global batch (the same per-GPU batch).
# Checked on the CPU with `--preset tiny --cpu-smoke` (two gloo processes) before shipping.
set -u
OUT=${1:?usage: paper_2gpu_targets_h200x2.sh OUT [MODEL...]}
shift
MODELS=${*:-clip imagebind}
# PLANNERS=megatron,mosaic: fewer plans where a model's run nears its limit
VARIANT=${VARIANT-grad_sync=overlapped}
# bf16 weights summed in bf16 during the backward: 1.95-1.99x predicted, Unified-IO 2 included
VARIANT2=${VARIANT2-grad_sync=overlapped,bf16_weights=true,reduce_dtype=bf16}
mkdir -p "$OUT" /tmp/logs
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
declare -A LIMIT=([clip]=170 [imagebind]=230 [ofasys]=560 [unified-io-2]=480 [qwen3-vl]=470)
for m in $MODELS; do
  timeout -k 10 "${LIMIT[$m]:-300}" torchrun --standalone --nproc-per-node 2 -m mosaic bench \
    "$m" --gpus 2 --preset paper --perf-model profiled --compile-scope blocks \
    --user-programs torch-compile --rounds 4 --out "/tmp/b-$m" --json \
    ${PLANNERS:+--planners "$PLANNERS"} \
    ${VARIANT:+--engine-variant "$VARIANT"} ${VARIANT2:+--engine-variant "$VARIANT2"} \
    > "$OUT/bench_${m}_paper_2gpu.json" 2> "/tmp/logs/bench_${m}_paper_2gpu.err"
  echo "$m paper 2gpu rc=$?"; grep "^mosaic bench" "/tmp/logs/bench_${m}_paper_2gpu.err" | tail -n 2
done
python3 benchmarks/bench_summary.py "$OUT"/bench_*.json
tar czf "$OUT/logs.tar.gz" -C /tmp logs
cd "$OUT" && tar czf /tmp/results.tar.gz . && find . -mindepth 1 -delete && mv /tmp/results.tar.gz .
