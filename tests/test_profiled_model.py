"""ProfiledModel on a synthetic DB whose ground truth is known (analytic times + noise, and a
non-linear bandwidth contention), so fitting and held-out accuracy are checked on CPU."""

from __future__ import annotations

import numpy as np
import pytest

from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.perf import make_perf_model
from mosaic.perf.accuracy import (
    kernels_with_colocations,
    model_error,
    print_model_error,
    store_interference_fits,
)
from mosaic.perf.base import PerfModel, Work
from mosaic.perf.interference import InterferenceParams, finish_times_s, group_time_s
from mosaic.perf.profiled import (
    MIN_KERNEL_COLOCATIONS,
    ProfiledModel,
    SurfaceSet,
    fit_surface,
    interference_choice_name,
    monotone_row,
)
from mosaic.plan import Placement, Plan, Stage
from mosaic.profile.db import ColocPoint, ColocWork, ModulePoint, ProfileDB, ProfileDBError
from mosaic.zoo import get_model
from tests.helpers import encoders_and_head, spec

CLUSTER = make_cluster(1, "h200")
BATCHES = (1, 2, 4, 8, 16, 32)
SMS = (8, 16, 32, 48, 64, 96, 132)
TRUTH = InterferenceParams(variant="aware", alpha=6.0, p=1.5, q=2.0, zeta=0.7, prio_boost=2.0,
                           cap_share=0.4, kappa=0.02)


def _specs():
    return [
        spec("vision", params_m=80, tokens=256, dim=1024, layers=8),
        spec("audio", params_m=20, tokens=512, dim=768, layers=6),
        spec("text", params_m=10, tokens=64, dim=512, layers=4),
        spec("imu", params_m=1, tokens=1024, dim=1024, layers=6),  # memory-bound
        spec("motion", params_m=2, tokens=768, dim=768, layers=4),  # memory-bound
    ]


def _noise(rng, sigma):
    return float(np.exp(sigma * rng.standard_normal()))


def _coloc(rng, truth, specs, sigs, sharing, params=TRUTH):
    n = int(rng.choice([2, 2, 3]))
    idx = rng.choice(len(specs), size=n, replace=False)
    b = int(rng.choice(BATCHES[1:]))
    if sharing == "partition":
        cuts = np.sort(rng.choice(np.arange(1, 16), size=n - 1, replace=False))
        sms = np.diff(np.r_[0, cuts, 16]) * 8
    elif sharing == "cap":
        sms = [int(rng.choice([16, 32, 64])) for _ in range(n - 1)] + [132]
    else:
        sms = [132] * n
    prio = [1 if (sharing == "free" and i == 0 and rng.random() < 0.5) else 0 for i in range(n)]
    cows = [truth.cowork(specs[i], b, int(k), p) for i, k, p in zip(idx, sms, prio, strict=True)]
    times = [t * _noise(rng, 0.01) for t in finish_times_s(params, cows, sharing)]
    group = max(times)
    works = tuple(ColocWork(module=specs[i].name, signature=sigs[i], per_gpu_batch=b,
                            num_sms=int(k), priority=p, alone_s=c.alone_s, time_s=float(t))
                  for i, k, p, c, t in zip(idx, sms, prio, cows, times, strict=True))
    return ColocPoint(model="toy", preset="tiny", sharing=sharing, works=works,
                      group_time_s=group)


def make_synthetic_db(path, *, sigma=0.01, num_colocs=72, seed=0):
    """Analytic ground truth + log-normal noise; colocations under TRUTH's contention."""
    rng = np.random.default_rng(seed)
    truth = SurfaceSet(CLUSTER, {}, {}, {})  # no points: the analytic model, calibration 1
    specs = _specs()
    db = ProfileDB.create(path, hardware="h200", num_sms=132, config={"synthetic": True})
    sigs = [db.add_module("toy", "tiny", s) for s in specs]
    for s, sig in zip(specs, sigs, strict=True):
        db.add_points([ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k,
                                   time_s=truth.time_s(s, b, k) * _noise(rng, sigma))
                       for b in BATCHES for k in SMS])
    modes = ("partition", "free", "cap")
    for i in range(num_colocs):
        db.add_colocation(_coloc(rng, truth, specs, sigs, modes[i % 3]))
    db.close()
    return truth, specs


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("db") / "h200.sqlite"
    truth, specs = make_synthetic_db(path)
    return path, truth, specs


def test_recovers_held_out_single_points(synthetic):
    path, truth, specs = synthetic
    model = ProfiledModel(CLUSTER, path)
    errors = []
    for s in specs:
        for b in (3, 6, 12, 24):  # batches never measured
            for k in (24, 40, 56, 80, 104, 120):  # SM counts never measured
                pred = model.module_time_s(s, b, k / 132)
                errors.append(abs(pred / truth.time_s(s, b, k) - 1))
    assert np.mean(errors) < 0.04 and np.percentile(errors, 90) < 0.08


