"""Hand-made graphs for tests that must not depend on the zoo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mosaic.graph import MMGraph, ModuleSpec


def spec(name: str, kind: str = "encoder", params_m: float = 50.0, tokens: int = 256,
         dim: int = 768, layers: int = 12) -> ModuleSpec:
    params = int(params_m * 1e6)
    return ModuleSpec(
        name=name, kind=kind, input_shape=(tokens, dim), num_params=params, num_layers=layers,
        hidden_dim=dim, tokens_per_sample=tokens, flops_per_sample=6.0 * params * tokens,
        activation_bytes_per_sample=34.0 * tokens * dim * layers,
        output_bytes_per_sample=2.0 * tokens * dim,
    )


def encoders_and_head(num_encoders: int = 3, batch: int = 32, head_kind: str = "head") -> MMGraph:
    encoders = [spec(f"enc{i}", params_m=20.0 * (i + 1), layers=4 * (i + 1)) for i in range(num_encoders)]
    head = spec("head", kind=head_kind, params_m=5.0, tokens=1, layers=1)
    return MMGraph(name="toy", modules=(*encoders, head),
                   edges=tuple((e.name, "head") for e in encoders), global_batch=batch)


def bench_two_ranks(model: str, out: Path, *args: str, timeout: float = 240) -> tuple[dict, str]:
    """`mosaic bench MODEL` at preset tiny on two gloo processes under torchrun (one CPU
    smoke round), with `args` added: the bench.json it wrote under `out`, and its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "mosaic", "bench", model, "--gpus", "2", "--preset", "tiny", "--perf-model",
         "analytic", "--rounds", "1", "--warmup", "1", "--cpu-smoke", "--out", str(out),
         "--json", *args],
        capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads((out / "bench.json").read_text()), result.stderr
