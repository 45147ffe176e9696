"""Background checkpoint saves of CUDA state (run on the lent H200): the state is copied to
host memory before training goes on, and what loads is the state at the save."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaic.engine.checkpoint import begin_checkpoint, latest_checkpoint, load_checkpoint
from mosaic.engine.session import make_optimizer
from tests.test_checkpoint import assert_bitwise, flat_state

pytestmark = pytest.mark.gpu


def _job(seed: int):
    torch.manual_seed(seed)
    modules = {"enc": nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 64)).cuda()}
    return modules, make_optimizer("adamw", list(modules["enc"].parameters()), 1e-2)


def _step(modules, opt) -> None:
    opt.zero_grad(set_to_none=True)
    modules["enc"](torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
    opt.step()


def test_a_background_save_of_cuda_state_holds_the_state_at_the_save(tmp_path):
    modules, opt = _job(0)
    _step(modules, opt)
    want = {k: v.cpu() for k, v in flat_state(modules, opt).items()}
    pending = begin_checkpoint(tmp_path, 1, modules, opt)
    for _ in range(5):  # the GPU changes the weights while the files are written
        _step(modules, opt)
    assert pending.wait() == latest_checkpoint(tmp_path)
    fresh, fresh_opt = _job(1)
    _step(fresh, fresh_opt)
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 1
    assert_bitwise({k: v.cpu() for k, v in flat_state(fresh, fresh_opt).items()}, want)
