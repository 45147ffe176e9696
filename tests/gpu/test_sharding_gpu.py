"""Sharded states (FSDP2) on two GPUs over NCCL (skipped without them): sharded plans train like
the same plans unsharded and like one process, beside CUDA-graphed unsharded modules, and a
zoo model under bf16 autocast and torch.compile follows its unsharded loss curve.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_sharding_gpu.py -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import failure_lines
from tests.test_engine import reference_state
from tests.test_sharding_engine import (
    LR,
    SHARDED_CASES,
    STEPS,
    ZOO_CASES,
    assert_same,
    load_run,
    make_model,
    run_cases,
    unsharded,
    zoo_plan,
)

pytestmark = pytest.mark.gpu

FP32_GPU = {"rtol": 1e-4, "atol": 1e-5}
"""Float32 on a GPU, sharded against unsharded: NCCL sums in another order than gloo."""
BF16 = {"rtol": 3e-2, "atol": 3e-2}
"""Loss curves under bf16 autocast (as tests/gpu/test_engine_gpu.py)."""


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("graphs", [False, True])
def test_sharded_plans_over_nccl_train_like_unsharded_and_one_process(tmp_path, graphs):
    """fp32 (autocast off); with graphs, the unsharded modules replay CUDA graphs while the
    sharded ones run eagerly with FSDP's collectives in their hooks."""
    _two_gpus()
    cases = {}
    for name, (model, plan) in SHARDED_CASES.items():
        cases[name] = {"model": model, "plan": plan, "steps": STEPS, "graphs": graphs}
        cases[f"{name}-unsharded"] = {"model": model, "plan": unsharded(plan), "steps": STEPS,
                                      "graphs": graphs}
    run_cases(cases, tmp_path, device="cuda")
    for name, (model, _) in SHARDED_CASES.items():
        states, losses = load_run(tmp_path, name)
        plain_states, plain_losses = load_run(tmp_path, f"{name}-unsharded")
        torch.testing.assert_close(losses[0], plain_losses[0], **FP32_GPU)
        reference = reference_state(make_model(model), "tiny", STEPS, LR)  # on the CPU
        for rank in range(2):
            assert_same(states[rank], plain_states[rank], **FP32_GPU)
            assert_same(states[rank], reference, rtol=1e-3, atol=1e-4)  # as test_engine_gpu


def test_zoo_models_sharded_follow_the_unsharded_loss_curve(tmp_path):
    """bf16 autocast, AdamW, CUDA graphs and torch.compile on: the sharded modules compiled
    after sharding (traced anew) and not graphed, the others compiled and graphed."""
    _two_gpus()
    cases = {}
    for model, sharded in ZOO_CASES.items():
        for label, shard in (("sharded", sharded), ("unsharded", set())):
            cases[f"{model}-{label}"] = {
                "model": model, "plan": zoo_plan(model, shard), "steps": 8, "lr": 1e-4,
                "optimizer": "adamw", "amp": True, "graphs": True, "compile": "default"}
    run_cases(cases, tmp_path, device="cuda")
    for model, sharded in ZOO_CASES.items():
        _, losses = load_run(tmp_path, f"{model}-sharded")
        _, plain_losses = load_run(tmp_path, f"{model}-unsharded")
        print(f"{model}: sharded {[round(x, 4) for x in losses[0]]}, "
              f"unsharded {[round(x, 4) for x in plain_losses[0]]}")
        torch.testing.assert_close(losses[0], plain_losses[0], **BF16)
        report = json.loads((tmp_path / f"{model}-sharded" / "compile0.json").read_text())
        assert sharded <= set(report["compiled"]) & set(report["compile_s"]), report
        assert not report["eager"], report


def test_sharded_plans_over_nccl_clip_the_global_norm_as_one_process_does(tmp_path):
    """--clip-grad-norm over NCCL with FSDP shards beside graphed unsharded modules (fp32)."""
    _two_gpus()
    clip = 0.05
    cases = {name: {"model": model, "plan": plan, "steps": STEPS, "graphs": True,
                    "clip_grad_norm": clip}
             for name, (model, plan) in SHARDED_CASES.items()}
    run_cases(cases, tmp_path, device="cuda")
    for name, (model, _) in SHARDED_CASES.items():
        norms: list[float] = []
        reference = reference_state(make_model(model), "tiny", STEPS, LR, clip_grad_norm=clip,
                                    norms=norms)
        states, _ = load_run(tmp_path, name)
        for rank in range(2):
            assert_same(states[rank], reference, rtol=1e-3, atol=1e-4)
            logged = json.loads((tmp_path / name / f"grad_norms{rank}.json").read_text())
            assert logged == pytest.approx(norms, rel=1e-3), name


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_the_users_fsdp2_program_passes_the_bench_check_beside_ddp_over_nccl(tmp_path,
                                                                            reduce_dtype):
    """The user's torch.compile program on FSDP2 (bf16 weights gathered, compiled without CUDA
    graphs) beside the same program on DDP and a plan, in one `mosaic bench` on both GPUs:
    its gradients pass the bench's check (the bf16-weights tolerance) and it is timed; with
    bf16 reductions, DDP's bf16 hook and FSDP2's bf16 reduce-scatter too. Prints each
    contender's step and what the compile report says of the FSDP2 program's modules."""
    _two_gpus()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "mosaic", "bench", "clip", "--gpus", "2", "--preset", "small", "--perf-model",
         "analytic", "--planners", "megatron", "--rounds", "2", "--out", str(tmp_path),
         "--user-programs", "torch-eager,torch-compile,torch-compile-fsdp", "--json",
         "--reduce-dtype", reduce_dtype],
        capture_output=True, text=True, timeout=420, env=env)
    assert result.returncode == 0, failure_lines(result.stderr)
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["planner"]: r for r in report["results"]}
    compiled = report["checks"]["compile"]
    print({label: round(1e3 * r["measured_iteration_s"], 2) for label, r in rows.items()},
          report["checks"]["gradients"],
          {k: v for k, v in compiled.get("compiled", {}).items() if k.startswith("torch-compile-fsdp")},
          {k: v for k, v in compiled.get("eager", {}).items() if k.startswith("torch-compile-fsdp")})
    assert rows["torch-compile-fsdp"]["measured_iteration_s"] > 0
    assert "torch-compile-fsdp" in report["checks"]["gradients"]["other_kernels"]
