"""Backward graphs that leave their module's gradients themselves (engine/graphed.py), against
eager autograd, in each of the three modes (skipped without CUDA).

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


def _data():
    torch.manual_seed(0)
    module = _WithUnused().cuda()
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 8, device="cuda")
    return module, x, y, torch.randn(64, 8, device="cuda")


def _eager_grads(module, x, y, grad):
    for p in module.parameters():
        p.grad = None
    xs = x.clone().requires_grad_()
    module(xs, y.clone()).backward(grad)
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()], xs.grad


def _graphed(module, x, y, mode):
    flat = FlatGrads(list(module.parameters())) if mode != "own" else None
    graphed = InGraphGradModule(module, flat.params if flat else list(module.parameters()),
                                (x.clone().requires_grad_(), y.clone()), torch.cuda.Stream(),
                                mode, flat.views if flat else None)
    if flat is not None:
        flat.leave_unattached(graphed.unused)
    return graphed, flat


def _start_step(graphed, flat):
    if flat is None:
        graphed.attach()
    else:
        flat.attach(zero=graphed.mode == "add")


@pytest.mark.parametrize("mode", ["own", "copy", "add"])
def test_the_backward_graph_leaves_the_gradients_eager_autograd_computes(mode):
    module, x, y, grad = _data()
    want_params, want_input = _eager_grads(module, x, y, grad)
    graphed, flat = _graphed(module, x, y, mode)
    assert [id(p) for p in graphed.unused] == [id(p) for p in module.unused.parameters()]
    for p in module.parameters():
        p.grad = None  # as the optimizer's zero_grad leaves them
    steps = 2 if mode == "add" else 1  # "add": two micro-steps, the second adds to the first
    _start_step(graphed, flat)
    for _ in range(steps):
        xs = x.clone().requires_grad_()
        graphed(xs, y.clone()).backward(grad)
    torch.cuda.synchronize()
    for p, want in zip(module.parameters(), want_params, strict=True):
        if want is None:
            assert p.grad is None  # unused: left for the optimizer to skip
        else:
            torch.testing.assert_close(p.grad, steps * want)
    torch.testing.assert_close(xs.grad, want_input)

    _start_step(graphed, flat)  # the next optimizer step starts afresh
    graphed(x.clone().requires_grad_(), y.clone()).backward(grad)
    torch.cuda.synchronize()
    torch.testing.assert_close(module.first.weight.grad, want_params[0])


def test_an_encoder_fed_raw_data_still_gets_its_gradients():
    """No input requires grad: the replay node must still run its backward (the anchor)."""
    module = nn.Linear(8, 8).cuda()
    x = torch.randn(4, 8, device="cuda")
    graphed = InGraphGradModule(module, list(module.parameters()), (x.clone(),),
                                torch.cuda.Stream())
    graphed.attach()
    graphed(x).sum().backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(module.bias.grad, torch.full((8,), 4.0, device="cuda"))


def test_capture_keeps_no_autograd_graph_over_the_parameters():
    """The captured forward's autograd graph is dropped: it held each parameter's
    AccumulateGrad node, created on the capture stream, and eager autograd over the same
    parameters on the default stream (the bench's user programs) then warned that the streams
    differ and synchronised them."""
    import warnings

    module, x, y, grad = _data()
    graphed, _ = _graphed(module, x, y, "own")
    assert graphed.static_output.grad_fn is None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*AccumulateGrad node's stream")
        _eager_grads(module, x, y, grad)
    graphed.attach()
    graphed(x.clone().requires_grad_(), y.clone()).backward(grad)  # replay still works
    torch.cuda.synchronize()



def test_capture_holds_one_set_of_gradients_beside_the_graphs():
    """The warm-up drops each iteration's gradients before the next (it held two sets at once:
    with the eager step's and the graph's, Qwen3-VL `paper` peaked 31 GiB over its steady
    steps). Capturing a module of 256 MiB of weights holds one warm-up set of gradients, then
    the graph's own: never two sets at once, so the peak stays under base + 1.5 sets."""
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(4)]).cuda()
    x = torch.randn(8, 4096, device="cuda", requires_grad=True)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graphed = InGraphGradModule(module, list(module.parameters()), (x,), torch.cuda.Stream())
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 1.5 * grad_bytes
    graphed.attach()
    out = graphed(x.detach().clone().requires_grad_())
    out.sum().backward()
    assert all(p.grad is not None for p in module.parameters())


def test_own_gradients_outlive_the_next_forward_when_asked():
    """An update deferred under the next forward reads the gradients while that forward runs
    (update_gates.py). With `grads_outlive_forward` the backward graph keeps its own pool, so
    the forward's temporaries (which may otherwise reuse the memory of the gradients the
    backward left) leave them as they were."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    graphed = InGraphGradModule(module, list(module.parameters()), (x.clone(),),
                                torch.cuda.Stream(), grads_outlive_forward=True)
    graphed.attach()
    graphed(x).square().sum().backward()
    torch.cuda.synchronize()
    kept = [p.grad.clone() for p in module.parameters()]
    graphed(torch.randn_like(x) * 100)  # a forward alone, other values
    torch.cuda.synchronize()
    for p, want in zip(module.parameters(), kept, strict=True):
        assert torch.equal(p.grad, want)


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_the_backward_graph_sums_its_buckets_inside_the_capture(wire):
    """grad_sync='overlapped' (engine/bucket_reduce.py) on one GPU: a one-rank NCCL group, so
    the sum is the gradient itself and the division by 2 shows that each bucket was summed
    inside the replayed graph (two buckets here: a layer each), with the unused layer's gradients
    left None and two replays alike."""
    import torch.distributed as dist

    from mosaic.engine.bucket_reduce import InBackwardReduce

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))  # the communicator, before the capture
        module, x, y, grad = _data()
        want_params, want_input = _eager_grads(module, x, y, grad)
        flat = FlatGrads(list(module.parameters()))
        reducer = InBackwardReduce(flat, dist.group.WORLD, divide_by=2, wire_dtype=wire,
                                   bucket_bytes=32 * 8 * 4)
        graphed = InGraphGradModule(module, flat.params, (x.clone().requires_grad_(), y.clone()),
                                    torch.cuda.Stream(), "copy", flat.views, reducer=reducer)
        flat.leave_unattached(graphed.unused)
        assert len(reducer.buckets) == 2 and sorted(reducer.order) == [0, 1]
        reducer.agree_on_order()
        for _ in range(2):
            flat.attach(zero=False)
            xs = x.clone().requires_grad_()
            graphed(xs, y.clone()).backward(grad)
            torch.cuda.synchronize()
            for p, want in zip(module.parameters(), want_params, strict=True):
                if want is None:
                    assert p.grad is None
                elif wire is None:
                    torch.testing.assert_close(p.grad, want / 2)
                else:
                    torch.testing.assert_close(p.grad, (want / 2).bfloat16().float())
            torch.testing.assert_close(xs.grad, want_input)
    finally:
        if started:
            dist.destroy_process_group()
