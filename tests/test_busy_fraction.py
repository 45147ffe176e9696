"""Busy fractions: stored per module and batch, and the capacity bound they put on colocations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mosaic.perf.base import Work
from mosaic.perf.interference import (
    CoWork,
    InterferenceParams,
    busy_work_s,
    group_time_s,
    within_capacity,
)
from mosaic.perf.profiled import ProfiledModel, SurfaceSet
from mosaic.profile.db import BusyPoint, ModulePoint, ProfileDB, module_signature
from mosaic.profile.profiler import ProfilerConfig, ProfilerError, busy_only_split, recorded_part
from mosaic.profile.recipe import rebuild_recipe
from tests.helpers import spec
from tests.test_profiled_model import CLUSTER, make_synthetic_db


def _work(busy: float | None) -> CoWork:
    """On half the GPU it takes 1.6x its whole-GPU time: more work per SM than on all of it,
    as green-context surfaces of compiled modules show."""
    return CoWork(sms=(66.0, 132.0), times=(1.6, 1.0), limit=132.0, memory_s=0.0, busy=busy)


def test_two_copies_of_a_module_that_fills_the_gpu_take_twice_its_time():
    free = InterferenceParams(variant="unaware", zeta=1.0)
    assert group_time_s(free, [_work(None), _work(None)], "free") == pytest.approx(1.6)
    assert group_time_s(free, [_work(1.0), _work(1.0)], "free") == pytest.approx(2.0)
    assert group_time_s(free, [_work(0.9), _work(0.9)], "free") == pytest.approx(1.8)
    # a module that keeps little of the GPU busy is not held back by the bound
    assert group_time_s(free, [_work(0.6), _work(0.6)], "free") == pytest.approx(1.6)
    unbounded = InterferenceParams(variant="unaware", zeta=1.0, busy_bound=False)
    assert group_time_s(unbounded, [_work(1.0), _work(1.0)], "free") == pytest.approx(1.6)


def test_a_fitted_stretch_below_one_does_not_beat_the_gpus_capacity():
    """A negative kappa (fitted on eager colocations) would shorten every group; where the
    busy fractions are known the group still takes their busy work one after another."""
    shrink = InterferenceParams(variant="unaware", zeta=1.0, kappa=-0.05)
    assert group_time_s(shrink, [_work(None), _work(None)], "free") == pytest.approx(1.6 * 0.95)
    assert group_time_s(shrink, [_work(1.0), _work(1.0)], "free") == pytest.approx(2.0)
    assert group_time_s(shrink, [_work(0.6), _work(0.6)], "free") == pytest.approx(1.52)
    assert busy_work_s([_work(0.6), _work(None)]) == 0.0


def test_the_bound_needs_every_member_measured_and_leaves_one_module_alone():
    rates = [1 / 1.6, 1 / 1.6]
    assert within_capacity([_work(1.0), _work(None)], rates) == rates
    assert within_capacity([_work(1.0)], rates[:1]) == rates[:1]
    assert within_capacity([_work(1.0), _work(1.0)], rates) == pytest.approx([0.5, 0.5])


def test_the_db_keeps_busy_points_and_drops_them_with_a_remeasured_surface(tmp_path):
    db = ProfileDB.create(tmp_path / "p.sqlite", hardware="h200", num_sms=132)
    assert db.busy() == []  # a DB made before the table: none, not an error
    sig = db.add_module("clip", "small", spec("vision"))
    db.add_busy([BusyPoint(signature=sig, per_gpu_batch=b, alone_s=0.01, pair_s=0.018)
                 for b in (8, 32)])
    db.add_busy([BusyPoint(signature=sig, per_gpu_batch=32, alone_s=0.01, pair_s=0.02)])
    assert [(p.per_gpu_batch, round(p.fraction, 3)) for p in db.busy()] == [(8, 0.9), (32, 1.0)]
    assert dict(db.iter_counts())["busy"] == 2
    db.replace_points(sig, [ModulePoint(signature=sig, per_gpu_batch=8, num_sms=132, time_s=0.01)])
    assert db.busy() == []
    db.close()


def test_the_busy_fraction_is_interpolated_in_log_batch_and_held_at_the_ends():
    busy = [BusyPoint(signature="s", per_gpu_batch=16, alone_s=1.0, pair_s=1.6),
            BusyPoint(signature="s", per_gpu_batch=64, alone_s=1.0, pair_s=2.0),
            BusyPoint(signature="t", per_gpu_batch=8, alone_s=1.0, pair_s=0.2)]
    surfaces = SurfaceSet(CLUSTER, {}, {}, {}, busy=busy)
    assert surfaces.busy_fraction("s", 32) == pytest.approx(0.9)
    assert surfaces.busy_fraction("s", 4) == pytest.approx(0.8)
    assert surfaces.busy_fraction("s", 256) == pytest.approx(1.0)
    assert surfaces.busy_fraction("t", 8) == 0.5  # below half is noise: clipped
    assert surfaces.busy_fraction("u", 8) is None and surfaces.busy_fraction(None, 8) is None


def test_a_profiled_model_bounds_colocations_of_modules_measured_as_filling_the_gpu(tmp_path):
    path = tmp_path / "busy.sqlite"
    _, specs = make_synthetic_db(path, num_colocs=12)
    with ProfileDB.open(path, readonly=False) as db:
        db.add_busy([BusyPoint(signature=r.signature, per_gpu_batch=b, alone_s=1.0, pair_s=2.0)
                     for r in db.modules() for b in (2, 32)])
    model = ProfiledModel(CLUSTER, path, interference="unaware")
    works = model.coworks([Work(module=s, per_gpu_batch=32) for s in specs[:2]], "free")
    assert [w.busy for w in works] == [1.0, 1.0]
    sequential = sum(w.full_s for w in works)
    bounded = group_time_s(model.params, works, "free")
    unbounded = group_time_s(replace(model.params, busy_bound=False), works, "free")
    # no faster than one after the other (the last one alone may use fewer SMs than all)
    assert bounded >= sequential * (1 + model.params.kappa) * (1 - 1e-9) > unbounded


def test_the_recipe_names_a_busy_only_run_for_models_measured_that_way(tmp_path):
    path = tmp_path / "p.sqlite"
    with ProfileDB.create(path, hardware="h200", num_sms=132, config={"budget_s": 120}) as db:
        a = db.add_module("clip", "small", spec("vision"))
        b = db.add_module("qwen3-vl", "small", spec("llm", dim=768), kernels="compile-default")
        db.add_points([ModulePoint(signature=s, per_gpu_batch=4, num_sms=132, time_s=0.01)
                       for s in (a, b)])
        db.add_busy([BusyPoint(signature=b, per_gpu_batch=n, alone_s=0.01, pair_s=0.02)
                     for n in (8, 32)])
        # the same module in another preset's model, beside one never measured: no busy run
        db.add_module("ofasys", "paper", spec("llm", dim=768), kernels="compile-default")
        db.add_module("ofasys", "paper", spec("audio", dim=512), kernels="compile-default")
        db.set_meta("profile.compile-default.small.busy", '{"budget_s": 50}')
    steps = rebuild_recipe(path, "out.sqlite")
    assert [s.command for s in steps if "--busy-only" in s.command] == [
        "mosaic profile qwen3-vl --preset small --kernels compile-default --busy-only "
        "--budget 50 --update --db out.sqlite"]
    assert steps[0].command == ("mosaic profile clip --preset small --surfaces-only "
                                "--budget 120 --db out.sqlite")
    assert steps[-1].what == "compile-default `small` busy fractions of 1 modules (2 points)"


def test_unknown_busy_batches_are_refused():
    with pytest.raises(ProfilerError, match="choose from"):
        ProfilerConfig(busy_batches=("largest",))


def test_a_busy_only_run_measures_only_modules_with_a_surface_of_its_kernels():
    """A busy fraction bounds a surface of the same kernels: a module without one is skipped
    and named, and (since it is not registered) the recipe claims no surface for it."""
    from mosaic.zoo import get_model

    graph = get_model("clip").graph("paper")
    busy_only = ProfilerConfig(kernels="compile-default-blocks", surfaces=False)
    text = next(m for m in graph.modules if m.name == "text")
    surfaced = {module_signature(text, "compile-default-blocks"),
                module_signature(graph.module("vision"), "compile-default")}  # other kernels
    kept, skipped = busy_only_split(graph, busy_only, surfaced)
    assert [m.name for m in kept] == ["text"] and sorted(skipped) == ["align", "vision"]
    whole = replace(busy_only, surfaces=True)
    assert busy_only_split(graph, whole, set()) == (list(graph.modules), [])


def test_an_updating_run_records_every_run_of_its_part_for_the_recipe():
    """The recipe rebuilds a part of the DB in one run: it needs every model measured into it
    and a budget for all of them, not only the last run's."""
    before = '{"models": ["clip", "imagebind"], "budget_s": 390}'
    assert recorded_part(before, ["ofasys", "clip"], 480) == {
        "models": ["clip", "imagebind", "ofasys"], "budget_s": 870}
    assert recorded_part(before, ["clip"], 100) == {  # a resumed run: the same models
        "models": ["clip", "imagebind"], "budget_s": 390}
    assert recorded_part(None, ["ofasys"], 50) == {"models": ["ofasys"], "budget_s": 50}
    assert recorded_part("not json", ["ofasys"], 50) == {"models": ["ofasys"], "budget_s": 50}