@pytest.mark.slow  # fits every variant on every fold: the longest one-process test
def test_interference_aware_beats_unaware_and_linear(synthetic):
    path, _, _ = synthetic
    result = model_error(path, CLUSTER, folds=3)
    rows = result["rows"]
    aware, linear, unaware = (rows[f"profiled-{v}"]["coloc_mape"] for v in ("aware", "linear", "unaware"))
    assert aware < 4.0, rows
    assert aware < 0.8 * linear and aware < 0.8 * unaware, rows
    assert rows["profiled-aware"]["single_mape"] < 4.0
    assert rows["profiled-aware"]["n_points"]["coloc"] == 72
    held = result["fallback_held_out"]  # truth is analytic x noise: either way is near exact
    assert held["modules"] > 0 and held["nearest"]["median_pct"] < 5 and held["global"]["median_pct"] < 5
    print_model_error(result)


def test_never_nan_outside_the_hull():
    pts = [ModulePoint(signature="s", per_gpu_batch=b, num_sms=k, time_s=1e-3 * (1 + b / k))
           for b in (4, 8, 16) for k in (32, 64, 96)]
    surface = fit_surface(pts)
    b = np.array([1, 2, 4, 64, 1024, 16, 4])
    k = np.array([1, 8, 132, 200, 8, 1000, 0.5])
    out = surface.predict(b, k)
    assert np.all(np.isfinite(out)) and np.all(out > 0)
    # few points (collinear): parametric only, still finite
    line = fit_surface(pts[:3])
    assert np.all(np.isfinite(line.predict(b, k)))


def test_a_surface_is_fitted_once_for_the_same_points():
    """Models of other engine kinds on one DB share the fit (the gate loads dozens); points
    that differ in any value, or in the GPU's SM count, are another surface."""
    pts = [ModulePoint(signature="s", per_gpu_batch=b, num_sms=k, time_s=1e-3 * (1 + b / k))
           for b in (4, 8, 16) for k in (32, 64, 96)]
    same = [ModulePoint(signature="other", per_gpu_batch=p.per_gpu_batch, num_sms=p.num_sms,
                        time_s=p.time_s) for p in pts]
    assert fit_surface(pts, 132) is fit_surface(same, 132)
    slower = [*pts[:-1], ModulePoint(signature="s", per_gpu_batch=16, num_sms=96, time_s=1.0)]
    assert fit_surface(slower, 132) is not fit_surface(pts, 132)
    assert fit_surface(pts, 120) is not fit_surface(pts, 132)


def test_monotone_in_sms_and_fallback(synthetic):
    path, truth, specs = synthetic
    model = ProfiledModel(CLUSTER, path)
    for s in specs:
        times = [model.module_time_s(s, 8, k / 132) for k in range(8, 133, 8)]
        assert all(a >= b for a, b in zip(times, times[1:], strict=False))
    unknown = spec("unknown", params_m=33, tokens=100, dim=640, layers=3)
    assert model.module_time_s(unknown, 8, 64 / 132) == pytest.approx(
        model.surfaces.fallback_s(unknown, 8, 64))
    assert model.module_time_s(unknown, 8, 64 / 132) == pytest.approx(truth.time_s(unknown, 8, 64),
                                                                    rel=0.05)
    assert "analytic x" in model.describe() and "interference=aware" in model.describe()


def test_is_a_perf_model_a_planner_can_use(synthetic):
    path, _, _ = synthetic
    graph = encoders_and_head(3, batch=32)
    for variant in ("aware", "linear", "unaware"):
        model = make_perf_model("profiled", CLUSTER, db=path, interference=variant)
        assert isinstance(model, PerfModel) and model.name == "profiled"
        enc = [m.name for m in graph.modules if m.kind == "encoder"]
        colocated = Plan(model="toy", planner="manual", num_gpus=1, stages=(
            Stage(sharing="free", placements=tuple(
                Placement(module=e, gpus=(0,), priority=int(i == 0)) for i, e in enumerate(enc))),
            Stage(placements=(Placement(module="head", gpus=(0,)),))))
        temporal = Plan(model="toy", planner="manual", num_gpus=1, stages=tuple(
            Stage(placements=(Placement(module=m, gpus=(0,)),)) for m in [*enc, "head"]))
        for plan in (colocated, temporal):
            t = model.iteration_time_s(plan, graph)
            assert np.isfinite(t) and t > 0
            assert 0 < model.gpu_utilisation(plan, graph) <= 1
            assert model.predict(plan, graph).predicted_iteration_s == pytest.approx(t)
        works = [Work(graph.module(e), 32, 0.33) for e in enc]
        part = model.colocated_time_s(works, "partition")
        assert part >= max(model.module_time_s(w.module, 32, 0.33) for w in works) * 0.999


def test_unknown_variant_and_missing_db(tmp_path):
    with pytest.raises(ValueError, match="interference='bogus'"):
        InterferenceParams(variant="bogus")
    with pytest.raises(ProfileDBError, match="does not exist"):
        ProfiledModel(CLUSTER, tmp_path / "missing.sqlite")


