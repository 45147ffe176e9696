"""A user's own nn.Modules as a mosaic model: their cost graph, and the trainer's protocol.

    graph = graph_from_modules("clip-imu", modules, edges, example_inputs, global_batch=64)
    model = UserModel(graph, modules, data)      # a TrainableModel: trainer.train(config, model)

The modules follow the zoo's calling convention (`mosaic.zoo.base`):
* `module(*inputs[name], *[outputs[p] for p in predecessors(name)])`: a module takes its own
  data inputs first (possibly none), then its predecessors' outputs in edge order;
* encoders return ONE tensor with the batch on axis 0;
* the sink (the loss or alignment head, a module like any other) returns a scalar loss; a
  contrastive head, whose loss is over the whole batch, sets `needs_global_batch = True` so
  that the engine all-gathers its inputs across data-parallel ranks.

Costs are counted exactly as the zoo counts its own modules (`mosaic.zoo.cost.count_graph`:
one forward + backward on fake tensors at `COUNT_BATCH` samples under FlopCounterMode, saved
activations at bf16, non-view aten ops as kernels); the user's weights are neither copied
nor touched (the counting copy shares nothing: its parameters are meta, then fake, tensors).

Data, in one of three forms (`DataSource`):
* a callable (step, batch_size) -> {module: tensor or tuple}, or an iterable (a DataLoader)
  of such dicts: the GLOBAL batch of each step, made on every rank, which keeps the rows its
  share of each module processes (axis 0 of every tensor). So every rank must see the same
  batch: a callable that depends only on the step does; an iterable must be seeded alike on
  every rank. It is made once per step, whatever the gradient accumulation.
* a `mosaic.data.RowSource` (e.g. `mosaic.data.ShardedDataset(dataset)`): asked for the rows
  of each module that this rank processes only; see `mosaic.data` for its contract.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from mosaic.data import RowSource, slice_rows
from mosaic.graph import MODULE_KINDS, GraphError, MMGraph, ModuleSpec

DataFn = Callable[[int, int], Mapping[str, Any]]
"""(step, batch_size) -> {module name: tensor or tuple of tensors}, batch on axis 0."""
DataSource = DataFn | Iterable[Mapping[str, Any]] | RowSource

_STEP_SEED = 1_000_003
"""The trainer seeds step `s` of seed `k` as k * _STEP_SEED + s (engine.session.make_batch)."""


class UserModelError(GraphError):
    """A user's module, input or data source that does not follow the calling convention."""


