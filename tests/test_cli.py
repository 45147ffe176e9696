"""The `mosaic` command end to end, as a user runs it (a subprocess: exit codes and stderr)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import encoders_and_head


def mosaic(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mosaic", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=240)


def one_line_error(result, needle):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]


def test_plan_json_for_a_custom_graph(tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(encoders_and_head(3, batch=32).to_json())
    result = mosaic("plan", str(graph), "--gpus", "4", "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {"model", "gpus", "hardware", "perf_model", "plans"} <= summary.keys()
    times = {p["planner"]: p["predicted_iteration_s"] for p in summary["plans"]}
    assert {"megatron", "distmm", "spindle", "mosaic"} <= times.keys()
    assert times["mosaic"] <= min(times.values()) * (1 + 1e-9)
    for p in summary["plans"]:
        assert (tmp_path / "out" / f"{p['planner']}.png").exists()
        assert json.loads(Path(p["plan_file"]).read_text())["planner"] == p["planner"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["clip", "imagebind", "qwen3-vl", "unified-io-2", "ofasys"])
def test_plan_every_zoo_model_on_8_gpus(model, tmp_path):
    result = mosaic("plan", model, "--gpus", "8", "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)["plans"]
    best_baseline = min(p["predicted_iteration_s"] for p in plans if p["planner"] != "mosaic")
    mosaic_time = next(p["predicted_iteration_s"] for p in plans if p["planner"] == "mosaic")
    assert mosaic_time <= best_baseline * (1 + 1e-9)


def test_plan_says_how_a_module_too_big_for_a_gpu_was_fit(tmp_path):
    result = mosaic("plan", "qwen3-vl", "--preset", "paper", "--gpus", "2", "--batch", "16",
                    "--perf-model", "profiled", "--out", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    notes = {n.split(":")[0]: n for n in summary["notes"] if " fit a GPU " in n}
    assert notes.keys() == {p["planner"] for p in summary["plans"]}
    for plan in summary["plans"]:
        assert plan["sharded"] == ["llm"] and plan["states_over"] == {"llm": 2}
        assert plan["tensor_parallel"] == {}
        assert (f"llm fit a GPU with states sharded (FSDP2), predicted "
                f"{plan['predicted_iteration_s'] * 1e3:.2f} ms; split by tensor parallelism "
                "instead: predicted") in notes[plan["planner"]]


def test_unknown_model_is_one_line():
    one_line_error(mosaic("plan", "gpt-17", "--gpus", "8"), "gpt-17")


def test_zero_gpus_is_one_line():
    one_line_error(mosaic("plan", "clip", "--gpus", "0", "--preset", "tiny"), "--gpus 0")


def test_cyclic_custom_graph_is_one_line(tmp_path):
    d = encoders_and_head(2).to_dict()
    d["edges"].append(["head", "enc0"])
    path = tmp_path / "cyclic.json"
    path.write_text(json.dumps(d))
    one_line_error(mosaic("plan", str(path), "--gpus", "2"), "cycle")


def test_malformed_graph_json_is_one_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    one_line_error(mosaic("plan", str(path), "--gpus", "2"), "not valid JSON")


def test_malformed_plan_json_is_one_line(tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(encoders_and_head(2).to_json())
    plan = tmp_path / "plan.json"
    plan.write_text('{"model": "toy", "num_gpus": 2, "stages": [{"placements": [{"module": "enc0"}]}]}')
    one_line_error(mosaic("simulate", str(graph), "--plan", str(plan)), "missing key")
    plan.write_text("[1, 2")
    one_line_error(mosaic("simulate", str(graph), "--plan", str(plan)), "not valid JSON")


def test_simulate_a_hand_written_plan(tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(encoders_and_head(2, batch=8).to_json())
    plan = {"model": "toy", "planner": "manual", "num_gpus": 1, "stages": [
        {"sharing": "free", "placements": [{"module": "enc0", "gpus": [0], "priority": 1},
                                           {"module": "enc1", "gpus": [0]}]},
        {"placements": [{"module": "head", "gpus": [0]}]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = mosaic("simulate", str(graph), "--plan", str(tmp_path / "plan.json"), "--json",
                    "--out", str(tmp_path / "sim"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plans"][0]["predicted_iteration_s"] > 0


def test_simulate_predicts_for_the_gradient_sync_asked(tmp_path):
    """`mosaic simulate --grad-sync overlapped` replays the plan for an engine that sums
    during the backward: Unified-IO 2 `paper` on 2 GPUs steps faster than under `flat`."""
    times = {}
    for sync in ("flat", "overlapped"):
        result = mosaic("simulate", "unified-io-2", "--gpus", "2", "--batch", "8", "--planner",
                        "megatron", "--perf-model", "profiled", "--grad-sync", sync, "--json",
                        "--out", str(tmp_path / sync))
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        times[sync] = report["simulation"]["iteration_s"]
        assert times[sync] == pytest.approx(report["plans"][0]["predicted_iteration_s"], rel=1e-6)
    assert times["overlapped"] < 0.8 * times["flat"]


def test_planning_a_zoo_model_imports_no_torch(tmp_path):
    """The counted costs ship with the package (zoo/data/costs.json): `mosaic plan` on a zoo
    model needs neither torch nor transformers, which cost seconds to import."""
    code = ("import sys\nfrom mosaic.cli import main\n"
            f"try:\n    main(['plan', 'clip', '--gpus', '8', '--out', {str(tmp_path)!r}, '--json'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print([m for m in ('torch', 'transformers') if m in sys.modules], file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr
    assert json.loads(result.stdout)["plans"]


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    """Artifacts go to a temporary name and are renamed when whole: a full disk mid-PNG leaves
    neither a truncated PNG nor the temporary file."""
    import errno

    from matplotlib.figure import Figure

    from mosaic.cli import main

    def full_disk(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space"):
        main(["plan", str(_toy_graph(tmp_path)), "--gpus", "2", "--planners", "megatron",
              "--perf-model", "analytic", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["megatron.json"]  # written whole, before


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path):
    from mosaic.files import atomic_path, write_text_atomic

    target = write_text_atomic(tmp_path / "plan.json", "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def _toy_graph(tmp_path):
    path = tmp_path / "g.json"
    path.write_text(encoders_and_head(2, batch=8).to_json())
    return path


@pytest.mark.slow  # trains under torchrun
@pytest.mark.parametrize("gpus", [1, 2])
def test_train_and_plan_choose_the_same_plan(tmp_path, gpus):
    """One planning path: `mosaic train --planner mosaic` trains the plan `mosaic plan` makes
    for the same model, GPUs and preset (the engine never plans by itself)."""
    planned = mosaic("plan", "clip", "--gpus", str(gpus), "--preset", "tiny", "--planners",
                     "mosaic", "--out", str(tmp_path / "plan"), "--json")
    assert planned.returncode == 0, planned.stderr
    want = json.loads((tmp_path / "plan" / "mosaic.json").read_text())
    train = ["train", "clip", "--preset", "tiny", "--planner", "mosaic", "--gpus", str(gpus),
             "--steps", "1", "--out", str(tmp_path / "run")]
    if gpus == 1:
        trained = mosaic(*train)
    else:  # two processes stand in for two GPUs
        trained = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "-m", "mosaic", *train], capture_output=True, text=True, timeout=240,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert trained.returncode == 0, trained.stderr[-2000:]
    got = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert got["stages"] == want["stages"] and got["num_gpus"] == gpus
    assert got["predicted_iteration_s"] == pytest.approx(want["predicted_iteration_s"])


@pytest.mark.parametrize("gpus", [1, 2])
def test_plan_predicts_for_the_engine_train_runs_with_the_same_settings(gpus):
    """`mosaic plan --compile-scope S [--bf16-weights]` reads the surfaces and engine term of
    the GPU engine `mosaic train` runs with those settings (bf16 weights with the bf16
    gradient reduction train requires of them on several GPUs)."""
    from mosaic.cli import planned_engine_kind, predicted_engine_kind
    from mosaic.engine.session import EngineConfig

    for scope in ("module", "blocks"):
        for bf16 in (False, True):
            trained = EngineConfig(graphs=True, compile="default", compile_scope=scope,
                                   bf16_weights=bf16, reduce_dtype="bf16" if bf16 else "fp32")
            assert planned_engine_kind(gpus, scope, bf16) == predicted_engine_kind(
                trained, gpus, "cuda")
    per_weight = EngineConfig(graphs=True, compile="default", bf16_weights=True,
                              reduce_dtype="bf16", bf16_flat_grads=False)
    assert planned_engine_kind(gpus, "module", True, per_weight_update=True) == (
        predicted_engine_kind(per_weight, gpus, "cuda"))
    overlapped = EngineConfig(graphs=True, compile="default", grad_sync="overlapped")
    assert planned_engine_kind(gpus, grad_sync="overlapped") == (
        predicted_engine_kind(overlapped, gpus, "cuda"))


def test_the_compile_scopes_the_cli_offers_are_the_engines():
    from mosaic.cli import CompileScopeName
    from mosaic.engine.compile import COMPILE_SCOPES

    assert tuple(CompileScopeName) == COMPILE_SCOPES
    from mosaic.cli import GradSyncName
    from mosaic.engine.runner import GRAD_SYNC

    assert set(GradSyncName) == set(GRAD_SYNC)
    one_line_error(mosaic("plan", "clip", "--compile-scope", "layers"), "--compile-scope")


def test_plan_with_bf16_weights_predicts_the_step_without_weight_casts(tmp_path):
    args = ["plan", "unified-io-2", "--gpus", "1", "--preset", "paper", "--batch", "4",
            "--planners", "megatron", "--json"]
    fp32 = mosaic(*args, "--out", str(tmp_path / "fp32"))
    bf16 = mosaic(*args, "--bf16-weights", "--compile-scope", "blocks", "--out",
                  str(tmp_path / "bf16"))
    assert fp32.returncode == 0 and bf16.returncode == 0, fp32.stderr + bf16.stderr
    fp32, bf16 = json.loads(fp32.stdout), json.loads(bf16.stdout)
    assert "blocks-scope+grads-in-graph+bf16-weights" in bf16["perf_model"]
    step = {name: r["plans"][0]["predicted_iteration_s"] for name, r in (("fp32", fp32),
                                                                        ("bf16", bf16))}
    assert step["bf16"] < 0.85 * step["fp32"]
    # The shipped profile's updates: train would update this plan a weight at a time (a
    # note with that prediction, below the flat update's); without bf16 weights, no note.
    assert fp32["notes"] == []
    (note,) = bf16["notes"]
    assert note.startswith("megatron: `mosaic train --bf16-weights` updates this plan a weight")
    assert float(note.rsplit(" ", 2)[-2]) < step["bf16"] * 1e3
    # bf16 moments too: the shipped profile's measured update with them, a weight at a time
    moments = mosaic(*args, "--bf16-weights", "--bf16-moments", "--compile-scope", "blocks",
                     "--out", str(tmp_path / "moments"))
    assert moments.returncode == 0, moments.stderr
    moments = json.loads(moments.stdout)
    assert moments["perf_model"].count("+bf16-moments") == 1
    (moments_note,) = moments["notes"]
    assert moments_note.startswith("megatron: `mosaic train --bf16-weights --bf16-moments` ")
    assert float(moments_note.rsplit(" ", 2)[-2]) < float(note.rsplit(" ", 2)[-2]) - 4.0
    # The layout named: predicted as the note said, no note
    per_weight = mosaic(*args, "--bf16-weights", "--bf16-moments", "--no-bf16-flat-grads",
                        "--compile-scope", "blocks", "--out", str(tmp_path / "per-weight"))
    assert per_weight.returncode == 0, per_weight.stderr
    per_weight = json.loads(per_weight.stdout)
    assert per_weight["notes"] == []
    predicted_ms = per_weight["plans"][0]["predicted_iteration_s"] * 1e3
    assert predicted_ms == pytest.approx(float(moments_note.rsplit(" ", 2)[-2]), abs=0.01)
    # Without main weights: the shipped profile's update so, a weight at a time (the LLM's
    # alone 3.8 ms less on the H200)
    no_main = mosaic(*args, "--bf16-weights", "--bf16-moments", "--no-bf16-flat-grads",
                     "--no-fp32-main-weights", "--compile-scope", "blocks", "--out",
                     str(tmp_path / "no-main"))
    assert no_main.returncode == 0, no_main.stderr
    no_main = json.loads(no_main.stdout)
    assert no_main["perf_model"].count("+no-main-weights") == 1
    assert no_main["plans"][0]["predicted_iteration_s"] * 1e3 < predicted_ms - 3.0


def test_the_cli_reference_is_current():
    """docs/cli.md is generated from the commands; regenerate it with
    `mosaic cli-reference > docs/cli.md` after changing an option."""
    from mosaic.cli import reference_markdown

    assert (Path(__file__).parents[1] / "docs" / "cli.md").read_text() == reference_markdown()


def test_a_hand_written_graph_error_names_the_module_and_field(tmp_path):
    listing = mosaic("models", "--preset", "tiny", "--json")
    graph = json.loads(listing.stdout)[0]
    graph["modules"][0]["num_params"] = "85M"
    (tmp_path / "g.json").write_text(json.dumps(graph))
    one_line_error(mosaic("plan", str(tmp_path / "g.json")),
                   "modules[0] ('vision'): num_params = '85M' must be a plain int")
    del graph["modules"][0]["flops_per_sample"]
    graph["modules"][0]["num_params"] = 1000
    (tmp_path / "g.json").write_text(json.dumps(graph))
    one_line_error(mosaic("plan", str(tmp_path / "g.json")), "missing ['flops_per_sample']")


def test_plan_accepts_the_models_listing_or_one_graph_of_it(tmp_path):
    listing = tmp_path / "models.json"
    listing.write_text(mosaic("models", "--preset", "tiny", "--json").stdout)
    one_line_error(mosaic("plan", str(listing), "--gpus", "2"), "#NAME")
    result = mosaic("plan", f"{listing}#imagebind", "--gpus", "2", "--out", str(tmp_path / "p"),
                    "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "imagebind"


def test_the_footer_keeps_the_interference_coefficients():
    """rich would read '[alpha=...]' as markup and drop it: the footer prints it as text."""
    result = mosaic("plan", "clip", "--gpus", "1", "--preset", "small", "--perf-model",
                    "profiled", "--planners", "megatron")
    assert result.returncode == 0, result.stderr
    assert "[alpha=" in " ".join(result.stdout.split())


def test_simulate_shows_no_speedup_it_did_not_compute(tmp_path):
    planned = mosaic("plan", "clip", "--gpus", "2", "--preset", "tiny", "--planners", "mosaic",
                     "--out", str(tmp_path / "p"))
    assert planned.returncode == 0, planned.stderr
    result = mosaic("simulate", "clip", "--plan", str(tmp_path / "p" / "mosaic.json"),
                    "--preset", "tiny", "--out", str(tmp_path / "s"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["plans"][0]["speedup_vs_megatron"] is None


@pytest.mark.parametrize("device, share, said", [("cuda:0", 0.95, True), ("cuda:0", 0.5, False),
                                                 ("cpu", 0.99, False)])
def test_train_says_when_the_host_bounded_the_steps(capsys, device, share, said):
    """On a GPU, a run whose launches take most of each step is told so (on a CPU launching
    is the step itself: nothing to say)."""
    from types import SimpleNamespace

    from mosaic.cli import DataName, _say_trained
    from mosaic.plan import Plan

    summary = {"model": "clip", "preset": "tiny", "planner": "megatron", "num_gpus": 1,
               "first_loss": 2.0, "final_loss": 1.0, "step_time_median_s": 0.01,
               "step_time_p90_s": 0.011, "samples_per_s": 800.0, "pool": {},
               "device": device, "host_launch_share": share}
    plan = Plan(model="clip", planner="megatron", num_gpus=1, stages=())
    _say_trained(SimpleNamespace(summary=summary, plan=plan), DataName.synthetic)
    assert ("host-bound: launching a step took" in capsys.readouterr().out) is said
    _say_trained(SimpleNamespace(summary={**summary, "graphs": False}, plan=plan),
                 DataName.synthetic)  # eager: graphs are the remedy, not the batch
    assert ("drop --no-graphs" in capsys.readouterr().out) is said


def test_train_runs_like_bench_by_default_and_eagerly_on_a_cpu(tmp_path):
    """`mosaic train` asks for CUDA graphs and Inductor as `mosaic bench` does (an eager run
    was launch-bound: CLIP `small` b32 took 58 ms a step on the H200); a CPU has no graphs and
    the auto compile mode leaves it eager, so the same command runs on both."""
    from mosaic.cli import _compile_mode

    trained = mosaic("train", "clip", "--preset", "tiny", "--steps", "1",
                     "--out", str(tmp_path / "run"))
    assert trained.returncode == 0, trained.stderr[-2000:]
    asked = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (asked["graphs"], asked["compile_mode"]) == (True, "auto")
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert ran["graphs"] is False and ran["compile"]["compiled"] == {}
    assert _compile_mode("auto") is None and _compile_mode("none") is None
    assert _compile_mode("max-autotune-gemm") == "max-autotune-gemm"


def test_train_reports_its_compile_time_and_eager_modules(capsys):
    """Compile time is start-up the user pays: the training line says how much, and which
    modules fell back to eager and why (the engine logged it once already)."""
    from types import SimpleNamespace

    from mosaic.cli import DataName, _say_trained
    from mosaic.plan import Plan

    summary = {"model": "clip", "preset": "small", "planner": "megatron", "num_gpus": 1,
               "first_loss": 2.0, "final_loss": 1.0, "step_time_median_s": 0.01,
               "step_time_p90_s": 0.011, "samples_per_s": 800.0, "pool": {},
               "device": "cuda:0", "host_launch_share": 0.2,
               "compile": {"compiled": {"vision": {}, "text": {}}, "eager": {"align": "why"},
                           "compile_s": {"vision": 30.0, "text": 12.5},
                           "total_compile_s": 42.5}}
    plan = Plan(model="clip", planner="megatron", num_gpus=1, stages=())
    _say_trained(SimpleNamespace(summary=summary, plan=plan), DataName.synthetic)
    assert "compile: 2 module(s) by Inductor, 42.5 s; eager: align (why)" in capsys.readouterr().out
    _say_trained(SimpleNamespace(summary={**summary, "bf16_weights": True,
                                          "bf16_flat_grads": False}, plan=plan),
                 DataName.synthetic)  # autotune may choose the layout: the line says which
    assert "plan=megatron (bf16 weights, updated a weight at a time) gpus=1" in (
        capsys.readouterr().out)
    _say_trained(SimpleNamespace(summary={**summary, "bf16_weights": True, "bf16_moments": True,
                                          "fp32_main_weights": False}, plan=plan),
                 DataName.synthetic)
    assert "plan=megatron (bf16 weights, bf16 moments, no fp32 main weights) gpus=1" in (
        capsys.readouterr().out)
    _say_trained(SimpleNamespace(summary={**summary, "compile": {"compiled": {}}}, plan=plan),
                 DataName.synthetic)
    assert "compile:" not in capsys.readouterr().out


@pytest.mark.parametrize("device, predicted, said", [
    ("cuda:0", 0.0696, "(p90 11.0; model 71.4)"), ("cuda:0", None, "(p90 11.0)"),
    ("cpu", 0.0696, "(p90 11.0)")])
def test_train_says_the_models_step_beside_the_measured_one_on_a_gpu(capsys, device, predicted,
                                                                     said):
    """The training line shows the model's step where it predicts this device's (a GPU's;
    on a CPU it predicts the GPU's, no yardstick for the CPU's step): the plan's predicted
    step and the guard's read of the gradients (1.8 ms here)."""
    from types import SimpleNamespace

    from mosaic.cli import DataName, _say_trained
    from mosaic.plan import Plan

    summary = {"model": "clip", "preset": "tiny", "planner": "megatron", "num_gpus": 1,
               "first_loss": 2.0, "final_loss": 1.0, "step_time_median_s": 0.01,
               "step_time_p90_s": 0.011, "samples_per_s": 800.0, "pool": {},
               "device": device, "host_launch_share": 0.2, "predicted_iteration_s": predicted,
               "predicted_guard_s": 0.0018}
    plan = Plan(model="clip", planner="megatron", num_gpus=1, stages=())
    _say_trained(SimpleNamespace(summary=summary, plan=plan), DataName.synthetic)
    assert f"step 10.0 ms median {said}, 800.0 samples/s" in capsys.readouterr().out


