"""bf16 weights without fp32 main copies on the GPU (skipped without CUDA): the compiled,
captured update as one kernel that rounds as the CPU's eager one does, and training with it.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_rounded_weights_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaic.engine.main_weights import MainWeightsAdamW
from mosaic.engine.rounded_weights import RoundedWeightsAdamW
from mosaic.engine.session import EngineConfig
from mosaic.zoo import get_model
from tests.gpu.test_main_weights_gpu import stepped_bf16_weight
from tests.test_engine import one_gpu_plans

pytestmark = pytest.mark.gpu
STEPS = 6


def _rounded_after(steps: int, device: str) -> tuple[RoundedWeightsAdamW, nn.Parameter]:
    return stepped_bf16_weight(RoundedWeightsAdamW, steps, device)


def test_the_update_is_one_kernel_captured_and_rounds_as_on_the_cpu():
    """One Inductor kernel for the whole update (weight, gradient and moments in, weight and
    moments out: the fp32 main and the nearest-rounded bf16 stay temporaries), captured after
    the eager steps; after one step from equal states it rounds as the CPU's eager update but
    where fp32 arithmetic left the new value a bit apart (then at most two bf16 steps)."""
    from torch._inductor import config, metrics

    from mosaic.engine import rounded_weights

    torch._dynamo.reset()  # compiled here, not reused from an earlier test or disk
    rounded_weights._rounded_update_fn.cache_clear()
    metrics.reset()
    with config.patch(fx_graph_cache=False):
        gpu, _ = _rounded_after(STEPS, "cuda")
    assert metrics.generated_kernel_count == 1
    assert len(gpu.graphs) == 1  # captured, replayed since
    _, cpu_weight = _rounded_after(1, "cpu")
    _, gpu_weight = _rounded_after(1, "cuda")
    cpu, got = cpu_weight.detach().float(), gpu_weight.detach().float().cpu()
    assert float((cpu == got).float().mean()) > 0.9
    assert bool(((cpu - got).abs() <= torch.maximum(cpu.abs(), got.abs()) * 2 ** -6).all())


def test_the_compiled_update_follows_main_weights_unbiased():
    """4 M weights, same gradients, 10 steps: the weights without main copies differ from
    MainWeightsAdamW's main weights by the rounding's noise, unbiased on average. Ten steps of
    lr = 1e-3 move a weight about as far as a few roundings' noise (the difference's norm was
    1.08x the distance moved in the CPU's eager run of the same test over 1 M weights)."""
    torch.manual_seed(0)
    start = torch.randn(4096, 1024).to(device="cuda", dtype=torch.bfloat16)
    runs = {}
    for cls in (MainWeightsAdamW, RoundedWeightsAdamW):
        weight = nn.Parameter(start.clone())
        weight.grad = torch.empty_like(weight)
        optimizer = cls([weight], 1e-3, moments="bf16")
        for step in range(STEPS + 4):
            weight.grad.copy_(torch.randn(weight.shape, device="cuda",
                                          generator=torch.Generator("cuda").manual_seed(step)))
            optimizer.step()
        runs[cls] = optimizer.mains[0].float()
    main, rounded = runs[MainWeightsAdamW], runs[RoundedWeightsAdamW]
    moved = (main - start.float()).norm()
    difference = rounded - main
    assert float(difference.norm() / moved) < 1.5
    assert abs(float(difference.mean())) < 4 * float(difference.std()) / difference.numel() ** 0.5