# --- the cost graph ----------------------------------------------------------------------------
def graph_from_modules(
    name: str,
    modules: Mapping[str, nn.Module],
    edges: Sequence[tuple[str, str]],
    example_inputs: Mapping[str, Any],
    global_batch: int,
    *,
    kinds: Mapping[str, str] | None = None,
    num_layers: Mapping[str, int] | None = None,
    hidden_dims: Mapping[str, int] | None = None,
) -> MMGraph:
    """The MMGraph of `modules` joined by `edges`, costs counted on the modules themselves.

    `example_inputs[name]` is a module's own data input (a tensor or a tuple of tensors; a
    module fed only by other modules may be left out), with a batch of 1 or more on axis 0:
    only shapes and dtypes matter (integer inputs such as token ids are used as given).
    `kinds` defaults to 'head' for sinks and 'encoder' otherwise; `num_layers` and
    `hidden_dims` feed the analytic performance model's kernel-latency and tiling terms
    (defaults: the number of direct children that are ModuleLists' items, else 1; 0).
    """
    from mosaic.zoo.cost import COUNT_BATCH, count_graph

    order = _topological(name, list(modules), [tuple(e) for e in edges])
    inputs = {n: _as_tuple(example_inputs.get(n, ()), f"example_inputs[{n!r}]") for n in order}
    unknown = set(example_inputs) - set(modules)
    if unknown:
        raise UserModelError(f"example_inputs names unknown module(s) {sorted(unknown)}; "
                             f"modules are {list(modules)}")
    for n, ts in inputs.items():
        for i, t in enumerate(ts):
            if t.ndim == 0 or t.shape[0] < 1:
                raise UserModelError(f"example_inputs[{n!r}][{i}] has shape {tuple(t.shape)}; "
                                     "give a batch of 1 or more on axis 0")
    predecessors = {n: [s for s, d in edges if d == n] for n in order}
    sinks = [n for n in order if not any(s == n for s, _ in edges)]

    def build(module_name: str) -> nn.Module:
        return _Checked(module_name, _meta_copy(modules[module_name]), module_name in sinks)

    def make_inputs(batch: int) -> dict[str, tuple[Tensor, ...]]:
        return {n: tuple(_rows(t.detach().cpu(), batch) for t in ts) for n, ts in inputs.items()}

    with torch.random.fork_rng(devices=[]):  # a module may draw in forward: leave the RNG be
        costs = count_graph(order, predecessors, build, make_inputs)
    kinds = dict(kinds or {})
    bad = {n: k for n, k in kinds.items() if k not in MODULE_KINDS or n not in modules}
    if bad:
        raise UserModelError(f"kinds {bad}: keys must be module names {list(modules)} and values "
                             f"one of {MODULE_KINDS}")
    specs = []
    for n in order:
        cost = costs[n]
        out = cost.out_shape
        specs.append(ModuleSpec(
            name=n,
            kind=kinds.get(n, "head" if n in sinks else "encoder"),
            input_shape=tuple(inputs[n][0].shape[1:]) if inputs[n] else (),
            num_params=cost.num_params,
            num_layers=(num_layers or {}).get(n, _guess_layers(modules[n])),
            hidden_dim=(hidden_dims or {}).get(n, out[-1] if out else 0),
            tokens_per_sample=out[0] if len(out) >= 2 else 1,
            flops_per_sample=cost.flops_per_sample,
            activation_bytes_per_sample=cost.activation_bytes_per_sample,
            output_bytes_per_sample=cost.output_bytes_per_sample,
            num_kernels=cost.num_kernels,
            max_tensor_parallel=_max_tensor_parallel(n, modules[n]),
            bf16_weight_params=cost.bf16_weight_params,
        ))
    return MMGraph(name=name, modules=tuple(specs), edges=tuple(tuple(e) for e in edges),
                   global_batch=global_batch, preset="custom",
                   meta={"source": "graph_from_modules", "count_batch": COUNT_BATCH})


def _topological(name: str, names: list[str], edges: list[tuple[str, str]]) -> list[str]:
    """`names` in a topological order that keeps the user's order among independent modules."""
    for edge in edges:
        if len(edge) != 2 or any(e not in names for e in edge):
            raise UserModelError(f"graph {name!r}: edge {edge!r} must join two of the modules "
                                 f"{names}")
    order: list[str] = []
    todo = list(names)
    while todo:
        ready = next((n for n in todo if all(s in order for s, d in edges if d == n)), None)
        if ready is None:
            raise UserModelError(f"graph {name!r}: the edges among {todo} form a cycle; module "
                                 "edges must form a DAG")
        order.append(ready)
        todo.remove(ready)
    return order


def _as_tuple(value: Any, what: str) -> tuple[Tensor, ...]:
    items = value if isinstance(value, tuple | list) else (value,)
    if not all(isinstance(t, Tensor) for t in items):
        raise UserModelError(f"{what}: give a tensor or a tuple of tensors, got "
                             f"{[type(t).__name__ for t in items]}")
    return tuple(items)


def _rows(t: Tensor, batch: int) -> Tensor:
    """`batch` samples from an example tensor of any batch size (repeating rows if needed)."""
    return t[torch.arange(batch) % t.shape[0]]


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters and buffers are meta tensors: no weights are copied."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _max_tensor_parallel(name: str, module: nn.Module) -> int:
    """A module's own TP degrees: its `max_tensor_parallel` attribute, which needs its
    `tp_plan(tensor_parallel)` method (mosaic.engine.tensor_parallel; docs/own-model.md)."""
    most = getattr(module, "max_tensor_parallel", 1)
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise UserModelError(f"module {name!r}: max_tensor_parallel={most!r} must be an int >= 1")
    if most > 1 and not callable(getattr(module, "tp_plan", None)):
        raise UserModelError(f"module {name!r} sets max_tensor_parallel={most} but has no "
                             "tp_plan(tensor_parallel) method returning its parallelize_module "
                             "plan; add one (docs/own-model.md) or drop the attribute")
    return most


