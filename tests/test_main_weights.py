"""bf16 weights with fp32 main weights (engine/main_weights.py) on CPU: which weights turn bf16,
and the optimizer's arithmetic against torch's AdamW."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from mosaic.engine import main_weights
from mosaic.engine.main_weights import MainWeightsAdamW, cast_weights_bf16

STEPS = 5
LR, WEIGHT_DECAY = 1e-2, 0.1


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.conv = nn.Conv2d(1, 2, 3)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: the embedding computes in fp32 with it


def test_only_the_large_weights_autocast_would_cast_turn_bf16():
    torch.manual_seed(0)
    module = _Tiny()
    fp32 = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert cast_weights_bf16([module]) == []  # every weight here is below MIN_ELEMENTS
    cast = cast_weights_bf16([module], min_elements=1)
    dtypes = {n: p.dtype for n, p in module.named_parameters()}
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == {"proj.weight", "conv.weight"}
    assert {id(p) for p in cast} == {id(module.proj.weight), id(module.conv.weight)}
    assert isinstance(module.proj.weight, nn.Parameter) and module.proj.weight.requires_grad
    for name, p in module.named_parameters():  # autocast's rounding, no other change
        torch.testing.assert_close(p.detach(), fp32[name].to(p.dtype), rtol=0, atol=0)
    assert cast_weights_bf16([module], min_elements=1) == []  # already bf16: nothing more


def test_one_modules_weights_gradients_and_states_are_updated_in_one_launch_as_one_by_one():
    """cast_weights_bf16 lays a module's bf16 weights end to end and the engine's flat
    gradient buffer their gradients, so the optimizer updates the module in one launch:
    bit for bit what it computes a weight at a time."""
    from mosaic.engine.comm import FlatGrads

    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)),
               nn.Sequential(nn.Linear(4, 6))]
    loose = [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)),
             nn.Sequential(nn.Linear(4, 6))]
    for m, twin in zip(modules, loose, strict=True):
        twin.load_state_dict(m.state_dict())
    cast_weights_bf16(modules, min_elements=1)
    for twin in loose:  # the same bf16 weights, each in its own tensor
        for sub in twin.modules():
            if isinstance(sub, nn.Linear):
                sub.weight.data = sub.weight.data.to(torch.bfloat16)
    flat = [FlatGrads(list(m.parameters())) for m in modules]
    together = MainWeightsAdamW([q for m in modules for q in m.parameters()], LR,
                                weight_decay=WEIGHT_DECAY)
    apart = MainWeightsAdamW([q for m in loose for q in m.parameters()], LR,
                             weight_decay=WEIGHT_DECAY)
    assert [len(run) for run in apart.launch_runs()] == []  # no gradients yet
    for step in range(3):
        for grads in flat:
            grads.attach()
        for params in ([q for m in modules for q in m.parameters()],
                       [q for m in loose for q in m.parameters()]):
            for q, g in zip(params, _grads(params, step), strict=True):
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                q.grad.copy_(g)
        assert [len(run) for run in together.launch_runs()] == [2, 1]  # a launch a module
        assert [len(run) for run in apart.launch_runs()] == [1, 1, 1]
        together.step()
        apart.step()
    for a, b in zip([q for m in modules for q in m.parameters()],
                    [q for m in loose for q in m.parameters()], strict=True):
        assert a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
    assert all(torch.equal(a, b) for a, b in zip(together.mains, apart.mains, strict=True))


def _grads(params, step):
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator) for p in params]


def test_each_weight_length_gets_a_kernel_of_its_own_until_the_process_budget(monkeypatch):
    """A kernel compiled for one length is autotuned on that length, whatever ran first; past
    MAX_STATIC_KERNELS lengths in the process (Dynamo's recompile limit counts them all), new
    lengths share the kernel for every length, and lengths seen before keep theirs."""
    monkeypatch.setattr(main_weights, "_STATIC_LENGTHS", set())
    monkeypatch.setattr(main_weights, "MAX_STATIC_KERNELS", 3)
    weights = [nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (4, 5, 6, 7, 4)]
    optimizer = MainWeightsAdamW(weights, lr=1e-3)
    one, any_length = optimizer._update_one_length, optimizer._update_any_length
    assert one is not any_length
    assert [optimizer._kernel(w.numel()) for w in weights] == [one, one, one, any_length, one]
    assert optimizer._kernel(5) is one and optimizer._kernel(8) is any_length
    other = MainWeightsAdamW([nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], lr=1e-3,
                             weight_decay=0.1)  # other constants: a kernel of its own, if room
    assert other._kernel(4) is other._update_any_length  # the budget is the process's
    fixed = MainWeightsAdamW([nn.Parameter(torch.zeros(9, dtype=torch.bfloat16))], lr=1e-3,
                             dynamic=False)
    assert fixed._kernel(9) is fixed._update_one_length


def test_the_per_weight_kernel_is_tuned_on_a_large_update_of_zeros_before_its_first_weight():
    """Inductor sizes and autotunes a kernel's blocks on its first call, so the one kernel for
    every weight's length is first called on TUNING_LENGTH zeros, once, marked with their
    length as the size hint (Inductor's cache keys on it), leaving the real call's result as
    the plain update's."""
    calls, hints = [], []

    def update(*args):
        calls.append((args[0].numel(), [t.dtype for t in args[:5]], args[0].abs().sum().item()))
        hints.append([getattr(t, "_dynamo_hint_overrides", {}).get(0) for t in args[:5]])
        main_weights._adamw_update(*args, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)

    tuned = main_weights._tuned_on_large_weight(update, 64)
    scalars = [torch.tensor(v) for v in (1e-3, 1e-3, 0.5, 0.0, 1.0, 1.0)]

    def tensors():
        torch.manual_seed(0)
        return [torch.rand(8), torch.randn(8).bfloat16(), torch.rand(8), torch.rand(8),
                torch.empty(8, dtype=torch.bfloat16)]

    expected = tensors()
    update(*expected, *scalars)
    calls.clear()
    hints.clear()
    got = tensors()
    tuned(*got, *scalars)
    tuned(*tensors(), *scalars)
    layout = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16]
    assert [(n, dtypes) for n, dtypes, _ in calls] == [(64, layout), (8, layout), (8, layout)]
    assert calls[0][2] == 0.0  # zeros: no NaN, nothing of the caller's touched
    if main_weights.marks_size_hints():  # the length keys Inductor's cache; the weights untouched
        assert hints == [[64] * 5, [None] * 5, [None] * 5]
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("weight_decay", [0.0, WEIGHT_DECAY])
def test_main_weights_step_as_fp32_adamw_fed_the_same_gradients(weight_decay):
    """Fed the bf16 gradients that the backward leaves, the main weights move as fp32 AdamW
    fed the same gradients in fp32 (autocast's cast), and each step writes the bf16 weight
    as the main weight rounded; fp32 parameters beside them (a bias, a norm) step as AdamW
    too, and a learning rate set between steps reaches both."""
    torch.manual_seed(0)
    starts = [torch.randn(6, 4), torch.randn(5)]
    weight = nn.Parameter(starts[0].to(torch.bfloat16))
    bias = nn.Parameter(starts[1].clone())
    unused = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))  # no gradient: not stepped
    reference = [nn.Parameter(starts[0].to(torch.bfloat16).float()),  # the main starts rounded
                 nn.Parameter(starts[1].clone())]
    optimizer = MainWeightsAdamW([weight, bias, unused], LR, weight_decay=weight_decay)
    adamw = torch.optim.AdamW(reference, lr=LR, weight_decay=weight_decay, foreach=False)
    for step in range(STEPS):
        if step == 2:
            optimizer.param_groups[0]["lr"] = adamw.param_groups[0]["lr"] = LR / 2
        g_weight, g_bias = _grads([weight, bias], step)
        weight.grad, bias.grad = g_weight.to(torch.bfloat16), g_bias
        reference[0].grad, reference[1].grad = weight.grad.float(), g_bias.clone()
        optimizer.step()
        adamw.step()
    (main,) = [m for m in optimizer.mains if m.shape == weight.shape]
    torch.testing.assert_close(main, reference[0].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.detach(), reference[1].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.detach(), main.to(torch.bfloat16), rtol=0, atol=0)
    assert torch.count_nonzero(unused) == 0


