"""A zoo model: real nn.Modules, synthetic data and the MMGraph of their measured costs.

Calling convention (the engine relies on it)
--------------------------------------------
* `build_modules(preset)` returns one `ZooModule` per graph module, keyed by name, in graph
  (topological) order. Weights are a function of (seed, module name, device type), so every
  rank that builds a module gets the same weights, whatever else it builds.
* `make_inputs(preset, batch_size, generator, device)` returns, for EVERY module, the tuple of
  its own data inputs (empty for modules fed only by other modules). Every tensor has the batch
  on axis 0, so data parallelism shards a batch by slicing axis 0 of each tensor.
  `make_rows(preset, ranges, step=, seed=, global_batch=)` draws only some rows of a step's
  batch, the same whatever the split: the trainer's data (each rank keeps its share only).
* `module(*inputs[name], *[outputs[p] for p in graph.predecessors(name)])`: a module takes its
  own data inputs first, then its predecessors' outputs in edge order.
* Encoders and embeddings return ONE tensor with the batch on axis 0 ([B, N, D] or [B, D]).
* The sink returns a scalar loss:
  - LLM sinks: mean token cross-entropy of the text positions against labels that are the
    sink's own data input; a mean over its local batch, so data parallel ranks average it.
  - Contrastive heads (CLIP, ImageBind): symmetric InfoNCE over the batch they are given.
    They set `needs_global_batch = True`: the engine all-gathers their inputs across data
    parallel ranks (all other modules: False).
* No dropout anywhere, fused SDPA attention; float32 on CPU and bf16 autocast on the GPU both
  work. `loss(modules, inputs)` runs the whole model in one process: the reference the
  distributed engine must match.

Cost facts
----------
`graph(preset)` counts each module's forward + backward FLOPs (FlopCounterMode), the bytes
autograd saves for backward (saved_tensors_hooks, at bf16) and the kernel count on fake
tensors (see `mosaic.zoo.cost`), once per (model, preset) per process; `global_batch` only
rescales the graph. The counts of every shipped preset come from `zoo/data/costs.json`
(`mosaic.zoo.cost_table`) when its fingerprint matches, so planning imports neither torch nor
transformers; this module and `configs` import them only inside the methods that need them.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from mosaic.graph import GraphError, MMGraph, ModuleSpec
from mosaic.zoo.configs import ModuleConfig, Shape
from mosaic.zoo.cost_table import COUNT_BATCH, ModuleCost, shipped_costs

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from mosaic.zoo.common import ZooModule

    Device = str | torch.device


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One size of a zoo model: per-module size configs and the global batch."""

    name: str
    global_batch: int
    """Samples per training iteration."""
    modules: Mapping[str, ModuleConfig]
    """Module name -> size config, in graph (topological) order."""
    note: str = ""
    """How the sizes were chosen."""

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise GraphError(f"preset {self.name!r}: global_batch={self.global_batch} must be >= 1")


