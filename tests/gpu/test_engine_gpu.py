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
from tests.test_engine import (
    ToyModel,
    assert_state_close,
    one_gpu_plans,
    reference_state,
    state_of,
)
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


@pytest.mark.parametrize(("graphs", "grad_sync"),
                         [(False, "ddp"), (True, "ddp"), (True, "flat"), (True, "overlapped")])
def test_nccl_processes_equal_one_process(tmp_path, graphs, grad_sync):
    """The CPU multi-process cases over NCCL, float32 (autocast off) against the CPU loop;
    with graphs, capture also runs next to live NCCL communicators, and with 'overlapped'
    each data-parallel module's backward graph holds its buckets' all-reduces."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cases = cases_2()
    run_workers(2, cases, tmp_path, device="cuda", graphs=graphs, grad_sync=grad_sync)
    for name, (toy, plan) in cases.items():
        reference = reference_state(ToyModel(toy), "tiny", STEPS, LR)
        check_case(tmp_path, name, toy, plan, 2, reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bf16_weights", [False, True])
@pytest.mark.parametrize("planner", ["mosaic", "megatron"])
def test_overlapped_optimizer_steps_each_module_on_its_stream_as_one_optimizer_would(
        bf16_weights, planner):
    """`--engine-variant optimizer_overlap=true`: each module's AdamW (fused, or over its bf16
    weights' flat buffers) starts when its backward ends, on the module's stream or, in
    megatron's temporal stages, on a side stream; the parameters come out as one optimizer's."""
    from tests.test_bench import overlapped_against_one_optimizer

    # Six steps: MainWeightsAdamW captures its update once the gradients stay put (step 4).
    states, ready, graph = overlapped_against_one_optimizer(
        "cuda", graphs=True, steps=6, bf16_weights=bf16_weights, planner=planner)
    assert ready["overlapped"] == set(graph.names)  # one GPU, nothing summed: all final early
    for name, want in states["one"].items():
        torch.testing.assert_close(states["overlapped"][name], want, rtol=1e-6, atol=1e-7,
                                   msg=name)


FP32 = EngineConfig(amp=False)
"""float32 on one stream: two runs agree to the last bits but for atomics' order."""


@pytest.mark.parametrize("graphs", [False, True])
def test_steps_in_flight_train_as_steps_read_one_by_one(graphs):
    """The trainer reads step k while step k+1 runs (engine/steps.py): the same losses and
    weights as waiting for every step, with CUDA graphs replaying over the same buffers."""
    from mosaic.zoo import get_model

    plan = one_gpu_plans(get_model("imagebind").graph("tiny"))["temporal"]

    def run(read_each_step: bool):
        engine = EngineConfig(amp=False, graphs=graphs)
        return train(TrainConfig(model="imagebind", preset="tiny", plan=plan, steps=6,
                                 warmup_steps=1, engine=engine, device="cuda", progress=False,
                                 read_each_step=read_each_step))

    one_by_one, in_flight = run(True), run(False)
    np.testing.assert_allclose([s["loss"] for s in in_flight.steps],
                               [s["loss"] for s in one_by_one.steps], rtol=1e-5)
    assert_state_close(state_of(in_flight.modules), state_of(one_by_one.modules))


def _clean_and_skipped(monkeypatch, nan_step: int, engine: EngineConfig = FP32,
                       preset: str = "tiny"):
    """ImageBind (tiny: fp32), trained `nan_step` steps clean, then one step more with a NaN
    gradient at `nan_step` and --skip-nonfinite."""
    from mosaic.zoo import get_model

    plan = one_gpu_plans(get_model("imagebind").graph(preset))["temporal"]

    def run(steps: int):
        return train(TrainConfig(model="imagebind", preset=preset, plan=plan, steps=steps,
                                 warmup_steps=1, engine=engine, device="cuda", progress=False,
                                 skip_nonfinite=True))

    clean = run(nan_step)
    monkeypatch.setenv("MOSAIC_FAULT", f"nan:rank=0:step={nan_step}")
    return clean, run(nan_step + 1)


def test_a_nan_step_is_skipped_on_the_gpu_without_a_host_check(monkeypatch):
    """Fused AdamW told `found_inf` by the device: the skipped step leaves every weight as the
    clean run's after step 1 (an applied update, even of zero gradients, moves them by about
    the learning rate), though the host read the step only after launching the next."""
    clean, skipped = _clean_and_skipped(monkeypatch, 2)
    assert [("skipped" in r) for r in skipped.steps] == [False, False, True]
    assert_state_close(state_of(skipped.modules), state_of(clean.modules))


