"""The fitted per-step engine term: recovery on synthetic rows, the repo's bench results, and
how the profiled model applies it (only for the engine kind it was fitted on)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mosaic.cli import main
from mosaic.hardware import make_cluster
from mosaic.perf.engine_term import (
    FIT_PREFIX,
    EngineTermError,
    IterationRow,
    bf16_family,
    engine_kind,
    fit_engine_term,
    fit_engine_terms,
    held_out_mape,
    identifiable,
    kernels_of_engine,
    plan_features,
    refit,
    rows_from_db,
    rows_from_results,
    sequential_plan,
    stored_term,
)
from mosaic.perf.profiled import ProfiledModel
from mosaic.planners import plan_all
from mosaic.profile.db import IterationRecord, ProfileDB, default_db_path
from mosaic.zoo import get_model

RESULTS = "benchmarks/results"


def _synthetic(engine="eager", const=8e-4, per_param=1.6e-9, groups=6, seed=0, sigma=1e-4):
    """Rows whose measured - predicted is exactly const + per_param * params (+ noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        for _ in range(5):
            params = float(rng.uniform(1e6, 5e8))
            predicted = float(rng.uniform(5e-3, 5e-2))
            feats = {"const": 1.0, "stages": float(rng.integers(1, 4)),
                     "busiest_modules": float(rng.integers(1, 6)), "params": params,
                     "predicted": predicted}
            measured = predicted + const + per_param * params + rng.normal(0, sigma)
            rows.append(IterationRow(group=f"file{g}", engine=engine, features=feats,
                                     predicted_s=predicted, measured_s=measured))
    return rows


def test_a_known_linear_term_is_recovered():
    rows = _synthetic()
    term = fit_engine_term(rows, "eager", feature_sets=[("const", "params")])
    assert term.coef[0] == pytest.approx(8e-4, rel=0.1)
    assert term.coef[1] == pytest.approx(1.6e-9, rel=0.05)
    assert term.mape < 1.0 < term.baseline_mape
    chosen = fit_engine_term(rows, "eager")  # feature set picked by held-out error
    assert "params" in chosen.features and chosen.mape < 1.0
    assert held_out_mape(rows, ("const",)) > chosen.mape


def test_each_engine_kind_gets_its_own_fit():
    rows = _synthetic("eager") + _synthetic("graphs+compile-default", const=-2e-3, per_param=0,
                                            seed=1)
    terms = fit_engine_terms(rows)
    assert set(terms) == {"eager", "graphs+compile-default"}
    f = {"const": 1.0, "stages": 2.0, "busiest_modules": 3.0, "params": 1e8, "predicted": 0.02}
    assert terms["eager"].seconds(f) == pytest.approx(8e-4 + 0.16, rel=0.05)
    assert terms["graphs+compile-default"].seconds(f) == pytest.approx(-2e-3, abs=3e-4)
    with pytest.raises(EngineTermError, match="at least 2 runs"):
        fit_engine_term(_synthetic(groups=1), "eager")


def test_engine_kind_of_a_bench_engine_record():
    assert engine_kind(None) == "eager"
    assert engine_kind({"graphs": False, "compile": None}) == "eager"
    assert engine_kind({"graphs": True, "compile": "default"}) == "graphs+compile-default"
    assert engine_kind({"graphs": True, "compile": "default", "grad_sync": "bucketed",
                        "reduce_dtype": "bf16"}) == "graphs+compile-default+bucketed+bf16-reduce"
    blocks = {"graphs": True, "compile": "default", "compile_scope": "blocks"}
    assert engine_kind(blocks) == "graphs+compile-default+blocks-scope"
    assert engine_kind({**blocks, "compile_scope": "module"}) == "graphs+compile-default"
    assert kernels_of_engine("graphs+compile-default+bucketed") == "compile-default"
    assert kernels_of_engine("graphs") == kernels_of_engine(None) == "eager"


def test_the_repos_bench_results_fit_better_than_uncorrected():
    rows = rows_from_results(RESULTS)
    kinds = {r.engine for r in rows}
    assert {"eager", "graphs+compile-default"} <= kinds
    assert all(r.group != "bench_imagebind_small_analytic.json" for r in rows)  # analytic: out
    terms = fit_engine_terms(rows)
    for kind, term in terms.items():
        assert term.mape <= term.baseline_mape, kind  # the empty term where none helps
    assert terms["eager"].features and terms["eager"].mape < terms["eager"].baseline_mape


@pytest.fixture()
def db_copy(tmp_path):
    path = tmp_path / "h200.sqlite"
    shutil.copy(default_db_path("h200"), path)
    path.chmod(0o644)
    return path


def test_refit_stores_the_term_and_the_model_applies_it_per_engine(db_copy, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["model-error", "--fit-engine-term", f"{RESULTS}/h200-small", "--fit-engine-term",
              f"{RESULTS}/engine-speed-h200", "--db", str(db_copy), "--json"])
    assert exit_.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eager"]["mape"] < out["eager"]["baseline_mape"]
    with ProfileDB.open(db_copy) as db:
        fits = {f.name: f for f in db.fits()}
    assert fits[FIT_PREFIX + "eager"].mape == pytest.approx(out["eager"]["mape"])
    cluster = make_cluster(1, "h200")
    graph = get_model("clip").graph("small", global_batch=32)
    plain = ProfiledModel(cluster, db_copy)
    eager = ProfiledModel(cluster, db_copy, engine="eager")
    other = ProfiledModel(cluster, db_copy, engine="graphs")  # no fit for it: not applied
    assert "engine term [eager]" in eager.describe() and "held-out MAPE" in eager.describe()
    assert "none fitted for 'graphs'" in other.describe()
    for p in plan_all(graph, cluster, plain, ["megatron", "mosaic"]):
        base = plain.iteration_time_s(p, graph)
        assert other.iteration_time_s(p, graph) == base
        assert eager.iteration_time_s(p, graph) == pytest.approx(base + eager.engine_term_s(p, graph))
        assert eager.engine_term_s(p, graph) != 0


def test_a_tuned_engine_without_surfaces_or_term_of_its_own_is_predicted_as_the_default():
    """The shipped DB holds compile-default surfaces and terms, none for tuned kernels: the
    tuned engine is predicted like the default one, not from eager surfaces (which put a
    tuned CLIP b128 step at 30.5 ms against 21.3 measured)."""
    cluster = make_cluster(1, "h200")
    graph = get_model("clip").graph("small", global_batch=128)
    tuned = ProfiledModel(cluster, engine="graphs+compile-max-autotune-gemm+grads-in-graph")
    default = ProfiledModel(cluster, engine="graphs+compile-default+grads-in-graph")
    assert tuned.engine_term is not None
    for p in plan_all(graph, cluster, default, ["megatron", "mosaic"]):
        assert tuned.iteration_time_s(p, graph) == pytest.approx(default.iteration_time_s(p, graph))


def test_bf16_weights_take_their_familys_term_and_save_the_weight_casts():
    """An engine keeping bf16 GEMM weights skips autocast's two casts a weight (12 bytes) at
    the optimizer's measured bandwidth, in the composed time; its per-step term is its bf16
    family's, fitted on bf16 runs (sharing the fp32 twin's, 53 bf16 rows were predicted fast:
    median -2.8%), whichever way it updates the weights, and the fp32 twin's where the DB
    has no family term."""
    from mosaic.perf.profiled import CAST_BYTES_PER_PARAM

    fp32_kind = "graphs+compile-default+grads-in-graph"
    assert engine_kind({"graphs": True, "compile": "default", "grads_in_graph": True,
                        "bf16_weights": True}) == f"{fp32_kind}+bf16-weights"
    cluster = make_cluster(1, "h200")
    graph = get_model("ofasys").graph("paper")
    fp32 = ProfiledModel(cluster, engine=fp32_kind)
    bf16 = ProfiledModel(cluster, engine=f"{fp32_kind}+bf16-weights")
    assert bf16.engine_term.engine == f"{fp32_kind}+bf16-weights" != fp32.engine_term.engine
    for way in ("+per-weight-update", "+per-weight-update+bf16-moments+no-main-weights"):
        lean = ProfiledModel(cluster, engine=f"{fp32_kind}+bf16-weights{way}")
        assert lean.engine_term == bf16.engine_term
    tuned = f"graphs+compile-max-autotune-gemm+grads-in-graph+bf16-weights{way}"
    assert bf16_family(tuned) == f"{fp32_kind}+bf16-weights" and bf16_family(fp32_kind) is None
    params = sum(m.num_params for m in graph.modules)
    cast_s = fp32.memory_pass_s(params, CAST_BYTES_PER_PARAM)
    assert 3e-3 < cast_s < 6e-3  # 1.12 B weights: about 4 ms measured
    (plan,) = plan_all(graph, cluster, fp32, ["megatron"])
    assert fp32.composed_time_s(plan, graph) - bf16.composed_time_s(plan, graph) == pytest.approx(
        cast_s)
    fp32.accumulating(4)
    bf16.accumulating(4)  # 4 x (12 casts + 12 fp32 adds - 6 bf16 adds) - 3 folds of 12 = 36
    assert fp32.composed_time_s(plan, graph) - bf16.composed_time_s(plan, graph) == pytest.approx(
        3 * cast_s)


def test_bf16_engines_fall_back_to_the_fp32_twins_term_and_are_fitted_as_one_family(db_copy):
    family = "graphs+compile-default+grads-in-graph+bf16-weights"
    with ProfileDB.open(db_copy, readonly=False) as db:
        db.conn.execute("DELETE FROM fits WHERE name = ?", (FIT_PREFIX + family,))
        db.conn.commit()
        term = stored_term(db, family + "+per-weight-update")
    assert term.engine == "graphs+compile-default+grads-in-graph"
    rows = [IterationRow(group=f"run{i}", engine=family + way, features={"const": 1.0},
                         predicted_s=0.010, measured_s=0.0103, label="megatron")
            for i, way in enumerate(("", "+per-weight-update", "+per-weight-update+bf16-moments"))]
    assert list(fit_engine_terms(rows)) == [family]


def test_an_unprofiled_update_takes_the_term_of_the_update_it_varies(db_copy):
    """The grouped and 8-bit-first-moment updates (bench variants, not profiled) fit families
    of their own, but without one they are predicted with the family of the update they
    change, not with the fp32 twin's: their predictions are that update's."""
    lean = "graphs+compile-default+grads-in-graph+bf16-weights+per-weight-update+bf16-moments" \
        "+no-main-weights"
    with ProfileDB.open(db_copy) as db:
        base = stored_term(db, lean)
        for variant in ("+grouped-update", "+fp8-first-moment"):
            term = stored_term(db, lean + variant)
            assert term.engine == base.engine == "graphs+compile-default+grads-in-graph+bf16-weights"


def test_refit_of_one_engine_kind_leaves_the_other_terms(db_copy):
    with ProfileDB.open(db_copy) as db:
        before = {f.name: f.params for f in db.fits()}
    terms = refit(db_copy, [f"{RESULTS}/h200-small", f"{RESULTS}/engine-speed-h200",
                            f"{RESULTS}/engine-speed-h200x2"],
                  kinds=["graphs+compile-default"])
    assert list(terms) == ["graphs+compile-default"]
    with ProfileDB.open(db_copy) as db:
        after = {f.name: f.params for f in db.fits()}
    assert after[FIT_PREFIX + "eager"] == before[FIT_PREFIX + "eager"]
    with pytest.raises(EngineTermError, match="no iteration rows"):
        refit(db_copy, [f"{RESULTS}/h200-small"], kinds=["graphs+nothing"])


def test_refit_needs_a_db_and_rows(db_copy, tmp_path):
    assert main_code(["model-error", "--fit-engine-term", RESULTS]) == 2
    with pytest.raises(EngineTermError, match="no profiled-model iteration rows"):
        refit(db_copy, [])


def main_code(argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code


def test_recorded_iterations_are_rows_with_the_term_taken_out(tmp_path):
    path = tmp_path / "old.sqlite"
    ProfileDB.create(path, hardware="h200", num_sms=132).close()
    with ProfileDB.open(path) as db:  # a DB made before the table: opens, reads none
        assert db.iterations() == [] and not db.has_table("iterations")
    graph = get_model("clip").graph("tiny")
    cluster = make_cluster(1, "h200")
    plan = plan_all(graph, cluster, ProfiledModel(cluster), ["megatron"])[0]
    rec = IterationRecord(plan_json=json.dumps(plan.to_dict()), label="megatron", model="clip",
                          preset="tiny", global_batch=graph.global_batch, num_gpus=1,
                          predicted_s=0.012, engine_term_s=0.002, measured_s=0.013,
                          engine="eager", perf_model="profiled (x)", date="2026-11-30T00:00:00")
    with ProfileDB.open(path, readonly=False) as db:
        db.add_iterations([rec, rec])
    with ProfileDB.open(path) as db:
        assert db.iterations() == [rec, rec]
        (row, _) = rows_from_db(db)
    assert row.predicted_s == pytest.approx(0.010) and row.group == "db:2026-11-30T00:00:00"
    assert row.features == plan_features(plan, graph, 0.010)


def test_gradient_sync_settings_name_an_engine_only_where_gpus_synchronise():
    flat = {"graphs": True, "compile": "default", "grad_sync": "flat", "grads_in_graph": True}
    assert engine_kind(flat, 2) == "graphs+compile-default+flat+grads-in-graph"
    assert engine_kind(flat, 1) == "graphs+compile-default+grads-in-graph"
    assert engine_kind({**flat, "graphs": False}, 1) == "compile-default"
    # DDP takes its modules' gradients from autograd: grads_in_graph changes nothing there
    ddp = {**flat, "grad_sync": "ddp"}
    assert engine_kind(ddp, 2) == "graphs+compile-default"
    assert engine_kind(ddp, 1) == "graphs+compile-default+grads-in-graph"


def test_the_default_gpu_engine_record_is_engineconfigs_default():
    from dataclasses import asdict

    from mosaic.engine.session import EngineConfig
    from mosaic.perf.engine_term import GPU_ENGINE, gpu_engine_kind

    default = asdict(EngineConfig(graphs=True, compile="default"))
    assert {k: default[k] for k in GPU_ENGINE} == GPU_ENGINE
    assert gpu_engine_kind(2) == "graphs+compile-default+flat+grads-in-graph"


def test_a_term_that_predicts_held_out_runs_worse_than_none_is_not_kept():
    rows = [IterationRow(group=f"run{g}", engine="k", features={"const": 1.0, "predicted": p},
                         predicted_s=p, measured_s=p * m)
            for g, (p, m) in enumerate([(0.01, 1.0), (0.02, 1.7), (0.015, 0.9), (0.03, 1.0)])]
    term = fit_engine_term(rows, "k", feature_sets=[("const",)])
    assert term.features == () and term.mape == term.baseline_mape


def test_the_term_takes_back_a_share_of_what_a_colocation_is_predicted_to_save():
    """The shipped eager term has the colocation_saving feature (the compiled one no longer
    needs it, with compiled colocations in the profile): for a plan running CLIP's encoders
    side by side it is the sequential plan's composed prediction minus the plan's; a plan that
    colocates nothing has none."""
    from mosaic.plan import Placement, Plan, Stage

    cluster = make_cluster(1, "h200")
    graph = get_model("clip").graph("small", global_batch=32)
    model = ProfiledModel(cluster, engine="eager")
    assert "colocation_saving" in model.engine_term.features
    side_by_side = Plan(model="clip", planner="test", num_gpus=1, stages=(
        Stage(sharing="free", placements=(Placement(module="vision", gpus=(0,), priority=1),
                                          Placement(module="text", gpus=(0,)))),
        Stage(placements=(Placement(module="align", gpus=(0,)),))))
    one_by_one = sequential_plan(side_by_side)
    assert [s.sharing for s in one_by_one.stages] == ["temporal", "temporal"]

    def composed(plan):
        return model.iteration_time_s(plan, graph) - model.engine_term_s(plan, graph)

    saving = composed(one_by_one) - composed(side_by_side)
    assert saving > 0
    features = plan_features(side_by_side, graph, composed(side_by_side), composed(one_by_one))
    assert features["colocation_saving"] == pytest.approx(saving)
    assert model.engine_term_s(side_by_side, graph) == pytest.approx(
        model.engine_term.seconds(features))
    assert plan_features(one_by_one, graph, composed(one_by_one),
                         composed(one_by_one))["colocation_saving"] == 0
    assert plan_features(one_by_one, graph, 1.0)["colocation_saving"] == 0  # none known


def test_features_that_move_together_on_the_rows_are_never_fitted_together():
    """Every run of one model has the same parameter count, so `const` and `params` are one
    column: a fit of both splits one number between them arbitrarily (it once stored +451 ms
    -5.86 ns/param for CLIP, a negative step for any larger model). Such a set is skipped."""
    rows = [IterationRow(group=r.group, engine=r.engine,
                         features=r.features | {"params": 1.5e8}, predicted_s=r.predicted_s,
                         measured_s=r.measured_s) for r in _synthetic(per_param=0.0)]
    assert not identifiable(rows, ("const", "params"))
    assert identifiable(rows, ("const", "predicted"))
    term = fit_engine_term(rows, "eager")
    assert not {"const", "params"} <= set(term.features)
    with pytest.raises(EngineTermError, match="too few"):
        fit_engine_term(rows, "eager", feature_sets=[("const", "params")])


def test_a_feature_set_needs_more_runs_than_features():
    """Each held-out fold fits on every run but one: with as many features as runs the fold's
    coefficients are pinned by the runs' own noise."""
    rows = _synthetic(groups=3)
    term = fit_engine_term(rows, "eager")
    assert len(term.features) <= 2
    with pytest.raises(EngineTermError, match="too few"):
        fit_engine_term(rows, "eager", feature_sets=[("const", "stages", "params")])


def test_an_engine_summing_in_the_backward_takes_its_flat_twins_term(db_copy):
    """grad_sync='overlapped' replays the same graphs as 'flat' (the same host work a step):
    without rows of its own it is predicted with the flat engine's term."""
    flat = "graphs+compile-default+flat+grads-in-graph"
    with ProfileDB.open(db_copy, readonly=False) as db:
        db.conn.execute("INSERT INTO fits SELECT ?, params_json, mape, n_points, created FROM "
                        "fits WHERE name = ?", (FIT_PREFIX + flat,
                                                FIT_PREFIX + "graphs+compile-default+grads-in-graph"))
        db.conn.commit()
        twin = stored_term(db, flat)
        overlapped = stored_term(db, flat.replace("flat", "overlapped"))
    assert overlapped is not None and overlapped.coef == twin.coef
