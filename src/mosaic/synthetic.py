"""Seeded synthetic multimodal graphs, heterogeneous like OFASys, for planner tests and benchmarks.

Shape: many small modality encoders of very different sizes (IMU, tabular, text ...), a few
big ones (vision, video), optionally fusion/projector heads that consume some encoders, and
one consumer LLM (or a head, for tiny graphs) fed by the fusion heads and the other encoders:
a DAG of 2 or 3 levels. Costs follow transformer arithmetic: params ~ 12 L h^2, forward +
backward FLOPs ~ 6 params tokens, activations ~ 34 tokens h L bytes (bf16, no recompute).
"""

from __future__ import annotations

import math
import random

from mosaic.graph import GraphError, MMGraph, ModuleSpec

MODALITIES = ("vision", "audio", "video", "text", "imu", "depth", "thermal", "motion",
              "tabular", "point", "ecg", "struct", "speech", "event")
SMALL_PARAMS = (1e6, 60e6)
BIG_PARAMS = (150e6, 700e6)
LLM_PARAMS = (300e6, 1.5e9)
BIG_FRACTION = 0.2


def _module(name: str, kind: str, params: float, dim: int, tokens: int, out_dim: int) -> ModuleSpec:
    layers = max(1, round(params / (12 * dim * dim)))
    params = int(max(params, 12 * dim * dim * layers * 0.5))
    return ModuleSpec(
        name=name, kind=kind, input_shape=(tokens, dim), num_params=params, num_layers=layers,
        hidden_dim=dim, tokens_per_sample=tokens, flops_per_sample=6.0 * params * tokens,
        activation_bytes_per_sample=34.0 * tokens * dim * layers,
        output_bytes_per_sample=2.0 * tokens * out_dim,
    )


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _encoder(rng: random.Random, index: int, out_dim: int) -> ModuleSpec:
    big = index == 0 or rng.random() < BIG_FRACTION
    params = _log_uniform(rng, *(BIG_PARAMS if big else SMALL_PARAMS))
    dim = rng.choice((768, 1024) if big else (128, 256, 384, 512, 768))
    tokens = rng.choice((256, 577) if big else (16, 32, 64, 128, 256))
    modality = MODALITIES[index % len(MODALITIES)]
    return _module(f"enc{index}_{modality}", "encoder", params, dim, tokens, out_dim)


def synthetic_graph(num_modules: int, seed: int, num_gpus: int = 8,
                    global_batch: int | None = None) -> MMGraph:
    """A random OFASys-like graph of `num_modules` modules; the same seed gives the same graph.

    The default global batch is 16 samples per GPU of `num_gpus` (at least 16), a power of two
    times num_gpus, so many DP degrees divide it.
    """
    if num_modules < 1:
        raise GraphError(f"num_modules={num_modules}: a graph needs at least one module")
    rng = random.Random(seed)
    llm_dim = rng.choice((1024, 1536, 2048))
    llm_kind = "llm" if num_modules >= 3 else "head"
    llm_tokens = rng.choice((512, 1024)) if llm_kind == "llm" else 1
    llm_params = _log_uniform(rng, *LLM_PARAMS) if llm_kind == "llm" else 20e6
    llm = _module("llm" if llm_kind == "llm" else "head", llm_kind, llm_params, llm_dim, llm_tokens, llm_dim)
    num_fusion = 0 if num_modules < 6 else rng.randint(1, min(3, (num_modules - 3) // 3))
    encoders = [_encoder(rng, i, llm_dim) for i in range(num_modules - 1 - num_fusion)]
    fusions = [_module(f"fusion{j}", "head", _log_uniform(rng, 5e6, 80e6), 512, 64, llm_dim)
               for j in range(num_fusion)]
    edges = []
    for enc in encoders:
        # About half of the encoders feed a fusion head (when there is one), the rest the LLM.
        if fusions and rng.random() < 0.5:
            edges.append((enc.name, rng.choice(fusions).name))
        else:
            edges.append((enc.name, llm.name))
    for f in fusions:
        if not any(dst == f.name for _, dst in edges):
            edges.append((encoders[0].name, f.name))
        edges.append((f.name, llm.name))
    batch = global_batch or 16 * max(1, num_gpus)
    return MMGraph(name=f"synthetic-{num_modules}m-s{seed}", modules=(*encoders, *fusions, llm),
                   edges=tuple(edges), global_batch=batch, preset="synthetic",
                   meta={"generator": "mosaic.synthetic", "seed": seed, "num_gpus": num_gpus})