def test_stored_surface_fits_are_used_and_changed_points_fitted_again(tmp_path, monkeypatch):
    """`mosaic profile` stores every surface's law: a model on another machine (where least
    squares stops elsewhere) predicts from the same parameters; points that changed since
    are fitted again."""
    import mosaic.perf.profiled as profiled

    path = tmp_path / "h200.sqlite"
    _, specs = make_synthetic_db(path, num_colocs=6)
    with ProfileDB.open(path, readonly=False) as db:
        record = profiled.surface_fits(db, CLUSTER)
        db.add_fit(record)
    assert record.name == profiled.SURFACE_FITS and record.n_points >= len(specs)  # + absorbed
    fresh = ProfiledModel(CLUSTER, path)
    expected = [fresh.surfaces.time_s(s, 8, 48) for s in specs]

    def drifted(*args, **kwargs):  # another build's least squares: a different optimum
        raise AssertionError("a stored surface was fitted again")

    monkeypatch.setattr(profiled, "_fit_theta", drifted)
    profiled._fitted.cache_clear()
    stored = ProfiledModel(CLUSTER, path)
    assert [stored.surfaces.time_s(s, 8, 48) for s in specs] == expected
    with ProfileDB.open(path, readonly=False) as db:  # one module measured again
        sig = db.modules()[0].signature
        db.add_points([ModulePoint(signature=sig, per_gpu_batch=64, num_sms=132, time_s=0.5)])
    with pytest.raises(AssertionError, match="fitted again"):
        ProfiledModel(CLUSTER, path).surfaces.time_s(specs[0], 8, 48)


def test_stored_fit_is_used_and_stale_one_refitted(tmp_path):
    from dataclasses import asdict

    from mosaic.profile.db import FitRecord

    path = tmp_path / "h200.sqlite"
    make_synthetic_db(path, num_colocs=6)
    stored = InterferenceParams(variant="aware", alpha=1.23, fitted_on=6)
    with ProfileDB.open(path, readonly=False) as db:
        db.add_fit(FitRecord(name="model_error.aware", params=asdict(stored), mape=2.5,
                             n_points=6, created="now"))
        db.add_fit(FitRecord(name="model_error.linear", params={"variant": "linear", "old": 1},
                             mape=3.0, n_points=6, created="now"))
    aware = ProfiledModel(CLUSTER, path)
    assert aware.params.alpha == 1.23 and "stored fit" in aware.describe()
    assert "held-out coloc MAPE 2.5%" in aware.describe()
    linear = ProfiledModel(CLUSTER, path, interference="linear")
    assert linear.params_source == "fitted on load" and linear.params.fitted_on == 6


def test_shipped_h200_db_predicts_its_own_measurements():
    from mosaic.profile.db import default_db_path, has_shipped_db

    if not has_shipped_db("h200"):
        pytest.skip("no shipped H200 profile")
    with ProfileDB.open(default_db_path("h200"), hardware="h200") as db:
        modules = db.modules()
        points = db.points()
        assert len(db.colocations()) > 0
    models = {"eager": ProfiledModel(make_cluster(8, "h200")),
              "compile-default": ProfiledModel(make_cluster(8, "h200"),
                                               engine="graphs+compile-default"),
              "compile-default-blocks": ProfiledModel(
                  make_cluster(8, "h200"), engine="graphs+compile-default+blocks-scope")}
    kernels = {m.signature: m.kernels for m in modules}
    specs = {m.signature: m.spec for m in modules}
    assert set(kernels.values()) == set(models)  # the engine's compiled modules are profiled
    def ratio(p):
        model = models[kernels[p.signature]]
        scale = model.surfaces.rescaled.get(p.signature, 1.0)  # stale: scaled to colocations
        return model.module_time_s(specs[p.signature], p.per_gpu_batch,
                                   p.num_sms / 132) / (scale * p.time_s)

    errors = [abs(ratio(p) - 1) for p in points]
    assert np.median(errors) < 0.03 and max(errors) < 0.25


def test_the_engine_kind_picks_its_kernels_surfaces_and_says_where_it_falls_back(tmp_path):
    """Compiled surfaces for one module: a compiled engine predicts it from them, the other
    from its eager surface (a coverage note says so), and the eager engine ignores them."""
    specs = _specs()[:2]
    db = ProfileDB.create(tmp_path / "k.sqlite", hardware="h200", num_sms=132)
    for kernels, scale, which in (("eager", 1.0, specs), ("compile-default", 0.5, specs[:1])):
        for s in which:
            sig = db.add_module("toy", "tiny", s, kernels)
            db.add_points([ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k,
                                       time_s=scale * 1e-3 * b * 132 / k)
                           for b in BATCHES for k in SMS])
    db.close()
    eager = ProfiledModel(CLUSTER, tmp_path / "k.sqlite")
    compiled = ProfiledModel(CLUSTER, tmp_path / "k.sqlite", engine="graphs+compile-default")
    for s, ratio in ((specs[0], 0.5), (specs[1], 1.0)):
        assert compiled.module_time_s(s, 8, 1.0) == pytest.approx(
            ratio * eager.module_time_s(s, 8, 1.0), rel=0.05)
    graph = MMGraph(name="toy", modules=tuple(specs), edges=(), global_batch=4 * max(BATCHES))
    plan = Plan(model="toy", planner="hand", num_gpus=1, stages=(Stage(placements=tuple(
        Placement(module=s.name, gpus=(0,)) for s in specs)),))
    notes = compiled.coverage_notes(plan, graph)
    assert any(f"{specs[1].name}: no compile-default surface" in n for n in notes)
    assert sum("outside the measured" in n for n in notes) == 2


