"""bf16 weights without fp32 main copies (engine/rounded_weights.py) on the CPU: why the new
weight is rounded stochastically, the optimizer against MainWeightsAdamW, its state, the
engine's flag and what the memory and performance models count for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from mosaic.engine.main_weights import MainWeightsAdamW, hashed_bits, stochastic_bf16
from mosaic.engine.rounded_weights import RoundedWeightsAdamW, bf16_weights_adamw, weight_bits
from mosaic.engine.session import EngineConfig, SessionError
from mosaic.graph import MAIN_WEIGHT_BYTES, GraphError, MMGraph
from mosaic.perf.engine_term import engine_kind, no_main_weights, term_engine
from mosaic.perf.profiled import MAIN_WEIGHT_SAVED_BYTES, ProfiledModel
from mosaic.profile.db import ProfileDB, module_signature
from mosaic.profile.main_weights import store, stored_updates
from tests.test_main_weights_profile import CLUSTER, FLAT, PER_WEIGHT, _plan_and_db

LR = 1e-3


def test_steps_below_half_a_bf16_unit_stall_rounded_to_nearest_and_add_up_stochastically():
    """A constant gradient moves each weight by lr a step (AdamW's normalised step), here
    1e-4 at weights near 1: a tenth of a bf16 unit (2^-7). Rounded to nearest, the weight
    never moves; RoundedWeightsAdamW's weights travel, on average, the fp32 main weights'
    distance (their spread is the rounding's noise, averaged over 4096 weights)."""
    steps, lr = 200, 1e-4
    start = torch.ones(4096, dtype=torch.bfloat16)
    nearest = start.clone()
    for _ in range(steps):
        nearest = (nearest.float() - lr).to(torch.bfloat16)
    assert torch.equal(nearest, start)
    travelled = {}
    for cls in (MainWeightsAdamW, RoundedWeightsAdamW):
        weight = nn.Parameter(start.clone())
        optimizer = cls([weight], lr, moments="bf16")
        for _ in range(steps):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        travelled[cls] = float(1 - optimizer.mains[0].float().mean())
    assert travelled[MainWeightsAdamW] == pytest.approx(steps * lr, rel=0.01)
    assert travelled[RoundedWeightsAdamW] == pytest.approx(travelled[MainWeightsAdamW], rel=0.1)


def test_the_weights_bits_are_even_whichever_way_the_moments_round():
    """The weight rounds with the moments' draw remixed (rounded_weights.weight_bits), not a
    draw of its own. 2^16 weights a third of a bf16 unit above a bf16 value round up a third
    of the time, as often where either moment's bits round it up as where they round it
    down: the rounding stays unbiased and the three are not coupled."""
    unit = 2.0 ** -7
    main = torch.full((1 << 16,), 1 + unit / 3)
    step = torch.tensor(5)
    draw = hashed_bits(main, step)
    first_up, second_up = (draw & 0xFFFF) >= 1 << 15, ((draw >> 16) & 0xFFFF) >= 1 << 15
    weight_up = stochastic_bf16(main, weight_bits(main, step)).float() > 1
    assert not torch.equal(weight_bits(main, step), draw & 0xFFFF)
    for moments_way in (first_up, ~first_up, second_up, ~second_up):
        assert float(weight_up[moments_way].float().mean()) == pytest.approx(1 / 3, abs=0.01)


def _pulled(cls, steps: int = 200, moments: str = "bf16"):
    """(start, target, weight, optimizer): a bf16 weight pulled to a target by noisy gradients,
    beside an fp32 bias."""
    torch.manual_seed(0)
    start = torch.randn(64, 32).to(torch.bfloat16)
    weight, bias = nn.Parameter(start.clone()), nn.Parameter(torch.zeros(64))
    target = torch.randn(64, 32)
    optimizer = cls([weight, bias], LR, weight_decay=0.01, moments=moments)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        weight.grad = (weight.float() - target + torch.randn(64, 32, generator=generator)
                       ).to(torch.bfloat16)
        bias.grad = torch.randn(64, generator=generator)
        optimizer.step()
    return start.float(), target, weight, optimizer


@pytest.mark.parametrize("moments", ["bf16", "fp32"])
def test_rounded_weights_train_as_the_main_weights_do_and_hold_no_copy(moments):
    """Same gradients' noise, 200 steps toward a target: the weights without a main copy get
    as close to it (the main run's progress within 2%; measured 0.4%, and 0.4% after 1000
    steps), and differ from the main weights by the rounding's noise alone: unbiased (their
    mean difference within 4 standard errors of zero), a random walk of a few bf16 units;
    the state holds the moments alone. With fp32 moments too (the weight's bits are then the
    update's only draw)."""
    start, target, _, main = _pulled(MainWeightsAdamW, moments=moments)
    _, _, weight, rounded = _pulled(RoundedWeightsAdamW, moments=moments)
    (main_weight,) = main.mains
    weight = weight.detach().float()
    progress = {name: float((start - target).norm() - (w - target).norm())
                for name, w in (("main", main_weight), ("rounded", weight))}
    assert progress["main"] > 0 and progress["rounded"] > 0.98 * progress["main"]
    difference = weight - main_weight
    spread = float(difference.pow(2).mean().sqrt())
    assert abs(float(difference.mean())) < 4 * spread / difference.numel() ** 0.5
    assert sorted(rounded.state[rounded.bf16[0]]) == ["exp_avg", "exp_avg_sq", "step"]
    assert rounded.state[rounded.bf16[0]]["exp_avg"].dtype == getattr(torch, {
        "bf16": "bfloat16", "fp32": "float32"}[moments])
    assert rounded.mains[0].data_ptr() == rounded.bf16[0].data_ptr()


def test_its_state_resumes_exactly_and_a_main_weights_state_loads_without_the_copies():
    _, _, w0, first = _pulled(RoundedWeightsAdamW, steps=3)
    _, _, w1, second = _pulled(RoundedWeightsAdamW, steps=1)
    second.load_state_dict(first.state_dict())
    w1.data.copy_(w0.detach())
    for optimizer, weight in ((first, w0), (second, w1)):
        weight.grad = torch.full_like(weight, 0.5)
        optimizer.step()
    assert torch.equal(w0, w1)  # the step count seeds the rounding: both rounded alike
    _, _, _, with_main = _pulled(MainWeightsAdamW, steps=2)
    second.load_state_dict(with_main.state_dict())
    want = with_main.state[with_main.bf16[0]]["exp_avg"]
    assert torch.equal(second.state[w1]["exp_avg"], want)
    with pytest.raises(ValueError, match="bf16_weights"):  # main weights kept: refused
        with_main.load_state_dict(first.state_dict())


def test_the_engine_builds_it_only_for_bf16_weights_and_not_under_a_gated_update():
    weight = nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16))
    assert type(bf16_weights_adamw([weight], LR, fp32_main_weights=False)) is RoundedWeightsAdamW
    assert type(bf16_weights_adamw([weight], LR)) is MainWeightsAdamW
    with pytest.raises(SessionError, match="bf16_weights=True"):
        EngineConfig(fp32_main_weights=False)
    with pytest.raises(SessionError, match="update_under_forward"):
        EngineConfig(bf16_weights=True, fp32_main_weights=False, update_under_forward=True)
    engine = EngineConfig(bf16_weights=True, bf16_moments=True, fp32_main_weights=False)
    assert not engine.holding(_graph()).modules[0].fp32_main_weights


