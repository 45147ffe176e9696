"""The paper's multimodal models as real nn.Modules and cost graphs, at presets paper/small/tiny.

    from mosaic.zoo import get_model
    model = get_model("imagebind")
    graph = model.graph("paper")                  # MMGraph with measured costs
    modules = model.build_modules("tiny")         # name -> nn.Module, graph order
    inputs = model.make_inputs("tiny", 8, torch.Generator().manual_seed(0))
    loss = model.loss(modules, inputs)

See `mosaic.zoo.base` for the calling convention the engine relies on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mosaic.graph import GraphError

if TYPE_CHECKING:
    from mosaic.zoo.base import Preset, ZooModel

# Model name -> the module defining its MODEL. A plain table, so an unknown name is refused
# (and the names listed) without importing any model; get_model imports only the one asked for.
_MODULES = {
    "clip": "clip",
    "imagebind": "imagebind",
    "qwen3-vl": "qwen3_vl",
    "unified-io-2": "unified_io_2",
    "ofasys": "ofasys",
}
MODEL_NAMES: tuple[str, ...] = tuple(_MODULES)

PRESETS: tuple[str, ...] = ("paper", "small", "tiny")
"""Every zoo model has these presets (tests/test_zoo.py checks it)."""


def get_model(name: str) -> ZooModel:
    """The zoo model called `name`; GraphError listing the valid names otherwise."""
    if name not in _MODULES:
        raise GraphError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    return importlib.import_module(f"mosaic.zoo.{_MODULES[name]}").MODEL


def list_models() -> list[str]:
    return list(MODEL_NAMES)


def __getattr__(name: str) -> Any:
    """`MODELS`, `Preset` and `ZooModel` as before, imported on first use (PEP 562)."""
    if name == "MODELS":
        return {n: get_model(n) for n in MODEL_NAMES}
    if name in ("Preset", "ZooModel"):
        from mosaic.zoo import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MODELS", "MODEL_NAMES", "PRESETS", "Preset", "ZooModel", "get_model", "list_models"]
