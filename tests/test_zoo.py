"""The zoo on CPU: every model builds, trains at `tiny`, and its cost graph is sane."""

from __future__ import annotations

import math

import pytest
import torch

from mosaic.graph import GraphError, MMGraph
from mosaic.zoo import MODELS, get_model, list_models

NAMES = ["clip", "imagebind", "qwen3-vl", "unified-io-2", "ofasys"]
TINY_BATCH = 8


def _tiny(name: str, seed: int = 0):
    model = get_model(name)
    modules = model.build_modules("tiny", seed=seed)
    inputs = model.make_inputs("tiny", TINY_BATCH, torch.Generator().manual_seed(seed))
    return model, modules, inputs


def test_registry_lists_the_papers_models():
    assert list_models() == NAMES
    assert set(MODELS) == set(NAMES)
    for name in NAMES:
        assert set(get_model(name).presets) == {"paper", "small", "tiny"}


def test_unknown_model_names_the_valid_ones():
    with pytest.raises(
        GraphError, match="valid models: clip, imagebind, qwen3-vl, unified-io-2, ofasys"
    ):
        get_model("gpt-5")


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(GraphError, match="valid presets: paper, small, tiny"):
        get_model("clip").graph("huge")


@pytest.mark.parametrize("name", NAMES)
def test_tiny_forward_backward_gives_finite_scalar_loss(name):
    model, modules, inputs = _tiny(name)
    assert list(modules) == model.module_names
    loss = model.loss(modules, inputs)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    for module in modules.values():
        for p in module.parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_inputs_have_batch_first_for_every_module(name):
    model = get_model(name)
    inputs = model.make_inputs("tiny", 3, torch.Generator().manual_seed(0))
    assert list(inputs) == model.module_names
    for name_, tensors in inputs.items():
        config = model.preset("tiny").modules[name_]
        assert len(tensors) == (1 if config.input_shape else 0)
        for t in tensors:
            assert t.shape == (3, *config.input_shape)


def test_encoders_return_batch_first_tensors_in_calling_convention():
    model, modules, inputs = _tiny("unified-io-2")
    shapes = model.in_shapes("tiny")["llm"]
    outs = [modules[p](*inputs[p]) for p in model.predecessors("llm")]
    assert [tuple(o.shape) for o in outs] == [(TINY_BATCH, *s) for s in shapes]


