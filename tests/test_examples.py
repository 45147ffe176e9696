"""The examples run as a user runs them (a subprocess), so CI keeps them working."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_clip_imu_example_trains():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "clip_imu.py"), "--steps", "20"],
                            capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan for 2 GPU(s)" in result.stdout and "plan for 1 GPU(s)" in result.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert last < first
    assert "zero-shot accuracy after training" in result.stdout


@pytest.mark.slow
def test_clip_imu_example_benches_its_plans_against_the_users_program():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "clip_imu.py"), "--bench"],
                            capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout[result.stdout.index("clip-imu (custom, batch 64)"):]
    for label in ("megatron", "mosaic", "torch-eager"):
        assert re.search(rf"{label} +│ +[\d.]+ ms", table), label
    assert "loss" not in result.stdout  # benched, not trained


def _makefile_demo_args() -> list[str]:
    """`make demo`'s CPU training run, as the Makefile writes it (DEMO_CPU = ...)."""
    line = re.search(r"^DEMO_CPU = (.+)$", (ROOT / "Makefile").read_text(), re.M)
    return line.group(1).split()


@pytest.mark.slow
def test_the_cpu_demo_learns_the_digits(tmp_path):
    """The README's demo on a CPU: the tiny CLIP on scikit-learn's digits, planned and trained;
    the loss falls clearly and the zero-shot accuracy on held-out images beats chance (0.1)."""
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "mosaic", *_makefile_demo_args(),
                             "--out", str(out)], capture_output=True, text=True, timeout=280,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"zero-shot accuracy [\d.]+ on 359 held-out images", result.stdout)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(losses[:3]) / 3, sum(losses[-20:]) / 20
    assert last < 0.8 * first, (first, last)
    accuracy = json.loads((out / "summary.json").read_text())["eval"]["zero_shot_accuracy"]
    assert accuracy > 0.3, accuracy  # three times chance