@dataclass(frozen=True, kw_only=True, eq=False)
class ZooModel:
    """A multimodal model of the zoo. Compared and hashed by identity (one instance per model)."""

    name: str
    description: str
    edges: tuple[tuple[str, str], ...]
    presets: Mapping[str, Preset]
    paper_tflops: Mapping[str, float] = field(default_factory=dict)
    """Table 1 of the paper: TFLOPs per iteration by module, where the paper gives them."""
    draws_on_device: ClassVar[bool] = True
    """`make_rows` can draw its synthetic rows on the GPU itself (engine/rows.py says why)."""

    def __post_init__(self) -> None:
        names = self.module_names
        for preset in self.presets.values():
            if list(preset.modules) != names:
                raise GraphError(
                    f"model {self.name!r}: preset {preset.name!r} has modules {list(preset.modules)}, "
                    f"expected {names} (every preset has the same modules in the same order)"
                )
        for src, dst in self.edges:
            if src not in names or dst not in names or names.index(src) >= names.index(dst):
                raise GraphError(
                    f"model {self.name!r}: edge {src}->{dst} must join modules listed in topological order {names}"
                )

    # --- structure ---------------------------------------------------------------------
    @property
    def module_names(self) -> list[str]:
        return list(next(iter(self.presets.values())).modules)

    def preset(self, name: str) -> Preset:
        if name not in self.presets:
            raise GraphError(
                f"model {self.name!r} has no preset {name!r}; valid presets: {', '.join(self.presets)}"
            )
        return self.presets[name]

    def predecessors(self, name: str) -> list[str]:
        return [src for src, dst in self.edges if dst == name]

    def in_shapes(self, preset: str) -> dict[str, list[Shape]]:
        """Per-sample output shapes of each module's predecessors, in edge order."""
        configs = self.preset(preset).modules
        out: dict[str, Shape] = {}
        shapes: dict[str, list[Shape]] = {}
        for name, config in configs.items():
            shapes[name] = [out[p] for p in self.predecessors(name)]
            out[name] = config.out_shape(shapes[name])
        return shapes

    # --- modules and data ----------------------------------------------------------------
    def build_modules(
        self,
        preset: str,
        device: Device = "cpu",
        dtype: torch.dtype | None = None,
        *,
        names: Iterable[str] | None = None,
        seed: int = 0,
    ) -> dict[str, ZooModule]:
        """Randomly initialised modules (all, or only `names`), in graph order, in train mode;
        `dtype` None is float32 (a None default keeps torch out of this module's import)."""
        configs = self.preset(preset).modules
        wanted = set(configs) if names is None else set(names)
        unknown = wanted - set(configs)
        if unknown:
            raise GraphError(
                f"model {self.name!r} has no module(s) {sorted(unknown)}; modules: {list(configs)}"
            )
        import torch

        shapes = self.in_shapes(preset)
        device = torch.device(device)
        return {
            name: _build_one(config, shapes[name], device, seed, name)
            .to(device=device, dtype=torch.float32 if dtype is None else dtype)
            .train()
            for name, config in configs.items()
            if name in wanted
        }

    def make_inputs(
        self,
        preset: str,
        batch_size: int,
        generator: torch.Generator,
        device: Device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> dict[str, tuple[Tensor, ...]]:
        """Synthetic data inputs of every module (possibly empty), drawn in graph order.

        Drawn on the generator's device, then moved: a CPU generator gives the same data on
        every device. Floating inputs are cast to `dtype` (None: they stay float32, as drawn);
        token ids stay int64.
        """
        if batch_size < 1:
            raise GraphError(f"make_inputs: batch_size={batch_size} must be >= 1")
        return {
            name: tuple(_to(t, device, dtype) for t in config.make_inputs(batch_size, generator))
            for name, config in self.preset(preset).modules.items()
        }

    def module_args(self, preset: str, module: str, batch_size: int,
                    generator: torch.Generator, device: Device = "cpu") -> tuple[Tensor, ...]:
        """Arguments to run one module alone: its own synthetic inputs, then a standard-normal
        stand-in for each predecessor's output (right shape, not the real values), all drawn
        from `generator` on its device, then moved."""
        import torch

        own = self.make_inputs(preset, batch_size, generator, device)[module]
        upstream = tuple(
            torch.randn(batch_size, *shape, generator=generator, device=generator.device)
            .to(device)
            for shape in self.in_shapes(preset)[module]
        )
        return (*own, *upstream)

    def make_rows(
        self,
        preset: str,
        ranges: Mapping[str, tuple[int, int]] | None,
        *,
        step: int,
        seed: int,
        global_batch: int,
        device: Device = "cpu",
    ) -> dict[str, tuple[Tensor, ...]]:
        """Synthetic rows [start, stop) of each module's own inputs in step `step`'s global
        batch (None: every module, all rows), drawn on `device`; every split of the batch sees
        the same samples (`mosaic.data`). On the host, where drawing is CPU time, sample i of a
        module comes from its own generator, seeded by (seed, step, module, i), so a rank draws
        only the samples it runs. On a GPU the cost is launching, not drawing: each module's
        whole global batch comes from one generator seeded by (seed, step, module), a few
        launches, and a rank keeps its rows (per sample it was about a hundred launches a step
        for CLIP `small` b32, from the thread that launches the training step). The values
        depend on the device type, not on the split, the rank or the run."""
        configs = self.preset(preset).modules
        if ranges is None:
            ranges = {name: (0, global_batch) for name in configs}
        draw = _rows_of_whole_batch if _draws_whole_batch(device) else _rows_sample_by_sample
        out: dict[str, tuple[Tensor, ...]] = {}
        for name, (start, stop) in ranges.items():
            rows = draw(configs[name], (start, stop), f"{seed}/{step}/{name}", global_batch, device)
            if rows:  # modules fed only by other modules have no inputs
                out[name] = rows
        return out

    def loss(
        self, modules: Mapping[str, ZooModule], inputs: Mapping[str, tuple[Tensor, ...]]
    ) -> Tensor:
        """Run every module in graph order in this process; returns the sink's loss."""
        outputs: dict[str, Tensor] = {}
        for name in self.module_names:
            upstream = [outputs[p] for p in self.predecessors(name)]
            outputs[name] = modules[name](*inputs[name], *upstream)
        return outputs[self.module_names[-1]]

    # --- cost graph ----------------------------------------------------------------------
    def graph(self, preset: str, global_batch: int | None = None) -> MMGraph:
        """The MMGraph of this model at `preset`, costs counted on the real modules."""
        chosen = self.preset(preset)
        costs = _measured_costs(self, preset)
        shapes = self.in_shapes(preset)
        specs = tuple(
            _module_spec(name, config, shapes[name], costs[name])
            for name, config in chosen.modules.items()
        )
        return MMGraph(
            name=self.name,
            modules=specs,
            edges=self.edges,
            global_batch=chosen.global_batch if global_batch is None else global_batch,
            preset=preset,
            meta={"description": self.description, "note": chosen.note, "count_batch": COUNT_BATCH},
        )


def _build_one(
    config: ModuleConfig, in_shapes: list[Shape], device: torch.device, seed: int, name: str
) -> ZooModule:
    import torch

    # Seed per module so a rank building a subset gets the same weights as one building all.
    module_seed = seed * 1_000_003 + zlib.crc32(name.encode())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(module_seed)
        with device:
            return config.build(in_shapes)


def _draws_whole_batch(device: Device) -> bool:
    """Whether make_rows draws each module's whole global batch at once on `device` (GPUs)."""
    import torch

    return torch.device(device).type != "cpu"


def _rows_sample_by_sample(config: ModuleConfig, rows: tuple[int, int], key: str, global_batch: int,
                           device: Device) -> tuple[Tensor, ...]:
    import torch

    samples = [config.make_inputs(1, _seeded_generator(f"{key}/{i}", device))
               for i in range(*rows)]
    if not samples or not samples[0]:
        return ()
    return tuple(torch.cat(column) for column in zip(*samples, strict=True))


def _rows_of_whole_batch(config: ModuleConfig, rows: tuple[int, int], key: str, global_batch: int,
                         device: Device) -> tuple[Tensor, ...]:
    whole = config.make_inputs(global_batch, _seeded_generator(f"{key}/batch", device))
    if rows == (0, global_batch):
        return tuple(whole)
    return tuple(t[rows[0]:rows[1]].clone() for t in whole)  # not a view: the rest is freed


def _seeded_generator(key: str, device: Device = "cpu") -> torch.Generator:
    """A generator on `device` seeded by a hash of `key` (the draw's coordinates), so that
    draws of nearby steps, indices or seeds do not come from related streams."""
    import hashlib

    import torch

    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest, "little") >> 1)