def test_training_without_main_weights_follows_main_weights_and_resumes(tmp_path, monkeypatch):
    """`mosaic train --bf16-weights --bf16-moments --no-fp32-main-weights` on the GPU (graphs,
    compiled modules): the losses follow the run with main weights, and a run stopped after a
    checkpoint resumes to the same weights (the step count seeds the rounding)."""
    from mosaic.engine import main_weights
    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import state_of

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # tiny weights
    model = get_model("imagebind")
    common = dict(model="imagebind", preset="tiny", plan=one_gpu_plans(model.graph("tiny"))["free"],
                  warmup_steps=1, device="cuda", lr=1e-3, progress=False)
    engines = {main: EngineConfig(graphs=True, compile="default", bf16_weights=True,
                                  bf16_moments=True, fp32_main_weights=main)
               for main in (True, False)}
    runs = {main: train(TrainConfig(steps=8, engine=engine, **common))
            for main, engine in engines.items()}
    losses = {main: [s["loss"] for s in run.steps] for main, run in runs.items()}
    print("main weights:", losses[True], "none:", losses[False])
    torch.testing.assert_close(losses[False], losses[True], rtol=2e-2, atol=0)
    ckpt = CheckpointConfig(directory=str(tmp_path / "ckpt"), every_steps=4)
    train(TrainConfig(steps=4, checkpoint=ckpt, engine=engines[False], **common))
    resumed = train(TrainConfig(steps=8, checkpoint=ckpt, resume=True, engine=engines[False],
                                **common))
    torch.testing.assert_close([s["loss"] for s in resumed.steps], losses[False][4:], rtol=1e-3,
                               atol=0)
    want, got = state_of(runs[False].modules), state_of(resumed.modules)
    for key in want:
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=1e-2, atol=1e-3,
                                   msg=key)


def test_grouped_launches_are_captured_and_update_as_one_launch_a_weight():
    """engine/grouped_update.py on the GPU: same-shaped weights four at a time through one
    function compiled with combo kernels, captured as the engine captures the update, leave
    the weights and moments the per-weight launches leave, bit for bit (each weight's
    arithmetic and bits are its own; only the launches are shared)."""
    from mosaic.engine.grouped_update import GroupedRoundedWeightsAdamW

    shapes = [(1024, 512)] * 6 + [(512,)] * 3 + [(256, 768)] * 2
    runs = {}
    for name, make in (("per weight", RoundedWeightsAdamW),
                       ("grouped", lambda ps, lr, **kw: GroupedRoundedWeightsAdamW(
                           ps, lr, group=4, **kw))):
        params = [nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))
                               .to(device="cuda", dtype=torch.bfloat16))
                  for i, s in enumerate(shapes)]
        for p in params:
            p.grad = torch.empty_like(p)
        optimizer = make(params, 1e-3, moments="bf16")
        for step in range(STEPS):
            for i, p in enumerate(params):
                generator = torch.Generator().manual_seed(100 * step + i)
                p.grad.copy_(torch.randn(p.shape, generator=generator))
            optimizer.step()
        assert len(optimizer.graphs) == 1, name  # captured, replayed since
        runs[name] = (params, optimizer)
    (engine, engine_opt), (grouped, grouped_opt) = runs["per weight"], runs["grouped"]
    for a, b in zip(engine, grouped, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(engine_opt.state[a]["exp_avg_sq"], grouped_opt.state[b]["exp_avg_sq"])


def test_the_8_bit_first_moment_update_is_captured_and_steps_as_on_the_cpu():
    """engine/fp8_first_moment.py on the GPU: compiled (the kernel count printed: the block
    scales are a reduction, which Inductor should fuse with the update around it), captured
    after the eager steps, and after one step from equal states its weight within two bf16
    units of the CPU's eager one's (fp32 arithmetic and fused multiply-adds differ)."""
    from torch._inductor import config, metrics

    from mosaic.engine import fp8_first_moment
    from mosaic.engine.fp8_first_moment import Fp8FirstMomentAdamW

    torch._dynamo.reset()
    fp8_first_moment._first_moment_update_fn.cache_clear()
    metrics.reset()
    with config.patch(fx_graph_cache=False):
        gpu, gpu_weight = stepped_bf16_weight(Fp8FirstMomentAdamW, STEPS, "cuda")
    print("fp8 first moment update kernels:", metrics.generated_kernel_count)
    assert len(gpu.graphs) == 1 and torch.isfinite(gpu_weight.float()).all()
    _, cpu_weight = stepped_bf16_weight(Fp8FirstMomentAdamW, 1, "cpu")
    _, gpu_weight = stepped_bf16_weight(Fp8FirstMomentAdamW, 1, "cuda")
    cpu, got = cpu_weight.detach().float(), gpu_weight.detach().float().cpu()
    assert float((cpu == got).float().mean()) > 0.9
    assert bool(((cpu - got).abs() <= torch.maximum(cpu.abs(), got.abs()) * 2 ** -6).all())
