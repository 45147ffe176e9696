"""The measured optimizer step (profile/optimizer.py): its fit, its place in the ProfileDB,
and the performance model pricing the step with it instead of the datasheet bandwidth."""

from __future__ import annotations

import pytest
import torch

from mosaic.hardware import make_cluster
from mosaic.perf.profiled import ProfiledModel
from mosaic.plan import Placement, Plan, Stage
from mosaic.profile.db import ProfileDB
from mosaic.profile.optimizer import (
    FIT_NAME,
    OptimizerFit,
    OptimizerPoint,
    fit,
    layer_shapes,
    profile_optimizer,
    stored_fit,
)
from mosaic.profile.recipe import rebuild_recipe
from tests.helpers import encoders_and_head, spec

CLUSTER = make_cluster(1, "h200")


def test_fit_recovers_a_straight_line_and_reports_its_error():
    truth = OptimizerFit(fixed_s=2e-5, s_per_param=8e-12)
    points = [OptimizerPoint(n, 12, truth.seconds(n)) for n in (10**7, 10**8, 10**9)]
    got, mape = fit(points)
    assert got.fixed_s == pytest.approx(truth.fixed_s, rel=1e-6)
    assert got.s_per_param == pytest.approx(truth.s_per_param, rel=1e-9)
    assert mape == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="two or more sizes"):
        fit(points[:1])


def test_layers_hold_twelve_hidden_squared_weights():
    h = 64
    weights = sum(a * b for a, b in (s for s in layer_shapes(h) if len(s) == 2))
    assert weights == 12 * h * h


def test_profiling_on_the_cpu_stores_a_fit_the_db_gives_back(tmp_path):
    with ProfileDB.create(tmp_path / "p.sqlite", hardware="h200", num_sms=132) as db:
        measured = profile_optimizer(db, torch.device("cpu"), layers=(1, 4), hidden=64)
        stored = stored_fit(db)
        (record,) = [f for f in db.fits() if f.name == FIT_NAME]
    assert stored == measured and record.n_points == 2
    assert [p[0] for p in record.params["points"]] == [12 * 64 * 64 + 13 * 64,
                                                       4 * (12 * 64 * 64 + 13 * 64)]


def _one_module_plan():
    graph = encoders_and_head(num_encoders=2, batch=8)
    encoders = tuple(Placement(module=m.name, gpus=(0,)) for m in graph.modules[:-1])
    stages = (Stage(placements=encoders), Stage(placements=(Placement(module="head", gpus=(0,)),)))
    return graph, Plan(model="toy", planner="manual", num_gpus=1, stages=stages)


def test_the_model_prices_the_step_with_the_measured_fit(tmp_path):
    path = tmp_path / "p.sqlite"
    ProfileDB.create(path, hardware="h200", num_sms=132).close()
    graph, plan = _one_module_plan()
    params = sum(m.num_params for m in graph.modules)
    datasheet = ProfiledModel(CLUSTER, path)
    assert datasheet.optimizer_s(plan, graph) == pytest.approx(
        params * 28.0 / CLUSTER.gpu.mem_bandwidth_bps)
    with ProfileDB.open(path, readonly=False) as db:
        measured = profile_optimizer(db, torch.device("cpu"), layers=(1, 2), hidden=32)
    model = ProfiledModel(CLUSTER, path)
    assert model.optimizer_s(plan, graph) == pytest.approx(measured.seconds(params))
    gap = model.iteration_time_s(plan, graph) - datasheet.iteration_time_s(plan, graph)
    assert gap == pytest.approx(measured.seconds(params) - datasheet.optimizer_s(plan, graph))
    assert "optimizer: measured" in model.describe()


def test_the_recipe_says_the_profile_runs_measure_the_optimizer(tmp_path):
    path = tmp_path / "p.sqlite"
    with ProfileDB.create(path, hardware="h200", num_sms=132) as db:
        db.add_module("clip", "small", spec("vision", params_m=10, tokens=16, dim=64, layers=1))
        profile_optimizer(db, torch.device("cpu"), layers=(1, 2), hidden=32)
    (step,) = rebuild_recipe(path)
    assert "optimizer-step fit (2 sizes)" in step.what
