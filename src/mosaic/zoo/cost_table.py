"""The zoo's counted module costs, shipped as `data/costs.json` so planning never imports torch.

Counting a preset (`mosaic.zoo.cost`) builds every module on fake tensors and runs a forward
+ backward under FlopCounterMode: seconds per model and a torch + transformers import. The
counts are a pure function of the module configs and the counting code, so they are counted
once (`python -m mosaic.zoo.cost --write`) and shipped; `ZooModel.graph` reads an entry when
its fingerprint matches and counts as before otherwise. tests/test_zoo_costs.py recounts and
compares, so the file cannot drift from the code.

The fingerprint hashes what the counts depend on: the preset's module configs (their dataclass
reprs), the model's edges (predecessor outputs are inputs), the counting batch, the file
format, and the major.minor versions of torch and transformers -- the kernel count and the
saved activations follow their op decompositions and autograd, which move between minor
releases. Versions come from package metadata, not an import, to stay cheap.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from mosaic.files import write_text_atomic


class ZooModel(Protocol):
    """What counting needs of a zoo model (`mosaic.zoo.base.ZooModel` is one). A protocol,
    not an import: base.py reads this table, so importing base here would close a circle."""

    name: str
    edges: tuple[tuple[str, str], ...]

    def preset(self, name: str) -> Any: ...
    def in_shapes(self, preset: str) -> dict[str, list[Any]]: ...
    def predecessors(self, name: str) -> list[str]: ...
    def make_inputs(self, preset: str, batch_size: int, generator: Any) -> dict[str, Any]: ...

COUNT_BATCH = 2
"""Samples per counting pass (2, not 1, so batch-broadcast shapes are not mistaken for sizes)."""

FORMAT = 2
"""Bump when ModuleCost or the counting method changes meaning: every entry goes stale."""
COSTS_PATH = Path(__file__).parent / "data" / "costs.json"
REGENERATE = "python -m mosaic.zoo.cost --write"


@dataclass(frozen=True, kw_only=True)
class ModuleCost:
    flops_per_sample: float
    activation_bytes_per_sample: float
    output_bytes_per_sample: float
    num_params: int
    num_kernels: int
    """Non-view aten ops in one forward + backward: an estimate of kernel launches."""
    out_shape: tuple[int, ...]
    bf16_weight_params: int = 0
    """Parameters `--bf16-weights` stores in bf16 (the engine's own rule, on a meta copy of
    the module: `cost.count_graph`)."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModuleCost:
        return cls(**{**d, "out_shape": tuple(d["out_shape"])})


@functools.lru_cache(maxsize=1)
def versions() -> dict[str, str] | None:
    """major.minor of torch and transformers, or None when either has no package metadata."""
    try:
        return {name: ".".join(metadata.version(name).split(".")[:2])
                for name in ("torch", "transformers")}
    except metadata.PackageNotFoundError:  # e.g. a source checkout on PYTHONPATH: count instead
        return None


def entry_key(model: str, preset: str) -> str:
    return f"{model}/{preset}"


def fingerprint(model: ZooModel, preset: str) -> str | None:
    """What the counts of (model, preset) depend on, hashed; None when versions are unknown."""
    found = versions()
    if found is None:
        return None
    configs = [(name, repr(config)) for name, config in model.preset(preset).modules.items()]
    text = repr((FORMAT, COUNT_BATCH, model.edges, configs, sorted(found.items())))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@functools.lru_cache(maxsize=4)
def load_table(path: Path = COSTS_PATH) -> dict[str, Any]:
    """The shipped table; an empty one when the file is missing (a partial install counts)."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {"format": FORMAT, "entries": {}}
    return table if table.get("format") == FORMAT else {"format": FORMAT, "entries": {}}


def shipped_costs(model: ZooModel, preset: str, path: Path = COSTS_PATH) -> dict[str, ModuleCost] | None:
    """The shipped costs of (model, preset) when their fingerprint matches, else None."""
    entry = load_table(path)["entries"].get(entry_key(model.name, preset))
    expected = fingerprint(model, preset)
    if entry is None or expected is None or entry.get("fingerprint") != expected:
        return None
    return {name: ModuleCost.from_dict(d) for name, d in entry["modules"].items()}


def table_entry(model: ZooModel, preset: str, costs: dict[str, ModuleCost]) -> dict[str, Any]:
    return {"fingerprint": fingerprint(model, preset),
            "modules": {name: {**asdict(cost), "out_shape": list(cost.out_shape)}  # as JSON reads
                        for name, cost in costs.items()}}


def write_table(entries: dict[str, dict[str, Any]], path: Path = COSTS_PATH) -> Path:
    """Write the table atomically: an interrupted regeneration never leaves half a cache."""
    table = {"format": FORMAT, "generated_by": REGENERATE, "versions": versions(),
             "count_batch": COUNT_BATCH, "entries": dict(sorted(entries.items()))}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(table, indent=1) + "\n")
    load_table.cache_clear()
    return path