def _to(t: Tensor, device: Device, dtype: torch.dtype | None) -> Tensor:
    cast = dtype is not None and t.is_floating_point()
    return t.to(device=device, dtype=dtype if cast else t.dtype)


@functools.lru_cache(maxsize=64)
def _measured_costs(model: ZooModel, preset: str) -> dict[str, ModuleCost]:
    shipped = shipped_costs(model, preset)
    if shipped is not None:
        return shipped
    # A preset changed since the table was written, or another torch / transformers: count.
    from mosaic.zoo.cost import count_model

    return count_model(model, preset)


def _module_spec(
    name: str, config: ModuleConfig, in_shapes: list[Shape], cost: ModuleCost
) -> ModuleSpec:
    assert cost.out_shape == config.out_shape(in_shapes), (name, cost.out_shape)
    return ModuleSpec(
        name=name,
        kind=config.kind,
        input_shape=config.input_shape,
        num_params=cost.num_params,
        num_layers=config.num_layers,
        hidden_dim=config.hidden_dim,
        tokens_per_sample=config.tokens_per_sample(in_shapes),
        flops_per_sample=cost.flops_per_sample,
        activation_bytes_per_sample=cost.activation_bytes_per_sample,
        output_bytes_per_sample=cost.output_bytes_per_sample,
        num_kernels=cost.num_kernels,
        max_tensor_parallel=config.max_tensor_parallel,
        bf16_weight_params=cost.bf16_weight_params,
    )
