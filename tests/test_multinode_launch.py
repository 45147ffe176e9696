"""Two "nodes" on this machine: two torchrun agents meeting at a c10d rendezvous, 2 ranks each
(gloo on the CPU), train one plan over all 4 ranks, as docs/multinode.md launches real nodes."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_two_node_torchrun_trains_one_plan(tmp_path):
    port = _free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MOSAIC_DEBUG": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    metrics = tmp_path / "metrics.jsonl"
    procs = []
    for node in range(2):
        cmd = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mosaic-test-{port}",
               "--node-rank", str(node), "-m", "mosaic", "train", "clip", "--preset", "tiny",
               "--planner", "megatron", "--gpus", "4", "--steps", "3", "--perf-model", "analytic",
               "--metrics", str(metrics)]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=100)[0])
    finally:
        for p in procs:  # only the agents this test started, by their handles
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"node {node}:\n{out[-4000:]}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) == 3
    losses = [row["loss"] for row in rows]
    assert all(math.isfinite(x) for x in losses), losses
    assert "gpus=4" in outputs[0], outputs[0][-2000:]
