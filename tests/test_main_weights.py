"""bf16 weights with fp32 main weights (engine/main_weights.py) on CPU: which weights turn bf16,
and the optimizer's arithmetic against torch's AdamW."""

from dataclasses import replace

import pytest
import torch
from torch import nn

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


def _grads(params, step):
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(p.shape, generator=generator) for p in params]


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
            optimizer.lr = adamw.param_groups[0]["lr"] = LR / 2
        g_weight, g_bias = _grads([weight, bias], step)
        weight.grad, bias.grad = g_weight.to(torch.bfloat16), g_bias
        reference[0].grad, reference[1].grad = weight.grad.float(), g_bias.clone()
        optimizer.step()
        adamw.step()
    (main,) = [m for m in optimizer.mains if m.shape == weight.shape]
    torch.testing.assert_close(main, reference[0].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias.detach(), reference[1].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.detach(), main.to(torch.bfloat16), rtol=0, atol=0)
    assert torch.count_nonzero(unused) == 0 and optimizer.lr == pytest.approx(LR / 2)


def test_a_parameter_that_is_not_one_flat_view_is_refused():
    weight = nn.Parameter(torch.randn(2, 3, 4, 4).to(torch.bfloat16)
                          .to(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="contiguous"):
        MainWeightsAdamW([weight], LR)


def test_bf16_weights_is_a_variant_of_every_plan_refused_on_cpu_and_by_the_trainer():
    from mosaic.engine.measure import (
        BenchConfig,
        BenchError,
        engine_variant,
        measure_plans,
        parse_variant,
        variant_applies,
    )
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, TrainError
    from mosaic.hardware import H200
    from mosaic.zoo import get_model
    from tests.test_bench import _plans

    model = get_model("clip")
    graph = model.graph("tiny")
    plans = _plans(graph)
    settings = parse_variant("bf16_weights=true")
    assert settings == {"bf16_weights": True} and variant_applies(plans["megatron"], settings)
    with pytest.raises(BenchError, match="autocast"):
        engine_variant(EngineConfig(amp=False), settings)
    plans["mosaic@bf16_weights=true"] = plans["mosaic"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=())
    engines = {"mosaic@bf16_weights=true": replace(config.engine, bf16_weights=True)}
    with pytest.raises(BenchError, match="needs a GPU"):
        measure_plans(model, "tiny", graph, plans, H200, config, engines)
    with pytest.raises(TrainError, match="bf16_weights"):
        TrainConfig(model="clip", preset="tiny", plan=plans["mosaic"],
                    engine=EngineConfig(bf16_weights=True))
