"""The bf16 weight update measured per module (profile/main_weights.py): what it measures, its
place in the ProfileDB and the recipe, and the model pricing a per-weight update with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mosaic.engine.main_weights import cast_weights_bf16
from mosaic.hardware import make_cluster
from mosaic.perf.engine_term import engine_kind, per_weight_update, term_engine
from mosaic.perf.profiled import ProfiledModel
from mosaic.plan import Placement, Plan, Stage
from mosaic.profile.db import ProfileDB, module_signature
from mosaic.profile.main_weights import UpdatePoint, measure_module, store, stored_updates
from mosaic.profile.recipe import rebuild_recipe
from tests.helpers import encoders_and_head

CLUSTER = make_cluster(1, "h200")
FLAT = "graphs+compile-default+grads-in-graph+bf16-weights"
PER_WEIGHT = FLAT + "+per-weight-update"


def _point(module: str, per_weight_ms: float, flat_ms: float, copy_ms: float) -> UpdatePoint:
    return UpdatePoint(model="clip", preset="small", module=module, bf16_weights=3,
                       bf16_parameters=3 << 16, per_weight_s=per_weight_ms / 1e3,
                       flat_update_s=flat_ms / 1e3, gradient_copy_s=copy_ms / 1e3)


def test_a_module_is_measured_in_both_layouts_over_its_bf16_weights():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.LayerNorm(256))
    (cast,) = [cast_weights_bf16([module])]
    assert len(cast) == 2
    before = [p.detach().clone() for p in module.parameters()]
    row = measure_module(module)
    assert row is not None and row["bf16_weights"] == 2 and row["bf16_parameters"] == 2 << 16
    assert all(row[k] > 0 for k in ("per_weight_s", "flat_update_s", "gradient_copy_s",
                                    "per_weight_bf16_moments_s", "flat_update_bf16_moments_s",
                                    "per_weight_no_main_s", "flat_update_no_main_s"))
    assert all(p.grad is None for p in module.parameters())  # no gradients left behind
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    assert measure_module(nn.Sequential(nn.LayerNorm(8))) is None  # no bf16 weights


def test_measuring_without_main_weights_leaves_the_kernel_budget_as_it_was(monkeypatch):
    """The update without main weights records its lengths in the process's kernel budget as
    MainWeightsAdamW's do; the profiler strikes them, or the modules measured after would be
    timed with the kernel for every length (OFASys's LLM was, 2.5x its time)."""
    from mosaic.engine import main_weights
    from mosaic.profile.main_weights import update_s

    monkeypatch.setattr(main_weights, "_STATIC_LENGTHS", set())
    weight = nn.Parameter(torch.zeros(64, 64, dtype=torch.bfloat16))
    update_s([weight], [torch.ones_like(weight)], moments="bf16")
    kept = set(main_weights._STATIC_LENGTHS)
    assert kept
    update_s([weight], [torch.ones_like(weight)], moments="bf16", fp32_main_weights=False)
    assert kept == main_weights._STATIC_LENGTHS


def test_stored_updates_come_back_and_a_module_measured_again_replaces_its_entry(tmp_path):
    with ProfileDB.create(tmp_path / "p.sqlite", hardware="h200", num_sms=132) as db:
        assert stored_updates(db) == {}
        store(db, {"a": _point("vision", 1.0, 0.6, 0.1), "b": _point("text", 0.5, 0.4, 0.1)})
        store(db, {"a": _point("vision", 0.9, 0.6, 0.1)})
        got = stored_updates(db)
    assert set(got) == {"a", "b"} and got["a"].per_weight_s == pytest.approx(0.9e-3)
    assert got["a"].per_weight_extra_s == pytest.approx(0.2e-3)
    assert got["b"].per_weight_extra_s == pytest.approx(0.0, abs=1e-12)


def test_the_engine_kind_names_the_per_weight_update_and_shares_the_fp32_term():
    engine = {"graphs": True, "compile": "default", "grads_in_graph": True, "bf16_weights": True}
    assert engine_kind(engine, 1) == FLAT
    assert engine_kind({**engine, "bf16_flat_grads": False}, 1) == PER_WEIGHT
    assert engine_kind({**engine, "bf16_weights": False, "bf16_flat_grads": False}, 1) == (
        "graphs+compile-default+grads-in-graph")
    assert per_weight_update(PER_WEIGHT) and not per_weight_update(FLAT)
    assert term_engine(PER_WEIGHT) == term_engine(FLAT) == "graphs+compile-default+grads-in-graph"


def _plan_and_db(tmp_path, measured: dict[str, tuple[float, float, float]]):
    graph = encoders_and_head(num_encoders=2, batch=8)
    stages = tuple(Stage(placements=(Placement(module=m.name, gpus=(0,)),)) for m in graph.modules)
    plan = Plan(model="toy", planner="manual", num_gpus=1, stages=stages)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "p.sqlite"
    with ProfileDB.create(path, hardware="h200", num_sms=132) as db:
        store(db, {module_signature(graph.module(name)): _point(name, *ms)
                   for name, ms in measured.items()})
    return graph, plan, path


def test_a_per_weight_plan_adds_each_measured_modules_difference(tmp_path):
    graph, plan, path = _plan_and_db(tmp_path, {"enc0": (1.0, 0.6, 0.1), "enc1": (0.5, 0.5, 0.1)})
    flat = ProfiledModel(CLUSTER, path, engine=FLAT)
    per_weight = ProfiledModel(CLUSTER, path, engine=PER_WEIGHT)
    gap = per_weight.iteration_time_s(plan, graph) - flat.iteration_time_s(plan, graph)
    assert gap == pytest.approx((0.3 - 0.1) * 1e-3)
    assert flat.per_weight_extra_s(plan, graph) == pytest.approx(0.2e-3)  # asked, not added
    notes = per_weight.coverage_notes(plan, graph)
    assert [n for n in notes if "weight at a time" in n] == [
        "head: bf16 update a weight at a time not measured; priced as the flat one (measure "
        "it: mosaic profile toy --preset custom --update --main-weights-only)"]
    assert not [n for n in flat.coverage_notes(plan, graph) if "weight at a time" in n]


def test_bf16_moments_save_each_modules_measured_difference_else_their_bytes(tmp_path):
    """With bf16 moments the step saves, per module, its measured update with fp32 less with
    bf16 moments in the engine's layout (so train's choice of layout compares the layouts'
    bf16-moment updates); a module measured before bf16 moments existed (None) is priced at
    BF16_MOMENTS_SAVED_BYTES a parameter at the optimizer's bandwidth, in either layout."""
    from dataclasses import replace

    from mosaic.perf.profiled import BF16_MOMENTS_SAVED_BYTES

    graph, plan, path = _plan_and_db(tmp_path, {"enc0": (1.0, 0.6, 0.1), "enc1": (0.5, 0.5, 0.1)})
    with ProfileDB.open(path, readonly=False) as db:
        points = stored_updates(db)
        enc0 = module_signature(graph.module("enc0"))
        points[enc0] = replace(points[enc0], per_weight_bf16_moments_s=0.7e-3,
                               flat_update_bf16_moments_s=0.45e-3)
        store(db, points)
    for engine, enc0_saving in ((FLAT, 0.15e-3), (PER_WEIGHT, 0.3e-3)):
        fp32 = ProfiledModel(CLUSTER, path, engine=engine)
        bf16 = ProfiledModel(CLUSTER, path, engine=engine + "+bf16-moments")
        unmeasured = sum(fp32.memory_pass_s(graph.module(m).num_params, BF16_MOMENTS_SAVED_BYTES)
                         for m in ("enc1", "head"))
        gap = fp32.iteration_time_s(plan, graph) - bf16.iteration_time_s(plan, graph)
        assert gap == pytest.approx(enc0_saving + unmeasured)
        if engine == FLAT:  # enc0 with bf16 moments 0.7 - 0.45 - 0.1, enc1 fp32 0.5 - 0.5 - 0.1
            assert bf16.per_weight_extra_s(plan, graph) == pytest.approx(0.15e-3 - 0.1e-3)
        assert engine_kind({"graphs": True, "compile": "default", "grads_in_graph": True,
                            "bf16_weights": True, "bf16_moments": True,
                            "bf16_flat_grads": engine == FLAT}, 1) == engine + "+bf16-moments"
        assert term_engine(engine + "+bf16-moments") == term_engine(engine)
    weightless = UpdatePoint(model="clip", preset="small", module="text", bf16_weights=0,
                             bf16_parameters=0, per_weight_s=0.0, flat_update_s=0.0,
                             gradient_copy_s=0.0)
    assert weightless.bf16_moments_saving_s == 0.0  # its moments stay fp32: nothing to save


def test_the_recipe_measures_the_updates_once_per_preset(tmp_path):
    path = tmp_path / "p.sqlite"
    with ProfileDB.create(path, hardware="h200", num_sms=132) as db:
        store(db, {"a": _point("vision", 1.0, 0.6, 0.1), "b": _point("text", 0.5, 0.4, 0.1),
                   "c": UpdatePoint(model="qwen3-vl", preset="small", module="llm",
                                    bf16_weights=57, bf16_parameters=10, per_weight_s=5e-3,
                                    flat_update_s=3e-3, gradient_copy_s=6e-4)})
    steps = [s for s in rebuild_recipe(path, "out.sqlite") if "--main-weights-only" in s.command]
    assert [s.command for s in steps] == [
        "mosaic profile clip qwen3-vl --preset small --main-weights-only --update --db out.sqlite"]
    assert steps[0].needs == "1 GPU" and "3 modules" in steps[0].what


def test_the_shipped_db_holds_the_update_of_every_zoo_module():
    """Every module of every zoo model that fits one H200, at both presets (a text encoder of
    embeddings alone as holding no bf16 weight), found as the model finds it."""
    from mosaic.zoo import MODEL_NAMES, get_model

    model = ProfiledModel(CLUSTER, engine=PER_WEIGHT)
    missing = [f"{name}/{preset}/{spec.name}" for name in MODEL_NAMES
               for preset in ("small", "paper") if (name, preset) != ("qwen3-vl", "paper")
               for spec in get_model(name).graph(preset).modules if model.update_of(spec) is None]
    assert missing == []
    held = model.updates.values()
    assert all(p.per_weight_s > 0 and p.flat_update_s > 0 for p in held if p.bf16_weights)
    assert {p.module for p in held if not p.bf16_weights} == {"text"}


def test_a_zoo_model_is_measured_module_by_module_and_weightless_ones_say_so():
    """`tiny` modules hold no weight large enough for bf16: each is recorded as updating
    nothing, the same modules the meta-device count finds without measuring."""
    from mosaic.engine import main_weights
    from mosaic.profile.main_weights import measure_model, weightless_modules

    main_weights._STATIC_LENGTHS.add(("cuda", 0.9, 0.999, 1e-8, 0.0, "fp32", 12345))
    points = measure_model("clip", "tiny", torch.device("cpu"), log=lambda line: None)
    assert not main_weights._STATIC_LENGTHS  # each model starts with the whole kernel budget
    assert [p.module for p in points.values()] == ["vision", "text", "align"]
    assert all(p.bf16_weights == 0 and p.per_weight_extra_s == 0 for p in points.values())
    assert weightless_modules("clip", "tiny") == points


def test_training_updates_a_weight_at_a_time_only_where_the_model_predicts_it_clearly_faster(
        tmp_path):
    from mosaic.cli import PER_WEIGHT_MARGIN, predicted_update_layout
    from mosaic.engine.session import EngineConfig
    from mosaic.perf.analytic import AnalyticModel

    graph, plan, path = _plan_and_db(tmp_path / "none", {})
    step_ms = ProfiledModel(CLUSTER, path, engine=FLAT).iteration_time_s(plan, graph) * 1e3
    engine = EngineConfig(bf16_weights=True)
    for saving, per_weight in ((2 * PER_WEIGHT_MARGIN, True), (PER_WEIGHT_MARGIN / 2, False)):
        graph, plan, path = _plan_and_db(tmp_path / str(per_weight), {"enc0": (1.0, 1.0 + saving * step_ms, 0.0)})
        perf = ProfiledModel(CLUSTER, path, engine=FLAT)
        chosen, why = predicted_update_layout(plan, graph, perf, engine)
        assert chosen.bf16_flat_grads is (not per_weight)
        assert (why is not None) is per_weight
    assert why is None and chosen is engine
    graph, plan, path = _plan_and_db(tmp_path, {"enc0": (1.0, 1.0 + step_ms, 0.0)})
    perf = ProfiledModel(CLUSTER, path, engine=FLAT)
    assert predicted_update_layout(plan, graph, perf, engine)[0].bf16_flat_grads is False
    # Where the layouts were not measured, and without measured updates: as given.
    accumulating = EngineConfig(bf16_weights=True, accumulation=2)
    assert predicted_update_layout(plan, graph, perf, accumulating) == (accumulating, None)
    assert predicted_update_layout(plan, graph, AnalyticModel(CLUSTER), engine) == (engine, None)


def test_an_update_measured_with_other_update_code_is_named(tmp_path):
    from dataclasses import replace

    from mosaic.profile.main_weights import update_code_digest

    graph = encoders_and_head(num_encoders=2, batch=8)
    stages = tuple(Stage(placements=(Placement(module=m.name, gpus=(0,)),)) for m in graph.modules)
    plan = Plan(model="toy", planner="manual", num_gpus=1, stages=stages)
    path = tmp_path / "p.sqlite"
    with ProfileDB.create(path, hardware="h200", num_sms=132) as db:
        store(db, {module_signature(graph.module("enc0")): replace(
                       _point("enc0", 1.0, 0.6, 0.1), code="0123456789ab"),
                   module_signature(graph.module("enc1")): replace(
                       _point("enc1", 1.0, 0.6, 0.1), code=update_code_digest()),
                   module_signature(graph.module("head")): _point("head", 1.0, 0.6, 0.1)})
    notes = ProfiledModel(CLUSTER, path, engine=PER_WEIGHT).coverage_notes(plan, graph)
    assert [n.split(":")[0] for n in notes if "update" in n] == ["enc0"]
    assert "engine/main_weights.py has changed since" in " ".join(notes)


def test_the_update_codes_digest_follows_its_code_not_its_prose(tmp_path):
    """Comments, docstrings and layout do not change the digest that marks a measured update
    stale; a change of the code does."""
    from mosaic.profile.main_weights import update_code_digest

    def digest(text: str) -> str:
        path = tmp_path / "update.py"
        path.write_text(text)
        return update_code_digest(path)

    code = digest('"""Doc."""\n\ndef f(x):\n    return x * 2\n')
    assert code == digest('"""Other doc."""\n# why\n\n\ndef f(x):\n    """Doc."""\n'
                          '    return (x *  2)  # a comment\n')
    assert code != digest('"""Doc."""\n\ndef f(x):\n    return x * 3\n')


def test_the_shipped_update_entries_were_measured_with_this_update_code():
    """Every bf16 update the shipped profile measured was measured with the engine's update
    code as it is: an edit of engine/main_weights.py or engine/rounded_weights.py that can
    change what the update costs needs `mosaic profile MODEL --update --main-weights-only`
    on the GPU in the same change (docs/engine.md), else the model prices stale entries."""
    from mosaic.profile.main_weights import rounded_code_digest, update_code_digest

    shipped = Path(__file__).parents[1] / "src" / "mosaic" / "profile" / "data" / "h200.sqlite"
    points = stored_updates(ProfileDB.open(shipped))
    measured = [p for p in points.values() if p.bf16_weights]
    assert measured and {p.code for p in measured} == {update_code_digest()}
    assert {p.rounded_code for p in measured if p.per_weight_no_main_s is not None} == {
        rounded_code_digest()}


def test_train_plans_then_takes_the_layout_the_profile_predicts(tmp_path, capsys):
    """`mosaic train --bf16-weights` without a layout flag: the plan made, then the layout
    from the profile's measured updates (here every module saves a second a weight at a
    time), said on rank 0; a layout flag given (choose_layout off) is kept."""
    import shutil
    from types import SimpleNamespace

    from mosaic import cli
    from mosaic.engine.session import EngineConfig
    from mosaic.profile.db import default_db_path
    from mosaic.zoo import get_model

    db_path = tmp_path / "p.sqlite"
    shutil.copy(default_db_path("h200"), db_path)
    graph = get_model("clip").graph("tiny")
    with ProfileDB.open(db_path, readonly=False) as db:
        store(db, {module_signature(spec): _point(spec.name, 1.0, 1001.0, 0.0)
                   for spec in graph.modules})
    d = SimpleNamespace(rank=0, device=SimpleNamespace(type="cpu"))
    engine = EngineConfig(amp=True, bf16_weights=True)
    args = ("clip", "tiny", None, 1, "h200", None, "profiled", db_path, 0, engine, d)
    plan, chosen = cli._training_plan(*args, choose_layout=True)
    assert plan.num_gpus == 1 and chosen.bf16_flat_grads is False
    assert "bf16 update: a weight at a time" in capsys.readouterr().out
    flat_plan, kept = cli._training_plan(*args)
    assert kept is engine
    # each run's prediction is the model's for the layout it runs
    for trained, layout in ((plan, PER_WEIGHT), (flat_plan, FLAT)):
        expected = ProfiledModel(CLUSTER, db_path, engine=layout).iteration_time_s(trained, graph)
        assert trained.predicted_iteration_s == pytest.approx(expected)
    assert plan.predicted_iteration_s < flat_plan.predicted_iteration_s


def test_train_predicts_for_the_engine_it_runs_and_a_cpu_for_the_gpu_engine():
    """The compile scope and bf16 weights change which measurements a prediction reads
    (Unified-IO 2 `paper` b4 by blocks: 72.6 ms, by modules 85.3 ms, measured 75.2 ms), so
    `mosaic train` predicts for its own engine; on a CPU, for what a GPU runs with them."""
    from mosaic.cli import predicted_engine_kind
    from mosaic.engine.session import EngineConfig
    from mosaic.perf.engine_term import gpu_engine_kind

    assert predicted_engine_kind(EngineConfig(), 1, "cpu") == gpu_engine_kind(1)
    gpu_default = EngineConfig(graphs=True, compile="default")
    assert predicted_engine_kind(gpu_default, 2, "cuda") == gpu_engine_kind(2)
    blocks = predicted_engine_kind(EngineConfig(compile_scope="blocks", bf16_weights=True,
                                                bf16_flat_grads=False), 1, "cpu")
    assert blocks == (gpu_engine_kind(1).replace("+grads-in-graph", "+blocks-scope+grads-in-graph")
                      + "+bf16-weights+per-weight-update")
    assert predicted_engine_kind(EngineConfig(compile="default"), 1, "cuda").startswith("compile-")