def test_fp32_parameters_alone_step_as_adamw_and_a_failed_capture_leaves_the_step_eager(
        monkeypatch):
    """Without bf16 weights the optimizer is torch's fused AdamW (what make_optimizer gives
    every plain fp32 run). Where its capture fails (faked here: a CPU captures nothing), it
    warns once, never tries again, and every step is still applied."""
    from mosaic.engine.session import make_optimizer

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5))]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = make_optimizer("adamw", params, LR, WEIGHT_DECAY)
    assert isinstance(optimizer, MainWeightsAdamW) and not optimizer.bf16
    adamw = torch.optim.AdamW(reference, lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    captures = []

    class FailingCapture:
        def __init__(self, graph, stream=None):
            captures.append(stream)

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", FailingCapture)
    module_stream = object()  # an overlapped optimizer's: captured on it, not aside
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: module_stream)
    monkeypatch.setattr(torch.cuda, "default_stream", object)
    optimizer._captures = True
    for p in params:  # the same addresses every step, as the backward graphs leave them
        p.grad = torch.empty_like(p)
    with pytest.warns(UserWarning, match="runs eagerly"):
        for step in range(STEPS):
            for p, r, g in zip(params, reference, _grads(params, step), strict=True):
                p.grad.copy_(g)
                r.grad = g.clone()
            optimizer.step()
            adamw.step()
    assert captures == [module_stream] and "not permitted" in optimizer.capture_failed
    for got, want in zip(params, reference, strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)


