"""bf16 weights with fp32 main weights on the GPU (skipped without CUDA): the compiled,
graph-captured optimizer step against the eager one on the CPU, and a plan trained so in
`mosaic bench` passing the gradient check against the fp32 user program.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_main_weights_gpu.py -s
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from mosaic.engine import main_weights
from mosaic.engine.main_weights import MainWeightsAdamW
from mosaic.engine.measure import BenchConfig, measure_plans
from mosaic.engine.session import EngineConfig
from mosaic.hardware import H200
from mosaic.zoo import get_model
from tests.test_engine import one_gpu_plans

pytestmark = pytest.mark.gpu
STEPS = 6


def test_the_captured_compiled_step_updates_as_the_eager_one():
    """Gradients rewritten in place each step (as the backward graphs do): after the eager
    steps the step, bf16 and fp32 parameters, is one CUDA graph, and weights and main weights
    match the CPU's, also after the learning rate changed."""
    torch.manual_seed(0)
    shapes = [(1024, 768), (768,), (3, 5, 7)]
    starts = [torch.randn(s) for s in shapes]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16]
    runs = {}
    for device in ("cpu", "cuda"):
        params = [nn.Parameter(x.to(device=device, dtype=d, copy=True))  # not the CPU start
                  for x, d in zip(starts, dtypes, strict=True)]
        grads = [torch.empty(p.shape, dtype=p.dtype, device=device) for p in params]
        optimizer = MainWeightsAdamW(params, 1e-3, weight_decay=0.01)
        for step in range(STEPS):
            if step == STEPS - 1:  # after the capture: the graph reads the lr from the device
                optimizer.param_groups[0]["lr"] = 5e-4
            generator = torch.Generator().manual_seed(step)
            for p, g in zip(params, grads, strict=True):
                g.copy_(torch.randn(p.shape, generator=generator))
                p.grad = g
            optimizer.step()
        runs[device] = ([p.detach().cpu() for p in params],
                        [m.cpu() for m in optimizer.mains], optimizer)
    assert len(runs["cuda"][2].graphs) == 1  # captured once, replayed since
    for got, want in zip(runs["cuda"][1], runs["cpu"][1], strict=True):  # bf16 weights' mains
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs["cuda"][0][1], runs["cpu"][0][1], rtol=1e-5, atol=1e-6)
    for weight, main in zip(runs["cuda"][0][::2], runs["cuda"][1], strict=True):
        torch.testing.assert_close(weight, main.to(weight.dtype), rtol=0, atol=0)


