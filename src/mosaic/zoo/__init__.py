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

from mosaic.graph import GraphError
from mosaic.zoo import clip, imagebind, ofasys, qwen3_vl, unified_io_2
from mosaic.zoo.base import Preset, ZooModel

MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (clip.MODEL, imagebind.MODEL, qwen3_vl.MODEL, unified_io_2.MODEL, ofasys.MODEL)
}


def get_model(name: str) -> ZooModel:
    """The zoo model called `name`; GraphError listing the valid names otherwise."""
    if name not in MODELS:
        raise GraphError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}")
    return MODELS[name]


def list_models() -> list[str]:
    return list(MODELS)


__all__ = ["MODELS", "Preset", "ZooModel", "get_model", "list_models"]
