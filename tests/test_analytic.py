"""The bootstrap model must reproduce the qualitative facts measured on the H200 (DESIGN.md)."""

import pytest

from mosaic.hardware import make_cluster
from mosaic.perf import AnalyticModel, Work
from mosaic.plan import Placement, Plan, Stage
from tests.helpers import encoders_and_head, spec

VISION = spec("vision", params_m=304, tokens=257, dim=1024, layers=24)
AUDIO = spec("audio", params_m=85, tokens=200, dim=768, layers=12)
TEXT = spec("text", params_m=85, tokens=77, dim=768, layers=12)


@pytest.fixture(scope="module")
def model():
    return AnalyticModel(make_cluster(1))


def test_time_falls_with_sms_and_rises_with_batch(model):
    times = [model.module_time_s(VISION, 32, s / 132) for s in (16, 32, 64, 132)]
    assert times == sorted(times, reverse=True)
    assert times[0] > 3 * times[-1]  # a big module scales with SMs
    assert model.module_time_s(VISION, 8) < model.module_time_s(VISION, 32)


def test_small_modules_saturate_early(model):
    # A small text encoder at a small batch gains little beyond a third of the GPU.
    assert model.module_time_s(TEXT, 4, 48 / 132) < 1.3 * model.module_time_s(TEXT, 4, 1.0)


def test_colocation_gain_shrinks_with_batch_and_free_beats_partition(model):
    gains = []
    for batch in (4, 8, 16, 32):
        works = [Work(m, batch) for m in (VISION, AUDIO, TEXT)]
        temporal = model.colocated_time_s(works, "temporal")
        free = model.colocated_time_s(works, "free")
        part = model.colocated_time_s(
            [Work(VISION, batch, 72 / 132), Work(AUDIO, batch, 32 / 132), Work(TEXT, batch, 16 / 132)],
            "partition")
        assert free < temporal
        assert free <= part
        gains.append(temporal / free)
    assert gains == sorted(gains, reverse=True)


def test_iteration_time_is_the_sum_of_stages_and_allreduce_grows_with_gpus(model):
    g = encoders_and_head(2, batch=32)
    c2 = make_cluster(2)
    m2 = AnalyticModel(c2)
    plan = Plan(model="toy", planner="m", num_gpus=2, stages=(
        Stage(placements=(Placement(module="enc0", gpus=(0, 1)),)),
        Stage(placements=(Placement(module="enc1", gpus=(0, 1)),)),
        Stage(placements=(Placement(module="head", gpus=(0, 1)),)),
    ))
    total = m2.iteration_time_s(plan, g)
    assert total == pytest.approx(sum(m2.stage_time_s(s, g) for s in plan.stages))
    assert m2.allreduce_s(1e9, [0, 1]) > 0 and m2.allreduce_s(1e9, [0]) == 0
    assert 0 < m2.gpu_utilisation(plan, g) <= 1


def test_the_predicted_timeline_ends_at_the_predicted_iteration_time():
    """The Gantt chart's bars tell the whole predicted time: compute, gradient all-reduce,
    transfers and the optimizer (its title quotes the same number)."""
    from mosaic.hardware import make_cluster
    from mosaic.perf import make_perf_model
    from mosaic.planners import plan_all
    from mosaic.report.timeline import predicted_timeline
    from mosaic.zoo import get_model

    graph = get_model("ofasys").graph("paper")
    cluster = make_cluster(8)
    perf = make_perf_model("analytic", cluster)
    for plan in plan_all(graph, cluster, perf):
        events = predicted_timeline(plan, graph, perf)
        assert max(e.end_s for e in events) == pytest.approx(plan.predicted_iteration_s)
