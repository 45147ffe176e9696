"""The host rows of the next training steps, made while the GPU runs the current one.

Synthetic inputs are drawn on the CPU: 16 ms a step for CLIP `paper` on each of two ranks,
measured by torch.profiler on 2 x H200, while the GPU waited. One background thread was not
enough once the trainer kept steps in flight: the H200 host's CPU draws CLIP `small`'s 32
rows in 30-50 ms (OFASys `paper`'s 8 in 120 ms) against an 8.5 ms step. Threads did not
fix it: with 8 of them CLIP `small` trained at 11.6 ms a step against 9.3 ms with the rows
drawn once, because every short torch call of the training thread waits for the GIL behind
them. On CUDA the rows are therefore drawn by worker processes (torch's DataLoader, forked:
the loaders need no pickling), one step per item, and a single thread pins them: a trace
of OFASys `paper` found the upload from pageable memory taking 5.2 ms of each step,
synchronously, while the GPU waited; from pinned memory the copy is asynchronous and the
host goes on to launch the step. On a CPU, where nothing waits for the host this way,
threads draw them. Either way the loaders are seeded per step and sample, so the rows are
the ones made inline.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

Rows = list[dict[str, Any]]


class RowPrefetcher:
    """`make(step)`'s rows for the steps of `steps`, asked for ahead of `get`.

    processes: DataLoader worker processes that draw them (None: `row_workers()` on CUDA,
    else 0); threads: drawing threads when there are no processes (None: `row_workers()`).
    """

    def __init__(self, make: Callable[[int], Rows], steps: range, *, pin: bool = False,
                 processes: int | None = None, threads: int | None = None) -> None:
        processes = (row_workers() if pin else 0) if processes is None else processes
        self._steps = steps
        self._loader = None
        if processes:
            self._loader = iter(_step_loader(make, steps, processes))
            self._ahead, draw = processes, self._next_from_loader
        else:
            self._ahead, draw = threads or row_workers(), make
        self._make = lambda step: pinned(draw(step), pin)
        # One thread takes the loader's items in order; several may draw at once.
        self._pool = ThreadPoolExecutor(max_workers=1 if processes else self._ahead,
                                        thread_name_prefix="mosaic-rows")
        self._pending: dict[int, Future] = {}
        self._ask(steps.start)

    def _next_from_loader(self, step: int) -> Rows:
        drawn, rows = next(self._loader)
        if drawn != step:
            raise RuntimeError(f"row prefetch out of order: asked for step {step}, got {drawn}")
        return rows

    def _ask(self, step: int) -> None:
        if step in self._steps and step not in self._pending:
            self._pending[step] = self._pool.submit(self._make, step)

    def get(self, step: int) -> Rows:
        """Step `step`'s rows (made now if not asked for); asks for the steps after it.
        Steps are taken in order, as the training loop takes them."""
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
        self._loader = None  # ends the worker processes


class _StepRows(torch.utils.data.Dataset):
    """Item i: (step, its rows) for the i-th step of `steps`."""

    def __init__(self, make: Callable[[int], Rows], steps: range) -> None:
        self.make, self.steps = make, steps

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> tuple[int, Rows]:
        step = self.steps[index]
        return step, self.make(step)


def _as_drawn(item: Any) -> Any:
    return item


def _step_loader(make: Callable[[int], Rows], steps: range, processes: int):
    return torch.utils.data.DataLoader(
        _StepRows(make, steps), batch_size=None, num_workers=processes, prefetch_factor=2,
        collate_fn=_as_drawn, multiprocessing_context="fork")


def row_workers() -> int:
    """Row-drawing processes (or threads) per rank: half the CPUs this process may use,
    shared by the ranks torchrun starts on this host, 1 to 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (cpus or 1) // (2 * ranks_here)))


def pinned(rows: Rows, pin: bool) -> Rows:
    """The rows in page-locked host memory when `pin` (CUDA), else as they are."""
    if not pin:
        return rows
    return [{m: tuple(t.pin_memory() for t in ts) for m, ts in r.items()} for r in rows]
