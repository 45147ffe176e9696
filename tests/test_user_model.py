"""A user's own modules: graph_from_modules counts them as the zoo counts its own, and
mosaic.api.train trains them (in place) under a plan, from a data function or an iterable."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mosaic.api as api
from mosaic.graph import GraphError
from mosaic.plan import Placement, Plan, Stage
from mosaic.user_model import UserModel, UserModelError
from mosaic.zoo.cost import count_module


class Encoder(nn.Module):
    def __init__(self, d_in: int, d: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, x):
        return self.net(x)


class Head(nn.Module):
    needs_global_batch = True

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, a, b):
        za, zb = F.normalize(self.proj(a), dim=-1), F.normalize(b, dim=-1)
        logits = 10 * za @ zb.t()
        return F.cross_entropy(logits, torch.arange(len(a)))


EDGES = [("a", "head"), ("b", "head")]


def modules():
    torch.manual_seed(0)
    return {"a": Encoder(4), "b": Encoder(6), "head": Head()}


def data(step: int, batch: int):
    g = torch.Generator().manual_seed(step)
    z = torch.randn(batch, 4, generator=g)
    return {"a": z, "b": torch.cat([z, z[:, :2]], dim=1)}


def one_gpu_plan(names=("a", "b", "head")) -> Plan:
    return Plan(model="mine", planner="manual", num_gpus=1, stages=tuple(
        Stage(placements=(Placement(module=n, gpus=(0,), sm_share=1.0),), sharing="temporal")
        for n in names))


def test_costs_are_counted_as_the_zoo_counts():
    mods = modules()
    graph = api.graph_from_modules("mine", mods, EDGES, {"a": torch.randn(1, 4),
                                                         "b": torch.randn(3, 6)}, global_batch=16)
    assert graph.names == ["a", "b", "head"] and graph.global_batch == 16
    assert [m.kind for m in graph.modules] == ["encoder", "encoder", "head"]
    a = graph.module("a")
    assert a.num_params == sum(p.numel() for p in mods["a"].parameters())
    assert a.input_shape == (4,)
    expected, _ = count_module(Encoder(4), (torch.randn(2, 4),))
    assert a.flops_per_sample == expected.flops_per_sample > 0
    assert a.num_kernels == expected.num_kernels > 0
    assert a.activation_bytes_per_sample == expected.activation_bytes_per_sample
    assert graph.module("head").flops_per_sample > 0
    # the user's weights are untouched (counting ran on a meta copy)
    assert all(not p.is_meta for m in mods.values() for p in m.parameters())


def test_the_weights_bf16_weights_would_cast_are_counted_on_a_copy():
    """A Linear weight of 65,536 elements or more is one `--bf16-weights` keeps in bf16; the
    count leaves the user's module as it was."""
    mods = {"a": Encoder(4, d=256), "b": Encoder(6, d=256), "head": Head(d=256)}
    graph = api.graph_from_modules("mine", mods, EDGES, {"a": torch.randn(1, 4),
                                                         "b": torch.randn(1, 6)}, global_batch=4)
    assert graph.module("a").bf16_weight_params == 256 * 256  # the 4 x 256 one is too small
    assert graph.module("head").bf16_weight_params == 256 * 256
    assert all(p.dtype == torch.float32 for m in mods.values() for p in m.parameters())


def test_bad_modules_and_edges_are_named():
    mods = modules()
    with pytest.raises(GraphError, match="cycle"):
        api.graph_from_modules("x", mods, [*EDGES, ("head", "a")], {}, 4)
    with pytest.raises(GraphError, match="edge"):
        api.graph_from_modules("x", mods, [("a", "nope")], {}, 4)

    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(UserModelError, match="ONE"):
        api.graph_from_modules("x", {"p": Pair(), "head": Head()}, [("p", "head")],
                               {"p": torch.randn(1, 8)}, 4)
    with pytest.raises(UserModelError, match="scalar"):
        api.graph_from_modules("x", {"a": Encoder(4)}, [], {"a": torch.randn(1, 4)}, 4)


def test_train_a_user_model_on_one_process():
    mods = modules()
    graph = api.graph_from_modules("mine", mods, EDGES, {n: t[:1] for n, t in data(0, 1).items()},
                                   global_batch=16)
    before = mods["a"].net[0].weight.detach().clone()
    result = api.train(graph, mods, one_gpu_plan(), data, lr=1e-2, steps=12, device="cpu",
                       progress=False)
    losses = [s["loss"] for s in result.steps]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert not torch.equal(before, mods["a"].net[0].weight)  # trained in place
    # the same run from an iterable of dicts
    mods2 = modules()
    result2 = api.train(graph, mods2, one_gpu_plan(), (data(s, 16) for s in range(12)), lr=1e-2,
                        steps=12, device="cpu", progress=False)
    assert [s["loss"] for s in result2.steps] == pytest.approx(losses, rel=1e-5)