def _two_kernel_db(path, rng, n_compiled, compiled_params):
    """Eager and compiled surfaces of the same modules (same times), eager colocations under
    TRUTH and `n_compiled` compiled ones under `compiled_params`."""
    truth = SurfaceSet(CLUSTER, {}, {}, {})
    specs = _specs()
    db = ProfileDB.create(path, hardware="h200", num_sms=132)
    for kernels, params, n in (("eager", TRUTH, 18), ("compile-default", compiled_params, n_compiled)):
        sigs = [db.add_module("toy", "tiny", s, kernels) for s in specs]
        for s, sig in zip(specs, sigs, strict=True):
            db.add_points([ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k,
                                       time_s=truth.time_s(s, b, k)) for b in BATCHES for k in SMS])
        for i in range(n):
            db.add_colocation(_coloc(rng, truth, specs, sigs, ("partition", "free", "cap")[i % 3],
                                     params))
    db.close()


def test_a_compiled_engine_fits_interference_on_compiled_colocations_once_there_are_enough(tmp_path):
    """Compiled kernels leave a neighbour less idle capacity: their colocations (here three
    times TRUTH's contention) get their own fit once there are enough of them."""
    from dataclasses import replace

    rng = np.random.default_rng(1)
    strong = replace(TRUTH, alpha=3 * TRUTH.alpha)
    _two_kernel_db(tmp_path / "few.sqlite", rng, MIN_KERNEL_COLOCATIONS - 1, strong)
    _two_kernel_db(tmp_path / "enough.sqlite", rng, 18, strong)
    engine = "graphs+compile-default"
    few = ProfiledModel(CLUSTER, tmp_path / "few.sqlite", engine=engine)
    assert (few.interference_kernels, few.params.fitted_on) == ("eager", 18)
    compiled = ProfiledModel(CLUSTER, tmp_path / "enough.sqlite", engine=engine)
    assert (compiled.interference_kernels, compiled.params.fitted_on) == ("compile-default", 18)
    assert "18 compile-default colocations" in compiled.describe()
    eager = ProfiledModel(CLUSTER, tmp_path / "enough.sqlite")
    assert eager.interference_kernels == "eager"

    with ProfileDB.open(tmp_path / "enough.sqlite") as db:
        colocs = [c for c in db.colocations()
                  if compiled.surfaces.colocation_kernels(c) == "compile-default"]
    samples = [compiled.surfaces.sample(c, use_measured_alone=False) for c in colocs]

    def mape(params):
        return np.mean([abs(group_time_s(params, s.works, s.sharing) / s.group_time_s - 1)
                        for s in samples])

    assert mape(compiled.params) < 0.5 * mape(eager.params)
    assert kernels_with_colocations(tmp_path / "enough.sqlite") == ["eager", "compile-default"]


def test_the_profiling_run_chooses_the_interference_fit_by_held_out_error(tmp_path):
    """Storing the compiled fits also stores which colocations fit better held out: with
    compiled contention three times the eager one, the compiled ones, by a wide margin. A
    stored choice is what a model follows, even against the count rule."""
    from dataclasses import replace

    path = tmp_path / "k.sqlite"
    _two_kernel_db(path, np.random.default_rng(2), 18, replace(TRUTH, alpha=3 * TRUTH.alpha))
    assert store_interference_fits(path, "h200", "compile-default") == 18
    engine = "graphs+compile-default"
    model = ProfiledModel(CLUSTER, path, engine=engine)
    choice = model.interference_choice
    assert choice["kernels"] == model.interference_kernels == "compile-default"
    assert choice["compile-default_mape"] < 0.5 * choice["eager_mape"]
    assert choice["held_out_by"] == "3 folds"  # one model: folds of its colocations
    assert "held-out error on the 18 compile-default colocations" in model.describe()
    with ProfileDB.open(path, readonly=False) as db:
        stored = next(f for f in db.fits() if f.name == interference_choice_name("compile-default"))
        db.add_fit(replace(stored, params={**stored.params, "kernels": "eager"}))
    assert ProfiledModel(CLUSTER, path, engine=engine).interference_kernels == "eager"