def test_a_parameter_that_is_not_one_flat_view_is_refused():
    weight = nn.Parameter(torch.randn(2, 3, 4, 4).to(torch.bfloat16)
                          .to(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="contiguous"):
        MainWeightsAdamW([weight], LR)


def test_bf16_weights_is_a_variant_of_every_plan_refused_without_autocast_or_adamw():
    from mosaic.engine.measure import (
        BenchConfig,
        BenchError,
        engine_variant,
        measure_plans,
        parse_variant,
        variant_applies,
    )
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, TrainError, train
    from mosaic.hardware import H200
    from mosaic.zoo import get_model
    from tests.helpers import bench_plans

    model = get_model("clip")
    graph = model.graph("tiny")
    plans = bench_plans(graph)
    with pytest.raises(BenchError, match="set bf16_weights=True too"):
        engine_variant(EngineConfig(amp=True), parse_variant("bf16_flat_grads=false"))
    per_weight = parse_variant("bf16_weights=true,bf16_flat_grads=false")
    assert not engine_variant(EngineConfig(amp=True), per_weight).runner_config().bf16_flat_grads
    settings = parse_variant("bf16_weights=true")
    assert settings == {"bf16_weights": True} and variant_applies(plans["megatron"], settings)
    with pytest.raises(BenchError, match="autocast"):
        engine_variant(EngineConfig(amp=False), settings)
    plans["mosaic@bf16_weights=true"] = plans["mosaic"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=(), engine=EngineConfig(amp=True))  # as on a GPU
    engines = {"mosaic@bf16_weights=true": replace(config.engine, bf16_weights=True)}
    measurements, checks = measure_plans(model, "tiny", graph, plans, H200, config, engines)
    row = {m.label: m for m in measurements}["mosaic@bf16_weights=true"]  # autocast on: CPU too
    assert row.engine_variant == {"bf16_weights": True} and row.median_s > 0
    assert checks["gradients"]["other_kernels"] == ["mosaic@bf16_weights=true"]
    assert checks["gradients"]["reference_kernels"] == "fp32 weights"
    with pytest.raises(TrainError, match="use adamw"):
        TrainConfig(model="clip", preset="tiny", plan=plans["mosaic"], optimizer="sgd",
                    engine=EngineConfig(bf16_weights=True))
    with pytest.raises(TrainError, match="leave amp unset"):
        train(TrainConfig(model="clip", preset="tiny", plan=plans["mosaic"], progress=False,
                          engine=EngineConfig(amp=False, bf16_weights=True)))


def test_a_group_of_bf16_copies_alone_builds_no_shared_fp32_modules(monkeypatch):
    """`--plans-at-once 1` with a bf16 variant: its group trains its own bf16 copy, so the
    fp32 modules the other plans share are not built beside it (at Unified-IO 2 `paper` b4
    the two did not fit on an H200 together, 2026-12-03)."""
    from mosaic.engine import measure
    from mosaic.engine.measure import BenchConfig, measure_plans
    from mosaic.engine.session import EngineConfig
    from mosaic.hardware import H200
    from mosaic.zoo import get_model
    from tests.helpers import bench_plans

    built = []
    real_build = measure.build_modules

    def build_modules(model, preset, names, seed, device):
        built.append(list(names))
        return real_build(model, preset, names, seed, device)

    monkeypatch.setattr(measure, "build_modules", build_modules)
    model = get_model("clip")
    graph = model.graph("tiny")
    plan = bench_plans(graph)["megatron"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=(), engine=EngineConfig(amp=True), plans_at_once=1)
    engines = {"megatron@bf16_weights=true": replace(config.engine, bf16_weights=True)}
    measurements, _ = measure_plans(model, "tiny", graph,
                                    {"megatron": plan, "megatron@bf16_weights=true": plan},
                                    H200, config, engines)
    assert built == [sorted(graph.names), [], sorted(graph.names)]  # shared, none, the copy
    assert all(m.median_s > 0 for m in measurements) and len(measurements) == 2


def test_a_step_told_found_inf_changes_nothing_and_the_next_one_steps():
    """The trainer's guard sets `found_inf` on the device: bf16 weights, main weights, moments
    and the step count stay as they were, and fp32 parameters too (torch's fused AdamW)."""
    weight = nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
    bias = nn.Parameter(torch.randn(3))
    optimizer = MainWeightsAdamW([weight, bias], LR)
    before = {k: v.clone() for k, v in optimizer.state[weight].items()}
    weight.grad, bias.grad = torch.full((4, 3), float("inf")).to(torch.bfloat16), torch.ones(3)
    start_weight, start_bias = weight.detach().clone(), bias.detach().clone()
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert torch.equal(weight, start_weight) and torch.equal(bias, start_bias)
    for key, value in optimizer.state[weight].items():
        assert torch.equal(value, before[key]), key
    del optimizer.found_inf  # told once, not any more: the next step updates
    weight.grad = torch.ones(4, 3, dtype=torch.bfloat16)
    optimizer.step()
    assert not torch.equal(weight, start_weight) and not torch.equal(bias, start_bias)
    assert float(optimizer.state[weight]["step"]) == 1


def test_a_saved_state_loads_into_the_live_tensors_and_an_fp32_runs_state_is_refused():
    torch.manual_seed(0)
    start = torch.randn(6, 4).to(torch.bfloat16)
    runs = []
    for _ in range(2):
        weight, bias = nn.Parameter(start.clone()), nn.Parameter(torch.zeros(4))
        runs.append((weight, bias, MainWeightsAdamW([weight, bias], LR)))
    (w0, b0, first), (w1, b1, second) = runs
    for step in range(3):
        g_weight, g_bias = _grads([w0, b0], step)
        w0.grad, b0.grad = g_weight.to(torch.bfloat16), g_bias
        first.step()
    live = second.state[w1]["main"]
    second.load_state_dict(first.state_dict())
    assert second.state[w1]["main"] is live  # copied into, not replaced
    w1.data.copy_(w0.detach())
    b1.data.copy_(b0.detach())
    for step in range(3, 5):
        for w, b, optimizer in runs:
            g_weight, g_bias = _grads([w, b], step)
            w.grad, b.grad = g_weight.to(torch.bfloat16), g_bias
            optimizer.step()
    assert torch.equal(w0, w1) and torch.equal(b0, b1)
    fp32_state = torch.optim.AdamW([nn.Parameter(torch.zeros(6, 4)), nn.Parameter(torch.zeros(4))])
    for p in fp32_state.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    fp32_state.step()
    with pytest.raises(ValueError, match="bf16_weights"):
        second.load_state_dict(fp32_state.state_dict())


@pytest.mark.parametrize(("accumulation", "background", "bf16_moments", "main"),
                         [(1, False, False, True), (2, False, False, True),
                          (1, True, False, True), (1, False, True, True),
                          (1, False, True, False), (2, False, True, False)])
def test_training_with_bf16_weights_resumes_exactly_and_an_fp32_run_refuses_its_checkpoint(
        tmp_path, monkeypatch, accumulation, background, bf16_moments, main):
    """On the CPU under bf16 autocast (amp=True): the first loss is the fp32-weight run's
    (autocast computed with the same bf16 values); stopped after a checkpoint and resumed,
    the run continues the exact loss curve and weights (the checkpoint holds the fp32 main
    weights, or without them (`main` False) the bf16 weights are all there is, and with bf16
    moments or rounded weights the step count their rounding is seeded by); a run with fp32
    weights refuses that checkpoint."""
    from mosaic.engine import main_weights
    from mosaic.engine.checkpoint import CheckpointConfig, CheckpointError
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, TrainError, train
    from tests.test_engine import ToyModel, one_gpu_plans, state_of

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the toy's weights are small
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    common = dict(device="cpu", model="toyvlm", plan=plan, warmup_steps=0, lr=1e-2,
                  progress=False)
    bf16 = EngineConfig(amp=True, bf16_weights=True, accumulation=accumulation,
                        bf16_moments=bf16_moments, fp32_main_weights=main)
    fp32 = EngineConfig(amp=True, accumulation=accumulation)
    whole = train(TrainConfig(steps=6, engine=bf16, **common), model=model)
    assert whole.steps[0]["loss"] == train(TrainConfig(steps=1, engine=fp32, **common),
                                           model=model).steps[0]["loss"]
    assert any(p.dtype == torch.bfloat16 for m in whole.modules.values() for p in m.parameters())
    assert whole.summary["bf16_moments"] is bf16_moments
    assert whole.summary["fp32_main_weights"] is main
    # The states are views into flat buffers: saved (in the background too) as themselves.
    ckpt = CheckpointConfig(directory=str(tmp_path / "ckpt"), every_steps=3, background=background)
    train(TrainConfig(steps=3, checkpoint=ckpt, engine=bf16, **common), model=model)
    resumed = train(TrainConfig(steps=6, checkpoint=ckpt, resume=True, engine=bf16, **common),
                    model=model)
    assert [s["loss"] for s in resumed.steps] == [s["loss"] for s in whole.steps[3:]]
    want, got = state_of(whole.modules), state_of(resumed.modules)
    assert all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises((TrainError, CheckpointError), match="bf16_weights"):
        train(TrainConfig(steps=6, checkpoint=ckpt, resume=True, engine=fp32, **common),
              model=model)
    other_moments = replace(bf16, bf16_moments=not bf16_moments)
    with pytest.raises(CheckpointError, match="bf16_moments"):  # not cast silently
        train(TrainConfig(steps=6, checkpoint=ckpt, resume=True, engine=other_moments, **common),
              model=model)
    other_main = replace(bf16, fp32_main_weights=not main)
    if main:  # resumed without main weights: the copies are dropped, as asked
        dropped = train(TrainConfig(steps=8, checkpoint=ckpt, resume=True, engine=other_main,
                                    **common), model=model)  # from the resumed run's step 6
        assert len(dropped.steps) == 2
    else:
        with pytest.raises(CheckpointError, match="--no-fp32-main-weights"):
            train(TrainConfig(steps=6, checkpoint=ckpt, resume=True, engine=other_main,
                              **common), model=model)


def test_a_bf16_run_refuses_an_fp32_runs_checkpoint(tmp_path, monkeypatch):
    from mosaic.engine import main_weights
    from mosaic.engine.checkpoint import CheckpointConfig, CheckpointError
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, TrainError, train
    from tests.test_engine import ToyModel, one_gpu_plans

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)
    model = ToyModel("toyvlm")
    common = dict(device="cpu", model="toyvlm", plan=one_gpu_plans(model.graph("tiny"))["free"],
                  warmup_steps=0, progress=False,
                  checkpoint=CheckpointConfig(directory=str(tmp_path / "ckpt"), every_steps=2))
    train(TrainConfig(steps=2, engine=EngineConfig(amp=True), **common), model=model)
    with pytest.raises((TrainError, CheckpointError), match="saved with fp32 weights"):
        train(TrainConfig(steps=4, resume=True, engine=EngineConfig(amp=True, bf16_weights=True),
                          **common), model=model)


