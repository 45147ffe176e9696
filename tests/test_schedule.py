"""The learning-rate schedule: its values, the trainer applying them step by step (SGD, so a
wrong rate shows in the weights), and a resumed run continuing on the same curve."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mosaic.engine.checkpoint import CheckpointConfig
from mosaic.engine.schedule import LRSchedule, ScheduleError
from mosaic.engine.session import OPTIMIZERS, build_modules, make_batch
from mosaic.engine.trainer import TrainConfig, train
from tests.test_engine import ToyModel, assert_state_close, one_gpu_plans, state_of

LR, MIN_LR = 0.1, 0.01


def test_warmup_ramps_to_the_peak_then_each_decay_ends_at_the_floor_on_the_last_step():
    cosine = LRSchedule(peak=LR, total_steps=5, warmup_steps=2, decay="cosine", min_lr=MIN_LR)
    assert [cosine.at(s) for s in range(5)] == pytest.approx(
        [LR / 2, LR, LR, (LR + MIN_LR) / 2, MIN_LR])
    linear = LRSchedule(peak=LR, total_steps=6, decay="linear", min_lr=MIN_LR)
    assert [linear.at(s) for s in range(6)] == pytest.approx(
        [LR - (LR - MIN_LR) * s / 5 for s in range(6)])
    warm = LRSchedule(peak=LR, total_steps=4, warmup_steps=4)
    assert [warm.at(s) for s in range(4)] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR])
    assert LRSchedule(peak=LR, total_steps=3).constant and not warm.constant
    assert LRSchedule(peak=LR, total_steps=1, decay="cosine").at(0) == LR  # nothing to decay over


@pytest.mark.parametrize("kwargs, option", [({"decay": "step"}, "--lr-decay"),
                                            ({"warmup_steps": 9}, "--lr-warmup-steps"),
                                            ({"min_lr": 1.0}, "--min-lr")])
def test_a_schedule_that_cannot_work_names_its_option(kwargs, option):
    with pytest.raises(ScheduleError, match=option):
        LRSchedule(peak=LR, total_steps=8, **kwargs)


def _config(plan, **kwargs) -> TrainConfig:
    return TrainConfig(**{"device": "cpu", "model": "toyvlm", "plan": plan, "warmup_steps": 0,
                          "lr": LR, "optimizer": "sgd", "lr_warmup_steps": 2,
                          "lr_decay": "cosine", "min_lr": MIN_LR, "progress": False, **kwargs})


def test_the_trainer_steps_each_update_at_the_schedules_rate(tmp_path):
    """Against a plain loop that sets the rate by hand before each SGD step; each metrics line
    holds the rate its step used."""
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    metrics = tmp_path / "metrics.jsonl"
    result = train(_config(plan, steps=5, metrics_path=str(metrics)), model=model)
    rates = [LR / 2, LR, LR, (LR + MIN_LR) / 2, MIN_LR]
    assert [json.loads(line)["lr"] for line in metrics.read_text().splitlines()] == (
        pytest.approx(rates))
    graph = model.graph("tiny")
    modules = build_modules(model, "tiny", graph.names, 0)
    optimizer = OPTIMIZERS["sgd"]([p for m in modules.values() for p in m.parameters()], lr=LR)
    for step, rate in enumerate(rates):
        data = make_batch(model, "tiny", graph.global_batch, 0, step)
        outputs: dict[str, torch.Tensor] = {}
        for name in graph.topo_order():
            outputs[name] = modules[name](*data.get(name, ()),
                                          *[outputs[p] for p in graph.predecessors(name)])
        optimizer.zero_grad(set_to_none=True)
        sum(outputs[s] for s in graph.sinks).backward()
        optimizer.param_groups[0]["lr"] = rate
        optimizer.step()
    assert_state_close(state_of(result.modules), state_of(modules))


@pytest.mark.parametrize("extra", [{}, {"optimizer": "adamw", "clip_grad_norm": 0.05}],
                         ids=["sgd", "adamw-clipped"])
def test_a_resumed_run_continues_on_the_same_curve(tmp_path, extra):
    """The rate is a function of the step and the run's length: a run resumed from its step-3
    checkpoint steps 3-5 at the uninterrupted run's rates and ends on its weights, bit for
    bit; with AdamW clipped (the optimizer told each step's clipping divisor) too."""
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    checkpoint = CheckpointConfig(directory=str(tmp_path / "ck"), every_steps=3)
    straight = train(_config(plan, steps=6, checkpoint=checkpoint,
                             metrics_path=str(tmp_path / "straight.jsonl"), **extra), model=model)
    shutil.rmtree(tmp_path / "ck" / "step-000006")
    (tmp_path / "ck" / "latest").write_text("step-000003")
    resumed = train(_config(plan, steps=6, checkpoint=checkpoint, resume=True,
                            metrics_path=str(tmp_path / "resumed.jsonl"), **extra), model=model)
    rows = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("straight", "resumed")}
    assert [r["step"] for r in rows["resumed"]] == [3, 4, 5]
    assert [r["lr"] for r in rows["resumed"]] == [r["lr"] for r in rows["straight"][3:]]
    assert [r["loss"] for r in rows["resumed"]] == [r["loss"] for r in rows["straight"][3:]]
    assert ([r.get("grad_norm") for r in rows["resumed"]]
            == [r.get("grad_norm") for r in rows["straight"][3:]])
    got, want = state_of(resumed.modules), state_of(straight.modules)
    assert all(torch.equal(got[k], want[k]) for k in want)
