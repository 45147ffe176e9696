"""The one timer: CUDA events on a GPU, `perf_counter` on CPU.

A mark is recorded on a stream without synchronising, so marks can sit inside a timed region;
only `seconds` waits (for the later mark), and it is called after the region ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Mark:
    """A point in time: a recorded CUDA event, or a host clock reading on CPU."""

    event: Any = None
    host_s: float = 0.0


class Timer:
    """Marks on streams and the seconds between them, for one device."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self, stream: Any = None) -> Mark:
        """Record now on `stream` (the current stream when None); never synchronises."""
        if not self.cuda:
            return Mark(host_s=time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return Mark(event=event)

    def seconds(self, start: Mark, end: Mark) -> float:
        """Seconds from `start` to `end`; waits for `end` on a GPU. Marks may be on any stream
        of the device (event times share one device clock)."""
        if not self.cuda:
            return end.host_s - start.host_s
        end.event.synchronize()
        return start.event.elapsed_time(end.event) / 1e3
