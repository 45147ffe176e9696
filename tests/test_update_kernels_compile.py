"""The bf16 optimizers' update functions compiled by Inductor on the CPU: each compiles (the
rest of the CPU suite runs them eagerly, as the engine does off CUDA) and steps as the eager
function does; the elementwise ones into one kernel. What the compiled code computes (the
hashed rounding bits, the bit casts, the skip) is checked here rather than first on a GPU.
The 8-bit first moment's block scales are a reduction: the CPU's code generator splits its
update into passes over the rows, so its kernel count is the GPU test's to print.
"""

import functools

import pytest
import torch
from torch._inductor import config, metrics

from mosaic.engine.fp8_first_moment import BLOCK, _first_moment_update
from mosaic.engine.main_weights import _adamw_update
from mosaic.engine.rounded_weights import _rounded_update

CONSTANTS = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
N = 3 * BLOCK + 40  # not whole blocks: the 8-bit moment's padding is exercised


def _seeded(seed: int, scale: float, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(N, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _scalars(found_inf: float) -> tuple[torch.Tensor, ...]:
    """lr, step size, bias correction's root, found_inf, gradient scale, step."""
    return (torch.tensor(1e-3), torch.tensor(1e-2), torch.tensor(0.05), torch.tensor(found_inf),
            torch.tensor(1.0), torch.tensor(7, dtype=torch.int32))


def _main_weights_args():
    return (_seeded(0, 1e-2, torch.float32), _seeded(1, 1e-3), _seeded(2, 1e-4),
            _seeded(3, 1e-6).abs(), torch.empty(N, dtype=torch.bfloat16))


def _rounded_args():
    return (_seeded(1, 1e-3), _seeded(2, 1e-4), _seeded(3, 1e-6).abs(), _seeded(0, 1e-2))


def _fp8_args():
    padded = -(-N // BLOCK) * BLOCK
    first = torch.nn.functional.pad(_seeded(2, 1e-4, torch.float32), (0, padded - N))
    scale = first.view(-1, BLOCK).abs().amax(dim=1) / 448
    codes = (first.view(-1, BLOCK) / scale[:, None]).view(-1).to(torch.float8_e4m3fn)
    return _seeded(1, 1e-3), codes, scale, _seeded(3, 1e-6).abs(), _seeded(0, 1e-2)


UPDATES = {  # the function, its tensors, how many lead those it only writes, its kernels
    "main weights, bf16 moments": (_adamw_update, _main_weights_args, 4, 1),
    "no main weights": (_rounded_update, _rounded_args, 4, 1),
    "no main weights, 8-bit first moment": (_first_moment_update, _fp8_args, 5, None),
}


def _stepped(update, args, found_inf: float) -> list[torch.Tensor]:
    states = [t.clone() for t in args]
    update(*states, *_scalars(found_inf))
    return [t.float() for t in states]


@pytest.mark.parametrize("name", list(UPDATES))
def test_each_update_compiles_and_steps_as_eager(name):
    """One generated kernel where elementwise; after a step from equal states every state within two of its
    storage's rounding steps of eager's (fp32 arithmetic may differ in the last bit, which can
    flip a stochastic rounding), nearly all of them equal; a skipped step changes nothing."""
    function, make_args, read, kernels = UPDATES[name]
    update = functools.partial(function, **CONSTANTS)
    args = make_args()
    eager = _stepped(update, args, 0.0)
    torch._dynamo.reset()
    metrics.reset()
    with config.patch(fx_graph_cache=False):
        compiled = torch.compile(update, dynamic=False)
        got = _stepped(compiled, args, 0.0)
        assert kernels is None or metrics.generated_kernel_count == kernels
        skipped = _stepped(compiled, args, 1.0)
    for before, want, have in zip(args, eager, got, strict=True):
        unit = 2.0 ** -3 if before.dtype == torch.float8_e4m3fn else 2.0 ** -8
        bound = torch.maximum(want.abs(), have.abs()) * 2 * unit
        assert bool(((want - have).abs() <= bound).all())
        assert float((want == have).float().mean()) > 0.95
    for before, kept in zip(args[:read], skipped, strict=False):
        assert torch.equal(kept, before.float())
