"""GPU mechanics of profiling: one module as CUDA graphs on quota'd streams, timed with events.

A graph keeps its SM quota only when captured ON the green-context stream it is replayed on
(measured on the H200: a graph captured elsewhere runs on every SM), so every (module, batch, stream) gets its own capture. A group of graphs is timed
together from one start event: a short sleep kernel on a launcher stream gives the host time to
enqueue every replay, then all member streams wait on the start event, so members start
together and each member's time is start -> its own end event.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mosaic.engine.graphed import fresh_cublas_workspaces
from mosaic.engine.green import SMPartitionPool, StreamRequest
from mosaic.errors import MosaicError
from mosaic.hardware import GPUSpec

SLEEP_CYCLES = 200_000
"""About 0.1 ms at the H200's clock: enough to enqueue a few graph replays behind it."""


class ProfilerError(MosaicError):
    """Profiling cannot give meaningful numbers here; the message says why and the fix."""


@dataclass(frozen=True, slots=True)
class Timing:
    median_s: float
    spread: float
    """(p90 - p10) / median over the repeats."""
    repeats: int
    members_s: tuple[float, ...] = ()
    """Median per member of a group (start -> member's end)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TimingConfig:
    min_repeats: int = 3
    max_repeats: int = 10
    point_budget_s: float = 0.06
    """Replays per point: as many as fit in this many seconds, within [min, max]."""
    clock: str = "events"
    """"events": CUDA events from one start event; "host": perf_counter while polling each
    stream (for drivers that refuse events recorded on green-context streams)."""


class GraphBench:
    """One module at one per-GPU batch: static inputs and a CUDA graph of fwd+bwd per stream."""

    def __init__(self, module: nn.Module, args: Sequence[torch.Tensor], amp: bool = True) -> None:
        self.module = module
        self.args = tuple(args)
        self.amp = amp
        self.grad_out: torch.Tensor | None = None
        self.eager = False
        """True once a capture failed: this module is timed eagerly (launch overhead included)."""
        self.mode = "global"
        self.capture_errors: list[str] = []
        self._last_oom = False
        """The last capture attempt ran out of memory. Only the fact is kept: the exception's
        traceback would hold the failed capture's frames, and with them every tensor it had
        allocated, so the retry after emptying the cache would fail too."""

    def step(self) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp, cache_enabled=False):
            out = self.module(*self.args)
        if out.dim() == 0:
            out.backward()
            return
        if self.grad_out is None:  # made during the eager warm-up, static inside graphs
            self.grad_out = torch.randn_like(out) * 1e-3
        out.backward(self.grad_out)

    def _clear_grads(self) -> None:
        for t in (*self.module.parameters(), *self.args):
            t.grad = None

    def capture(self, stream: torch.cuda.Stream) -> Any:
        """Warm up eagerly on `stream`, then capture fwd+bwd there (grads in the graph's pool).

        Low-level capture: `torch.cuda.graph` also runs gc.collect() and empty_cache() on every
        entry, which costs more than the capture for hundreds of small graphs; instead the
        cyclic GC is paused during capture (a graph it destroyed mid-capture would invalidate
        the capture). A capture refused in "global" error mode (e.g. a library's cudaMalloc
        in another thread) is retried in "relaxed" mode, one that ran out of memory once more
        after emptying the allocator's cache; a module that still cannot be captured is timed
        eagerly instead (`eager`, with the reasons in `capture_errors`).
        """
        release_idle_cache()
        with torch.cuda.stream(stream):
            self._clear_grads()
            self.step()
            self._clear_grads()
        torch.cuda.synchronize()
        for mode in self._modes():
            graph = self._try_capture(stream, mode)
            if graph is None and self._last_oom:
                # Deleted graphs' private pools stay cached until emptied (this low-level
                # capture skips torch.cuda.graph's empty_cache): empty, and try once more.
                gc.collect()
                torch.cuda.empty_cache()
                graph = self._try_capture(stream, mode)
            if graph is not None:
                return graph
        self.eager = True
        return _Eager(self.step)

    def _try_capture(self, stream: torch.cuda.Stream, mode: str) -> Any:
        """The graph, or None with the error noted (`capture_errors`, `_last_oom`)."""
        graph = torch.cuda.CUDAGraph()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode=mode)
                try:
                    self.step()
                finally:
                    graph.capture_end()
            self.mode = mode
            self._clear_grads()
            return graph
        except RuntimeError as exc:
            self._last_oom = isinstance(exc, torch.OutOfMemoryError)
            self.capture_errors.append(f"{mode}: {str(exc).strip().splitlines()[0][:200]} "
                                       f"[{memory_state()}]")
            del exc
            del graph
            _quiet_sync()
            self._clear_grads()
            return None
        finally:
            gc.enable()

    def _modes(self) -> tuple[str, ...]:
        if self.eager:
            return ()
        return (self.mode,) if self.mode == "relaxed" else ("global", "relaxed")


def _quiet_sync() -> None:
    with contextlib.suppress(RuntimeError):  # a failed capture's error surfaces once, not sticky
        torch.cuda.synchronize()


@dataclass(frozen=True, slots=True)
class _Eager:
    """Stands in for a graph whose capture failed: `replay` runs the step eagerly."""

    replay: Callable[[], None]


def _spread(xs: np.ndarray) -> float:
    if len(xs) < 3:
        return 0.0
    p10, p50, p90 = np.percentile(xs, [10, 50, 90])
    return float((p90 - p10) / p50)


def time_group(members: Sequence[tuple[Callable[[], None], torch.cuda.Stream]], cfg: TimingConfig,
               background: tuple[Callable[[], None], torch.cuda.Stream] | None = None) -> Timing:
    """Run every member (a replay function and its stream) together, `n` times.

    `background` (e.g. a memory-streaming antagonist) starts with them and is not timed.
    One untimed warm-up run sizes the number of repeats.
    """
    run = _run_events if cfg.clock == "events" else _run_host
    first = max(run(members, background))
    n = int(np.clip(cfg.point_budget_s / max(first, 1e-6), cfg.min_repeats, cfg.max_repeats))
    per = np.array([run(members, background) for _ in range(n)])
    group = per.max(axis=1)
    return Timing(float(np.median(group)), _spread(group), n,
                  tuple(float(x) for x in np.median(per, axis=0)))


def _launch_all(members: Sequence[tuple[Callable[[], None], Any]], background: Any,
                start: Any = None) -> list[Any]:
    """Members first: a long background launch sequence must not delay their enqueueing."""
    ends = []
    for fn, stream in list(members) + ([background] if background else []):
        if start is not None:
            stream.wait_event(start)
        with torch.cuda.stream(stream):
            fn()
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            ends.append(end)
    return ends


def _run_events(members: Sequence[tuple[Callable[[], None], Any]],
                background: Any) -> list[float]:
    launcher = torch.cuda.Stream()
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(launcher):
        torch.cuda._sleep(SLEEP_CYCLES)  # time to enqueue every member behind the start
        start.record(launcher)
    ends = _launch_all(members, background, start)
    torch.cuda.synchronize()
    return [start.elapsed_time(e) / 1e3 for e in ends[: len(members)]]


def _run_host(members: Sequence[tuple[Callable[[], None], Any]],
              background: Any) -> list[float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _launch_all(members, background)
    ends: dict[int, float] = {}
    while len(ends) < len(members):
        now = time.perf_counter() - t0
        for i, (_, stream) in enumerate(members):
            if i not in ends and stream.query():
                ends[i] = now
    torch.cuda.synchronize()
    return [ends[i] for i in range(len(members))]


def events_work(stream: torch.cuda.Stream) -> bool:
    """Can events be recorded on, and waited for from, this (green) stream?"""
    try:
        launcher = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(launcher)
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1000)
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) >= 0
    except RuntimeError:
        torch.cuda.synchronize()
        return False


MAX_GROUP_POOLS = 4
"""Colocation stream pools kept at once. Every stream holds its own cached allocator blocks
and cuBLAS workspaces, and every green context its own local memory: a profile that kept one
pool per layout ran the H200 out of memory after about a hundred layouts."""


IDLE_CACHE_FRACTION = 0.25
"""Return the allocator's cache to the device once this share of it sits unused. Warm-ups on
each SM count's stream cache their blocks per stream, and a deleted graph's private pool stays
reserved until emptied: on a big module, a few points' worth fill the GPU."""


def memory_state() -> str:
    """Allocated and reserved device memory, for error notes."""
    return (f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
            f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved")


def release_idle_cache() -> None:
    """Empty the allocator's cache when its unused memory exceeds IDLE_CACHE_FRACTION of the
    device (cheap to check; emptying on every capture would cost more than capturing).

    Called between captures, while other graphs are alive (a colocation captures each member
    before replaying any): so the cuBLAS workspaces stay, unlike free_device_memory(). A
    graph's GEMMs point into the workspace of the stream they were captured on; releasing it
    made the next replay of compiled ImageBind's graphs fault (unspecified launch failure)."""
    idle = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if idle > IDLE_CACHE_FRACTION * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory:
        gc.collect()
        torch.cuda.empty_cache()


def free_device_memory() -> None:
    """Return cached memory: cyclic garbage, per-stream cuBLAS workspaces, cached blocks.
    Only between measurements: a live graph may point into a workspace."""
    gc.collect()
    torch.cuda.synchronize()
    fresh_cublas_workspaces()
    torch.cuda.empty_cache()


class StreamBank:
    """Streams for profiling on one GPU: a cap stream per SM count, plain normal/high streams.

    Each cap is its own group, so every cap starts at the first SM unit and has exactly the
    SMs it asks for (the pool reports what the driver gave: on the H200 a 128-SM cap covers
    all 132, since the split leaves 15 groups of 8 and one of 12).
    """

    def __init__(self, gpu: GPUSpec, device: int = 0) -> None:
        self.gpu = gpu
        self.device = device
        caps = range(gpu.sm_granularity, gpu.num_sms, gpu.sm_granularity)
        requests = [StreamRequest(key=f"cap{k}", mode="cap", num_sms=k, group=i)
                    for i, k in enumerate(caps)]
        requests += [StreamRequest(key="free0", mode="free", num_sms=None, priority=0),
                     StreamRequest(key="free1", mode="free", num_sms=None, priority=1)]
        self.pool = SMPartitionPool.create(requests, device, gpu)
        if not self.pool.enforced:
            raise ProfilerError(f"SM quotas are not enforced on cuda:{device} "
                                f"({self.pool.fallback_reason}); profile on a GPU with green contexts")
        self.full_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.by_sms: dict[int, str] = {}
        for k in caps:
            got = self.pool.num_sms(f"cap{k}") or k
            if got < self.full_sms:
                self.by_sms.setdefault(got, f"cap{k}")
        self.by_sms[self.full_sms] = "free0"
        self.clock = "events" if events_work(self.pool.stream(self.by_sms[min(self.by_sms)])) else "host"
        self._partitions: dict[tuple[object, ...], SMPartitionPool] = {}

    @property
    def sm_values(self) -> list[int]:
        return sorted(self.by_sms)

    def stream(self, num_sms: int, priority: int = 0) -> tuple[str, torch.cuda.Stream]:
        key = f"free{priority}" if num_sms >= self.full_sms else self.by_sms[num_sms]
        return key, self.pool.stream(key)

    def group(self, mode: str, sizes: Sequence[int], priorities: Sequence[int]) -> tuple[
            list[str], list[torch.cuda.Stream], list[int]]:
        """Streams for a colocated group in a sharing mode, made by the engine's own pool (so
        partitions and caps are laid out as training lays them out): (stream tags, streams,
        SMs each member really has). A size of the whole GPU means no quota (a free stream)."""
        layout_key = (mode, *zip(sizes, priorities, strict=True))
        if layout_key not in self._partitions and len(self._partitions) >= MAX_GROUP_POOLS:
            self._evict()
        if layout_key not in self._partitions:
            reqs = []
            for i, (k, p) in enumerate(zip(sizes, priorities, strict=True)):
                quota = mode in ("partition", "cap") and k < self.full_sms
                reqs.append(StreamRequest(key=f"m{i}", mode=mode if quota else "free",
                                          num_sms=k if quota else None, priority=p, group=0))
            self._partitions[layout_key] = SMPartitionPool.create(reqs, self.device, self.gpu)
        pool = self._partitions[layout_key]
        keys = [f"m{i}" for i in range(len(sizes))]
        tag = f"{mode}:" + "-".join(f"{k}.{p}" for k, p in zip(sizes, priorities, strict=True))
        return ([f"{tag}:{key}" for key in keys], [pool.stream(key) for key in keys],
                [pool.num_sms(key) or self.full_sms for key in keys])

    def _evict(self) -> None:
        """Destroy the oldest group pool (call only when no graph captured on it is alive)."""
        oldest = next(iter(self._partitions))
        self._partitions.pop(oldest).close()
        free_device_memory()

    def close(self) -> None:
        for pool in self._partitions.values():
            pool.close()
        self._partitions.clear()
        self.pool.close()


class Antagonist:
    """A memory-streaming background: `copies` device-to-device copies of `num_bytes`, eager.

    Eager launches on a green stream obey its quota; each copy lasts far longer than its launch,
    so the queue stays ahead of the GPU.
    """

    def __init__(self, num_bytes: int = 512 << 20) -> None:
        self.src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        self.dst = torch.empty_like(self.src)
        self.num_bytes = num_bytes
        self.copies = 1

    def __call__(self) -> None:
        for _ in range(self.copies):
            self.dst.copy_(self.src)
