"""The host rows of the next training steps, made while the GPU runs the current one.

Synthetic inputs are drawn on the CPU: 16 ms a step for CLIP `paper` on each of two ranks,
measured by torch.profiler on 2 x H200, while the GPU waited. One background thread was not
enough once the trainer kept steps in flight: the H200 host's CPU draws CLIP `small`'s 32
rows in 30-54 ms (OFASys `paper`'s 8 in 120 ms) against an 8.5 ms step, and the trainer ran
at 30 ms a step. Several threads each draw a whole step, up to that many steps ahead (torch
releases the GIL while it draws): with 8, CLIP `small` trained at 10.96 ms a step against
10.65 ms with every step's rows drawn once (one H200 machine, one process). Worker processes
(torch's DataLoader, 8 forked workers, rows through shared memory) measured slower on the
same machine: 15.8-16.4 ms. The loaders are seeded per step and sample, so the rows are the
ones made inline. On CUDA the threads also pin them: a trace of OFASys `paper` found the
upload from pageable memory taking 5.2 ms of each step, synchronously, while the GPU waited;
from pinned memory the copy is asynchronous and the host goes on to launch the step.

The zoo's synthetic rows need none of that on a GPU: drawn there (`RowsOnDevice`), a step's
rows are kernel launches from the training thread, queued ahead of the step on its stream,
with no copy. Eight threads drawing on the host kept up only partly: CLIP `small` b32 trained
at 16.82 ms a step, 8.41 ms with every step's rows made once, and 12.58-14.27 ms with rows
drawn on the GPU one seeded generator per sample (H200, 2026-12-02, one process): about a
hundred launches a step on a host-bound step. So on a GPU each module's whole global batch is
now one draw (zoo/base.py make_rows): 8.12 ms in flight, as fast as rows made once (8.13 ms;
same machine and model, 2026-12-02). Real data (`mosaic.data` sources, a
user's loader) still comes through the threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Rows = list[dict[str, Any]]

PINNING = threading.Lock()
"""Held while a row thread pins rows, and by a thread about to capture a CUDA graph: pinning
allocates page-locked memory and queries events, which a capture in progress on any thread
forbids (the capture fails and the pinning thread gets "operation not permitted when stream
is capturing"). On the H200, `mosaic train clip --preset small --data digits` died so at the
optimizer's capture, three steps in (2026-12-04)."""


class RowPrefetcher:
    """`make(step)`'s rows for the steps of `steps`, made by `threads` threads (None:
    `row_threads()`), up to that many steps ahead of `get`, pinned when `pin`."""

    def __init__(self, make: Callable[[int], Rows], steps: range, *, pin: bool = False,
                 threads: int | None = None) -> None:
        self._make = lambda step: pinned(make(step), pin)
        self._steps = steps
        self._ahead = threads or row_threads()
        self._pool = ThreadPoolExecutor(max_workers=self._ahead, thread_name_prefix="mosaic-rows")
        self._pending: dict[int, Future] = {}
        self._ask(steps.start)

    def _ask(self, step: int) -> None:
        if step in self._steps and step not in self._pending:
            self._pending[step] = self._pool.submit(self._make, step)

    def get(self, step: int) -> Rows:
        """Step `step`'s rows (made now if not asked for); asks for the steps after it."""
        self._ask(step)
        rows = self._pending.pop(step).result()
        for ahead in range(step + 1, step + 1 + self._ahead):
            self._ask(ahead)
        return rows

    def settle(self) -> None:
        """Wait until the rows asked for are made and pinned (pinning allocates host memory:
        not while a CUDA graph is being captured)."""
        for future in self._pending.values():
            future.result()

    def __enter__(self) -> RowPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True)


class RowsOnDevice:
    """`make(step)`'s rows made when asked for, in the caller's thread: for rows drawn on the
    GPU, where the training thread's stream orders them before the step that reads them."""

    def __init__(self, make: Callable[[int], Rows]) -> None:
        self._make = make

    def get(self, step: int) -> Rows:
        return self._make(step)

    def settle(self) -> None:
        """Nothing is made ahead, so nothing is pending."""

    def __enter__(self) -> RowsOnDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def row_threads() -> int:
    """Row-drawing threads per rank: half the CPUs this process may use, shared by the ranks
    torchrun starts on this host, 1 to 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (cpus or 1) // (2 * ranks_here)))


def pinned(rows: Rows, pin: bool) -> Rows:
    """The rows in page-locked host memory when `pin` (CUDA), else as they are."""
    if not pin:
        return rows
    with PINNING:
        return [{m: tuple(t.pin_memory() for t in ts) for m, ts in r.items()} for r in rows]