def test_a_host_bound_run_turns_to_the_fused_check_and_still_skips_a_nan_step(monkeypatch):
    """A tiny model's step is bound by the host: after five steps the guard checks each
    module's gradients in one kernel (engine/steps.py GuardChoice); a NaN at step 6 is still
    skipped on the GPU."""
    clean, skipped = _clean_and_skipped(monkeypatch, 6)
    assert skipped.summary["nan_guard"] == "check"
    assert [("skipped" in r) for r in skipped.steps] == [False] * 6 + [True]
    assert_state_close(state_of(skipped.modules), state_of(clean.modules))


def test_a_nan_in_a_flat_gradient_buffer_is_skipped_by_the_captured_update(monkeypatch):
    """bf16 weights, graphed: the health check reads each module's flat gradient buffer (the
    NaN lands in a parameter's view of it) and the update, bf16 and fp32 parameters captured
    as one graph since step 3, skips on the device (`small`: its large weights are bf16).
    Attention runs on the math kernels: with the fused ones, 8 of the audio class token's 512
    fp32 weights differed by up to 3.5e-4 between the clean and the skipped run on the H200
    (a few elements, as Adam's sign flips on near-zero gradients of a backward that does not
    sum in the same order every run; an applied update moves the whole tensor)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    engine = EngineConfig(graphs=True, compile=None, bf16_weights=True)
    with sdpa_kernel(SDPBackend.MATH):
        clean, skipped = _clean_and_skipped(monkeypatch, 6, engine, "small")
    assert [("skipped" in r) for r in skipped.steps] == [False] * 6 + [True]
    assert_state_close(state_of(skipped.modules), state_of(clean.modules))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("graphs", [False, True])
def test_clipped_gradients_on_the_gpu_train_as_torchs_clip_grad_norm(graphs, optimizer):
    """--clip-grad-norm on the GPU: the norm from each module's gradients (the backward
    graphs' flat buffers with graphs), the factor applied on the device (AdamW: told it, in
    its captured step), float32 (autocast off) against the CPU loop clipping all its
    parameters. Steps past the optimizer's capture (MainWeightsAdamW captures its third)."""
    from mosaic.engine.trainer import TrainConfig, train

    model, clip, steps = ToyModel("toyvlm"), 0.05, 6
    lr = LR if optimizer == "sgd" else 1e-2
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    result = train(TrainConfig(device="cuda", model="toyvlm", plan=plan, steps=steps,
                               warmup_steps=1, lr=lr, optimizer=optimizer, clip_grad_norm=clip,
                               engine=EngineConfig(graphs=graphs, amp=False)), model=model)
    norms: list[float] = []
    want = reference_state(model, "tiny", steps, lr, clip_grad_norm=clip, norms=norms,
                           optimizer=optimizer)
    assert min(norms) > clip
    assert_state_close(state_of(result.modules), want, rtol=1e-3, atol=1e-4)
    assert [s["grad_norm"] for s in result.steps] == pytest.approx(norms, rel=1e-3)


def test_nccl_processes_clip_the_global_norm_as_one_process_does(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    clip = 0.05
    cases = cases_2()
    run_workers(2, cases, tmp_path, device="cuda", graphs=True, clip_grad_norm=clip)
    for name, (toy, plan) in cases.items():
        reference = reference_state(ToyModel(toy), "tiny", STEPS, LR, clip_grad_norm=clip)
        check_case(tmp_path, name, toy, plan, 2, reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("background_saves", [False, True])
def test_real_data_pinned_on_threads_leaves_the_optimizers_capture_whole(tmp_path,
                                                                        background_saves):
    """Real data comes through the row threads, which pin each step's rows (engine/rows.py);
    the optimizer captures its step a few steps in. Pinning from another thread during that
    capture made it fail and killed the run (`mosaic train clip --preset small --data
    digits`, fp32, H200, 2026-12-04): the run trains, and its optimizer step is captured;
    with a checkpoint written in the background after every step too (its writer thread
    must make no CUDA call while the optimizer captures)."""
    import warnings

    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.zoo import get_model

    plan = one_gpu_plans(get_model("clip").graph("small"))["temporal"]
    saves = (CheckpointConfig(directory=str(tmp_path), every_steps=1, background=True)
             if background_saves else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(TrainConfig(model="clip", preset="small", plan=plan, steps=10,
                                   warmup_steps=1, data="digits", device="cuda",
                                   progress=False, checkpoint=saves))
    assert len(result.steps) == 10
    assert not [w for w in caught if "capture failed" in str(w.message)]