def _replicated_plan(model: str, modules: list[str]):
    from mosaic.plan import Placement, Plan, Stage

    return Plan(model=model, planner="manual", num_gpus=2, stages=tuple(
        Stage(sharing="temporal", placements=(Placement(module=m, gpus=(0, 1)),))
        for m in modules))


def test_data_parallel_bf16_weights_are_refused_unless_reduced_in_bf16_by_name():
    from mosaic.engine.main_weights import bf16_weights_refusal

    plan = _replicated_plan("toyclip", ["vision", "text", "head"])
    sharded = replace(plan, stages=tuple(
        replace(s, placements=tuple(replace(p, shard=True) for p in s.placements))
        for s in plan.stages))
    common = dict(amp=None)
    assert "reduce_dtype='bf16'" in bf16_weights_refusal(plan, **common)
    assert "grad_sync 'flat' or 'ddp'" in bf16_weights_refusal(
        plan, reduce_dtype="bf16", grad_sync="bucketed", **common)
    assert "sharded" in bf16_weights_refusal(sharded, reduce_dtype="bf16", **common)
    for grad_sync in ("flat", "ddp"):
        assert bf16_weights_refusal(plan, reduce_dtype="bf16", grad_sync=grad_sync,
                                    **common) is None


DP_STEPS, DP_SAVE_AT = 4, 2


