"""Where each module's gradients live under each engine setting (runner.gradient_home): the
decision the GPU paths (graphed.py, FlatGrads, DDP) follow."""

from __future__ import annotations

import pytest

from mosaic.engine.runner import GradientHome, RunnerConfig, gradient_home


def _home(plain=True, data_parallel=True, accumulating=False, bf16_weights=False,
          **config) -> GradientHome:
    return gradient_home(RunnerConfig(graphs=True, **config), plain=plain,
                         data_parallel=data_parallel, accumulating=accumulating,
                         bf16_weights=bf16_weights)


@pytest.mark.parametrize(("kwargs", "want"), [
    # one GPU: the backward graph's own outputs, nothing copied
    ({"data_parallel": False}, GradientHome(flat=False, flat_sync=False, graph_mode="own")),
    ({"data_parallel": False, "accumulating": True},
     GradientHome(flat=True, flat_sync=False, graph_mode="add")),
    # bf16 weights: copied end to end, so the optimizer updates the module in one launch
    ({"data_parallel": False, "bf16_weights": True},
     GradientHome(flat=True, flat_sync=False, graph_mode="copy")),
    ({"data_parallel": False, "bf16_weights": True, "grads_in_graph": False},
     GradientHome(flat=False, flat_sync=False, graph_mode=None)),
    # ... unless asked to leave them where the backward wrote them (a weight at a time)
    ({"data_parallel": False, "bf16_weights": True, "bf16_flat_grads": False},
     GradientHome(flat=False, flat_sync=False, graph_mode="own")),
    ({"data_parallel": False, "accumulating": True, "bf16_weights": True,
      "bf16_flat_grads": False}, GradientHome(flat=True, flat_sync=False, graph_mode="add")),
    # data-parallel under flat: the graph copies into the buffer one all-reduce sums
    ({"grad_sync": "flat"}, GradientHome(flat=True, flat_sync=True, graph_mode="copy")),
    ({"grad_sync": "flat", "accumulating": True},
     GradientHome(flat=True, flat_sync=True, graph_mode="add")),
    # DDP hooks autograd's AccumulateGrad: the graph must hand the gradients to autograd
    ({"grad_sync": "ddp"}, GradientHome(flat=False, flat_sync=False, graph_mode=None)),
    ({"grad_sync": "bucketed"}, GradientHome(flat=False, flat_sync=False, graph_mode="own")),
    # tensor-parallel or FSDP modules run eagerly and are summed by their own machinery
    ({"plain": False, "grad_sync": "flat"},
     GradientHome(flat=False, flat_sync=False, graph_mode=None)),
    ({"grad_sync": "flat", "grads_in_graph": False},
     GradientHome(flat=True, flat_sync=True, graph_mode=None)),
])
def test_gradient_home(kwargs, want):
    assert _home(**kwargs) == want


def test_without_graphs_autograd_accumulates_everywhere():
    for data_parallel in (False, True):
        home = gradient_home(RunnerConfig(graphs=False, grad_sync="flat"), plain=True,
                             data_parallel=data_parallel, accumulating=True)
        assert home.graph_mode is None and home.flat == data_parallel
