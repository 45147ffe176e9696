"""Measured plan selection on CPU: timings are meaningless here, the choice logic is not."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mosaic.autotune import (
    AutotuneConfig,
    AutotuneError,
    TuneMeasurement,
    _choose,
    autotune,
    candidate_plans,
)
from mosaic.engine.measure import BASELINES
from mosaic.engine.session import EngineConfig
from mosaic.hardware import make_cluster
from mosaic.perf import make_perf_model
from mosaic.plan import Plan, plan_key
from mosaic.profile.db import ProfileDB
from mosaic.zoo import get_model
from tests.helpers import bench_two_ranks

CPU = {"steps_per_round": 1, "warmup_steps": 1, "engine": EngineConfig(graphs=False)}


def _setup(name):
    model = get_model(name)
    graph = model.graph("tiny")
    cluster = make_cluster(1, "h200")
    return model, graph, cluster, make_perf_model("profiled", cluster, preset="tiny")


def test_candidates_are_the_k_best_distinct_plans_plus_every_baseline():
    _, graph, cluster, perf = _setup("ofasys")
    plans, aliases = candidate_plans(graph, cluster, perf, k=2)
    keys = [plan_key(p) for p in plans.values()]
    assert len(set(keys)) == len(keys)  # distinct placement structures
    covered = {label for label in plans} | {a for al in aliases.values() for a in al}
    assert set(BASELINES) <= covered
    others = [p for p in plans.values() if p.planner not in BASELINES]
    assert len(others) <= 2
    best = min(p.predicted_iteration_s for p in plans.values())
    assert best in [p.predicted_iteration_s for p in others] or not others


def test_config_refuses_k0_and_planners_without_baselines():
    with pytest.raises(AutotuneError, match="K >= 1"):
        AutotuneConfig(k=0)
    with pytest.raises(AutotuneError, match="in_flight_steps=-1"):
        AutotuneConfig(in_flight_steps=-1)
    with pytest.raises(AutotuneError, match="baselines"):
        AutotuneConfig(planners=("mosaic",))


@pytest.mark.parametrize("name", ["clip", "ofasys"])
def test_autotune_picks_the_fastest_measured_and_records_it(name, tmp_path):
    model, graph, cluster, perf = _setup(name)
    db = tmp_path / "profile.sqlite"
    ProfileDB.create(db, hardware="h200", num_sms=132).close()
    config = AutotuneConfig(k=2, planners=("mosaic", "mosaic-unaware", *BASELINES), **CPU)
    result = autotune(model, "tiny", graph, cluster, perf, config, db=db)
    measured = {m.label: m.measured_s for m in result.measurements}
    assert all(m.in_flight_s > 0 for m in result.measurements)  # ranked in flight
    assert result.ranked_s == min(m.in_flight_s for m in result.measurements)
    assert result.ranked_s <= result.best_baseline_s
    assert result.plan.meta["autotune"]["chosen"] == result.label
    assert any(m.baseline for m in result.measurements)
    assert all(m.startup_s > 0 and m.predicted_s > 0 for m in result.measurements)
    assert result.plan.meta["autotune"]["best_baseline_s"] == result.best_baseline_s
    assert result.startup_s > 0
    with ProfileDB.open(db) as d:
        rows = d.iterations()
    assert {r.label: r.measured_s for r in rows} == measured
    assert {r.engine for r in rows} == {"eager@cpu"}  # CPU rows never mix with a GPU engine's
    assert all(r.model == name and r.num_gpus == 1 for r in rows)


def _measurement(label: str, per_step_ms: float, in_flight_ms: float | None,
                 baseline: bool = False) -> TuneMeasurement:
    return TuneMeasurement(label=label, predicted_s=1e-3, measured_s=per_step_ms * 1e-3,
                           startup_s=1.0, baseline=baseline,
                           in_flight_s=None if in_flight_ms is None else in_flight_ms * 1e-3)


def test_the_plan_kept_is_the_fastest_in_flight_as_training_runs_its_steps():
    """A plan that launches slowly can lead read a step at a time and trail in flight (the
    host's launch hides behind the GPU's work there); training runs in flight, so that
    decides, and the best baseline is taken on the same footing. Without windows (0 steps in
    flight) the per-step median decides, as before."""
    plans = {label: Plan(model="clip", planner=label, num_gpus=1, stages=()) for label in
             ("mosaic", "megatron", "spindle")}
    records = (_measurement("mosaic", 7.5, 7.4), _measurement("megatron", 7.7, 6.9, True),
               _measurement("spindle", 7.6, 7.0, True))
    result = _choose(records, plans, 3.0)
    assert result.label == "megatron" and result.ranked_s == pytest.approx(6.9e-3)
    assert result.measured_s == pytest.approx(7.7e-3)
    assert result.best_baseline_s == pytest.approx(6.9e-3)
    assert result.plan.meta["autotune"]["chosen"] == "megatron"
    per_step = tuple(dataclasses.replace(r, in_flight_s=None) for r in records)
    assert _choose(per_step, plans, 3.0).label == "mosaic"


@pytest.mark.slow
def test_bench_autotune_under_torchrun_two_processes(tmp_path):
    """Two gloo processes measure the candidates together; `autotune` joins the bench plans."""
    report, stderr = bench_two_ranks("clip", tmp_path, "--planners", "megatron,mosaic",
                                     "--steps-per-round", "1", "--user-programs", "none",
                                     "--autotune", "1", timeout=120)
    labels = {r["planner"] for r in report["results"]}
    assert labels == {"megatron", "mosaic", "autotune"}
    tuned = report["autotune"]
    best = min(m["in_flight_s"] for m in tuned["measurements"])
    chosen = next(m for m in tuned["measurements"] if m["label"] == tuned["chosen"])
    assert chosen["in_flight_s"] == best <= tuned["best_baseline_s"]
    assert "autotune: chose" in stderr


def test_train_autotune_trains_the_chosen_plan(tmp_path, capsys):
    from mosaic.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "clip", "--preset", "tiny", "--steps", "2", "--perf-model", "analytic",
              "--autotune", "1", "--out", str(tmp_path)])
    assert exit_.value.code == 0
    err = capsys.readouterr().err
    assert "autotune: chose" in err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["meta"]["autotune"]["best_baseline_s"] > 0
    with pytest.raises(SystemExit) as exit_:
        main(["train", "clip", "--plan", str(tmp_path / "plan.json"), "--autotune", "1"])
    assert exit_.value.code == 2


def test_measurements_of_a_run_on_the_shipped_profile_go_to_a_copy_never_into_the_package(tmp_path):
    from mosaic.autotune import record_db_for
    from mosaic.profile.db import default_db_path

    cluster = make_cluster(1, "h200")
    shipped = default_db_path("h200")
    before = shipped.stat().st_mtime_ns, shipped.stat().st_size
    perf = make_perf_model("profiled", cluster, preset="tiny")  # the shipped DB
    own = record_db_for(perf, "h200", tmp_path / "runs")
    assert own == tmp_path / "runs" / "profile-h200.sqlite" and own.read_bytes() == shipped.read_bytes()
    with ProfileDB.open(own, readonly=False) as db:  # later runs append, never replace it
        db.set_meta("appended", "yes")
    assert record_db_for(perf, "h200", tmp_path / "runs") == own
    with ProfileDB.open(own) as db:
        assert db.meta["appended"] == "yes"
    assert (shipped.stat().st_mtime_ns, shipped.stat().st_size) == before

    users = tmp_path / "mine.sqlite"
    ProfileDB.create(users, hardware="h200", num_sms=132).close()
    own_perf = make_perf_model("profiled", cluster, preset="tiny", db=users)
    assert record_db_for(own_perf, "h200", tmp_path / "runs") == users
    assert record_db_for(make_perf_model("analytic", cluster), "h200", tmp_path / "runs") is None


def test_accumulating_candidates_are_planned_for_one_micro_step():
    """A batch that fits only as micro-steps still has candidates, predicted accumulated."""
    from tests.helpers import encoders_and_head

    graph, cluster = encoders_and_head(3, batch=4096), make_cluster(1, "h200")
    with pytest.raises(AutotuneError, match="no planner"):
        candidate_plans(graph, cluster, make_perf_model("analytic", cluster), k=2)
    perf = make_perf_model("analytic", cluster, accumulation=32)
    plans, _ = candidate_plans(graph, cluster, perf, k=2)
    assert plans and all("32 accumulated micro-steps" in p.perf_model for p in plans.values())


def test_with_bf16_weights_the_update_a_weight_at_a_time_is_a_candidate(tmp_path, monkeypatch):
    """With bf16 weights, the best predicted plan is measured again updating a weight at a
    time (which update wins is the model's); when it wins, the result says to train with
    it, and its row stays out of the DB's rows for the flat engine's term."""
    from mosaic import autotune as tuning
    from mosaic.autotune import PER_WEIGHT_UPDATE
    from mosaic.engine import main_weights

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # `tiny` weights are all small
    model, graph, cluster, perf = _setup("clip")
    db = tmp_path / "profile.sqlite"
    ProfileDB.create(db, hardware="h200", num_sms=132).close()
    engine = EngineConfig(graphs=False, amp=True, bf16_weights=True)
    config = AutotuneConfig(k=1, planners=("mosaic", *BASELINES),
                            **{**CPU, "engine": engine})
    choose = tuning._choose

    def per_weight_fastest(records, plans, startup_s):
        fast = [dataclasses.replace(r, measured_s=1e-6, in_flight_s=1e-6)
                if r.engine_settings else r for r in records]
        return choose(tuple(fast), plans, startup_s)

    monkeypatch.setattr(tuning, "_choose", per_weight_fastest)
    result = autotune(model, "tiny", graph, cluster, perf, config, db=db)
    labels = [m.label for m in result.measurements]
    variant = next(label for label in labels if label.endswith("@bf16_flat_grads=false"))
    assert labels[0] + "@bf16_flat_grads=false" == variant  # the best predicted plan's
    assert result.label == variant and result.engine_settings == PER_WEIGHT_UPDATE
    assert result.plan.meta["autotune"]["engine_settings"] == PER_WEIGHT_UPDATE
    with ProfileDB.open(db) as d:
        assert variant not in {r.label for r in d.iterations()}
    plans = {"mosaic": result.plan}
    assert tuning._update_candidates(plans, EngineConfig()) == [] and list(plans) == ["mosaic"]


def test_train_trains_with_the_engine_settings_autotune_chose(monkeypatch):
    from types import SimpleNamespace

    import mosaic.autotune
    from mosaic import cli
    from mosaic.autotune import PER_WEIGHT_UPDATE

    tuned = SimpleNamespace(plan="the plan", engine_settings=PER_WEIGHT_UPDATE)
    monkeypatch.setattr(mosaic.autotune, "autotune_recorded", lambda *a, **k: (tuned, None))
    monkeypatch.setattr(cli, "_say_autotuned", lambda *a: None)
    d = SimpleNamespace(rank=0, device=SimpleNamespace(type="cpu"))
    engine = EngineConfig(amp=True, bf16_weights=True)
    plan, trained_with = cli._training_plan("clip", "tiny", None, 1, "h200", None, "analytic",
                                            None, 1, engine, d)
    assert plan == "the plan" and trained_with.bf16_flat_grads is False
    assert trained_with.bf16_weights and engine.bf16_flat_grads  # the given one is unchanged


def test_a_cuda_error_while_measuring_says_to_train_without_autotune(monkeypatch):
    """A CUDA error in a candidate's step (cuBLAS on OFASys `paper`, H200) poisons the
    process: autotune names the way on instead of a bare traceback; other errors pass."""
    from mosaic import autotune as tuning

    model, graph, cluster, perf = _setup("clip")

    def failing(message):
        def measure(*args, **kwargs):
            raise RuntimeError(message)
        return measure

    config = AutotuneConfig(k=1, **CPU)
    monkeypatch.setattr(tuning, "measure_plans", failing(
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"))
    with pytest.raises(AutotuneError, match="drop --autotune"):
        autotune(model, "tiny", graph, cluster, perf, config)
    monkeypatch.setattr(tuning, "measure_plans", failing("shapes do not match"))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        autotune(model, "tiny", graph, cluster, perf, config)


def test_a_cuda_error_names_the_candidate_whose_step_raised_it(monkeypatch):
    """The candidates share one process: the message says whose step the error came from
    (on the H200 it was gahc's plan of OFASys `paper`, among five candidates)."""
    from mosaic import autotune as tuning
    from mosaic.engine.measure import measure_plans
    from mosaic.engine.session import RankSession

    model, graph, cluster, perf = _setup("clip")
    monkeypatch.setattr(tuning, "measure_plans", measure_plans)  # the real one
    step = RankSession.step

    def megatron_fails(self, data):
        if self.plan.planner == "megatron":
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling ...")
        return step(self, data)

    monkeypatch.setattr(RankSession, "step", megatron_fails)
    with pytest.raises(AutotuneError, match="in 'megatron''s step .*drop --autotune"):
        autotune(model, "tiny", graph, cluster, perf, AutotuneConfig(k=1, **CPU))


def test_a_cuda_error_in_a_skippable_candidate_says_how_to_skip_it(monkeypatch):
    """gahc's plan of OFASys `paper` failed in cuBLAS on the H200 while the others trained:
    the message names the flag that measures the rest; a baseline cannot be skipped."""
    from mosaic import autotune as tuning
    from mosaic.engine.measure import measure_plans
    from mosaic.engine.session import RankSession

    model, graph, cluster, perf = _setup("ofasys")
    monkeypatch.setattr(tuning, "measure_plans", measure_plans)
    step = RankSession.step
    config = AutotuneConfig(k=1, **CPU)
    plans, aliases = candidate_plans(graph, cluster, perf, 1, config.planners)
    best = next(iter(plans.values()))

    def best_fails(self, data):
        if self.plan.planner == best.planner:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling ...")
        return step(self, data)

    monkeypatch.setattr(RankSession, "step", best_fails)
    assert best.planner not in BASELINES  # mosaic's plan, made by mosaic-partition too
    skip = "--autotune-skip " + ",".join([best.planner, *aliases[best.planner]])
    with pytest.raises(AutotuneError, match=f"{skip}.*drop --autotune"):
        autotune(model, "tiny", graph, cluster, perf, config)


def test_autotune_skip_leaves_a_planner_out_and_keeps_the_baselines():
    from mosaic.autotune import CANDIDATE_PLANNERS, autotune_planners

    assert autotune_planners() == CANDIDATE_PLANNERS
    kept = autotune_planners(["gahc", "exhaustive"])
    assert "gahc" not in kept and "exhaustive" not in kept and set(BASELINES) <= set(kept)
    _, graph, cluster, perf = _setup("ofasys")
    plans, aliases = candidate_plans(graph, cluster, perf, 3, autotune_planners(["gahc"]))
    named = {p.planner for p in plans.values()} | {a for al in aliases.values() for a in al}
    assert "gahc" not in named and set(BASELINES) <= named
    with pytest.raises(AutotuneError, match="--autotune-skip megatron: the baselines"):
        autotune_planners(["megatron"])
    with pytest.raises(AutotuneError, match="--autotune-skip nosuch: not a candidate planner"):
        autotune_planners(["nosuch"])


def test_train_refuses_autotune_skip_without_autotune_or_of_a_baseline(capsys):
    from mosaic.cli import main

    for args, message in ((["--autotune-skip", "gahc"], "add --autotune K"),
                          (["--autotune", "1", "--autotune-skip", "spindle"], "the baselines")):
        with pytest.raises(SystemExit):
            main(["train", "clip", "--preset", "tiny", "--steps", "1", *args])
        assert message in capsys.readouterr().err


def test_the_mosaic_search_offers_its_next_best_distinct_plans():
    """`plan_mosaic_alternatives`: best predicted first, no two that run alike; autotune
    adds them as `mosaic#N`, so K > 1 measures K distinct plans where they exist."""
    from mosaic.plan import run_key
    from mosaic.planners.mosaic import plan_mosaic_alternatives

    _, graph, cluster, perf = _setup("ofasys")
    found = plan_mosaic_alternatives(graph, cluster, perf, 4)
    predicted = [p.predicted_iteration_s for p in found]
    assert len(found) >= 2 and predicted == sorted(predicted)
    assert len({run_key(p) for p in found}) == len(found)
    assert [p.meta["alternative"] for p in found] == list(range(1, len(found) + 1))
    plans, aliases = candidate_plans(graph, cluster, perf, 3)
    labels = [*plans, *(a for al in aliases.values() for a in al)]
    assert any(label.startswith("mosaic#") for label in labels)
    assert len({run_key(p) for p in plans.values()}) == len(plans)
    assert len([n for n in plans if n not in BASELINES]) == 3
    one, _ = candidate_plans(graph, cluster, perf, 1)
    assert not any("#" in n for n in one)  # K = 1: the best plan alone, no alternatives


def test_a_failing_alternative_names_the_mosaic_planner_to_skip(monkeypatch):
    from mosaic import autotune as tuning

    model, graph, cluster, perf = _setup("ofasys")
    plans, aliases = candidate_plans(graph, cluster, perf, 3)
    label = next(n for n in [*plans, *(a for al in aliases.values() for a in al)]
                 if n.startswith("mosaic#"))
    whose = label if label in plans else next(k for k, al in aliases.items() if label in al)
    error = RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED")
    error.contender = whose
    failure = tuning._device_failure(error, plans, aliases)
    assert failure is not None and "--autotune-skip " in str(failure)
    skip = str(failure).split("--autotune-skip ")[1].split(";")[0].split(",")
    assert "#" not in ",".join(skip) and set(skip) <= set(tuning.CANDIDATE_PLANNERS)
