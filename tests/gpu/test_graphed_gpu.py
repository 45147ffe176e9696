"""Backward graphs that accumulate their module's gradients (engine/graphed.py), against eager
autograd (skipped without CUDA).

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_graphed_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaic.engine.comm import FlatGrads
from mosaic.engine.graphed import InGraphGradModule

pytestmark = pytest.mark.gpu


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))) * y


def _eager_grads(module, x, y, grad):
    for p in module.parameters():
        p.grad = None
    xs, ys = x.clone().requires_grad_(), y.clone()
    module(xs, ys).backward(grad)
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()], xs.grad


def test_the_backward_graph_accumulates_what_eager_autograd_does():
    torch.manual_seed(0)
    module = _WithUnused().cuda()
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 8, device="cuda")
    grad = torch.randn(64, 8, device="cuda")
    want_params, want_input = _eager_grads(module, x, y, grad)

    flat = FlatGrads(list(module.parameters()))

    def attach(unused):
        flat.leave_unattached(unused)
        flat.attach()

    samples = (x.clone().requires_grad_(), y.clone())
    graphed = InGraphGradModule(module, list(module.parameters()), samples, torch.cuda.Stream(),
                                attach)
    assert [id(p) for p in graphed.unused] == [id(p) for p in module.unused.parameters()]
    attach(graphed.unused)
    for _ in range(2):  # two micro-steps: the second adds to the first
        xs = x.clone().requires_grad_()
        graphed(xs, y.clone()).backward(grad)
    torch.cuda.synchronize()
    for p, want in zip(module.parameters(), want_params, strict=True):
        if want is None:
            assert p.grad is None  # unused: left for the optimizer to skip
        else:
            torch.testing.assert_close(p.grad, 2 * want)
    torch.testing.assert_close(xs.grad, want_input)

    attach(graphed.unused)  # the next optimizer step starts from zero
    graphed(x.clone().requires_grad_(), y.clone()).backward(grad)
    torch.cuda.synchronize()
    torch.testing.assert_close(module.first.weight.grad, want_params[0])


def test_an_encoder_fed_raw_data_still_gets_its_gradients():
    """No input requires grad: the replay node must still run its backward (the anchor)."""
    module = nn.Linear(8, 8).cuda()
    x = torch.randn(4, 8, device="cuda")
    flat = FlatGrads(list(module.parameters()))
    graphed = InGraphGradModule(module, list(module.parameters()), (x.clone(),),
                                torch.cuda.Stream(), lambda unused: flat.attach())
    flat.attach()
    graphed(x).sum().backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(module.bias.grad, torch.full((8,), 4.0, device="cuda"))