def test_the_guard_estimate_reads_each_gradient_once_in_its_dtype():
    """The trained step's guard reads 2 bytes a bf16 weight's gradient and 4 the others', on
    the GPU holding the most; Qwen3-VL `paper` with bf16 weights: 18.5 GB, 4.3 ms on the H200
    (its model missed the trained step, 108.4 ms, by that much without it)."""
    from mosaic.cli import _guard_estimate
    from mosaic.engine.session import EngineConfig
    from mosaic.hardware import H200
    from mosaic.plan import Placement, Plan, Stage
    from mosaic.zoo import get_model

    graph = get_model("qwen3-vl").graph("paper")
    plan = Plan(model=graph.name, planner="megatron", num_gpus=1, stages=tuple(
        Stage(placements=(Placement(module=m, gpus=(0,)),)) for m in graph.topo_order()))
    bf16 = EngineConfig(bf16_weights=True, bf16_moments=True)
    fp32 = EngineConfig()
    guard = {name: _guard_estimate(plan, "qwen3-vl", "paper", None, engine, "h200")
             for name, engine in (("bf16", bf16), ("fp32", fp32))}
    assert guard["bf16"] == pytest.approx(4.3e-3, rel=0.02)
    params = sum(m.num_params for m in graph.modules)
    assert guard["fp32"] == pytest.approx(4 * params / H200.mem_bandwidth_bps)


