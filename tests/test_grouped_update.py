"""The update a weight at a time with same-shaped weights grouped into one launch
(engine/grouped_update.py), on the CPU: the engine's arithmetic and bits, its flags' checks,
and its own engine kind for the performance model."""

import math

import pytest
import torch

from mosaic.engine.bf16_optimizer import bf16_optimizer
from mosaic.engine.grouped_update import GroupedRoundedWeightsAdamW
from mosaic.engine.rounded_weights import RoundedWeightsAdamW
from mosaic.engine.session import EngineConfig, SessionError

SHAPES = [(8, 4), (8, 4), (3,), (8, 4), (5, 2), (3,), (8, 4)]


def _stepped(make, steps: int = 3):
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))
                                 .bfloat16()) for i, s in enumerate(SHAPES)]
    optimizer = make(params)
    for step in range(steps):
        for i, p in enumerate(params):
            gen = torch.Generator().manual_seed(100 * step + i)
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).bfloat16()
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("group", [2, 3, 8])
def test_grouped_launches_update_every_weight_bit_for_bit_as_one_launch_a_weight(group):
    engine, engine_opt = _stepped(lambda ps: RoundedWeightsAdamW(ps, 1e-2, moments="bf16"))
    grouped, grouped_opt = _stepped(lambda ps: GroupedRoundedWeightsAdamW(
        ps, 1e-2, group=group, moments="bf16"))
    for a, b in zip(engine, grouped, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(engine_opt.state[a][key], grouped_opt.state[b][key])
    assert not torch.equal(engine[0], torch.randn(SHAPES[0], generator=torch.Generator()
                                                  .manual_seed(0)).bfloat16())  # they moved
    queued = grouped_opt._queued
    assert sorted(len(q) for q in queued.values()) == [1, 2, 4]  # (5, 2), (3,) and (8, 4)


def test_a_grouped_optimizers_checkpoint_loads_into_the_ungrouped_one():
    grouped, grouped_opt = _stepped(lambda ps: GroupedRoundedWeightsAdamW(
        ps, 1e-2, group=4, moments="bf16"), steps=2)
    plain = RoundedWeightsAdamW(grouped, 1e-2, moments="bf16")
    plain.load_state_dict(grouped_opt.state_dict())
    assert torch.equal(plain.state[grouped[0]]["exp_avg"], grouped_opt.state[grouped[0]]["exp_avg"])


def test_the_group_is_asked_for_only_where_it_applies():
    params = [torch.nn.Parameter(torch.zeros(4, 4).bfloat16())]
    assert type(bf16_optimizer(params, 1e-3, moments="bf16", fp32_main_weights=False)) \
        is RoundedWeightsAdamW
    assert isinstance(bf16_optimizer(params, 1e-3, moments="bf16", fp32_main_weights=False,
                                     update_group=4), GroupedRoundedWeightsAdamW)
    with pytest.raises(ValueError, match="fp32_main_weights=False"):
        bf16_optimizer(params, 1e-3, update_group=4)
    with pytest.raises(ValueError, match="group two or more"):
        GroupedRoundedWeightsAdamW(params, 1e-3, group=1)
    lean = dict(bf16_weights=True, bf16_flat_grads=False, fp32_main_weights=False)
    assert EngineConfig(**lean, update_group=8).update_group == 8
    with pytest.raises(SessionError, match="update_group=8 groups the launches"):
        EngineConfig(bf16_weights=True, fp32_main_weights=False, update_group=8)  # flat update
    with pytest.raises(SessionError, match="must be >= 1"):
        EngineConfig(**lean, update_group=0)


def test_grouped_rows_are_an_engine_kind_and_a_family_of_their_own():
    """Their rows must not shift the fitted term of the ungrouped update (not profiled, the
    grouped update is priced as the ungrouped one and its rows would read as faster)."""
    from mosaic.engine.measure import parse_variant
    from mosaic.perf.engine_term import bf16_family, engine_kind, term_engine

    settings = parse_variant("bf16_weights=true,bf16_flat_grads=false,bf16_moments=true,"
                             "fp32_main_weights=false,update_group=8")
    assert settings["update_group"] == 8
    kind = engine_kind({"graphs": True, "compile": "default", "grads_in_graph": True,
                        **settings}, gpus=1)
    assert kind.endswith("+no-main-weights+grouped-update")
    assert bf16_family(kind) == "graphs+compile-default+grads-in-graph+bf16-weights+grouped-update"
    assert term_engine(kind) == "graphs+compile-default+grads-in-graph"


def test_the_bench_measures_the_grouped_update_as_a_variant_and_trains_with_it(monkeypatch):
    """`mosaic bench --engine-variant ...,update_group=2` on the CPU: the plan trains its own
    bf16 copy with the grouped optimizer; and the trainer builds the grouped optimizer from
    the engine's flags."""
    from mosaic.engine.measure import parse_variant
    from mosaic.engine.trainer import TrainConfig, train
    from tests.helpers import measured_variant

    variant = ("bf16_weights=true,bf16_flat_grads=false,bf16_moments=true,"
               "fp32_main_weights=false,update_group=2")
    row, _, plans = measured_variant(monkeypatch, variant, "mosaic@grouped")
    assert row.engine_variant["update_group"] == 2 and row.median_s > 0
    steps = []
    real_step = GroupedRoundedWeightsAdamW._bf16_step
    monkeypatch.setattr(GroupedRoundedWeightsAdamW, "_bf16_step",
                        lambda self: (steps.append(self.group), real_step(self)))
    result = train(TrainConfig(model="clip", preset="tiny", plan=plans["mosaic"], steps=2,
                               warmup_steps=0, progress=False,
                               engine=EngineConfig(**parse_variant(variant))))
    assert steps == [2, 2] and all(math.isfinite(s["loss"]) for s in result.steps)