@pytest.mark.parametrize("name", NAMES)
def test_loss_falls_with_adamw(name):
    model, modules, inputs = _tiny(name)
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model.loss(modules, inputs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_only_contrastive_heads_need_the_global_batch():
    for name in NAMES:
        model = get_model(name)
        modules = model.build_modules("tiny")
        for module_name, module in modules.items():
            expected = name in ("clip", "imagebind") and module_name == "align"
            assert module.needs_global_batch is expected, (name, module_name)


def test_weights_and_data_are_deterministic_and_per_module():
    model = get_model("qwen3-vl")
    full = model.build_modules("tiny", seed=3)
    only_llm = model.build_modules("tiny", seed=3, names=["llm"])
    assert list(only_llm) == ["llm"]
    for a, b in zip(full["llm"].parameters(), only_llm["llm"].parameters(), strict=True):
        assert torch.equal(a, b)
    other_seed = model.build_modules("tiny", seed=4, names=["llm"])
    assert not torch.equal(next(full["llm"].parameters()), next(other_seed["llm"].parameters()))
    x = model.make_inputs("tiny", 4, torch.Generator().manual_seed(1))
    y = model.make_inputs("tiny", 4, torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for k in x for a, b in zip(x[k], y[k], strict=True))


def test_llm_loss_is_a_mean_over_samples():
    # Data parallelism averages the ranks' losses: two halves must average to the whole.
    model, modules, inputs = _tiny("qwen3-vl")
    with torch.no_grad():
        whole = model.loss(modules, inputs)
        halves = [
            model.loss(modules, {k: tuple(t[i : i + 4] for t in v) for k, v in inputs.items()})
            for i in (0, 4)
        ]
    assert torch.allclose(whole, sum(halves) / 2, rtol=1e-5)


def test_runs_under_bf16_autocast():
    model, modules, inputs = _tiny("ofasys")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(modules, inputs)
    assert math.isfinite(loss.item())


def test_unknown_module_name_is_refused():
    with pytest.raises(GraphError, match="no module"):
        get_model("clip").build_modules("tiny", names=["audio"])


def test_paper_modules_build_on_meta():
    modules = get_model("qwen3-vl").build_modules("paper", device="meta")
    assert all(p.is_meta for m in modules.values() for p in m.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_tiny_graph_validates_and_round_trips(name):
    model = get_model(name)
    graph = model.graph("tiny")
    assert graph.names == model.module_names
    assert graph.global_batch == model.preset("tiny").global_batch
    assert graph.sinks == [model.module_names[-1]]
    for spec in graph.modules:
        assert spec.flops_per_sample > 0, spec.name
        assert spec.activation_bytes_per_sample > 0, spec.name
        assert spec.num_params > 0 and spec.num_kernels > 0
    assert MMGraph.from_json(graph.to_json()) == graph
    assert model.graph("tiny", global_batch=64).global_batch == 64


def test_graph_params_match_the_real_modules():
    model, modules, _ = _tiny("ofasys")
    graph = model.graph("tiny")
    for spec in graph.modules:
        assert spec.num_params == sum(p.numel() for p in modules[spec.name].parameters())


@pytest.mark.parametrize("name", NAMES)
def test_flops_grow_with_preset(name):
    model = get_model(name)
    tiny, small = model.graph("tiny"), model.graph("small")
    for a, b in zip(tiny.modules, small.modules, strict=True):
        assert a.flops_per_sample < b.flops_per_sample, a.name
    assert tiny.total_flops() < small.total_flops()


def test_paper_imagebind_has_vit_l_sized_vision():
    graph = get_model("imagebind").graph("paper")
    vision = graph.module("vision")
    assert vision.num_layers == 24 and vision.hidden_dim == 1024
    assert abs(vision.num_params - 304e6) / 304e6 < 0.15
    # DESIGN.md: a ViT-L-like encoder at 257 tokens costs 15.5 TFLOP fwd+bwd for 32 samples.
    assert abs(vision.flops_per_sample * 32 - 15.5e12) / 15.5e12 < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("name", ["imagebind", "qwen3-vl", "unified-io-2"])
def test_paper_flops_near_table_1(name):
    model = get_model(name)
    graph = model.graph("paper")
    for module, tflops in model.paper_tflops.items():
        if graph.module(module).kind == "embedding":
            continue  # an embedding lookup does no matmul FLOPs; the table counts something else
        ours = graph.module(module).flops_per_sample * graph.global_batch / 1e12
        assert 0.75 < ours / tflops < 1.25, (module, ours, tflops)


# --- the shipped cost table (zoo/data/costs.json) ------------------------------------------
def _shipped_versions_or_skip():
    from mosaic.zoo.cost_table import load_table, versions

    shipped = load_table().get("versions")
    if shipped != versions():
        pytest.skip(f"costs.json was counted with {shipped}, this is {versions()}: the table is "
                    f"not used here (graph() counts), so it cannot be compared")


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_has_a_current_shipped_entry(name):
    """A preset edited without regenerating the table would silently fall back to counting."""
    from mosaic.zoo.cost_table import REGENERATE, shipped_costs

    _shipped_versions_or_skip()
    model = get_model(name)
    for preset in model.presets:
        assert shipped_costs(model, preset) is not None, (
            f"{name}/{preset}: no shipped costs for this config; run `{REGENERATE}`")


@pytest.mark.parametrize(("name", "preset"), [(n, "tiny") for n in NAMES] + [("clip", "small")])
def test_shipped_costs_equal_a_fresh_count(name, preset):
    """The table cannot drift from the counting code: recount and compare exactly."""
    from mosaic.zoo.cost import count_model
    from mosaic.zoo.cost_table import REGENERATE, shipped_costs

    _shipped_versions_or_skip()
    model = get_model(name)
    assert count_model(model, preset) == shipped_costs(model, preset), (
        f"{name}/{preset}: counted costs differ from costs.json; run `{REGENERATE}`")


def test_graph_reads_the_shipped_costs_without_counting(monkeypatch):
    from mosaic.zoo import base, cost

    _shipped_versions_or_skip()

    def refuse(*args):
        raise AssertionError("counted although the shipped table matches")

    monkeypatch.setattr(cost, "count_model", refuse)
    base._measured_costs.cache_clear()
    try:
        assert get_model("qwen3-vl").graph("paper").module("llm").flops_per_sample > 0
    finally:
        base._measured_costs.cache_clear()


def test_a_changed_config_misses_the_table():
    import dataclasses

    from mosaic.zoo.base import Preset, ZooModel
    from mosaic.zoo.cost_table import fingerprint, shipped_costs

    model = get_model("clip")
    tiny = model.preset("tiny")
    vision = dataclasses.replace(tiny.modules["vision"], num_layers=3)
    changed = ZooModel(name=model.name, description=model.description, edges=model.edges,
                       presets={"tiny": Preset(name="tiny", global_batch=tiny.global_batch,
                                               modules={**tiny.modules, "vision": vision})})
    assert fingerprint(changed, "tiny") != fingerprint(model, "tiny")
    assert shipped_costs(changed, "tiny") is None



def _first_layer(module: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in module.modules() if type(m).__name__.endswith("Layer"))


def _transformers_modules() -> list[tuple[str, str]]:
    """(model, module) of every zoo module built on a transformers model."""
    from transformers import PreTrainedModel

    found = []
    for name in NAMES:
        for module, built in get_model(name).build_modules("tiny").items():
            if any(isinstance(m, PreTrainedModel) for m in built.modules()):
                found.append((name, module))
    return found


def test_every_transformers_module_gets_no_mask_and_computes_the_masked_attention(monkeypatch):
    """transformers (5.17 on the GPU image; the packed-sequence check of causal masks even in
    5.24) builds the all-true bidirectional or causal mask whenever it is "tracing", CUDA-graph
    capture included: a layer compiled alone then met a mask in the capture that its warm-up
    had not, and Dynamo recompiled inside the capture. The zoo's attention never builds one,
    and computes what attention with transformers' explicit masks computes."""
    pairs = _transformers_modules()
    assert {("clip", "text"), ("ofasys", "audio"), ("ofasys", "llm")} <= set(pairs)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for name, module in pairs:
        model = get_model(name)
        built = model.build_modules("tiny", names=[module])[module]
        args = model.module_args("tiny", module, 2, torch.Generator().manual_seed(0))
        masks = []
        _first_layer(built).register_forward_pre_hook(lambda _m, a, kw, masks=masks: masks.append(
            kw.get("attention_mask", a[1] if len(a) > 1 else None)), with_kwargs=True)
        out = built(*args)
        assert masks == [None], (name, module)
        reference = model.build_modules("tiny", names=[module])[module]
        for m in reference.modules():
            if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
                m.config._attn_implementation = "eager"
        torch.testing.assert_close(out, reference(*args), rtol=1e-4, atol=1e-5,
                                   msg=lambda text, n=name, m=module: f"{n}/{m}: {text}")