def test_compiled_colocations_of_several_models_are_held_out_by_model():
    """Two models whose compiled colocations disagree (contention 3x and 0.3x the eager one):
    a fit on one predicts the other worse than the eager fit, so the eager fit is chosen,
    though a fit on both could look good on folds that mix them."""
    from dataclasses import replace

    from mosaic.perf.accuracy import interference_choice

    rng = np.random.default_rng(3)
    truth = SurfaceSet(CLUSTER, {}, {}, {})
    specs = _specs()
    sigs = {kernels: [f"{s.name}/{kernels}" for s in specs]
            for kernels in ("eager", "compile-default")}
    surfaces = SurfaceSet(CLUSTER, {sig: s for names in sigs.values()
                                    for sig, s in zip(names, specs, strict=True)}, {}, {},
                          kernels={sig: "compile-default" for sig in sigs["compile-default"]})
    modes = ("partition", "free", "cap")

    def colocations(model, kernels, params, n):
        return [replace(_coloc(rng, truth, specs, sigs[kernels], modes[i % 3], params),
                        model=model) for i in range(n)]

    eager = colocations("a", "eager", TRUTH, 12) + colocations("b", "eager", TRUTH, 12)
    own = (colocations("a", "compile-default", replace(TRUTH, alpha=3 * TRUTH.alpha), 12)
           + colocations("b", "compile-default", replace(TRUTH, alpha=0.3 * TRUTH.alpha), 12))
    choice = interference_choice(surfaces, own, eager)
    assert choice["held_out_by"] == "model"
    assert choice["kernels"] == "eager"
    assert choice["eager_mape"] < choice["compile-default_mape"]


def test_a_surface_that_disagrees_with_the_colocations_alone_times_is_called_stale(tmp_path):
    """A module made faster without new cost facts keeps its old surface: the alone times
    measured beside later colocations give it away, and the advice names the command."""
    import sqlite3

    from mosaic.perf.accuracy import stale_surface_advice

    path = tmp_path / "k.sqlite"
    _two_kernel_db(path, np.random.default_rng(4), 18, TRUTH)
    assert stale_surface_advice(path, "h200", "compile-default") == []
    with ProfileDB.open(path) as db:
        vision = next(m.signature for m in db.modules()
                      if m.module == "vision" and m.kernels == "compile-default")
    with sqlite3.connect(path) as conn:  # the surface of older, twice as slow code
        conn.execute("UPDATE module_points SET time_s = 2 * time_s WHERE signature = ?",
                     (vision,))
    with ProfileDB.open(path) as db:
        surfaces = SurfaceSet.from_db(db, CLUSTER, prefer="compile-default")
        drift = surfaces.drift(surfaces.colocations_of(db.colocations(), "compile-default"))
    assert [(d["module"], round(d["surface_over_measured"], 1)) for d in drift] == [
        ("vision", 2.0)]
    (advice,) = stale_surface_advice(path, "h200", "compile-default")
    assert "mosaic profile toy --preset tiny --kernels compile-default --surfaces-only " \
        "--update --remeasure" in advice
    specs = _specs()  # a plan that runs the module is told so
    graph = MMGraph(name="toy", modules=tuple(specs), edges=(), global_batch=8, preset="tiny")
    plan = Plan(model="toy", planner="hand", num_gpus=1, stages=(Stage(placements=tuple(
        Placement(module=s.name, gpus=(0,)) for s in specs)),))
    model = ProfiledModel(CLUSTER, path, engine="graphs+compile-default")
    notes = model.coverage_notes(plan, graph)
    assert [n.split(":")[0] for n in notes if "stale?" in n] == ["vision"]
    # until measured again, the surface is scaled to the newer measurements: truth again
    assert model.surfaces.rescaled[vision] == pytest.approx(0.5, rel=0.03)
    truth = SurfaceSet(CLUSTER, {}, {}, {})
    assert model.module_time_s(specs[0], 8, 1.0) == pytest.approx(
        truth.time_s(specs[0], 8, 132), rel=0.05)


def test_a_layer_by_layer_engine_falls_back_to_the_whole_module_compiled_surface(tmp_path):
    """No `compile-default-blocks` surface yet: the same mode compiled whole stands in before
    the eager one, and the plan's coverage notes say which."""
    spec_ = _specs()[0]
    db = ProfileDB.create(tmp_path / "b.sqlite", hardware="h200", num_sms=132)
    for kernels, scale in (("eager", 1.0), ("compile-default", 0.5)):
        sig = db.add_module("toy", "tiny", spec_, kernels)
        db.add_points([ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k,
                                   time_s=scale * 1e-3 * b * 132 / k) for b in BATCHES for k in SMS])
    db.close()
    whole = ProfiledModel(CLUSTER, tmp_path / "b.sqlite", engine="graphs+compile-default")
    blocks = ProfiledModel(CLUSTER, tmp_path / "b.sqlite",
                           engine="graphs+compile-default+blocks-scope")
    assert blocks.surfaces.prefer == "compile-default-blocks"
    assert blocks.module_time_s(spec_, 8, 1.0) == pytest.approx(whole.module_time_s(spec_, 8, 1.0))
    graph = MMGraph(name="toy", modules=(spec_,), edges=(), global_batch=8)
    plan = Plan(model="toy", planner="hand", num_gpus=1,
                stages=(Stage(placements=(Placement(module=spec_.name, gpus=(0,)),)),))
    assert (f"{spec_.name}: no compile-default-blocks surface; the compile-default one stands in"
            in blocks.coverage_notes(plan, graph))