def _data_parallel_worker(rank: int, world: int, out: str, grad_sync: str,
                          device: str = "cpu", toy: str = "toyclip", accumulation: int = 1,
                          bf16_moments: bool = False, main: bool = True) -> None:
    """Trains `toy` replicated on both ranks with bf16 weights (4 steps), then 2 steps with a
    checkpoint and a resume to 4; writes this rank's weights and losses. On CUDA over NCCL,
    graphed and compiled."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import save_file

    from mosaic.engine import main_weights
    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import ToyModel, state_of

    main_weights.MIN_ELEMENTS = 1  # the toy's weights are small
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(out, "store"), world)
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = ToyModel(toy)
    cuda = device == "cuda"
    engine = EngineConfig(amp=True, bf16_weights=True, reduce_dtype="bf16", grad_sync=grad_sync,
                          graphs=cuda, compile="default" if cuda else None,
                          accumulation=accumulation, bf16_moments=bf16_moments,
                          fp32_main_weights=main)
    common = dict(device=device, model=toy, engine=engine, warmup_steps=int(cuda), lr=1e-2,
                  progress=False, plan=_replicated_plan(toy, model.graph("tiny").names))
    whole = train(TrainConfig(steps=DP_STEPS, **common), model=model)
    ckpt = CheckpointConfig(directory=os.path.join(out, "ckpt"), every_steps=DP_SAVE_AT)
    train(TrainConfig(steps=DP_SAVE_AT, checkpoint=ckpt, **common), model=model)
    resumed = train(TrainConfig(steps=DP_STEPS, checkpoint=ckpt, resume=True, **common),
                    model=model)
    for tag, result in (("whole", whole), ("resumed", resumed)):
        save_file(state_of(result.modules), str(Path(out) / f"{tag}-rank{rank}.safetensors"))
        (Path(out) / f"{tag}-rank{rank}.json").write_text(
            json.dumps([s["loss"] for s in result.steps]))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.xdist_group("start_workers")  # see tests/test_engine_dist.py
@pytest.mark.parametrize(("grad_sync", "toy", "accumulation", "bf16_moments", "main"), [
    ("flat", "toyclip", 1, False, True), ("ddp", "toyclip", 1, False, True),
    ("flat", "toyvlm", 2, False, True), ("ddp", "toyvlm", 2, False, True),
    ("flat", "toyclip", 1, True, True), ("flat", "toyclip", 1, True, False)])
def test_data_parallel_bf16_weights_train_as_one_process_and_resume(
        tmp_path, monkeypatch, grad_sync, toy, accumulation, bf16_moments, main):
    """Two gloo processes, every module replicated, bf16 weights with their gradients summed
    in bf16 (with accumulation too: the micro-steps summed in fp32 before the last backward,
    which all-reduces): the replicas stay bitwise equal, the losses follow one process training the
    whole batch with bf16 weights (they differ by the bf16 sum), and a run resumed from a
    checkpoint continues the exact curve and weights (with DDP this needs the step before
    DDP wraps the modules to sum in bf16 too: it summed in fp32, so a resumed run's first
    step differed from the uninterrupted run's). With bf16 moments the replicas stay equal
    too: their stochastic rounding draws the same bits on every rank (a hash of index, value
    and step count, not a per-process generator), and so do weights kept without fp32 main
    copies (`main` False: rounded stochastically too)."""
    from mosaic.engine import main_weights
    from tests.helpers import start_workers

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the one-process run's toy weights
    start_workers(_data_parallel_worker,
                  (2, str(tmp_path), grad_sync, "cpu", toy, accumulation, bf16_moments, main),
                  nprocs=2)
    check_data_parallel_run(tmp_path, "cpu", toy)


def check_data_parallel_run(tmp_path, device: str, toy: str = "toyclip") -> None:
    """What _data_parallel_worker's two ranks wrote, against one process on `device`."""
    import json

    from safetensors.torch import load_file

    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import ToyModel, one_gpu_plans

    states = {(tag, r): load_file(str(tmp_path / f"{tag}-rank{r}.safetensors"))
              for tag in ("whole", "resumed") for r in (0, 1)}
    losses = {(tag, r): json.loads((tmp_path / f"{tag}-rank{r}.json").read_text())
              for tag in ("whole", "resumed") for r in (0, 1)}
    whole = states["whole", 0]
    assert any(t.dtype == torch.bfloat16 for t in whole.values())
    for other in (states["whole", 1], states["resumed", 0], states["resumed", 1]):
        assert other.keys() == whole.keys() and all(torch.equal(whole[k], other[k]) for k in whole)
    assert losses["resumed", 0] == losses["whole", 0][DP_SAVE_AT:]
    model = ToyModel(toy)
    one = train(TrainConfig(device=device, model=toy, steps=DP_STEPS, warmup_steps=0,
                            lr=1e-2, progress=False, engine=EngineConfig(amp=True, bf16_weights=True),
                            plan=one_gpu_plans(model.graph("tiny"))["temporal"]), model=model)
    torch.testing.assert_close(losses["whole", 0], [s["loss"] for s in one.steps],
                               rtol=2e-2, atol=0)


def test_micro_step_gradients_are_summed_in_fp32_and_rounded_at_most_twice():
    from mosaic.engine.main_weights import MicroStepGradients

    weight, unused = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)), nn.Parameter(
        torch.zeros(2, dtype=torch.bfloat16))
    kept = nn.Parameter(torch.zeros(3))  # fp32: autograd adds its micro-steps in fp32 already
    folded = MicroStepGradients([weight, unused, kept])
    assert folded.params == [weight, unused]
    micro = [torch.tensor([1.0, 256.0, 1e-3, -2.0]), torch.tensor([1 / 256, 1.0, 1e-3, 2.0]),
             torch.tensor([1 / 256, 1.0, 1e-3, 0.5]), torch.tensor([0.0, 1.0, 0.0, 0.0])]
    n = len(micro)
    for k, g in enumerate(micro):
        weight.grad = (weight.grad if weight.grad is not None else 0) + g.bfloat16()  # autograd
        folded.fold(k, n)
        if k < n - 2:
            assert torch.equal(weight.grad, torch.zeros_like(weight.grad))
    first = sum(g.bfloat16().float() for g in micro[:-1]).bfloat16()  # summed in fp32
    want = first + micro[-1].bfloat16()  # the last backward adds in bf16, as autograd does
    assert torch.equal(weight.grad, want) and unused.grad is None
    chained = micro[0].bfloat16()
    for g in micro[1:]:
        chained = chained + g.bfloat16()  # what bf16 accumulation would have left
    assert chained[1] == 256 and want[1] == 260  # 256 + 1 + 1 + 1: bf16 steps of 2 stay 256
    MicroStepGradients([kept]).fold(0, 2)  # no bf16 weight (a tiny model): nothing


