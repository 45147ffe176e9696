"""Cost facts of real modules, counted without running them: FLOPs, saved activations, kernels.

Modules and inputs live on fake tensors (`FakeTensorMode`: meta storage, no data, no compute).
Plain meta tensors would do for the counting itself, but transformers 5 makes data-dependent
checks on its attention masks that meta tensors cannot answer and that it skips for fake ones.

Each module runs one forward + backward at `COUNT_BATCH` samples, its predecessors' outputs
standing in as inputs that require grad (as in training, where the sink sends their gradients
back). Per-sample numbers divide by the batch; the contrastive head's B x B logits make its
cost grow with the batch, but it is a rounding error next to the encoders.

Counting takes seconds per model, so the zoo ships the counts (`mosaic.zoo.cost_table`);
`python -m mosaic.zoo.cost --write` recounts every model and preset into that table, and
`--check` recounts and lists the entries that differ.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

# ModuleCost and COUNT_BATCH live in the torch-free table module (planning reads them without
# torch); imported here under their old names too.
from mosaic.zoo.cost_table import COUNT_BATCH, ModuleCost, ZooModel

BF16_BYTES = 2
"""Activations are counted as if held in bf16, as they are under autocast on the GPU."""

aten = torch.ops.aten
# Ops that only make a new view or an empty buffer: no kernel runs on the GPU for them.
_NO_KERNEL_OPS = {
    aten.detach,
    aten._unsafe_view,
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.lift_fresh,
    aten.alias,
}


def _embedding_backward_flops(grad_shape, *args, **kwargs) -> int:
    # FlopCounterMode counts no FLOPs for an embedding; its backward adds each gradient row
    # into the table: one add per element, a small but honest non-zero cost.
    return math.prod(grad_shape)


_CUSTOM_FLOPS = {aten.embedding_dense_backward: _embedding_backward_flops}


class _KernelCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # prim ops (device queries) and views never launch anything.
        if (
            func.namespace == "aten"
            and not func.is_view
            and func.overloadpacket not in _NO_KERNEL_OPS
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _EfficientAttention(TorchFunctionMode):
    """Route SDPA to the memory-efficient kernel's op, as a GPU would run it.

    On fake/meta CPU tensors SDPA falls back to its math form, which saves the B x H x T x T
    attention matrix for backward; the fused kernels keep only the output and a logsumexp.
    The FLOP count is the same either way.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return _efficient_sdpa(*args, **kwargs)


def _efficient_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: the kernel wants equal heads
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    bias = None
    if attn_mask is not None:
        shape = (*q.shape[:-1], k.shape[-2])
        bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).expand(shape)
    out = aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, dropout_p, is_causal, scale=scale
    )
    return out[0]


class _SavedBytes:
    """Sums the storages autograd saves for backward, once each, parameters excluded."""

    def __init__(self, module: nn.Module) -> None:
        self.excluded = {
            t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers()]
        }
        self.bytes_by_storage: dict[int, int] = {}

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self.excluded:
            num_bytes = storage.nbytes()
            if t.is_floating_point():
                num_bytes = num_bytes // t.element_size() * BF16_BYTES
            self.bytes_by_storage[storage._cdata] = num_bytes
        return t

    @property
    def total(self) -> int:
        return sum(self.bytes_by_storage.values())


def bf16_weight_count(module: nn.Module) -> int:
    """Parameters `--bf16-weights` would store in bf16, found by casting `module` (a meta
    copy: nothing is computed) with the engine's own rule, so the count cannot drift from it."""
    from mosaic.engine.main_weights import cast_weights_bf16

    return sum(p.numel() for p in cast_weights_bf16([module]))


def count_module(module: nn.Module, args: Sequence[Tensor]) -> tuple[ModuleCost, Tensor]:
    """Cost of one forward + backward of `module(*args)`; returns the (detached) output too."""
    saved = _SavedBytes(module)
    kernels = _KernelCounter()
    with (
        FlopCounterMode(display=False, custom_mapping=_CUSTOM_FLOPS) as flops,
        kernels,
        _EfficientAttention(),
    ):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = module(*args)
        out.backward(None if out.ndim == 0 else torch.ones_like(out))
    floating = out.is_floating_point() and out.ndim > 0
    cost = ModuleCost(
        flops_per_sample=flops.get_total_flops() / COUNT_BATCH,
        activation_bytes_per_sample=saved.total / COUNT_BATCH,
        output_bytes_per_sample=out.numel() * BF16_BYTES / COUNT_BATCH if floating else 0.0,
        num_params=sum(p.numel() for p in module.parameters()),
        num_kernels=kernels.count,
        out_shape=tuple(out.shape[1:]),
    )
    return cost, out.detach()


