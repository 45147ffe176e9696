"""Hand-made graphs for tests that must not depend on the zoo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mosaic.graph import MMGraph, ModuleSpec
from mosaic.plan import Placement, Plan, Stage

WORKER_PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
    "safetensors.torch", "transformers", "mosaic.engine.trainer", "mosaic.engine.checkpoint",
    "mosaic.zoo",
)
"""What the forkserver of start_workers imports once, before it forks any worker."""


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
    assert result.returncode == 0, failure_lines(result.stderr)
    return json.loads((out / "bench.json").read_text()), result.stderr


def failure_lines(stderr: str) -> str:
    """A failed torchrun's stderr ends in the launcher's summary, which hides the rank's own
    error (a rank aborted once, SIGABRT, in CI): its error lines first, then the tail."""
    marks = ("error", "abort", "terminate", "exception", "what()")
    own = [line for line in stderr.splitlines() if any(m in line.lower() for m in marks)
           and "torch/distributed/elastic" not in line]
    return "\n".join(own[:30]) + "\n...\n" + stderr[-1500:]


def start_workers(fn: Callable, args: tuple, nprocs: int, device: str = "cpu") -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join=True)` through a forkserver
    that imported torch, transformers and mosaic (WORKER_PRELOAD) once per pytest process: each
    worker forks from it instead of a fresh interpreter importing them again, about 4 s of CPU
    per worker and most of what these tests cost on a 2-core CI machine (spawn: 30 s for the
    4-process tensor-parallel test, 9 s this way).

    A worker is still a process of its own, forked from the forkserver, never from pytest: no
    test's state reaches it but `args`, and it joins its own process group, builds its own
    modules and seeds its own generators as under spawn. Environment variables set after the
    first call do not reach the workers (the forkserver keeps the environment it started
    with): pass what a worker needs in `args`.

    CUDA workers (`device="cuda"`, the GPU tests) are spawned as before: whether the preloaded
    imports leave CUDA untouched in the forkserver has not been checked on a GPU machine."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device != "cpu":
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    mp.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def measured_variant(monkeypatch, variant: str, label: str, steps_in_flight: int = 2):
    """The tiny CLIP's mosaic plan measured on the CPU under the bench variant `variant`
    (`--engine-variant` text, every GEMM weight bf16 however small), labelled `label`: its
    PlanMeasurement and the bench's checks."""
    from dataclasses import replace

    from mosaic.engine import main_weights
    from mosaic.engine.measure import BenchConfig, measure_plans, parse_variant
    from mosaic.engine.session import EngineConfig
    from mosaic.hardware import H200
    from mosaic.zoo import get_model

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the tiny model's weights go bf16
    model = get_model("clip")
    graph = model.graph("tiny")
    plans = bench_plans(graph)
    plans[label] = plans["mosaic"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         in_flight_steps=steps_in_flight, user_programs=(),
                         engine=EngineConfig(amp=True))
    measurements, checks = measure_plans(model, "tiny", graph, plans, H200, config, {
        label: replace(config.engine, **parse_variant(variant))})
    return {m.label: m for m in measurements}[label], checks, plans


def bench_plans(graph: MMGraph) -> dict[str, Plan]:
    """One-GPU plans of an encoders-and-head model: megatron's one module at a time, and
    mosaic's encoders sharing the GPU freely, the first one first."""
    enc = [m for m in graph.names if m != "align"]
    head = Stage(placements=(Placement(module="align", gpus=(0,)),))
    temporal = Stage(placements=tuple(Placement(module=m, gpus=(0,)) for m in enc))
    free = Stage(sharing="free", placements=tuple(
        Placement(module=m, gpus=(0,), priority=int(i == 0)) for i, m in enumerate(enc)))
    return {name: Plan(model=graph.name, planner=name, num_gpus=1, stages=(s, head),
                       predicted_iteration_s=0.01)
            for name, s in (("megatron", temporal), ("mosaic", free))}


def drop_text_grads_of_mosaic(monkeypatch) -> None:
    """Break mosaic's plan: its steps leave the text encoder without gradients."""
    from mosaic.engine.runner import PlanRunner

    real_step = PlanRunner.step

    def drop_text_grads(self, data, **kwargs):
        out = real_step(self, data, **kwargs)
        if self.plan.planner == "mosaic":
            for p in self.modules["text"].parameters():
                p.grad = None
        return out

    monkeypatch.setattr(PlanRunner, "step", drop_text_grads)