def test_accumulated_bf16_weight_gradients_train_as_the_whole_batch(monkeypatch):
    """toyvlm on the CPU with bf16 weights: two and three micro-steps follow one step over the
    whole batch (the micro-steps' gradients summed in fp32)."""
    from mosaic.engine import main_weights
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import ToyModel, one_gpu_plans

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the toy's weights are small
    model = ToyModel("toyvlm")
    common = dict(device="cpu", model="toyvlm", steps=4, warmup_steps=0, lr=1e-2,
                  progress=False, plan=one_gpu_plans(model.graph("tiny"))["temporal"],
                  global_batch=12)
    runs = {n: train(TrainConfig(engine=EngineConfig(bf16_weights=True, accumulation=n),
                                 **common), model=model) for n in (1, 2, 3)}
    for n in (2, 3):
        torch.testing.assert_close([s["loss"] for s in runs[n].steps],
                                   [s["loss"] for s in runs[1].steps], rtol=2e-2, atol=0)


def test_clipping_bf16_weight_gradients_scales_what_main_weights_adamw_reads(monkeypatch):
    """toyvlm on the CPU with bf16 weights: clipping at a bound above every norm leaves the
    run bit-identical to no clipping (its scale is exactly 1), one below every norm changes
    it, and either logs the same first norm (taken before clipping, from bf16 gradients)."""
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import ToyModel, one_gpu_plans, state_of

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the toy's weights are small
    model = ToyModel("toyvlm")
    common = dict(device="cpu", model="toyvlm", steps=3, warmup_steps=0, lr=1e-2,
                  progress=False, plan=one_gpu_plans(model.graph("tiny"))["free"],
                  engine=EngineConfig(bf16_weights=True))
    runs = {clip: train(TrainConfig(clip_grad_norm=clip, **common), model=model)
            for clip in (None, 1e9, 1e-3)}
    norms = {clip: [s.get("grad_norm") for s in run.steps] for clip, run in runs.items()}
    assert norms[None] == [None] * 3 and min(norms[1e9]) > 1e-3
    assert norms[1e-3][0] == norms[1e9][0]
    plain, loose, tight = (state_of(runs[c].modules) for c in (None, 1e9, 1e-3))
    assert all(torch.equal(loose[k], plain[k]) for k in plain)
    assert any(not torch.equal(tight[k], plain[k]) for k in plain)


