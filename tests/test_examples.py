"""The examples run as a user runs them (a subprocess), so CI keeps them working."""

from __future__ import annotations

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
