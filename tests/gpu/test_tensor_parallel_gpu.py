"""Tensor parallelism over NCCL on two GPUs (skipped without them).

Measured on 2 x H200 (2026-11-30): the TP cases' losses differ from one CPU process by 0.4% at
step 0 and 1.9% after two SGD steps, beyond float32 round-off. Whether that is the GPU's own
numerics (TF32 convolutions in the vision encoder) or the shards is isolated here: the same
plan with the LLM data-parallel instead of split runs on the same GPUs, and TP must match it
tightly; both must follow the CPU run loosely.

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_tensor_parallel_dist import CASES, _free_port, _plan, _worker, reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile_scope", [None, "blocks"])
def test_tensor_parallel_over_nccl_matches_data_parallel_on_the_same_gpus(tmp_path,
                                                                          compile_scope):
    """`compile_scope='blocks'`: both plans compiled, the TP shards after the split (Inductor
    over DTensor weights and NCCL collectives); the shards' kernels differ from the whole
    layer's, so TP matches DP within Inductor's reordering, not exactly."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import torch.multiprocessing as mp

    cases = {"tp2": CASES[2]["tp2"],
             "dp2": [_plan(2, {"vision": (0, 1), "text": (1, 0)}, (0, 1), 1)]}
    mp.start_processes(_worker, args=(2, _free_port(), cases, str(tmp_path), "cuda", None,
                                      compile_scope),
                       nprocs=2, join=True, start_method="spawn")
    if compile_scope:
        report = json.loads((tmp_path / "tp2" / "compile0.json").read_text())
        assert "llm" in report["compile_s"] and not report["eager"], report

    def losses(name: str) -> list[float]:
        rows = (tmp_path / name / "metrics0.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows]

    exact = 1e-4 if compile_scope is None else 1e-3
    assert losses("tp2") == pytest.approx(losses("dp2"), rel=exact)  # the shards
    assert losses("tp2") == pytest.approx(reference()[0], rel=3e-2)  # the GPU: close
