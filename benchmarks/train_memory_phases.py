"""Where a `mosaic train` run's GPU memory goes: the same command line, in process, with
torch's allocated bytes and peak printed after the run's build, after each of its first steps
and after graph capture (the summary keeps only the run's peak). Usage:
    PYTHONPATH=src python benchmarks/train_memory_phases.py qwen3-vl --preset paper ...
"""

from __future__ import annotations

import functools
import sys

import torch

import mosaic.engine.trainer as trainer
from mosaic.cli import main


def _report(what: str) -> None:
    gib = 2**30
    print(f"memory after {what}: allocated {torch.cuda.memory_allocated() / gib:.1f} GiB, "
          f"peak {torch.cuda.max_memory_allocated() / gib:.1f} GiB", flush=True)


def _reporting(owner, name: str, limit: int) -> None:
    original, calls = getattr(owner, name), [0]

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] <= limit:
            torch.cuda.synchronize()
            _report(f"{name} #{calls[0]}")
        return result

    setattr(owner, name, wrapped)


if __name__ == "__main__":
    _reporting(trainer, "_build", 1)
    _reporting(trainer, "launch_step", 4)
    _reporting(trainer.RankSession, "capture_graphs", 1)
    main(["train", *sys.argv[1:]])
