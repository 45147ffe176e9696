"""bf16 AdamW moments for the bf16 weights (engine/main_weights.py, moments="bf16") on CPU:
stochastic rounding's bias with the hashed bits the update draws, why it is needed, and the
optimizer against fp32 moments."""

import pytest
import torch
from torch import nn

from mosaic.engine.main_weights import MainWeightsAdamW, hashed_bits, stochastic_bf16

LR = 1e-3


def _rounded(x: torch.Tensor, seed: int) -> torch.Tensor:
    """`x` stochastically rounded with the update's bits for step `seed`."""
    return stochastic_bf16(x, hashed_bits(x, torch.tensor(seed)) & 0xFFFF)


def test_stochastic_rounding_is_unbiased_and_keeps_bf16_values_exact():
    torch.manual_seed(0)
    x = torch.rand(4096) * 3 - 1.5  # both signs; most values fall between two bf16 ones
    rounded = torch.stack([_rounded(x, seed).float() for seed in range(256)])
    toward_zero = (x.view(torch.int32) & -65536).view(torch.float32)
    away = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    neighbours = (rounded == toward_zero) | (rounded == away)
    assert bool(neighbours.all())  # only the two bf16 neighbours of each value come out
    bias = (rounded.mean(0) - x) / (x.abs() * 2 ** -8)  # in units of half a bf16 step
    assert abs(float(bias.mean())) < 0.02 and float(bias.abs().max()) < 0.5
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(_rounded(exact, 7).float(), exact)
    assert not torch.equal(_rounded(x, 1), _rounded(x, 2))  # each step rounds afresh
    bits = torch.stack([hashed_bits(x, torch.tensor(seed)) for seed in range(16)])
    for half in (bits & 0xFFFF, (bits >> 16) & 0xFFFF):  # both moments' halves, uniform
        assert float(half.float().mean()) / 65536 == pytest.approx(0.5, abs=0.01)


def test_rounded_to_nearest_the_second_moment_stalls_and_stochastically_it_tracks():
    """AdamW's v with beta2 = 0.999 after the gradients grow 1.5x: its change per step, 0.1%
    of it, is under half a bf16 unit, so round-to-nearest keeps the old value for ever."""
    beta2, steps = 0.999, 3000
    exact = torch.full((2048,), 1.0)
    nearest, stochastic = exact.to(torch.bfloat16), exact.to(torch.bfloat16)
    torch.manual_seed(0)
    for step in range(steps):
        grad_sq = torch.full_like(exact, 2.25)
        exact = exact * beta2 + grad_sq * (1 - beta2)
        nearest = (nearest.float() * beta2 + grad_sq * (1 - beta2)).to(torch.bfloat16)
        stochastic = _rounded(stochastic.float() * beta2 + grad_sq * (1 - beta2), step)
    assert float(exact.mean()) == pytest.approx(1 + 1.25 * (1 - 0.999 ** steps), rel=1e-4)
    assert float(nearest.float().mean()) == 1.0
    assert float(stochastic.float().mean()) == pytest.approx(float(exact.mean()), rel=0.01)


def _trained(moments: str, steps: int = 200):
    """(start, target, optimizer) of a bf16 weight pulled to a target by noisy gradients."""
    torch.manual_seed(0)
    start = torch.randn(64, 32).to(torch.bfloat16)
    weight = nn.Parameter(start.clone())
    bias = nn.Parameter(torch.zeros(64))
    target = torch.randn(64, 32)
    optimizer = MainWeightsAdamW([weight, bias], LR, weight_decay=0.01, moments=moments)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        noise = torch.randn(64, 32, generator=generator)
        weight.grad = (weight.float() - target + noise).to(torch.bfloat16)
        bias.grad = torch.randn(64, generator=generator)
        optimizer.step()
    return start.float(), target, optimizer


def test_bf16_moments_follow_fp32_moments_and_hold_half_the_bytes():
    """Same gradients' noise, 200 steps: the main weights with bf16 moments stay within a
    small part of the distance the fp32-moment run travelled; only the bf16 weights' moments
    are bf16 (the fp32 bias keeps fused AdamW's fp32 state)."""
    start, target, fp32 = _trained("fp32")
    *_, bf16 = _trained("bf16")
    (main_fp32,), (main_bf16,) = fp32.mains, bf16.mains
    travelled = (main_fp32 - start).norm()
    assert float((main_bf16 - main_fp32).norm() / travelled) < 0.02
    assert (main_bf16 - target).norm() < (start - target).norm()  # it trained
    states = list(bf16.state.values())
    assert {s["exp_avg"].dtype for s in states} == {torch.bfloat16, torch.float32}
    weight_state = next(s for s in states if "main" in s)
    assert weight_state["exp_avg_sq"].dtype == torch.bfloat16
    assert weight_state["main"].dtype == torch.float32


def test_a_checkpoint_of_bf16_moments_resumes_exactly_and_unknown_moments_are_refused():
    *_, first = _trained("bf16", steps=3)
    *_, second = _trained("bf16", steps=1)
    second.load_state_dict(first.state_dict())
    for got, want in zip(second.state.values(), first.state.values(), strict=True):
        for key in want:
            assert torch.equal(got[key], want[key])
    with pytest.raises(ValueError, match="moments='fp16'"):
        MainWeightsAdamW([nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], LR,
                         moments="fp16")


def test_training_with_bf16_moments_follows_the_fp32_moment_loss_curve(monkeypatch):
    """The toy model trained 40 steps by the engine on the CPU (synthetic batches, a new one
    each step), bf16 weights with fp32 and with bf16 moments: the two runs' losses stay
    together step by step (the moments differ by rounding noise only)."""
    from mosaic.engine import main_weights
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import ToyModel, one_gpu_plans

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the toy's weights are small
    model = ToyModel("toyvlm")
    common = dict(device="cpu", model="toyvlm", plan=one_gpu_plans(model.graph("tiny"))["free"],
                  warmup_steps=0, lr=3e-2, progress=False, steps=40)
    losses = {moments: torch.tensor([s["loss"] for s in train(TrainConfig(
        engine=EngineConfig(amp=True, bf16_weights=True, bf16_moments=moments), **common),
        model=model).steps]) for moments in (False, True)}
    fp32, bf16 = losses[False], losses[True]
    assert not torch.equal(fp32, bf16)  # the rounding did act
    assert float(((bf16 - fp32).abs() / fp32).max()) < 0.01