def _graph() -> MMGraph:
    from mosaic.zoo import get_model

    return get_model("clip").graph("small")


def test_the_memory_model_counts_no_main_copy():
    graph = _graph().with_precision(bf16_weights=True, bf16_moments=True)
    lean = graph.with_precision(bf16_weights=True, bf16_moments=True, fp32_main_weights=False)
    for with_main, without in zip(graph.modules, lean.modules, strict=True):
        assert with_main.static_bytes - without.static_bytes == pytest.approx(
            MAIN_WEIGHT_BYTES * with_main.bf16_weight_params)
    spec = graph.modules[0]
    with pytest.raises(GraphError, match="fp32_main_weights=false"):
        replace(spec, bf16_weights=False, bf16_moments=False, fp32_main_weights=False)
    round_trip = MMGraph.from_dict(lean.to_dict())
    assert [m.fp32_main_weights for m in round_trip.modules] == [False] * len(lean.modules)


def test_the_model_prices_each_modules_measured_saving_else_the_copys_bytes(tmp_path):
    """Without main weights (and bf16 moments) the step saves, per module, its measured flat
    update with main weights less without; a module not measured so is priced at
    MAIN_WEIGHT_SAVED_BYTES a bf16 parameter at the optimizer's bandwidth. A per-weight plan
    adds the per-weight difference measured without main weights."""
    graph, plan, path = _plan_and_db(tmp_path, {"enc0": (1.0, 0.6, 0.1), "enc1": (0.5, 0.5, 0.1)})
    with ProfileDB.open(path, readonly=False) as db:
        points = stored_updates(db)
        enc0 = module_signature(graph.module("enc0"))
        points[enc0] = replace(points[enc0], per_weight_bf16_moments_s=0.7e-3,
                               flat_update_bf16_moments_s=0.45e-3, per_weight_no_main_s=0.5e-3,
                               flat_update_no_main_s=0.3e-3)
        store(db, points)
    moments = FLAT + "+bf16-moments"
    with_main = ProfiledModel(CLUSTER, path, engine=moments)
    without = ProfiledModel(CLUSTER, path, engine=moments + "+no-main-weights")
    unmeasured = sum(with_main.memory_pass_s(
        graph.module(m).bf16_weight_params or graph.module(m).num_params, MAIN_WEIGHT_SAVED_BYTES)
        for m in ("enc1", "head"))
    gap = with_main.iteration_time_s(plan, graph) - without.iteration_time_s(plan, graph)
    assert gap == pytest.approx(0.15e-3 + unmeasured)
    per_weight = ProfiledModel(CLUSTER, path,
                               engine=PER_WEIGHT + "+bf16-moments+no-main-weights")
    # enc0 without main 0.5 - 0.3 - 0.1, enc1 (not measured so) 0.5 - 0.5 - 0.1
    assert per_weight.per_weight_extra_s(plan, graph) == pytest.approx(0.1e-3 - 0.1e-3)
    assert no_main_weights(moments + "+no-main-weights") and not no_main_weights(moments)
    assert term_engine(moments + "+no-main-weights") == term_engine(FLAT)
    assert engine_kind({"graphs": True, "compile": "default", "grads_in_graph": True,
                        "bf16_weights": True, "bf16_moments": True, "fp32_main_weights": False},
                       1) == moments + "+no-main-weights"


def test_training_without_main_weights_follows_the_main_weight_loss_curve(monkeypatch):
    """The toy model trained 40 steps by the engine on the CPU, bf16 weights and moments with
    and without fp32 main weights: the losses stay together step by step."""
    from mosaic.engine import main_weights
    from mosaic.engine.trainer import TrainConfig, train
    from tests.test_engine import ToyModel, one_gpu_plans

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)  # the toy's weights are small
    model = ToyModel("toyvlm")
    common = dict(device="cpu", model="toyvlm", plan=one_gpu_plans(model.graph("tiny"))["free"],
                  warmup_steps=0, lr=3e-2, progress=False, steps=40)
    losses = {main: torch.tensor([s["loss"] for s in train(TrainConfig(
        engine=EngineConfig(amp=True, bf16_weights=True, bf16_moments=True,
                            fp32_main_weights=main), **common), model=model).steps])
        for main in (True, False)}
    assert not torch.equal(losses[True], losses[False])  # the rounding did act
    assert float(((losses[False] - losses[True]).abs() / losses[True]).max()) < 0.02
