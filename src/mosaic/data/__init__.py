"""Data that each rank loads only its own share of.

A plan has every module process a range of each step's GLOBAL batch on each rank
(`mosaic.engine.comm.sample_range`; a contrastive head all of it). The engine asks its data
source for exactly those rows, once per step (per micro-step with gradient accumulation):

    source.rows(step, {"vision": (0, 32), "text": (32, 64)}, global_batch=64)
        -> {"vision": (images_of_samples_0_to_31,), "text": (ids_of_samples_32_to_63,)}

so a rank reads and decodes only the samples of the modules it runs. The contract: the
sample at index i of step s is a function of (s, i) alone, whichever rank asks and however the
batch is split, so that any plan trains exactly as one process on the whole batch does
(tests/test_engine_dist.py checks it). A module without data inputs of its own may be left
out of the answer.

`ShardedDataset` is such a source over a map-style dataset (`len(ds)`, `ds[i]` -> {module:
tensor or tuple of tensors}): a seeded shuffle per epoch, as `DistributedSampler` does, but
split along the plan's ranges per module rather than one range per rank. `DatasetModel` feeds
a zoo model from a source instead of its synthetic inputs (`mosaic train --data digits`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mosaic.errors import MosaicError

if TYPE_CHECKING:
    from torch import Tensor, nn

    from mosaic.graph import MMGraph

Ranges = Mapping[str, tuple[int, int]]
"""Module name -> [start, stop) of the step's global batch."""

DATASETS = ("synthetic", "digits")
"""`--data` choices: the zoo's synthetic inputs, or scikit-learn's digits (CLIP only)."""


class DataError(MosaicError):
    """A data source or data set that cannot feed the model; the message says the fix."""


@runtime_checkable
class RowSource(Protocol):
    """Data that each rank loads only its share of (see the module doc)."""

    def rows(self, step: int, ranges: Ranges, global_batch: int) -> Mapping[str, Any]:
        """{module: tensor or tuple of tensors} with stop - start rows per module of `ranges`."""
        ...


def slice_rows(batch: Mapping[str, tuple[Tensor, ...]], ranges: Ranges) -> dict[str, tuple[Tensor, ...]]:
    """The rows of `ranges` cut from a whole global batch (sources that cannot do better)."""
    return {m: tuple(t[start:stop] for t in batch[m])
            for m, (start, stop) in ranges.items() if m in batch}


class ShardedDataset:
    """A map-style dataset as a RowSource: sample i of step s is item
    `permutation(epoch)[(s * global_batch + i) % len(dataset)]`, the permutation seeded by
    (seed, epoch) (identity without `shuffle`). A rank fetches only the items of its ranges,
    each once per call even when several of its modules need it."""

    def __init__(self, dataset: Any, *, seed: int = 0, shuffle: bool = True) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise DataError(f"ShardedDataset(dataset): give a map-style dataset (len() and "
                            f"[i]), got {type(dataset).__name__}; for an iterable DataLoader of "
                            "global batches pass the DataLoader itself to mosaic.api.train")
        if len(dataset) < 1:
            raise DataError("ShardedDataset(dataset): the dataset is empty")
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self._orders: dict[int, Tensor] = {}

    def index(self, step: int, sample: int, global_batch: int) -> int:
        """The dataset item at position `sample` of step `step`'s global batch."""
        position = step * global_batch + sample
        epoch, offset = divmod(position, len(self.dataset))
        return int(self._order(epoch)[offset]) if self.shuffle else offset

    def _order(self, epoch: int) -> Tensor:
        import torch

        if epoch not in self._orders:
            if len(self._orders) > 4:  # a run walks epochs forward: keep the last few only
                self._orders.pop(min(self._orders))
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(len(self.dataset), generator=generator)
        return self._orders[epoch]

    def rows(self, step: int, ranges: Ranges, global_batch: int) -> dict[str, tuple[Tensor, ...]]:
        items: dict[int, Mapping[str, Any]] = {}
        out = {}
        for module, (start, stop) in ranges.items():
            picked = [self.index(step, i, global_batch) for i in range(start, stop)]
            for i in picked:
                if i not in items:
                    items[i] = self.dataset[i]
            if picked and module in items[picked[0]]:
                out[module] = _stack([items[i][module] for i in picked])
        return out


def _stack(samples: Sequence[Any]) -> tuple[Tensor, ...]:
    """One sample's tensor (or tuple of tensors) per item -> batched tensors, batch first."""
    import torch

    fields = [s if isinstance(s, tuple | list) else (s,) for s in samples]
    return tuple(torch.stack(list(column)) for column in zip(*fields, strict=True))


class DatasetModel:
    """A zoo model trained on a RowSource instead of its synthetic inputs: modules and graph
    are the zoo model's, batches the source's; `evaluate` (when the source has one) scores
    the trained modules (the digits' zero-shot accuracy)."""

    def __init__(self, model: Any, source: RowSource, data_name: str) -> None:
        self.model, self.source, self.data_name = model, source, data_name
        self.name = model.name

    def graph(self, preset: str, global_batch: int | None = None) -> MMGraph:
        return self.model.graph(preset, global_batch)

    def build_modules(self, preset: str, device: Any = "cpu", dtype: Any = None, *,
                      names: Any = None, seed: int = 0) -> dict[str, nn.Module]:
        return self.model.build_modules(preset, device, dtype, names=names, seed=seed)

    def make_rows(self, preset: str, ranges: Ranges | None, *, step: int, seed: int,
                  global_batch: int) -> dict[str, tuple[Tensor, ...]]:
        del seed  # the source was seeded when it was made
        if ranges is None:
            ranges = {m: (0, global_batch) for m in self.model.module_names}
        rows = self.source.rows(step, ranges, global_batch)
        return {m: tuple(t) if isinstance(t, tuple | list) else (t,) for m, t in rows.items()}

    def make_inputs(self, preset: str, batch_size: int, generator: Any = None,
                    device: Any = "cpu") -> dict[str, tuple[Tensor, ...]]:
        """The source's first batch of `batch_size` samples (the trainer uses make_rows)."""
        rows = self.make_rows(preset, None, step=0, seed=0, global_batch=batch_size)
        return {m: tuple(t.to(device) for t in ts) for m, ts in rows.items()}

    def evaluate(self, modules: Mapping[str, nn.Module]) -> dict[str, Any] | None:
        evaluate = getattr(self.source, "evaluate", None)
        return evaluate(modules) if evaluate is not None else None


def check_dataset(model: Any, data: str, preset: str) -> None:
    """DataError unless the named data set can feed `model` at `preset` (loads nothing)."""
    if data == "synthetic":
        return
    if data not in DATASETS:
        raise DataError(f"data={data!r}; use one of {', '.join(DATASETS)}")
    from mosaic.data import digits

    digits.check_model(model, preset)


def with_dataset(model: Any, data: str, preset: str, seed: int = 0) -> Any:
    """`model` fed by the named data set (`DATASETS`); 'synthetic' leaves it as it is."""
    check_dataset(model, data, preset)
    if data == "synthetic":
        return model
    from mosaic.data import digits

    return DatasetModel(model, digits.source_for(model, preset, seed), data)
