"""Run folders (`mosaic train --out`) and job configs (`--config job.toml --set k=v`)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mosaic.files import OutputError
from mosaic.job_config import JobConfigError, load_job
from mosaic.plan import Placement, Plan, Stage
from mosaic.report.run_folder import check_run_dir, environment, write_run_folder


def test_check_run_dir_refuses_a_non_empty_folder(tmp_path):
    assert check_run_dir(tmp_path / "new") == tmp_path / "new"
    assert not (tmp_path / "new").exists()  # creates nothing
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputError, match="--overwrite"):
        check_run_dir(tmp_path / "full")
    check_run_dir(tmp_path / "full", overwrite=True)


def test_write_run_folder(tmp_path):
    plan = Plan(model="m", planner="manual", num_gpus=1, stages=(
        Stage(placements=(Placement(module="a", gpus=(0,)),)),))
    result = SimpleNamespace(
        summary={"model": "m", "device": "cpu", "final_loss": 1.0}, plan=plan,
        steps=[{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0}],
        timeline=[{"module": "a", "stage": 0, "gpu": 0, "phase": "fwd", "start_s": 0.0,
                   "end_s": 0.001, "sm_share": 1.0}])
    write_run_folder(tmp_path / "run", config={"lr": 1e-3}, result=result)
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["config.json", "curves.png", "env.json", "metrics.jsonl", "plan.json",
                     "summary.json", "timeline.json", "timeline.png"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["loss"] for line in lines] == [2.0, 1.0]
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    assert any(e.get("cat") == "measured fwd" for e in trace["traceEvents"])
    assert Plan.load(tmp_path / "run" / "plan.json") == plan
    assert environment()["gpu"] == "cpu"


def test_the_curves_have_a_panel_per_metric_the_run_logged(tmp_path):
    """Loss and step time always; the learning rate and gradient norm only where a schedule
    or clipping logged them (an empty panel would read as a flat zero)."""
    from matplotlib.image import imread

    from mosaic.report.run_folder import plot_curves

    plain = [{"step": s, "loss": 2.0 - s / 10, "step_time_s": 0.01, "warmup": s < 2}
             for s in range(6)]
    logged = [{**row, "lr": 1e-3 * (s + 1), "grad_norm": 3.0} for s, row in enumerate(plain)]
    widths = {}
    for name, steps in (("plain", plain), ("logged", logged)):
        path = plot_curves(steps, tmp_path / f"{name}.png", "m plan=manual")
        widths[name] = imread(path).shape[1]
    assert widths["logged"] == 2 * widths["plain"]  # four panels, not two


def test_job_config_toml_yaml_and_overrides(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('model = "clip"\n[train]\nsteps = 5\nlr = 1e-3\n[run]\nout = "runs/x"\n')
    job = load_job(toml, ["train.lr=2e-4", "plan.planner=megatron", "engine.graphs=true"])
    assert job == {"model": "clip", "steps": 5, "lr": 2e-4, "out": job["out"],
                   "planner": "megatron", "graphs": True}
    assert str(job["out"]) == "runs/x"
    yaml = tmp_path / "job.yaml"
    yaml.write_text("model: clip\ntrain:\n  steps: 7\n")
    assert load_job(yaml) == {"model": "clip", "steps": 7}


@pytest.mark.parametrize(("text", "overrides", "needle"), [
    ("[train]\nsteps = 'five'\n", [], "train.steps = 'five' must be an integer"),
    ("[train]\nlr = true\n", [], "train.lr = True must be a number"),
    ("[train]\nstep = 5\n", [], "unknown field 'train.step'"),
    ("[train\n", [], "not valid toml"),
    ("", ["train.lr"], "--set section.key=value"),
    ("", ["train.lr=fast"], "train.lr = 'fast' must be a number"),
])
def test_job_config_errors_name_the_field(tmp_path, text, overrides, needle):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(JobConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_job(path, overrides)


def mosaic(*args):
    return subprocess.run([sys.executable, "-m", "mosaic", *args], capture_output=True,
                          text=True, timeout=300)


def test_bad_job_field_is_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('model = "clip"\n[train]\npreset = "huge"\n')
    result = mosaic("train", "--config", str(job))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.preset = 'huge'" in result.stderr


@pytest.mark.slow
def test_train_with_config_writes_the_run_folder(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('model = "clip"\n[train]\nsteps = 3\n[plan]\nplanner = "megatron"\n')
    out = tmp_path / "run"
    result = mosaic("train", "--config", str(job), "--set", "train.lr=1e-3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["lr"] == 1e-3 and config["steps"] == 3 and config["planner"] == "megatron"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    trace = json.loads((out / "timeline.json").read_text())["traceEvents"]
    cats = {e.get("cat") for e in trace}
    assert "predicted" in cats and "measured fwd" in cats
    again = mosaic("train", "--config", str(job), "--out", str(out))
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_every_job_field_is_an_option_of_mosaic_train():
    import typer

    from mosaic.cli import app
    from mosaic.job_config import FIELDS

    train = typer.main.get_command(app).commands["train"]
    assert {param for param, _ in FIELDS.values()} <= {p.name for p in train.params}


def test_bench_results_name_the_code_and_the_transformers_that_measured_them():
    """A bench figure must be traceable to its code: the zoo's attention changed kernels on
    2026-12-01 without changing any cost fact, and only the commit tells such runs apart."""
    import shutil
    import subprocess
    from pathlib import Path

    import transformers

    from mosaic.engine.measure import environment as bench_environment

    env = bench_environment()
    assert env["transformers"] == transformers.__version__
    checkout = Path(__file__).parents[1]
    if shutil.which("git") is None or not (checkout / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=checkout).stdout.strip()
    assert env["git_sha"] == head


def test_measured_bars_stack_but_the_trace_keeps_each_plans_sm_share():
    """Bars that overlap on a GPU are stacked in the Gantt chart; the Chrome trace still says
    the share the plan gave (a stacked height had been reported as the module's SM share)."""
    from mosaic.report.bench_report import measured_events
    from mosaic.report.timeline import chrome_trace

    timeline = [{"module": m, "stage": 0, "gpu": 0, "start_s": start, "end_s": start + 2e-3,
                 "sm_share": share, "phase": "fwd"}
                for m, start, share in (("llm", 0.0, 1.0), ("video", 1e-3, 0.25))]
    events = measured_events(timeline)
    assert [(e.module, e.lane, e.height) for e in events] == [("llm", 0.0, 1.0),
                                                              ("video", 0.999, 0.05)]
    shares = [t["args"]["sm_share"] for t in chrome_trace(events)["traceEvents"]]
    assert shares == [1.0, 0.25]
