"""AdamW's first moment in block-scaled float8 e4m3, the second in bf16, without main weights
(engine/fp8_first_moment.py), on the CPU: the rounding, one step's states, the skip of a
non-finite step, training beside the bf16-moment update, and the flags."""

import pytest
import torch

from mosaic.engine.bf16_optimizer import bf16_optimizer
from mosaic.engine.fp8_first_moment import (
    BLOCK,
    SUBNORMAL_STEP,
    Fp8FirstMomentAdamW,
    _first_moment_update,
    fp8_stochastic,
)
from mosaic.engine.main_weights import MainWeightsAdamW
from mosaic.engine.rounded_weights import RoundedWeightsAdamW
from mosaic.engine.session import EngineConfig, SessionError

LEAN = dict(bf16_weights=True, bf16_moments=True, bf16_flat_grads=False, fp32_main_weights=False)


@pytest.mark.parametrize("value", [300.0, 1.3, 0.021, -0.0037, 1e-3])
def test_stochastic_rounding_is_unbiased_above_and_below_the_normals(value):
    """Every code finite, each one of the value's two neighbours, their mean the value (within
    2^-8 of a unit, the 8 bits' resolution; below 2^-6 on the subnormal grid)."""
    x = torch.full((1 << 16,), value)
    bits = torch.randint(0, 256, x.shape, dtype=torch.int32,
                         generator=torch.Generator().manual_seed(0))
    codes = fp8_stochastic(x, bits).float()
    unit = max(2.0 ** (torch.floor(torch.log2(torch.tensor(abs(value)))) - 3).item(),
               SUBNORMAL_STEP)
    assert torch.isfinite(codes).all() and len(set(codes.tolist())) == 2
    assert abs(codes.mean().item() - value) < unit / 64