def test_stored_compiled_interference_fits_are_read_instead_of_refitted(tmp_path):
    """What `mosaic profile` does after measuring colocations: fit and store, so a model built
    later reads the coefficients rather than fitting on every load."""
    from dataclasses import replace

    from mosaic.perf.accuracy import store_interference_fits

    path = tmp_path / "db.sqlite"
    _two_kernel_db(path, np.random.default_rng(2), 12, replace(TRUTH, alpha=3 * TRUTH.alpha))
    assert store_interference_fits(path, "h200", "compile-default") == 12
    model = ProfiledModel(CLUSTER, path, engine="graphs+compile-default")
    assert (model.params_source, model.interference_kernels) == ("stored fit", "compile-default")
    assert model.params.fitted_on == 12


def _calibration_points(ratio_of, seed=0):
    """Twelve modules of 8 points each, small (about 0.1 ms of analytic work) and large
    (about 10 ms); measured = analytic x ratio_of(analytic) x 2% noise."""
    rng = np.random.default_rng(seed)
    modules = {}
    for m in range(12):
        base = 1e-4 if m < 6 else 1e-2
        points = []
        for share in np.linspace(0.1, 1.0, 8):
            analytic = base * (1 + m % 6) / share
            points.append((analytic, share, analytic * ratio_of(analytic) * rng.lognormal(0, 0.02)))
        modules[f"m{m}"] = points
    return modules


def test_unprofiled_modules_are_calibrated_by_the_measured_points_nearest_in_size():
    """Compiled kernels on the H200 run tiny work about 3x faster than the analytic model and
    large work at about its rate: one mean factor is wrong for both, the nearest points are
    right for each, and the held-out test picks them."""
    from mosaic.perf.profiled import AnalyticCalibration

    by_module = _calibration_points(lambda a: 0.3 if a < 1e-3 else 1.0)
    calibration = AnalyticCalibration.chosen(by_module)
    assert calibration.nearest
    assert calibration.held_out["nearest"] < 5 < calibration.held_out["global"]
    assert calibration.factor(2e-4, 0.5) == pytest.approx(0.3, rel=0.05)
    assert calibration.factor(2e-2, 0.5) == pytest.approx(1.0, rel=0.05)
    assert calibration.factor(1e3, 0.5) == pytest.approx(1.0, rel=0.05)  # beyond: clamped
    assert 0.3 < calibration.mean < 1.0
    assert "held-out" in calibration.describe()


def test_one_factor_is_kept_where_it_predicts_held_out_modules_better():
    """A ratio that does not follow size (here it alternates between modules of neighbouring
    sizes): the nearest points are the other kind, the mean is closer, and the held-out test
    keeps the mean."""
    from mosaic.perf.profiled import AnalyticCalibration

    by_module = {f"m{m}": [(1e-4 * (1 + m) / k, k, 1e-4 * (1 + m) / k * (2.0 if m % 2 else 0.5))
                           for k in np.linspace(0.1, 1.0, 8)] for m in range(12)}
    calibration = AnalyticCalibration.chosen(by_module)
    assert not calibration.nearest, calibration.held_out
    assert calibration.held_out["global"] < calibration.held_out["nearest"]
    assert calibration.factor(2e-4, 0.5) == calibration.mean
    assert AnalyticCalibration.chosen({}).factor(1e-3, 1.0) == 1.0


def test_a_surface_row_keeps_the_whole_gpus_time_where_the_law_dips_below_it():
    """Between sampled SM counts the law can predict a quota faster than the whole GPU it
    measured; the row rises to the whole GPU's time there instead of pulling it down."""
    raw = np.array([40.0, 20.0, 9.0, 8.9, 9.5])  # 8.9 at 128 SMs under 9.5 on all 132
    row = monotone_row(raw)
    assert row[-1] == 9.5 and list(row) == [40.0, 20.0, 9.5, 9.5, 9.5]
    assert list(monotone_row(np.array([4.0, 3.0, 2.0]))) == [4.0, 3.0, 2.0]
    assert list(monotone_row(np.array([4.0, 5.0, 2.0]))) == [4.0, 4.0, 2.0]  # a bump is flattened


