"""Engine on a GPU (skipped without CUDA): every sharing mode trains like temporal execution,
CUDA graphs like eager, and NCCL processes like one process.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_engine_gpu.py -s

With -s each test prints one line per run (mode, pool backend, median step time), so the
run doubles as a quick look at the sharing modes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mosaic.engine.session import EngineConfig
from mosaic.engine.trainer import TrainConfig, train
from tests.test_engine import ToyModel, one_gpu_plans, reference_state
from tests.test_engine_dist import LR, STEPS, cases_2, check_case, run_workers

pytestmark = pytest.mark.gpu

BF16 = {"rtol": 3e-2, "atol": 3e-2}
"""Loss curves under bf16 autocast: the modes run the same kernels, but some backward
kernels accumulate with atomics, so curves may drift apart in the last bits."""


def _run(preset: str, sharing: str, graphs: bool, steps: int = 8) -> tuple[list[float], dict]:
    from mosaic.zoo import get_model

    plan = one_gpu_plans(get_model("imagebind").graph(preset))[sharing]
    result = train(TrainConfig(model="imagebind", preset=preset, plan=plan, steps=steps,
                               warmup_steps=1, lr=1e-4, engine=EngineConfig(graphs=graphs), device="cuda",
                               progress=False))
    summary = result.summary
    print(f"imagebind/{preset} {sharing:9s} graphs={graphs!s:5s} "
          f"backend={summary['pool']['backend']:13s} "
          f"median={1e3 * summary['step_time_median_s']:.2f} ms "
          f"losses={[round(s['loss'], 4) for s in result.steps]}")
    return [s["loss"] for s in result.steps], summary


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_colocated_modes_follow_the_temporal_loss_curve(preset):
    temporal, _ = _run(preset, "temporal", graphs=False)
    for sharing in ("free", "partition", "cap"):
        losses, summary = _run(preset, sharing, graphs=False)
        np.testing.assert_allclose(losses, temporal, **BF16, err_msg=sharing)
        if sharing == "partition" and not summary["pool"]["enforced"]:
            print(f"WARNING: SM quotas not enforced: {summary['pool']['fallback_reason']}")


@pytest.mark.parametrize("sharing", ["temporal", "free", "partition"])
def test_cuda_graphs_agree_with_eager(sharing):
    eager, _ = _run("small", sharing, graphs=False)
    graphed, _ = _run("small", sharing, graphs=True)
    np.testing.assert_allclose(graphed, eager, **BF16, err_msg=sharing)


@pytest.mark.parametrize("graphs", [False, True])
def test_nccl_processes_equal_one_process(tmp_path, graphs):
    """The CPU multi-process cases over NCCL, float32 (autocast off) against the CPU loop;
    with graphs, capture also runs next to live NCCL communicators."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cases = cases_2()
    run_workers(2, cases, tmp_path, device="cuda", graphs=graphs)
    for name, (toy, plan) in cases.items():
        reference = reference_state(ToyModel(toy), "tiny", STEPS, LR)
        check_case(tmp_path, name, toy, plan, 2, reference, rtol=1e-3, atol=1e-4)


def test_overlapped_optimizer_steps_each_module_on_its_stream_as_one_optimizer_would():
    """`--engine-variant optimizer_overlap=true`: each module's fused AdamW starts on the
    module's stream when its backward ends; the parameters come out as one AdamW's."""
    from tests.test_bench import overlapped_against_one_optimizer

    states, ready, graph = overlapped_against_one_optimizer("cuda", graphs=True)
    assert ready["overlapped"] == set(graph.names)  # one GPU, nothing summed: all final early
    for name, want in states["one"].items():
        torch.testing.assert_close(states["overlapped"][name], want, rtol=1e-6, atol=1e-7,
                                   msg=name)
