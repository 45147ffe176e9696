"""Background checkpoint saves (begin_checkpoint, CheckpointConfig.background).

- The checkpoint holds the state at the save, not what training changed while it was written.
- Until every rank's files are written, `latest` names the previous checkpoint; a failed
  background write raises at `wait()` on every rank and leaves `latest` where it was.
- Two gloo processes save in the background while they keep training with collectives of
  their own (the save's collectives run on a group of their own) and resume bitwise.
- `mosaic train` with background saves resumes the exact loss curve of a synchronous run.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter

import mosaic.engine.checkpoint as ck
from mosaic.engine.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    begin_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mosaic.engine.trainer import TrainConfig, train
from tests.helpers import start_workers
from tests.test_checkpoint import (
    REPLICATED,
    STEPS,
    _linear_job,
    _raise_oserror,
    _step,
    assert_bitwise,
    flat_state,
    make_job,
    train_steps,
)
from tests.test_engine import ToyModel
from tests.test_steps import _config as _steps_config


def test_the_checkpoint_holds_the_state_at_the_save_not_later_changes(tmp_path):
    modules, opt = _linear_job()
    _step(modules, opt)
    want = flat_state(modules, opt)
    pending = begin_checkpoint(tmp_path, 1, modules, opt)
    for _ in range(3):  # training goes on while the files are written
        _step(modules, opt)
    assert pending.wait() == tmp_path / "step-000001" == latest_checkpoint(tmp_path)
    fresh, fresh_opt = _linear_job(seed=5)
    _step(fresh, fresh_opt)  # the optimizer has state to be overwritten
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 1
    assert_bitwise(flat_state(fresh, fresh_opt), want)


def test_latest_moves_only_once_every_file_is_written(tmp_path, monkeypatch):
    modules, opt = _linear_job()
    save_checkpoint(tmp_path, 1, modules, opt)
    writing, release = threading.Event(), threading.Event()
    write = FileSystemWriter.write_data

    def slow_write(self, *args, **kwargs):
        writing.set()
        release.wait(timeout=30)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write)
    _step(modules, opt)
    pending = begin_checkpoint(tmp_path, 2, modules, opt)
    assert writing.wait(timeout=30)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"  # a crash now loses step 2
    release.set()
    assert pending.wait() == latest_checkpoint(tmp_path) == tmp_path / "step-000002"


def test_a_failed_background_write_raises_at_wait_and_keeps_latest(tmp_path, monkeypatch):
    modules, opt = _linear_job()
    save_checkpoint(tmp_path, 1, modules, opt)
    monkeypatch.setattr(FileSystemWriter, "finish", _raise_oserror)
    _step(modules, opt)
    pending = begin_checkpoint(tmp_path, 2, modules, opt)
    with pytest.raises(CheckpointError, match="No space left on device"):
        pending.wait()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"


def _worker(rank: int, world: int, out: str) -> None:
    """Train REPLICATED, save in the background at step 3 and keep training (gradient
    all-reduces on the default group while the save's collectives run), wait at the end;
    then resume from it into fresh modules and train the same steps again."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), world),
                            rank=rank, world_size=world)
    model, out_dir = ToyModel("toyclip"), Path(out)
    runner, opt = make_job(model, REPLICATED)
    pending = []

    def checkpoint(done: int) -> None:
        if done == 3:
            pending.append(begin_checkpoint(out_dir / "ck", done, runner.modules, opt))
            save_file(flat_state(runner.modules, opt), str(out_dir / f"saved-{rank}.safetensors"))

    losses = train_steps(model, runner, opt, range(STEPS), checkpoint)
    pending[0].wait()
    runner, opt = make_job(model, REPLICATED, seed=1)
    assert load_checkpoint(out_dir / "ck", runner.modules, opt).step == 3
    save_file(flat_state(runner.modules, opt), str(out_dir / f"loaded-{rank}.safetensors"))
    resumed = train_steps(model, runner, opt, range(3, STEPS))
    if rank == 0:
        (out_dir / "losses.json").write_text(json.dumps({"run": losses, "resumed": resumed}))
    dist.destroy_process_group()


@pytest.mark.xdist_group("start_workers")  # see tests/test_engine_dist.py
def test_two_processes_save_in_the_background_while_training(tmp_path):
    start_workers(_worker, (2, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        saved = load_file(str(tmp_path / f"saved-{rank}.safetensors"))
        assert_bitwise(load_file(str(tmp_path / f"loaded-{rank}.safetensors")), saved)
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses["resumed"] == losses["run"][3:]


def _config(directory: Path, background: bool) -> TrainConfig:
    return _steps_config(steps=6, checkpoint=CheckpointConfig(
        directory=str(directory), every_steps=2, background=background))


def test_training_with_background_saves_resumes_like_synchronous_ones(tmp_path):
    whole = train(_config(tmp_path / "sync", False), model=ToyModel("toyclip"))
    background = train(_config(tmp_path / "bg", True), model=ToyModel("toyclip"))
    assert [r["loss"] for r in background.steps] == [r["loss"] for r in whole.steps]
    assert latest_checkpoint(tmp_path / "bg") == tmp_path / "bg" / "step-000006"
    for step in (2, 4, 6):  # every scheduled save was published
        assert (tmp_path / "bg" / f"step-{step:06d}" / ck.MARKER).is_file()


def test_the_cli_trains_with_background_checkpoints(tmp_path):
    from tests.test_cli import mosaic

    run = mosaic("train", "clip", "--preset", "tiny", "--steps", "4", "--checkpoint-dir",
                 str(tmp_path), "--checkpoint-every", "2", "--checkpoint-background")
    assert run.returncode == 0, run.stderr[-2000:]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000004"
    assert (tmp_path / "step-000002" / ck.MARKER).is_file()