def test_train_says_its_mfu_on_a_gpu_as_the_bench_counts_it(capsys):
    """A trained step's MFU: the model's FLOPs a step over the GPUs' datasheet dense bf16
    peak for that long (the bench's formula), said on the training line where the run had a
    GPU (the summary holds none on a CPU)."""
    from types import SimpleNamespace

    from mosaic.cli import DataName, _say_trained
    from mosaic.engine.trainer import model_flops_utilisation
    from mosaic.plan import Plan
    from mosaic.zoo import get_model

    graph = get_model("clip").graph("small")
    mfu = model_flops_utilisation(graph, 1, "h200", 0.01)
    assert mfu == pytest.approx(graph.total_flops() / (989e12 * 0.01))
    assert model_flops_utilisation(graph, 2, "h200", 0.01) == pytest.approx(mfu / 2)
    summary = {"model": "clip", "preset": "small", "planner": "megatron", "num_gpus": 1,
               "first_loss": 2.0, "final_loss": 1.0, "step_time_median_s": 0.01,
               "step_time_p90_s": 0.011, "samples_per_s": 800.0, "pool": {},
               "device": "cuda:0", "host_launch_share": 0.2, "mfu": 0.316,
               "config": {"hardware": "h200"}}
    plan = Plan(model="clip", planner="megatron", num_gpus=1, stages=())
    _say_trained(SimpleNamespace(summary=summary, plan=plan), DataName.synthetic)
    assert "800.0 samples/s, MFU 31.6% of 989 TF/s, SM quotas" in capsys.readouterr().out
    _say_trained(SimpleNamespace(summary={**summary, "mfu": None}, plan=plan),
                 DataName.synthetic)
    assert "MFU" not in capsys.readouterr().out