def _guess_layers(module: nn.Module) -> int:
    lists = [len(m) for m in module.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, default=1) or 1


class _Checked(nn.Module):
    """Counts `inner` (its parameters are its own) and checks what it returns."""

    def __init__(self, name: str, inner: nn.Module, sink: bool) -> None:
        super().__init__()
        self.name, self.inner, self.sink = name, inner, sink

    def forward(self, *args: Tensor) -> Tensor:
        out = self.inner(*args)
        if not isinstance(out, Tensor):
            raise UserModelError(
                f"module {self.name!r} returned {type(out).__name__}; a module must return ONE "
                "tensor (wrap a transformers model to return e.g. .pooler_output)")
        if self.sink and out.ndim != 0:
            raise UserModelError(f"module {self.name!r} is a sink (no outgoing edge) and must "
                                 f"return a scalar loss; it returned shape {tuple(out.shape)}")
        if not self.sink and args and (out.ndim == 0 or out.shape[0] != args[0].shape[0]):
            raise UserModelError(f"module {self.name!r} returned shape {tuple(out.shape)}; "
                                 f"modules other than the sink keep the batch on axis 0")
        return out


# --- the trainer's protocol ---------------------------------------------------------------------
class UserModel:
    """A TrainableModel (`mosaic.engine.trainer`) over the user's modules and data.

    `build_modules` hands the trainer the user's OWN module objects (moved to the rank's
    device), so training updates them in place; `preset` is ignored. Under torchrun every rank
    runs the user's script, so seed the RNG before building the modules (DDP also broadcasts
    rank 0's weights of every module placed on several GPUs).
    """

    def __init__(self, graph: MMGraph, modules: Mapping[str, nn.Module], data: DataSource,
                 seed: int = 0, *, fresh_copies: bool = False) -> None:
        missing = [n for n in graph.names if n not in modules]
        extra = [n for n in modules if n not in graph.names]
        if missing or extra:
            raise UserModelError(f"modules {list(modules)} do not match graph {graph.name!r} "
                                 f"modules {graph.names} (missing {missing}, extra {extra})")
        if not (callable(data) or isinstance(data, Iterable | RowSource)):
            raise UserModelError(f"data: give a callable (step, batch_size) -> dict, an "
                                 f"iterable of dicts or a mosaic.data.RowSource; got "
                                 f"{type(data).__name__}")
        self.name = graph.name
        self._graph = graph
        self._modules = dict(modules)
        self._data = data
        self._seed = seed
        self._fresh_copies = fresh_copies
        """`build_modules` hands out deep copies of the modules as given (the bench: every set-up
        starts from the same weights, and the user's modules stay untrained)."""
        self._iterator: Iterator[Mapping[str, Any]] | None = None
        self._calls = 0
        self._global: tuple[int, dict[str, tuple[Tensor, ...]]] | None = None
        """The last step's global batch (data of the global-batch forms), for its micro-steps."""

    def graph(self, preset: str = "custom", global_batch: int | None = None) -> MMGraph:
        del preset
        if global_batch is None or global_batch == self._graph.global_batch:
            return self._graph
        return dataclasses.replace(self._graph, global_batch=global_batch)

    def build_modules(self, preset: str = "custom", device: Any = "cpu",
                      dtype: torch.dtype | None = None, *, names: Iterable[str] | None = None,
                      seed: int = 0) -> dict[str, nn.Module]:
        del preset, seed  # the user built (and seeded) the modules
        wanted = set(self._graph.names if names is None else names)
        given = {n: copy.deepcopy(self._modules[n]) if self._fresh_copies else self._modules[n]
                 for n in self._graph.names if n in wanted}
        return {n: m.to(device=device, dtype=dtype or torch.float32).train()
                for n, m in given.items()}

    def make_rows(self, preset: str, ranges: Mapping[str, tuple[int, int]] | None, *,
                  step: int, seed: int, global_batch: int) -> dict[str, tuple[Tensor, ...]]:
        """Rows [start, stop) of each module's inputs in step `step` (None: all), on the host:
        a RowSource loads only those; the other forms make the global batch once per step."""
        del seed  # the user's data is seeded by the user
        if ranges is None:
            ranges = {n: (0, global_batch) for n in self._graph.names}
        if isinstance(self._data, RowSource):
            raw = self._data.rows(step, ranges, global_batch)
            return self._check_batch(raw, step, "cpu", None, ranges, global_batch)
        if self._global is None or self._global[0] != step:
            self._global = (step, self._global_batch(step, global_batch, "cpu", None))
        return slice_rows(self._global[1], ranges)

    def make_inputs(self, preset: str, batch_size: int, generator: torch.Generator,
                    device: Any = "cpu", dtype: torch.dtype | None = None
                    ) -> dict[str, tuple[Tensor, ...]]:
        """One global batch: the data function's for this step, or the iterable's next."""
        del preset
        return self._global_batch(self._step(generator), batch_size, device, dtype)

    def _global_batch(self, step: int, batch_size: int, device: Any,
                      dtype: torch.dtype | None) -> dict[str, tuple[Tensor, ...]]:
        if isinstance(self._data, RowSource):
            raw = self._data.rows(step, dict.fromkeys(self._graph.names, (0, batch_size)),
                                  batch_size)
        elif callable(self._data) and not isinstance(self._data, Iterable):
            raw = self._data(step, batch_size)
        else:
            if self._iterator is None:
                self._iterator = iter(self._data)
            try:
                raw = next(self._iterator)
            except StopIteration:
                raise UserModelError(f"data ran out at step {step}; give an iterable with at "
                                     "least `steps` batches (or a callable)") from None
        full = dict.fromkeys(self._graph.names, (0, batch_size))
        return self._check_batch(raw, step, device, dtype, full, batch_size)

    def _step(self, generator: torch.Generator) -> int:
        step = generator.initial_seed() - self._seed * _STEP_SEED
        if not 0 <= step < _STEP_SEED:  # not seeded by the trainer's rule: count calls
            step = self._calls
        self._calls += 1
        return step

    def _check_batch(self, raw: Mapping[str, Any], step: int, device: Any,
                     dtype: torch.dtype | None, ranges: Mapping[str, tuple[int, int]],
                     global_batch: int) -> dict[str, tuple[Tensor, ...]]:
        """`raw` as {module: tuple of tensors} for the modules of `ranges`, each tensor with
        stop - start rows (the global batch, or this rank's share of a RowSource's)."""
        if not isinstance(raw, Mapping):
            raise UserModelError(f"data at step {step} is a {type(raw).__name__}; give a dict "
                                 f"keyed by module name ({self._graph.names})")
        unknown = set(raw) - set(self._graph.names)
        if unknown:
            raise UserModelError(f"data at step {step} names unknown module(s) "
                                 f"{sorted(unknown)}; modules: {self._graph.names}")
        out: dict[str, tuple[Tensor, ...]] = {}
        for n, (start, stop) in ranges.items():
            ts = _as_tuple(raw.get(n, ()), f"data at step {step}, [{n!r}]")
            for i, t in enumerate(ts):
                if t.ndim == 0 or t.shape[0] != stop - start:
                    need = ("" if (start, stop) == (0, global_batch) else
                            f"{stop - start} rows, samples [{start}, {stop}) of ")
                    raise UserModelError(
                        f"data at step {step}, [{n!r}][{i}] has shape {tuple(t.shape)}; it "
                        f"must hold {need}the global batch ({global_batch}) on axis 0")
            cast = [dtype is not None and t.is_floating_point() for t in ts]
            out[n] = tuple(t.to(device=device, dtype=dtype if c else t.dtype)
                           for t, c in zip(ts, cast, strict=True))
        return out

    def loss(self, inputs: Mapping[str, tuple[Tensor, ...]]) -> Tensor:
        """Every module in graph order in this process: the reference a plan must match."""
        outputs: dict[str, Tensor] = {}
        for n in self._graph.names:
            outputs[n] = self._modules[n](*inputs[n],
                                          *[outputs[p] for p in self._graph.predecessors(n)])
        return outputs[self._graph.sinks[0]]