def test_a_user_model_trains_clipped_on_a_schedule():
    """The API passes clipping and the learning-rate schedule to the trainer: each step's
    metrics hold its rate and its norm before clipping (the bound is below it)."""
    mods = modules()
    graph = api.graph_from_modules("mine", mods, EDGES, {n: t[:1] for n, t in data(0, 1).items()},
                                   global_batch=16)
    result = api.train(graph, mods, one_gpu_plan(), data, lr=1e-2, steps=4, device="cpu",
                       progress=False, clip_grad_norm=1e-3, lr_warmup_steps=2,
                       lr_decay="linear", min_lr=1e-3)
    assert [s["lr"] for s in result.steps] == pytest.approx([5e-3, 1e-2, 1e-2, 1e-3])
    assert all(s["grad_norm"] > 1e-3 for s in result.steps)


def test_planned_by_the_api():
    mods = modules()
    graph = api.graph_from_modules("mine", mods, EDGES, {n: t[:1] for n, t in data(0, 1).items()},
                                   global_batch=16)
    for gpus in (1, 2):
        plan = api.plan(graph, gpus=gpus, planner="megatron")
        assert plan.num_gpus == gpus
    result = api.train(graph, mods, api.plan(graph, gpus=1), data, lr=1e-2, steps=3,
                       device="cpu", progress=False)
    assert len(result.steps) == 3


def test_data_errors_name_the_module():
    mods = modules()
    graph = api.graph_from_modules("mine", mods, EDGES, {n: t[:1] for n, t in data(0, 1).items()},
                                   global_batch=8)
    model = UserModel(graph, mods, lambda step, b: {"a": torch.randn(b, 4), "b": torch.randn(3, 6)})
    with pytest.raises(UserModelError, match=r"\['b'\]\[0\].*global batch \(8\)"):
        model.make_inputs("custom", 8, torch.Generator().manual_seed(0))
    model = UserModel(graph, mods, lambda step, b: {"c": torch.randn(b, 4)})
    with pytest.raises(UserModelError, match="unknown module"):
        model.make_inputs("custom", 8, torch.Generator().manual_seed(0))
    model = UserModel(graph, mods, iter([]))
    with pytest.raises(UserModelError, match="ran out"):
        model.make_inputs("custom", 8, torch.Generator().manual_seed(0))
    with pytest.raises(UserModelError, match="do not match"):
        UserModel(graph, {"a": mods["a"]}, data)


def test_data_function_gets_the_step():
    mods = modules()
    graph = api.graph_from_modules("mine", mods, EDGES, {n: t[:1] for n, t in data(0, 1).items()},
                                   global_batch=4)
    seen = []

    def record(step, batch):
        seen.append((step, batch))
        return data(step, batch)

    api.train(graph, mods, one_gpu_plan(), record, lr=1e-3, steps=4, seed=3, device="cpu",
              progress=False)
    assert seen == [(s, 4) for s in range(4)]


def test_import_mosaic_imports_no_torch():
    code = ("import sys, mosaic; assert 'torch' not in sys.modules; "
            "f = mosaic.graph_from_modules; assert callable(mosaic.train); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_bench_measures_the_users_modules_against_their_own_program_and_leaves_them_untrained():
    """`mosaic.api.bench`: the planners' plans of the user's modules and the user's eager
    program, from copies of the same weights (groups too), gradients checked, timed."""
    from mosaic.engine.measure import BenchConfig

    mods = modules()
    before = {n: [p.detach().clone() for p in m.parameters()] for n, m in mods.items()}
    graph = api.graph_from_modules("mine", mods, EDGES, {"a": torch.randn(1, 4),
                                                         "b": torch.randn(1, 6)}, global_batch=16)
    config = BenchConfig(rounds=1, steps_per_round=2, warmup_steps=1, nvml_seconds=0,
                         user_programs=("torch-eager",), plans_at_once=1)
    run = api.bench(graph, mods, data, planners=("megatron", "mosaic"), config=config,
                    perf_model="analytic")
    rows = {r["planner"]: r for r in run.report["results"]}
    assert set(rows) == {"megatron", "mosaic", "torch-eager"}
    assert all(r["measured_iteration_s"] > 0 and r["max_grad_error"] < 1e-4 for r in rows.values())
    assert run.report["checks"]["gradients"]["reference"] == "torch-eager"
    assert run.report["model"] == "mine" and run.report["global_batch"] == 16
    for name, m in mods.items():  # the bench trained copies
        for p, q in zip(m.parameters(), before[name], strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