def test_the_per_weight_kernel_is_one_graph_for_every_length_after_its_tuning_call():
    """Tuned on a large update of zeros marked with their length as the size hint, the one
    update kernel then takes weights of other lengths, unmarked, without compiling again, and
    updates them as the CPU's eager update does."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    update = main_weights._update_fn("cuda", 0.9, 0.999, 1e-8, 0.0, "fp32", True, 1 << 20)  # its own
    for n in (1 << 16, 3 << 16, 1 << 18):
        torch.manual_seed(n)
        cpu = [torch.rand(n), torch.randn(n).bfloat16(), torch.rand(n), torch.rand(n),
               torch.empty(n, dtype=torch.bfloat16)]
        cuda = [t.cuda() for t in cpu]
        scalars = [torch.tensor(v) for v in (1e-3, 1e-3, 0.5, 0.0, 1.0, 1.0)]
        main_weights._update_fn("cpu", 0.9, 0.999, 1e-8, 0.0, "fp32", True)(*cpu, *scalars)
        update(*cuda, *(s.cuda() for s in scalars))
        for i in (0, 2, 3):  # main weight, both moments
            torch.testing.assert_close(cuda[i].cpu(), cpu[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cuda[4], cuda[0].bfloat16(), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_weights_a_weight_at_a_time_get_a_kernel_per_length_and_update_as_on_the_cpu(
        monkeypatch):
    """Each length compiles its own kernel (autotuned on that length), a repeated length
    reuses it, and the steps move the weights as the CPU's eager update does."""
    from torch._dynamo.utils import counters

    # The process's budget of such kernels, not what the GPU tests before this one spent.
    monkeypatch.setattr(main_weights, "_STATIC_LENGTHS", set())

    lengths, weight_decay = (12345, 23456, 34567, 12345), 0.0123  # constants of its own
    runs = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        weights = [nn.Parameter(torch.randn(n).bfloat16().to(device)) for n in lengths]
        optimizer = MainWeightsAdamW(weights, lr=1e-3, weight_decay=weight_decay)
        before = counters["stats"]["unique_graphs"]
        for step in range(3):
            torch.manual_seed(step)
            for w in weights:
                w.grad = torch.randn(w.shape).bfloat16().to(device)
            optimizer.step()
        if device == "cuda":
            assert counters["stats"]["unique_graphs"] - before == len(set(lengths))
        runs[device] = [m.cpu() for m in optimizer.mains]
    for got, want in zip(runs["cuda"], runs["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_module_updated_in_one_launch_on_the_gpu_as_on_the_cpu():
    """The weights of a module end to end (cast_weights_bf16), their gradients in a flat
    buffer rewritten in place: one compiled launch per module, captured, as the CPU's."""
    from mosaic.engine.comm import FlatGrads
    from mosaic.engine.main_weights import cast_weights_bf16

    runs = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(512, 768), nn.LayerNorm(768), nn.Linear(768, 256))
        module.to(device)
        cast_weights_bf16([module])
        flat = FlatGrads(list(module.parameters()))
        optimizer = MainWeightsAdamW(list(module.parameters()), 1e-3, weight_decay=0.01)
        for step in range(STEPS):
            flat.attach()
            generator = torch.Generator().manual_seed(step)
            for q in module.parameters():
                q.grad.copy_(torch.randn(q.shape, generator=generator))
            assert [len(run) for run in optimizer.launch_runs()] == [2]
            optimizer.step()
        runs[device] = ([q.detach().cpu() for q in module.parameters()], optimizer)
    assert len(runs["cuda"][1].graphs) == 1
    for got, want in zip(runs["cuda"][0], runs["cpu"][0], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
    for got, want in zip(runs["cuda"][1].mains, runs["cpu"][1].mains, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_the_one_kernel_guard_checks_bf16_gradients_on_the_gpu(bad):
    """torch's AMP check has no CUDA kernel for bf16: the trainer's host-bound guard must
    still find a bad bf16 gradient (and pass a good one) next to fp32 ones."""
    from mosaic.engine.steps import _not_finite

    grads = [torch.randn(300, device="cuda"), torch.randn(64, 64, device="cuda").bfloat16()]
    if bad is not None:
        grads[1][5, 7] = bad
    assert float(_not_finite(grads, "check")) == float(bad is not None)


def test_a_plan_with_bf16_weights_computes_what_the_fp32_user_program_does():
    model = get_model("clip")
    graph = model.graph("small", global_batch=32)
    plans = {k: p for k, p in one_gpu_plans(graph).items() if k == "partition"}
    per_weight = "partition@bf16_weights=true,bf16_flat_grads=false"
    plans["partition@bf16_weights=true"] = plans[per_weight] = plans["partition"]
    config = BenchConfig(rounds=2, steps_per_round=3, warmup_steps=4, nvml_seconds=0,
                         engine=EngineConfig(graphs=True, compile="default"),
                         user_programs=("torch-eager",))
    bf16 = EngineConfig(graphs=True, compile="default", bf16_weights=True)
    engines = {"partition@bf16_weights=true": bf16,
               per_weight: replace(bf16, bf16_flat_grads=False)}  # gradients left in place
    measurements, checks = measure_plans(model, "small", graph, plans, H200, config, engines)
    medians = {m.label: round(1e3 * m.median_s, 2) for m in measurements}
    errors = {m.label: max(m.grad_error.values()) for m in measurements}
    print(medians, errors, checks["gradients"])
    assert all(math.isfinite(v) and v > 0 for v in medians.values())
    # bf16 weights are autocast's own rounding: gradients agree as closely as fp32 plans do
    assert errors["partition@bf16_weights=true"] <= max(2 * errors["partition"], 1e-2)
    assert errors[per_weight] <= max(2 * errors["partition"], 1e-2)
    assert checks["gradients"]["reference"] == "torch-eager"
    torch.cuda.synchronize()


def test_plans_of_a_bf16_bench_share_one_copy_and_capture_each_update_on_the_gpu():
    """Autotune under `mosaic train --bf16-weights`: the plans share one bf16 copy and one
    MainWeightsAdamW whose update is captured once per plan's gradient layout (flat buffers,
    and a weight at a time), and every plan passes the gradient check."""
    model = get_model("clip")
    graph = model.graph("small", global_batch=32)
    plans = dict(one_gpu_plans(graph))
    per_weight = "partition@bf16_flat_grads=false"
    plans[per_weight] = plans["partition"]
    bf16 = EngineConfig(graphs=True, compile="default", bf16_weights=True)
    config = BenchConfig(rounds=2, steps_per_round=3, warmup_steps=4, nvml_seconds=0,
                         engine=bf16, user_programs=())
    engines = {per_weight: replace(bf16, bf16_flat_grads=False)}
    measurements, checks = measure_plans(model, "small", graph, plans, H200, config, engines)
    medians = {m.label: round(1e3 * m.median_s, 2) for m in measurements}
    print(medians, checks["gradients"])
    assert set(medians) == set(plans) and all(v > 0 for v in medians.values())
    assert checks["gradients"]["other_kernels"] == []  # one kernel class: all bf16
    torch.cuda.synchronize()


def test_training_with_bf16_weights_follows_fp32_weights_and_resumes(tmp_path, monkeypatch):
    """`mosaic train --bf16-weights` on the GPU (graphs, compiled modules, the NaN guard's
    found_inf on the device): the losses follow the fp32-weight run's (the same bf16 values
    in forward and backward; the optimizers' arithmetic differs in the last bits), the step
    is captured, and a run stopped after a checkpoint resumes to the same weights."""
    from mosaic.engine import main_weights
    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import state_of

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # tiny weights
    model = get_model("imagebind")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    common = dict(model="imagebind", preset="tiny", plan=plan, warmup_steps=1, device="cuda",
                  lr=1e-3, progress=False)
    engine = EngineConfig(graphs=True, compile="default")
    bf16 = EngineConfig(graphs=True, compile="default", bf16_weights=True)
    fp32_run = train(TrainConfig(steps=8, engine=engine, **common))
    whole = train(TrainConfig(steps=8, engine=bf16, **common))
    losses = [s["loss"] for s in whole.steps]
    print("fp32 weights:", [round(s["loss"], 5) for s in fp32_run.steps], "bf16:", losses)
    torch.testing.assert_close(losses, [s["loss"] for s in fp32_run.steps], rtol=2e-2, atol=0)
    ckpt = CheckpointConfig(directory=str(tmp_path / "ckpt"), every_steps=4)
    train(TrainConfig(steps=4, checkpoint=ckpt, engine=bf16, **common))
    resumed = train(TrainConfig(steps=8, checkpoint=ckpt, resume=True, engine=bf16, **common))
    torch.testing.assert_close([s["loss"] for s in resumed.steps], losses[4:], rtol=1e-3, atol=0)
    want, got = state_of(whole.modules), state_of(resumed.modules)
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=1e-2, atol=1e-3,
                                   msg=key)


@pytest.mark.parametrize(("grad_sync", "toy", "accumulation"), [
    ("flat", "toyclip", 1), ("ddp", "toyclip", 1), ("flat", "toyvlm", 2), ("ddp", "toyvlm", 2)])
def test_data_parallel_bf16_weights_over_nccl(tmp_path, monkeypatch, grad_sync, toy,
                                              accumulation):
    """The CPU two-process test over NCCL, graphed and compiled: replicas bitwise equal, the
    losses one process's within the bf16 sum, a resume exact."""
    from mosaic.engine import main_weights
    from tests.helpers import start_workers
    from tests.test_main_weights import _data_parallel_worker, check_data_parallel_run

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)
    start_workers(_data_parallel_worker, (2, str(tmp_path), grad_sync, "cuda", toy, accumulation),
                  nprocs=2, device="cuda")
    check_data_parallel_run(tmp_path, "cuda", toy)


def test_accumulated_micro_steps_with_bf16_weights_follow_the_whole_batch(monkeypatch):
    """Graphed and compiled: the backward graphs add each micro-step's bf16 gradients into the
    flat buffers, the engine folds them into fp32 sums; two micro-steps train as one step."""
    from mosaic.engine import main_weights
    from mosaic.engine.trainer import TrainConfig, train

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)
    model = get_model("ofasys")
    plan = one_gpu_plans(model.graph("tiny"))["temporal"]
    runs = {n: train(TrainConfig(model="ofasys", preset="tiny", plan=plan, steps=6,
                                 warmup_steps=1, device="cuda", lr=1e-3, progress=False,
                                 engine=EngineConfig(graphs=True, compile="default",
                                                     bf16_weights=True, accumulation=n)))
            for n in (1, 2)}
    losses = {n: [s["loss"] for s in run.steps] for n, run in runs.items()}
    print("accumulation 1:", losses[1], "2:", losses[2])
    torch.testing.assert_close(losses[2], losses[1], rtol=2e-2, atol=0)



