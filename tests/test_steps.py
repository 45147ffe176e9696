"""Steps kept in flight (engine/steps.py): the trainer launches step k+1 before it reads step
k, and the NaN guard still never applies a bad step's update: the fused optimizer skips it
on the device (`found_inf`), and the host stops the run or logs the skip one step later."""

from __future__ import annotations

import json

import pytest
import torch

from mosaic.engine.session import make_optimizer
from mosaic.engine.steps import GuardChoice, _not_finite, read_bad, skips_on_device
from mosaic.engine.trainer import TrainConfig, TrainError, train
from tests.test_engine import ToyModel, one_gpu_plans, state_of


def _config(**kwargs) -> TrainConfig:
    model = ToyModel("toyclip")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    kwargs = {"steps": 4, "optimizer": "adamw", **kwargs}
    return TrainConfig(device="cpu", model="toyclip", plan=plan, warmup_steps=0, lr=1e-2,
                       progress=False, **kwargs)


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(3))]


def test_which_optimizers_skip_on_the_device():
    assert skips_on_device(make_optimizer("adamw", _params(), 1e-3))
    assert skips_on_device(make_optimizer("sgd", _params(), 1e-3))
    assert not skips_on_device(torch.optim.AdamW(_params(), lr=1e-3, foreach=True))
    assert not skips_on_device(torch.optim.SGD(_params(), lr=1e-3, momentum=0.9, fused=True))
    assert not skips_on_device(None)