def _make_fake(module: nn.Module, mode: FakeTensorMode) -> None:
    """Swap a meta module's parameters and buffers for fake CPU tensors, in place.

    CPU rather than meta: transformers opens `torch.autocast(device_type=x.device.type)`,
    which has no meta flavour.
    """
    fakes: dict[int, Tensor] = {}  # keeps tied parameters tied

    def fake_of(t: Tensor) -> Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                sub._parameters[name] = fakes.setdefault(
                    id(p), nn.Parameter(fake_of(p), p.requires_grad)
                )
        for name, b in sub._buffers.items():
            if b is not None:
                sub._buffers[name] = fakes.setdefault(id(b), fake_of(b))


def count_graph(
    order: Sequence[str],
    predecessors: Mapping[str, Sequence[str]],
    build: Callable[[str], nn.Module],
    make_inputs: Callable[[int], Mapping[str, tuple[Tensor, ...]]],
) -> dict[str, ModuleCost]:
    """Count every module in topological `order` on fake tensors.

    `build(name)` makes a module on the current default device: meta, because some
    initialisers of transformers 4.5x read values, which fake tensors refuse and meta ones
    skip; its parameters then become fake. `make_inputs(batch)` gives real CPU data inputs.
    """
    real_inputs = make_inputs(COUNT_BATCH)
    costs: dict[str, ModuleCost] = {}
    outputs: dict[str, Tensor] = {}
    # Non-fake inputs are allowed for the few constants modules keep as plain CPU tensors
    # (VideoMAE's sinusoidal table); fake mode converts them on use.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for name in order:
        with torch.device("meta"):
            module = build(name)
            bf16_weights = bf16_weight_count(build(name))
        _make_fake(module, mode)
        data = tuple(mode.from_tensor(t) for t in real_inputs[name])
        upstream = tuple(outputs[p].requires_grad_(True) for p in predecessors[name])
        with mode:
            cost, outputs[name] = count_module(module, (*data, *upstream))
        costs[name] = replace(cost, bf16_weight_params=bf16_weights)
    return costs


def count_model(model: ZooModel, preset: str) -> dict[str, ModuleCost]:
    """Count every module of `model` at `preset` (what the shipped table caches)."""
    configs = model.preset(preset).modules
    shapes = model.in_shapes(preset)
    generator = torch.Generator().manual_seed(0)
    # Building draws random weights: leave the caller's RNG as it was.
    with torch.random.fork_rng(devices=[]):
        return count_graph(
            order=list(configs),
            predecessors={name: model.predecessors(name) for name in configs},
            build=lambda name: configs[name].build(shapes[name]),
            make_inputs=lambda batch: model.make_inputs(preset, batch, generator),
        )


def main(argv: Sequence[str] | None = None) -> int:
    from mosaic.zoo import get_model, list_models
    from mosaic.zoo.cost_table import entry_key, load_table, table_entry, write_table

    parser = argparse.ArgumentParser(prog="python -m mosaic.zoo.cost", description=(
        "Recount the zoo's module costs; --write stores them in the shipped table."))
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="recount and write data/costs.json")
    action.add_argument("--check", action="store_true", help="recount; exit 1 if the table differs")
    parser.add_argument("--models", nargs="+", default=list_models(), metavar="MODEL")
    args = parser.parse_args(argv)
    entries = dict(load_table()["entries"])
    stale = []
    for name in args.models:
        model = get_model(name)
        for preset in model.presets:
            entry = table_entry(model, preset, count_model(model, preset))
            key = entry_key(name, preset)
            if entries.get(key) != entry:
                stale.append(key)
            entries[key] = entry
            print(f"{key}: {'changed' if key in stale else 'same'}", file=sys.stderr)
    if args.write:
        print(f"wrote {write_table(entries)}", file=sys.stderr)
        return 0
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