def test_stochastic_rounding_compiled_and_captured_draws_new_bits_each_replay():
    """A graph whose rounding drew the same bits each replay would round each value the same
    way every step and bias the moments: with the seed (the update's step count) advanced in
    the graph, two replays over the same values round some differently, unbiased on average."""
    x = torch.rand(1 << 20, device="cuda") + 1.0  # in [1, 2): bf16 steps of 2^-7
    out = torch.empty(x.shape, device="cuda", dtype=torch.bfloat16)
    seed = torch.zeros((), device="cuda")

    def rounding():
        seed.add_(1)
        out.copy_(main_weights.stochastic_bf16(x, main_weights.hashed_bits(x, seed) & 0xFFFF))

    compiled = torch.compile(rounding, dynamic=False)
    compiled()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled()
    replays = []
    for _ in range(64):
        graph.replay()
        replays.append(out.float().clone())
    assert float((replays[0] != replays[1]).float().mean()) > 0.25  # 1/3 expected
    bias = (torch.stack(replays).mean(0) - x).mean() / 2 ** -8  # in half bf16 steps
    assert abs(float(bias)) < 0.01


def test_bf16_moments_in_the_captured_compiled_step_follow_fp32_moments():
    """The compiled, captured update with bf16 moments against fp32 moments, same gradients:
    the main weights stay within the rounding's noise of the fp32 run, and the second
    moment unbiased, within a few bf16 units."""
    torch.manual_seed(0)
    start = torch.randn(4096, 1024)
    runs = {}
    for moments in ("fp32", "bf16"):
        weight = nn.Parameter(start.to(device="cuda", dtype=torch.bfloat16))
        weight.grad = torch.empty_like(weight)
        optimizer = MainWeightsAdamW([weight], 1e-3, moments=moments)
        for step in range(STEPS + 4):
            generator = torch.Generator().manual_seed(step)
            weight.grad.copy_(torch.randn(weight.shape, generator=generator))
            optimizer.step()
        assert len(optimizer.graphs) == 1  # captured, replayed since
        state = optimizer.state[weight]
        assert state["exp_avg_sq"].dtype == main_weights.MOMENT_DTYPES[moments]
        runs[moments] = (optimizer.mains[0].clone(), state["exp_avg_sq"].float())
    (main_fp32, v_fp32), (main_bf16, v_bf16) = runs["fp32"], runs["bf16"]
    assert torch.isfinite(main_bf16).all()
    moved = (main_fp32 - start.cuda().to(torch.bfloat16).float()).norm()
    assert float((main_bf16 - main_fp32).norm() / moved) < 0.02
    relative = (v_bf16 - v_fp32) / v_fp32
    assert abs(float(relative.mean())) < 1e-3  # unbiased over 4 M moments
    assert float(relative.abs().mean()) < 2 ** -6  # a few rounding steps of noise, no more


