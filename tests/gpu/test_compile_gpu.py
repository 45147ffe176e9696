"""Inductor on the GPU (skipped without CUDA): the audio encoder (transformers ASTModel)
compiles with its scoped workaround and trains; without it torch 2.11 asserted in
tiling_utils.get_pw_red_splits (pytorch#197077).

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_compile_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from mosaic.engine.compile import CompileReport, compile_modules

pytestmark = pytest.mark.gpu


def _fwd_bwd(view, inputs):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = view(*inputs)
    out.float().square().mean().backward()


def test_the_audio_encoder_compiles_with_its_workaround_and_trains():
    from mosaic.zoo import get_model

    model = get_model("imagebind")
    module = model.build_modules("small", "cuda", names=["audio"])["audio"]
    inputs = model.make_inputs("small", 4, torch.Generator().manual_seed(0), "cuda")["audio"]
    views, report = compile_modules({"audio": module}, "default", CompileReport())
    _fwd_bwd(views["audio"], inputs)
    assert report.eager == {}, report.eager
    assert report.compiled["audio"]["options"] == {"triton.coalesce_tiling_analysis": False}
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)
    print(f"audio encoder compiled in {report.compile_s['audio']:.1f} s")


@pytest.mark.parametrize("module", ["audio", "llm"])
def test_a_module_compiled_by_blocks_is_captured_without_compiling_inside_the_capture(module):
    """Compile scope `blocks` runs a module's glue eagerly between compiled layers. With
    transformers' SDPA the glue built an attention mask only while capturing (it counts
    capture as tracing), the layer recompiled inside the capture, and CUDA refused
    (OFASys `paper` on the H200, 2026-12-01). The zoo's attention builds none: capture works
    and replays what the compiled module computes."""
    from mosaic.engine.graphed import InGraphGradModule
    from mosaic.zoo import get_model

    model = get_model("ofasys")
    built = model.build_modules("tiny", "cuda", names=[module])[module]
    args = model.module_args("tiny", module, 4, torch.Generator("cuda").manual_seed(0), "cuda")
    views, report = compile_modules({module: built}, "default", CompileReport(), scope="blocks")
    assert report.compiled[module]["scope"] == "blocks"
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        want = views[module](*args).float()
        graphed = InGraphGradModule(views[module], list(built.parameters()), args,
                                    torch.cuda.Stream())
    graphed.forward_graph.replay()
    torch.testing.assert_close(graphed.static_output.float(), want, rtol=2e-2, atol=2e-2)