def _one_step(n: int, found_inf: float = 0.0):
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3).bfloat16()
    weight = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-2).bfloat16()
    padded = -(-n // BLOCK) * BLOCK
    state = {"codes": torch.zeros(padded, dtype=torch.float8_e4m3fn),
             "scale": torch.zeros(padded // BLOCK),
             "exp_avg_sq": torch.zeros(n, dtype=torch.bfloat16), "weight": weight.clone()}
    _first_moment_update(grad, state["codes"], state["scale"], state["exp_avg_sq"],
                         state["weight"], torch.tensor(1e-3), torch.tensor(1e-2),
                         torch.tensor(1e-3 ** 0.5), torch.tensor(found_inf), torch.tensor(1.0),
                         torch.tensor(1, dtype=torch.int32), beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0)
    return grad.float(), weight.float(), state


def test_one_step_stores_the_moments_and_moves_the_weight_as_adamw():
    """From zero moments, 1000 elements (not whole blocks: the pad reads zero): each block's
    scale is its largest first moment over 448, the codes read back within one e4m3 unit,
    the second moment is bf16's rounding of (1 - beta2) g^2, and the weight takes AdamW's first
    step within a bf16 unit."""
    g, before, state = _one_step(1000)
    m = torch.nn.functional.pad(0.1 * g, (0, 24))
    assert torch.allclose(state["scale"], m.view(-1, BLOCK).abs().amax(dim=1) / 448)
    back = (state["codes"].float().view(-1, BLOCK) * state["scale"][:, None]).view(-1)
    assert ((back - m).abs() <= m.abs() / 8 + state["scale"].repeat_interleave(BLOCK)
            * SUBNORMAL_STEP).all()
    assert (back[1000:] == 0).all()
    assert torch.allclose(state["exp_avg_sq"].float(), 1e-3 * g * g, rtol=2 ** -7)
    step = 1e-2 * 0.1 * g / ((1e-3 * g * g).sqrt() / 1e-3 ** 0.5 + 1e-8)  # 1e-3, signed as g
    assert (state["weight"].float() - before).abs().min() > 5e-4  # far above a bf16 unit
    assert torch.allclose(state["weight"].float(), before - step, rtol=2 ** -7, atol=1e-4)


def test_a_non_finite_step_changes_nothing():
    g, before, state = _one_step(512, found_inf=1.0)
    assert torch.equal(state["weight"].float(), before)
    assert (state["codes"].float() == 0).all() and (state["scale"] == 0).all()
    assert (state["exp_avg_sq"].float() == 0).all()


def test_training_stays_near_fp32_adamw():
    """Weights of 300, 4096 and 7 elements (small, so a step is many bf16 units: what differs
    is the moments' rounding, not the weights'), 20 steps of the same gradients: against
    MainWeightsAdamW with fp32 moments, the weights moved within 10% of the distance moved
    (bf16 moments: within 3%; measured 5% and 1.5%); the state is the documented one."""
    shapes = [(20, 15), (64, 64), (7,)]
    runs = {}
    for name, make in (("fp32", lambda ps: MainWeightsAdamW(ps, 1e-3, moments="fp32")),
                       ("bf16", lambda ps: RoundedWeightsAdamW(ps, 1e-3, moments="bf16")),
                       ("fp8", lambda ps: Fp8FirstMomentAdamW(ps, 1e-3))):
        params = [torch.nn.Parameter((torch.randn(s, generator=torch.Generator().manual_seed(i))
                                      * 1e-2).bfloat16()) for i, s in enumerate(shapes)]
        start = [p.detach().float().clone() for p in params]
        optimizer = make(params)
        for step in range(20):
            for i, p in enumerate(params):
                gen = torch.Generator().manual_seed(100 * step + i)
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2 + 1e-3).bfloat16()
            optimizer.step()
        runs[name] = ([m.detach().float() for m in optimizer.mains], start, optimizer, params)
    exact, start = runs["fp32"][:2]
    for name, bound in (("bf16", 0.03), ("fp8", 0.1)):
        for got, want, begun in zip(runs[name][0], exact, start, strict=True):
            assert float((got - want).norm() / (want - begun).norm()) < bound, name
    optimizer, params = runs["fp8"][2:]
    state = optimizer.state[params[0]]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg"].numel() == 512
    assert state["exp_avg_scale"].numel() == 2 and state["exp_avg_sq"].dtype == torch.bfloat16


def test_the_flags_ask_for_it_only_where_it_applies():
    from mosaic.engine.trainer import TrainConfig, TrainError
    from mosaic.perf.engine_term import bf16_family, engine_kind
    from mosaic.zoo import get_model
    from tests.helpers import bench_plans

    params = [torch.nn.Parameter(torch.zeros(4, 4).bfloat16())]
    assert isinstance(bf16_optimizer(params, 1e-3, moments="bf16", fp32_main_weights=False,
                                     fp8_first_moment=True), Fp8FirstMomentAdamW)
    with pytest.raises(ValueError, match="no fp32 main weights"):
        bf16_optimizer(params, 1e-3, moments="bf16", fp8_first_moment=True)
    assert EngineConfig(**LEAN, fp8_first_moment=True).fp8_first_moment
    with pytest.raises(SessionError, match="bf16_moments=True"):
        EngineConfig(bf16_weights=True, bf16_flat_grads=False, fp32_main_weights=False,
                     fp8_first_moment=True)
    with pytest.raises(SessionError, match="choose one"):
        EngineConfig(**LEAN, fp8_first_moment=True, update_group=4)
    plan = bench_plans(get_model("clip").graph("tiny"))["mosaic"]
    with pytest.raises(TrainError, match="fp8_first_moment is measured by `mosaic bench"):
        TrainConfig(model="clip", preset="tiny", plan=plan,
                    engine=EngineConfig(**LEAN, fp8_first_moment=True))
    kind = engine_kind({"graphs": True, "compile": "default", **LEAN, "fp8_first_moment": True})
    assert kind.endswith("+no-main-weights+fp8-first-moment")
    assert bf16_family(kind).endswith("+bf16-weights+fp8-first-moment")


def test_the_bench_measures_it_as_a_variant(monkeypatch):
    """`mosaic bench --engine-variant ...,fp8_first_moment=true` on the CPU: the plan trains
    its own bf16 copy with the 8-bit first moment, checked as other kernels are."""
    from tests.helpers import measured_variant

    row, checks, _ = measured_variant(
        monkeypatch, "bf16_weights=true,bf16_flat_grads=false,bf16_moments=true,"
        "fp32_main_weights=false,fp8_first_moment=true", "mosaic@fp8")
    assert row.engine_variant["fp8_first_moment"] is True and row.median_s > 0
    assert "mosaic@fp8" in checks["gradients"]["other_kernels"]