def stepped_bf16_weight(optimizer_class, steps: int, device: str):
    """(optimizer, weight): one bf16 weight with bf16 moments stepped `steps` times by
    `optimizer_class` on `device`, its gradients drawn on the CPU from seeds (equal on every
    device) and written in place, as the backward graphs leave them."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(512, 256).to(device=device, dtype=torch.bfloat16))
    weight.grad = torch.empty_like(weight)
    optimizer = optimizer_class([weight], 1e-3, moments="bf16")
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        weight.grad.copy_(torch.randn(weight.shape, generator=generator))
        optimizer.step()
    return optimizer, weight


def _bf16_moments_after(steps: int, device: str) -> dict[str, torch.Tensor]:
    optimizer, weight = stepped_bf16_weight(MainWeightsAdamW, steps, device)
    return {k: optimizer.state[weight][k].float().cpu() for k in ("exp_avg", "exp_avg_sq")}


@pytest.mark.parametrize("steps", [1, STEPS])
def test_bf16_moments_round_on_the_gpu_as_on_the_cpu(steps):
    """The hashed rounding is integer arithmetic on the index, the new main weight's bits and
    the step count: the compiled, captured update on the GPU rounds the moments as the CPU's
    eager one does, except where fp32 arithmetic (fused multiply-adds) left a value or the
    main weight a bit apart. After one step from equal states such a pair is at most two bf16
    steps apart (each side rounds to a neighbour of its own exact value); later steps carry
    those differences on, so over several steps only their rarity and size are bounded (the
    CPU's compiled update against its eager one: 99.8% equal, mean difference 1e-5 of the
    mean magnitude after six steps)."""
    cpu_states, gpu_states = _bf16_moments_after(steps, "cpu"), _bf16_moments_after(steps, "cuda")
    for key in ("exp_avg", "exp_avg_sq"):
        cpu, gpu = cpu_states[key], gpu_states[key]
        assert float((cpu == gpu).float().mean()) > 0.9
        difference = (cpu - gpu).abs()
        if steps == 1:
            assert bool((difference <= torch.maximum(cpu.abs(), gpu.abs()) * 2 ** -6).all())
        else:
            assert float(difference.mean()) <= float(cpu.abs().mean()) * 2 ** -10