def test_the_health_vector_names_what_was_not_finite():
    assert read_bad([1.0, 0.0, 0.0, 0.0, 0.0], ["a", "b"]) == []
    assert read_bad([1.0, 2.0, 0.0, 0.0, 0.0], ["a", "b"]) == []  # a stop request is no fault
    assert read_bad([float("nan"), 0.0, 1.0, 0.0, 2.0], ["a", "b"]) == [
        "loss", "gradient of module 'b'"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_skipped_step_changes_no_weight_and_counts_no_step(monkeypatch, optimizer):
    """AdamW keeps moving the weights with its moments on a zero gradient, so only a skipped
    update leaves them exactly as after step 1 (a NaN gradient applied would leave NaNs)."""
    clean = train(_config(steps=2, optimizer=optimizer), model=ToyModel("toyclip"))
    monkeypatch.setenv("MOSAIC_FAULT", "nan:rank=0:step=2")
    result = train(_config(steps=3, optimizer=optimizer, skip_nonfinite=True),
                   model=ToyModel("toyclip"))
    assert [("skipped" in r) for r in result.steps] == [False, False, True]
    want, got = state_of(clean.modules), state_of(result.modules)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_the_run_stops_at_the_bad_step_with_every_earlier_line_written(monkeypatch, tmp_path):
    """Step 2 is read while step 3 is in flight: the error names step 2, and the metrics hold
    steps 0 and 1, in order."""
    metrics = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("MOSAIC_FAULT", "nan:rank=0:step=2")
    with pytest.raises(TrainError, match=r"step 2: non-finite gradient of module"):
        train(_config(steps=5, metrics_path=str(metrics)), model=ToyModel("toyclip"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]


def test_every_step_is_read_once_in_order_with_its_time(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = train(_config(steps=6, metrics_path=str(metrics)), model=ToyModel("toyclip"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6)) == [r["step"] for r in result.steps]
    assert all(r["step_time_s"] > 0 and r["loss"] == r["loss"] for r in rows)
    # On a CPU launching computes the step: the launch is nearly all of the step's time.
    assert all(0 < r["launch_s"] <= r["step_time_s"] + 1e-3 for r in rows)
    assert 0 < result.summary["host_launch_share"] <= 1.1


def test_reading_each_step_first_trains_the_same_run():
    in_flight = train(_config(steps=5), model=ToyModel("toyclip"))
    one_by_one = train(_config(steps=5, read_each_step=True), model=ToyModel("toyclip"))
    assert [r["loss"] for r in in_flight.steps] == [r["loss"] for r in one_by_one.steps]
    want, got = state_of(one_by_one.modules), state_of(in_flight.modules)
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("where", [2, 1], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf"), 3e38])
def test_both_guards_flag_the_same_gradients_and_change_none(bad, where):
    grads = [torch.randn(5), torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(7)]
    if bad is not None:
        grads[where].view(-1)[4] = bad
    if bad == 3e38:  # finite, but its square overflows: only the norms guard gives up on it
        flags = {guard: float(_not_finite(grads, guard)) for guard in ("norms", "check")}
        assert flags == {"norms": 1.0, "check": 0.0}
        return
    before = [g.clone() for g in grads]
    flags = {guard: float(_not_finite(grads, guard)) for guard in ("norms", "check")}
    assert flags == {"norms": float(bad is not None), "check": float(bad is not None)}
    for after, was in zip(grads, before, strict=True):
        torch.testing.assert_close(after, was, rtol=0, atol=0, equal_nan=True)


def test_the_guard_turns_to_one_check_per_module_only_where_the_host_is_the_bound():
    host_bound, gpu_bound = GuardChoice(), GuardChoice()
    samples = GuardChoice.SKIP + GuardChoice.SAMPLES
    switched = [host_bound.observe(0.009, 0.010) for _ in range(samples)]
    assert switched == [False] * (samples - 1) + [True] and host_bound.guard == "check"
    assert not any(gpu_bound.observe(0.020, 0.080) for _ in range(samples + 3))
    assert gpu_bound.guard == "norms" and gpu_bound.decided
    assert not host_bound.observe(0.001, 0.080) and host_bound.guard == "check"  # for good


def test_a_nan_step_after_the_guard_turned_is_skipped_too(monkeypatch):
    """The trainer turns to the per-module check after five steps; a NaN at step 6 is still
    skipped on the device. On a CPU launching is nearly the whole step, but on a loaded
    two-core CI machine the median share once fell under HOST_BOUND: the turn is forced here
    (test_the_guard_turns_to_one_check_per_module_only_where_the_host_is_the_bound tests the
    threshold)."""
    monkeypatch.setattr(GuardChoice, "HOST_BOUND", 0.0)
    clean = train(_config(steps=6), model=ToyModel("toyclip"))
    monkeypatch.setenv("MOSAIC_FAULT", "nan:rank=0:step=6")
    result = train(_config(steps=7, skip_nonfinite=True), model=ToyModel("toyclip"))
    assert result.summary["nan_guard"] == "check"
    assert [("skipped" in r) for r in result.steps] == [False] * 6 + [True]
    want, got = state_of(clean.modules), state_of(result.modules)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_the_cli_passes_read_each_step(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "mosaic", "train", "clip", "--preset", "tiny",
                             "--steps", "2", "--read-each-step", "--out", str(out)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["read_each_step"] is True


def test_clipping_norms_and_divides_gradients_one_dtype_per_foreach_call(monkeypatch):
    """torch runs a foreach kernel over a list mixing dtypes a tensor at a time (the first
    clipping took the host 94 ms a step on the H200 that way), so the norms and the division
    are grouped by dtype; and the norm counts each tensor once over the ranks that copy it."""
    from mosaic.engine import steps

    calls: list[set[torch.dtype]] = []
    for name in ("_foreach_norm", "_foreach_div_"):
        real = getattr(torch, name)

        def recording(grads, *args, real=real, **kwargs):
            calls.append({g.dtype for g in grads})
            return real(grads, *args, **kwargs)

        monkeypatch.setattr(torch, name, recording)
    grads = [torch.full((4,), 1.0), torch.full((3,), 2.0, dtype=torch.bfloat16),
             torch.full((2,), 3.0), torch.full((5,), 1.0, dtype=torch.bfloat16)]
    share = steps._squared_norm_share(grads, copies=[1, 1, 2, 1])
    assert share.item() == pytest.approx(4 * 1 + 3 * 4 + 2 * 9 / 2 + 5 * 1)
    assert len(calls) == 3 and all(len(dtypes) == 1 for dtypes in calls)

    class Session:
        def gradients(self, name):
            return grads

    calls.clear()
    steps._divide_gradients(Session(), ["m"], torch.tensor(2.0))
    assert len(calls) == 2 and all(len(dtypes) == 1 for dtypes in calls)
    assert [g[0].item() for g in grads] == [0.5, 1.0, 1.5, 0.5]
