"""Compiled modules in the engine, on CPU: Inductor's kernels train like eager ones, and a
module whose compile fails trains eagerly, alone, and says why."""

import pytest
import torch

from mosaic.engine.compile import CompileReport, compile_modules, workaround_options
from mosaic.engine.session import EngineConfig
from mosaic.engine.trainer import TrainConfig, train
from tests.test_engine import ToyModel, assert_state_close, one_gpu_plans, state_of


def _train(model, engine: EngineConfig):
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    return train(TrainConfig(device="cpu", model=model.name, plan=plan, steps=3, warmup_steps=0,
                             lr=1e-2, optimizer="sgd", engine=engine, progress=False), model=model)


@pytest.mark.slow
# One xdist worker runs the Inductor tests in turn (this and test_user_program's): the second
# reuses the precompiled header and kernels the first built, most of the cost on a clean machine.
@pytest.mark.xdist_group("inductor")
def test_a_compiled_plan_trains_like_the_eager_one():
    model = ToyModel("toyvlm")
    eager = _train(model, EngineConfig())
    compiled = _train(model, EngineConfig(compile="default"))
    assert set(compiled.summary["compile"]["compiled"]) == set(model.factories)
    assert not compiled.summary["compile"]["eager"]
    assert_state_close(state_of(compiled.modules), state_of(eager.modules), rtol=1e-4, atol=1e-5)


def test_a_module_whose_compile_fails_runs_eagerly_and_says_why(monkeypatch):
    def broken_compile(module, **kwargs):
        def fails(*args):
            raise RuntimeError("AssertionError in tiling_utils (injected)")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)
    model = ToyModel("toyvlm")
    eager = _train(model, EngineConfig())
    result = _train(model, EngineConfig(compile="default"))
    report = result.summary["compile"]
    assert set(report["eager"]) == set(model.factories)
    assert "tiling_utils (injected)" in report["eager"]["vision"]
    assert_state_close(state_of(result.modules), state_of(eager.modules))


def test_only_the_audio_encoder_gets_the_inductor_workaround():
    from mosaic.zoo import get_model

    modules = get_model("imagebind").build_modules("tiny")
    options = {name: workaround_options(m)[0] for name, m in modules.items()}
    assert options["audio"] == {"triton.coalesce_tiling_analysis": False}
    assert all(not o for name, o in options.items() if name != "audio")


def test_the_engine_refuses_inductors_own_cuda_graphs():
    with pytest.raises(ValueError, match="captures CUDA graphs itself"):
        compile_modules({"m": torch.nn.Linear(2, 2)}, "reduce-overhead", CompileReport())


def test_gemm_tuning_passes_inductors_gemm_option_alone(monkeypatch):
    """max-autotune-gemm is Inductor's GEMM tuning without max-autotune's coordinate-descent
    tuning of every other kernel; the user program's twin keeps reduce-overhead's graphs."""
    from mosaic.engine.user_program import plain_compile

    seen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: seen.append(kwargs) or module)
    compile_modules({"m": torch.nn.Linear(2, 2)}, "max-autotune-gemm", CompileReport())
    plain_compile("m", torch.nn.Linear(2, 2), "reduce-overhead-max-autotune-gemm")
    plain_compile("m", torch.nn.Linear(2, 2), "reduce-overhead")
    assert seen[0]["options"] == {"max_autotune_gemm": True}
    assert seen[1] == {"options": {"triton.cudagraphs": True, "max_autotune_gemm": True}}
    assert seen[2] == {"mode": "reduce-overhead"}


def test_the_backward_is_compiled_without_retaining_a_graph(monkeypatch):
    """AOTAutograd refuses retain_graph once a compiled backward donates buffers (OFASys
    `paper` vision on the H200): the first call compiles the backward on a throwaway forward,
    so the returned output's graph is the only one the real backward uses."""
    calls = []

    def fake_compile(module, **kwargs):
        return module  # stands in for Inductor: the first-call logic is what is tested

    def record_grad(outputs, inputs, **kwargs):
        calls.append(kwargs)
        return real_grad(outputs, inputs, **kwargs)

    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.autograd, "grad", record_grad)
    layer = torch.nn.Linear(3, 2)
    views, report = compile_modules({"m": layer}, "default", CompileReport())
    x = torch.randn(4, 3, requires_grad=True)
    views["m"](x).sum().backward()
    assert len(calls) == 1 and not calls[0].get("retain_graph")
    assert not report.eager and x.grad is not None and layer.weight.grad is not None


class _Stack(torch.nn.Module):
    """An embedding, three identical blocks in a ModuleList, a head: a toy transformer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).sum()


@pytest.mark.slow
@pytest.mark.xdist_group("inductor")
def test_blocks_scope_compiles_one_layer_for_all_and_leaves_the_module_as_it_was():
    from torch._dynamo.utils import counters

    from mosaic.engine.compile import repeated_block_lists

    module, x = _Stack(), torch.randn(4, 8)
    assert [path for path, _ in repeated_block_lists(module)] == ["layers"]
    eager_loss = module(x)
    eager_grads = torch.autograd.grad(eager_loss, list(module.parameters()))
    torch._dynamo.reset()
    counters.clear()
    views, report = compile_modules({"m": module}, "default", scope="blocks")
    loss = views["m"](x)
    grads = torch.autograd.grad(loss, list(module.parameters()))
    assert report.compiled["m"]["scope"] == "blocks" and report.compiled["m"]["blocks"] == 3
    assert counters["stats"]["unique_graphs"] == 1  # the block, traced once for all three
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The module itself still runs eagerly (the user's eager program shares it).
    assert all(type(layer) is torch.nn.Sequential for layer in module.layers)
    assert all(p1 is p2 for p1, p2 in zip(views["m"].parameters(), module.parameters(),
                                          strict=True))


def test_a_module_without_repeated_blocks_is_compiled_whole_under_blocks_scope():
    _, report = compile_modules({"m": torch.nn.Linear(2, 2)}, "default", scope="blocks")
    assert report.compiled["m"]["scope"] == "module"
    with pytest.raises(ValueError, match="compile scope 'layers'"):
        compile_modules({"m": torch.nn.Linear(2, 2)}, "default", scope="layers")


def test_the_user_program_compiles_whole_modules_under_an_engine_compiling_blocks():
    from mosaic.engine.measure import user_compile_fn

    _, report = compile_modules({"m": _Stack()}, "default", scope="blocks")
    user_compile_fn(report, "torch-compile")("m", _Stack(), "reduce-overhead")
    assert report.compiled["m"]["scope"] == "blocks"
    assert report.compiled["torch-compile/m"]["scope"] == "module"


def test_compiling_raises_dynamos_recompile_limit_for_blocks_sharing_one_function(monkeypatch):
    """Past Dynamo's limit a function runs eagerly with only a warning: the limit must cover
    every block class and batch shape that shares one `forward` (transformers' layers)."""
    import torch._dynamo

    from mosaic.engine.compile import RECOMPILE_LIMIT

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    compile_modules({"m": _Stack()}, "default", scope="blocks")
    assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT
