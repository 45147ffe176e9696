"""`mosaic bench` logic on CPU: timings are meaningless here, the bookkeeping is not."""

import json

import pytest

from mosaic.bench import BenchConfig, BenchError, bench_report, measure_plans
from mosaic.hardware import H200
from mosaic.plan import Placement, Plan, Stage
from mosaic.zoo import get_model


def _plans(graph):
    enc = [m for m in graph.names if m != "align"]
    head = Stage(placements=(Placement(module="align", gpus=(0,)),))
    temporal = Stage(placements=tuple(Placement(module=m, gpus=(0,)) for m in enc))
    free = Stage(sharing="free", placements=tuple(
        Placement(module=m, gpus=(0,), priority=int(i == 0)) for i, m in enumerate(enc)))
    return {name: Plan(model=graph.name, planner=name, num_gpus=1, stages=(s, head),
                       predicted_iteration_s=0.01)
            for name, s in (("megatron", temporal), ("mosaic", free))}


def test_bench_measures_every_plan_and_reports_ratios(tmp_path):
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=2, steps_per_round=2, warmup_steps=1, nvml_seconds=0)
    measurements = measure_plans(model, "tiny", graph, _plans(graph), H200, config)
    assert [m.label for m in measurements] == ["megatron", "mosaic"]
    assert all(len(m.step_times_s) == 4 for m in measurements)
    assert {e["module"] for e in measurements[1].timeline} == set(graph.names)
    report = bench_report(graph, measurements, H200, "tiny")
    json.dumps(report)  # serialisable
    row = report["results"][1]
    assert {"planner", "measured_iteration_s", "spread_s", "predicted_iteration_s", "mfu"} <= row.keys()
    assert report["mosaic_speedup_vs_best_baseline"] == pytest.approx(
        measurements[0].median_s / measurements[1].median_s)


def test_bench_refuses_multi_gpu_plans_in_one_process():
    model = get_model("clip")
    graph = model.graph("tiny")
    plan = Plan(model="clip", planner="megatron", num_gpus=2, stages=(
        Stage(placements=tuple(Placement(module=m, gpus=(0, 1)) for m in graph.names[:-1])),
        Stage(placements=(Placement(module="align", gpus=(0, 1)),))))
    with pytest.raises(BenchError, match="torchrun"):
        measure_plans(model, "tiny", graph, {"megatron": plan}, H200, BenchConfig())
