"""`mosaic bench` on a GPU (skipped without CUDA): graphed plans, one of them on green
contexts, timed beside the user's `torch.compile(mode="reduce-overhead")` program.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_bench_gpu.py -s

Inductor's cudagraph trees clear torch's cached cuBLAS workspaces before each recording; a
plan graph that had captured a cached workspace then faulted ("unspecified launch failure")
in its next step. The engine now captures with workspaces of its own.
"""

from __future__ import annotations

import math

import pytest
import torch

from mosaic.engine.measure import BenchConfig, GradientsDiffer, measure_plans
from mosaic.engine.session import EngineConfig
from mosaic.hardware import H200
from mosaic.zoo import get_model
from tests.helpers import bench_plans, drop_text_grads_of_mosaic
from tests.test_engine import one_gpu_plans

pytestmark = pytest.mark.gpu


def test_graphed_plans_survive_the_reduce_overhead_user_program():
    model = get_model("clip")
    graph = model.graph("small", global_batch=32)
    plans = {k: p for k, p in one_gpu_plans(graph).items() if k in ("temporal", "partition")}
    config = BenchConfig(rounds=2, steps_per_round=3, warmup_steps=3, nvml_seconds=0,
                         engine=EngineConfig(graphs=True, compile="default"),
                         user_programs=("torch-eager", "torch-compile"))
    measurements, checks = measure_plans(model, "small", graph, plans, H200, config)
    medians = {m.label: m.median_s for m in measurements}
    print({label: round(1e3 * s, 2) for label, s in medians.items()}, checks["gradients"])
    assert set(medians) == {"temporal", "partition", "torch-eager", "torch-compile"}
    assert all(math.isfinite(s) and s > 0 for s in medians.values())
    # Steps in flight: the reduce-overhead program's loss is a CUDA-graph-tree output that
    # its next replay overwrites; the window sums it into a tensor of its own.
    in_flight = {m.label: m.summary()["in_flight_median_s"] for m in measurements}
    print("in flight, ms:", {label: round(1e3 * s, 2) for label, s in in_flight.items()})
    assert all(len(m.in_flight_step_times_s) == 2 and in_flight[m.label] > 0
               for m in measurements)
    held = {m.label: m.graph_memory_bytes for m in measurements}
    print("graph memory, MiB:", {k: v and round(v / 2**20) for k, v in held.items()},
          "peak, GiB:", [p / 2**30 for p in checks["peak_memory_bytes"]])
    assert held["temporal"] > 0 and held["partition"] > 0 and held["torch-eager"] is None
    pools = {m.label: m.graph_pool_bytes for m in measurements}
    print("graph pools, MiB:", {k: v and round(v / 2**20) for k, v in pools.items()})
    assert pools["temporal"] > 0 and pools["partition"] > 0 and pools["torch-eager"] is None
    assert checks["peak_memory_bytes"][0] >= max(held["temporal"], held["partition"])
    torch.cuda.synchronize()  # a fault in the last steps surfaces here


def test_a_plan_that_drops_a_modules_gradients_is_refused_on_the_gpu(monkeypatch):
    """Deliberately broken: mosaic's compiled, graphed plan leaves its text encoder without
    gradients. Its loss is the same; the gradient check, with its tolerance measured from
    the user's compiled program against the eager one, refuses it and passes megatron's."""
    drop_text_grads_of_mosaic(monkeypatch)
    model = get_model("clip")
    graph = model.graph("small", global_batch=32)
    config = BenchConfig(rounds=1, steps_per_round=2, warmup_steps=2, nvml_seconds=0,
                         engine=EngineConfig(graphs=True, compile="default"),
                         user_programs=("torch-eager", "torch-compile"))
    with pytest.raises(GradientsDiffer) as refused:
        measure_plans(model, "small", graph, bench_plans(graph), H200, config)
    checks = refused.value.checks["gradients"]
    differences = checks["differences"]
    print(refused.value, {k: checks[k] for k in ("noise_floor", "tolerance")})
    assert (refused.value.label, refused.value.module) == ("mosaic", "text")
    assert refused.value.difference == pytest.approx(1.0)
    assert checks["noise_floor"] > 0 and checks["tolerance"] < 0.2
    assert max(differences["megatron"].values()) <= checks["tolerance"]
    assert max(differences["torch-compile"].values()) <= checks["tolerance"]