@pytest.mark.parametrize("variants", [[], [{"bf16_weights": True}]])
def test_a_cpu_bench_of_bf16_weights_runs_everything_under_autocast(monkeypatch, variants):
    """On the CPU autocast is off by default; a bf16-weight variant runs under it, so the
    bench puts every plan and the reference there too (else the gradient check compares
    bf16 with fp32 and refuses the variant, as `mosaic bench --cpu-smoke` did)."""
    import mosaic.bench
    from mosaic.engine.measure import BenchConfig
    from mosaic.hardware import make_cluster
    from mosaic.zoo import get_model

    seen = {}

    def stop(perf_model, cluster, preset, profile_db, engine):
        seen["amp"] = engine.amp
        raise SystemExit(0)

    monkeypatch.setattr(mosaic.bench, "perf_model_for", stop)
    model = get_model("clip")
    with pytest.raises(SystemExit):
        mosaic.bench.run_bench(model, model.graph("tiny"), make_cluster(1, "h200"),
                               BenchConfig(), variants=variants)
    assert seen["amp"] is (True if variants else None)


def test_plans_of_a_bf16_bench_share_one_bf16_copy_and_one_main_weights_optimizer(monkeypatch):
    """Autotune under `mosaic train --bf16-weights` measures every candidate with bf16
    weights: they share one cast copy of the modules and one MainWeightsAdamW, as fp32 plans
    share theirs (a copy each: 16 bytes a parameter per plan), and still pass the gradient
    check; a variant back to fp32 weights trains its own fp32 copy."""
    from mosaic.engine import main_weights, measure
    from mosaic.engine.measure import BenchConfig, measure_plans
    from mosaic.engine.session import EngineConfig
    from mosaic.hardware import H200
    from mosaic.zoo import get_model
    from tests.helpers import bench_plans

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # `tiny` weights are all small
    model = get_model("clip")
    graph = model.graph("tiny")
    plans = bench_plans(graph)
    plans["mosaic@bf16_weights=false"] = plans["mosaic"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=(), engine=EngineConfig(amp=True, bf16_weights=True))
    engines = {"mosaic@bf16_weights=false": replace(config.engine, bf16_weights=False)}
    s = measure._setup(model, "tiny", graph, plans, H200, config, engines)
    try:
        assert isinstance(s.optimizer, MainWeightsAdamW) and s.optimizer.bf16
        assert s.contenders["megatron"].modules is None is s.contenders["mosaic"].modules
        own = s.contenders["mosaic@bf16_weights=false"].modules
        assert all(p.dtype == torch.float32 for m in own.values() for p in m.parameters())
    finally:
        measure._close(s.contenders)
        measure.end_distributed(s.dist)
    measurements, checks = measure_plans(model, "tiny", graph, plans, H200, config, engines)
    assert {m.label for m in measurements} == set(plans)
    assert checks["gradients"]["other_kernels"] == ["mosaic@bf16_weights=false"]