def test_the_shipped_compiled_surfaces_never_predict_a_quota_faster_than_the_whole_gpu():
    cluster = make_cluster(1, "h200")
    model = ProfiledModel(cluster, engine="graphs+compile-default+grads-in-graph")
    graph = get_model("imagebind").graph("small", global_batch=32)
    for module in graph.modules:
        whole = model.module_time_s(module, 32, 1.0)
        assert all(model.module_time_s(module, 32, share) >= whole
                   for share in (0.25, 0.5, 0.75, 0.9, 0.97))
    audio = graph.module("audio")  # the row's whole-GPU end is the surface's own value there
    sig = model.surfaces.signature_of(audio)
    assert model.module_time_s(audio, 32, 1.0) == pytest.approx(
        float(model.surfaces.surfaces[sig].predict(32, [132])[0]))


def test_a_colocations_alone_times_become_points_where_its_members_surfaces_have_none():
    """A colocation times each member alone on its quota first, the surfaces' own method: at a
    quota the surface never sampled that time is a point of it; where the surface has a point
    it stays; a stale (rescaled) surface takes none."""
    vision, audio = _specs()[:2]
    truth = SurfaceSet(CLUSTER, {}, {}, {})

    def points(sig, s):
        return [ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k, time_s=truth.time_s(s, b, k))
                for b in (1, 8) for k in (16, 64, 132)]

    def work(sig, s, k, alone_s):
        return ColocWork(module=s.name, signature=sig, per_gpu_batch=8, num_sms=k, priority=0,
                         alone_s=alone_s, time_s=2 * alone_s)

    surfaces = SurfaceSet(CLUSTER, {"v": vision, "a": audio},
                          {"v": points("v", vision), "a": points("a", audio)}, {})
    at_96 = 1.2 * truth.time_s(vision, 8, 96)  # slower than the law between 64 and 132
    colocs = [ColocPoint(model="toy", preset="tiny", sharing="partition", group_time_s=1.0, works=(
        work("v", vision, 96, at_96), work("v", vision, 64, 9.0), work("a", audio, 96, 5.0)))
        for _ in range(2)]
    surfaces.rescaled["a"] = 0.5
    assert surfaces.absorb_alone_times(colocs) == 1
    added = [p for p in surfaces.points["v"] if p.phase == "colocation-alone"]
    assert [(p.per_gpu_batch, p.num_sms, p.repeats) for p in added] == [(8, 96, 2)]
    assert next(p.time_s for p in surfaces.points["v"] if p.num_sms == 64 and p.per_gpu_batch == 8) \
        == pytest.approx(truth.time_s(vision, 8, 64))  # the surface's own point stays
    assert surfaces.surfaces["v"].predict(8, [96])[0] == pytest.approx(at_96, rel=0.02)
    assert len(surfaces.points["a"]) == 6
    assert surfaces.absorb_alone_times(colocs) == 0  # each point once


def test_mosaic_profile_stores_the_surface_fits_it_would_otherwise_fit_on_load(tmp_path):
    from mosaic.cli import _store_surface_fits
    from mosaic.perf.profiled import SURFACE_FITS

    path = tmp_path / "h200.sqlite"
    make_synthetic_db(path, num_colocs=0)
    _store_surface_fits(path, "h200")
    with ProfileDB.open(path) as db:
        (fit,) = [f for f in db.fits() if f.name == SURFACE_FITS]
    assert fit.n_points == 5 and all(len(theta) == 5 for theta in fit.params["thetas"].values())


def test_the_shipped_db_stores_a_fit_for_every_surface_a_model_of_it_uses():
    """Else plans made from it would again depend on the machine's least squares."""
    from mosaic.perf import profiled
    from mosaic.profile.db import default_db_path

    with ProfileDB.open(default_db_path("h200")) as db:
        stored = next(f for f in db.fits() if f.name == "surfaces").params["thetas"]
        with pytest.MonkeyPatch.context() as patch:  # every key a model builds, none fitted
            patch.setattr(profiled, "_fit_theta", lambda b, k, t, full: np.zeros(5))
            try:
                needed = profiled.surface_fits(db, CLUSTER).params["thetas"]
            finally:  # the zero laws must not stay cached for other tests
                profiled._fitted.cache_clear()
    assert set(needed) <= set(stored)


def test_gradients_summed_in_the_backward_expose_only_what_outlasts_it():
    """grad_sync='overlapped': a data-parallel module's all-reduce A, in n buckets produced
    evenly through its backward B, exposes max(A/n, A - B (n-1)/n) (perf/base.py); the same
    plan summed after the backward exposes all of A, and accumulated micro-steps still do."""
    import math

    from mosaic.engine.bucket_reduce import BUCKET_BYTES
    from mosaic.perf.base import BACKWARD_SHARE, GRAD_BYTES_PER_PARAM, IN_BACKWARD_BUCKET_BYTES
    from mosaic.planners import plan_all

    assert IN_BACKWARD_BUCKET_BYTES == BUCKET_BYTES
    cluster = make_cluster(2, "h200")
    graph = get_model("unified-io-2").graph("paper", global_batch=8)
    after = ProfiledModel(cluster, engine="graphs+compile-default+flat+grads-in-graph")
    during = ProfiledModel(cluster, engine="graphs+compile-default+overlapped+grads-in-graph")
    assert during.sums_in_backward and not after.sums_in_backward
    plan = plan_all(graph, cluster, after, ["megatron"])[0]
    for stage in plan.stages:
        for p in stage.placements:
            module = graph.module(p.module)
            total = after.exposed_allreduce_s(module, p, graph)
            assert total == after.placement_allreduce_s(module, p) > 0
            backward = BACKWARD_SHARE * during.module_time_s(module, 4, p.sm_share)
            n = math.ceil(module.num_params * GRAD_BYTES_PER_PARAM / IN_BACKWARD_BUCKET_BYTES)
            assert during.exposed_allreduce_s(module, p, graph) == pytest.approx(
                max(total / n, total - backward * (n - 1) / n))
    assert during.composed_time_s(plan, graph) < after.composed_time_s(plan, graph)
    during.accumulating(2)
    after.accumulating(2)
    assert during.composed_time_s(plan, graph) == pytest.approx(after.composed_time_s(plan, graph))


