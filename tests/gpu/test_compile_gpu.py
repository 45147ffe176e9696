"""Inductor on the GPU (skipped without CUDA): the audio encoder (transformers ASTModel)
compiles with its scoped workaround and trains; without it torch 2.11 asserted in
tiling_utils.get_pw_red_splits (pytorch#197077).

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_compile_gpu.py -s
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mosaic.engine.compile import CompileReport, compile_modules
from mosaic.engine.session import EngineConfig
from mosaic.engine.trainer import TrainConfig, train

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


def test_modules_compiled_by_blocks_are_captured_without_compiling_inside_the_capture():
    """Compile scope `blocks` runs a module's glue eagerly between compiled layers. With
    transformers' SDPA the glue built an attention mask only while capturing (it counts
    capture as tracing), a layer recompiled inside the capture, and CUDA refused (OFASys
    `paper` on the H200, 2026-12-01). The zoo's attention builds none: the engine captures
    OFASys (audio encoder and LLM included, modules of a level sharing the GPU) and trains as it does uncaptured."""
    from mosaic.zoo import get_model
    from tests.test_engine import one_gpu_plans

    plan = one_gpu_plans(get_model("ofasys").graph("tiny"))["free"]
    losses = {}
    for graphs in (False, True):
        engine = EngineConfig(graphs=graphs, compile="default", compile_scope="blocks")
        result = train(TrainConfig(model="ofasys", preset="tiny", plan=plan, steps=4,
                                   warmup_steps=1, lr=1e-4, engine=engine, device="cuda",
                                   progress=False))
        losses[graphs] = [s["loss"] for s in result.steps]
    np.testing.assert_allclose(losses[True], losses[False], rtol=3e-2, atol=3e-2)
