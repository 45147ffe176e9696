"""`mosaic train --data` and `--tensorboard`: refused in one line before any work when they
cannot be served, and what they write when they can."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mosaic.cli import main
from mosaic.engine.trainer import TrainConfig, TrainError, train
from tests.test_engine import ToyModel, one_gpu_plans

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    captured = capsys.readouterr()
    return info.value.code or 0, captured.out, captured.err


def test_digits_for_a_model_that_is_not_clip_is_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, "train", "imagebind", "--data", "digits",
                             "--out", str(tmp_path / "run"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "CLIP-shaped" in err and "--data synthetic" in err
    assert not (tmp_path / "run").exists()


def test_an_unknown_data_set_is_refused_with_the_choices(capsys):
    code, _, err = run_cli(capsys, "train", "clip", "--data", "mnist")
    assert code == 2 and "mnist" in err and "digits" in err


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed")
def test_tensorboard_without_the_package_is_one_line(capsys, tmp_path):
    code, out, err = run_cli(capsys, "train", "clip", "--tensorboard", str(tmp_path / "tb"))
    assert code == 2 and out == ""
    assert "--tensorboard" in err and "pip install tensorboard" in err
    with pytest.raises(TrainError, match="tensorboard_dir"):
        TrainConfig(model="clip", plan_path="p.json", tensorboard_dir=str(tmp_path))


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (optional)")
def test_tensorboard_gets_the_loss_and_step_time_of_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = ToyModel("toyclip")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    result = train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=4, lr=1e-2,
                               tensorboard_dir=str(tmp_path)), model=model)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses == pytest.approx([s["loss"] for s in result.steps])
    assert len(events.Scalars("train/step_time_ms")) == 4


def test_torch_trace_covers_the_last_steps_of_every_rank(tmp_path):
    import gzip
    import json

    model = ToyModel("toyclip")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=6, lr=1e-2,
                      torch_trace_dir=str(tmp_path)), model=model)
    with gzip.open(tmp_path / "trace-rank0.json.gz", "rt") as f:
        trace = json.load(f)
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"}  # the last 3 of 6
    table = (tmp_path / "kernels-rank0.txt").read_text()
    assert "last 3 steps" in table and "aten::" in table
    from mosaic.report.kernel_time import summarise_trace_dir

    assert summarise_trace_dir(tmp_path) == [tmp_path / "kernel-time-rank0.json"]
    summary = json.loads((tmp_path / "kernel-time-rank0.json").read_text())
    assert summary == {"steps": 3, "devices": {}}  # a CPU run launches no GPU kernels


def test_a_gpu_trace_waits_for_the_steps_in_flight_before_its_first_traced_step(monkeypatch):
    """Steps run in flight: without a sync the kernels of the step before the window land in
    the trace and every per-step time comes out high."""
    from types import SimpleNamespace

    from mosaic.engine.trainer import _WindowedTracer

    prof = SimpleNamespace(step_num=0)
    prof.step = lambda: setattr(prof, "step_num", prof.step_num + 1)
    synced_at = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced_at.append(prof.step_num))
    tracer = _WindowedTracer(prof, first_active=4, device=torch.device("cuda"))
    for _ in range(7):
        tracer.step()
    assert synced_at == [3]  # after the warmup step (the 4th), before the profiler goes active
    cpu = _WindowedTracer(prof, first_active=1, device=torch.device("cpu"))
    cpu.step()
    assert synced_at == [3]


def test_a_run_resumes_from_the_checkpoint_before_a_corrupt_latest_one(tmp_path, capsys):
    from mosaic.engine.checkpoint import CheckpointConfig

    model = ToyModel("toyclip")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    ckpt = CheckpointConfig(directory=str(tmp_path), every_steps=3)
    train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=6, lr=1e-2,
                      checkpoint=ckpt), model=model)
    shard = next((tmp_path / "step-000006").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-16])
    capsys.readouterr()
    result = train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=8, lr=1e-2,
                               checkpoint=ckpt, resume="auto"), model=ToyModel("toyclip"))
    err = capsys.readouterr().err
    assert "step-000006 cannot be loaded" in err and "resuming at step 3 of 8" in err
    assert [s["step"] for s in result.steps] == [3, 4, 5, 6, 7]