def test_the_planners_search_prices_the_sum_as_the_model_does():
    """The search's cost of a data-parallel block's all-reduce is what the model exposes: all
    of it under 'flat', what outlasts the module's backward (on the whole GPU) under
    'overlapped'."""
    from mosaic.planners.common import SearchSpace

    cluster = make_cluster(2, "h200")
    graph = get_model("unified-io-2").graph("paper", global_batch=8)
    after = ProfiledModel(cluster, engine="graphs+compile-default+flat+grads-in-graph")
    during = ProfiledModel(cluster, engine="graphs+compile-default+overlapped+grads-in-graph")
    flat_space, overlapped_space = SearchSpace(graph, cluster, after), SearchSpace(graph, cluster,
                                                                                  during)
    for module in graph.modules:
        total = flat_space.allreduce_s(module.name, 2)
        assert overlapped_space.allreduce_s(module.name, 2) == pytest.approx(
            during.exposed_sum_s(module, 4, 1.0, total))
    llm = max(graph.modules, key=lambda m: m.num_params).name
    assert overlapped_space.allreduce_s(llm, 2) < 0.5 * flat_space.allreduce_s(llm, 2)


def test_gradients_summed_in_bf16_send_half_the_bytes():
    """reduce_dtype='bf16' (engine kind 'bf16-reduce', which bf16 weights need on several
    GPUs) sums two bytes a parameter: the model's all-reduce is that of half the bytes, in
    the plans' prediction and in the planners' search alike."""
    from mosaic.planners.common import SearchSpace

    cluster = make_cluster(2, "h200")
    graph = get_model("clip").graph("paper", global_batch=32)
    fp32 = ProfiledModel(cluster, engine="graphs+compile-default+flat+grads-in-graph")
    bf16 = ProfiledModel(cluster, engine="graphs+compile-default+flat+bf16-reduce+grads-in-graph")
    placement = Placement(module="vision", gpus=(0, 1))
    vision = graph.module("vision")
    assert bf16.placement_allreduce_s(vision, placement) == pytest.approx(
        fp32.allreduce_s(vision.num_params * 2.0, (0, 1)))
    assert SearchSpace(graph, cluster, bf16).allreduce_s("vision", 2) == pytest.approx(
        bf16.placement_allreduce_s(vision, placement))


def test_a_sum_beside_another_modules_backward_is_not_hidden():
    """The engine sums during the backward only where no other module's backward runs beside
    it on its GPUs (plan.Stage.runs_alone): in a concurrent stage the model
    exposes the whole all-reduce, in a temporal one what outlasts the backward."""
    cluster = make_cluster(2, "h200")
    graph = get_model("clip").graph("paper", global_batch=32)
    during = ProfiledModel(cluster, engine="graphs+compile-default+overlapped+grads-in-graph")
    vision, text = (Placement(module=m, gpus=(0, 1)) for m in ("vision", "text"))
    spec = graph.module("vision")
    total = during.placement_allreduce_s(spec, vision)
    free = Stage(sharing="free", placements=(vision, text))
    temporal = Stage(sharing="temporal", placements=(vision, text))
    assert during.exposed_allreduce_s(spec, vision, graph, free) == total
    assert during.exposed_allreduce_s(spec, vision, graph, temporal) < total


def test_the_simulation_of_sums_during_the_backward_takes_the_models_time():
    """`mosaic simulate` replays a plan as the model composes it (overlap off): with the
    sums during the backward too, its iteration is the model's, each sum drawn ending what
    it exposes after the stage's compute."""
    from mosaic.planners import plan_all
    from mosaic.simulate import simulate

    cluster = make_cluster(2, "h200")
    graph = get_model("unified-io-2").graph("paper", global_batch=8)
    during = ProfiledModel(cluster, engine="graphs+compile-default+overlapped+grads-in-graph")
    plan = during.predict(plan_all(graph, cluster, during, ["megatron"])[0], graph)
    assert simulate(plan, graph, during).iteration_s == pytest.approx(
        plan.predicted_iteration_s, rel=1e-6)
