"""The profiler's capture fallbacks, with CUDA faked on the CPU (graph_timing.GraphBench)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from mosaic.profile import graph_timing


class _FakeGraph:
    """Refuses its first capture for lack of memory (as the H200 did with ImageBind `paper`
    vision at batch 1, when deleted graphs' pools were still cached)."""

    refusals = 1

    def capture_begin(self, capture_error_mode: str) -> None:
        if _FakeGraph.refusals:
            _FakeGraph.refusals -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB.")

    def capture_end(self) -> None:
        pass


@pytest.fixture()
def cuda(monkeypatch) -> SimpleNamespace:
    """CUDA faked for GraphBench.capture: `calls` has one entry per torch.cuda.empty_cache()
    call; `memory` sets what the allocator reports (bytes of a 100-byte device)."""
    calls: list[int] = []
    monkeypatch.setattr(graph_timing.torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(graph_timing.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graph_timing.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(graph_timing.torch.cuda, "empty_cache", lambda: calls.append(1))
    memory = {"reserved": 0, "allocated": 0}
    monkeypatch.setattr(graph_timing.torch.cuda, "memory_reserved", lambda: memory["reserved"])
    monkeypatch.setattr(graph_timing.torch.cuda, "memory_allocated", lambda: memory["allocated"])
    monkeypatch.setattr(graph_timing.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(graph_timing.torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": 100})())
    monkeypatch.setattr(graph_timing, "fresh_cublas_workspaces", lambda: None)
    return SimpleNamespace(calls=calls, memory=memory)


def _bench() -> graph_timing.GraphBench:
    return graph_timing.GraphBench(torch.nn.Linear(4, 2), [torch.randn(3, 4)], amp=False)


def test_a_capture_out_of_memory_is_retried_after_emptying_the_cache(cuda):
    _FakeGraph.refusals = 1
    bench = _bench()
    graph = bench.capture(stream=None)
    assert isinstance(graph, _FakeGraph) and not bench.eager
    assert cuda.calls == [1] and bench.mode == "global"
    assert "out of memory" in bench.capture_errors[0]


def test_a_module_that_never_fits_is_timed_eagerly_and_says_why(cuda):
    _FakeGraph.refusals = 10
    bench = _bench()
    graph = bench.capture(stream=None)
    assert bench.eager and not isinstance(graph, _FakeGraph)
    assert len(bench.capture_errors) == 4  # global, again after emptying, relaxed, again


def test_a_failed_capture_keeps_none_of_its_tensors(cuda, monkeypatch):
    """The exception's traceback held the failed capture's frames and so every tensor it had
    allocated: the retry after emptying the cache ran out of memory too (UIO-2 `paper`)."""
    import weakref

    held: list[weakref.ref] = []

    class Grows(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if capturing:
                activation = torch.ones(1000)
                held.append(weakref.ref(activation))
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
            return x.sum()

    capturing = False

    class _Capturing(_FakeGraph):
        def capture_begin(self, capture_error_mode: str) -> None:
            nonlocal capturing
            capturing = True

        def capture_end(self) -> None:
            nonlocal capturing
            capturing = False

    monkeypatch.setattr(graph_timing.torch.cuda, "CUDAGraph", _Capturing)
    bench = graph_timing.GraphBench(Grows(), [torch.randn(3, 4, requires_grad=True)], amp=False)
    bench.capture(stream=None)
    assert bench.eager and len(held) == 4
    assert all(ref() is None for ref in held)
    assert "0.0 GiB allocated" in bench.capture_errors[0]


def test_idle_cache_is_returned_once_it_is_a_quarter_of_the_device(cuda):
    cuda.memory.update(reserved=30, allocated=10)  # 20 of 100 idle: kept
    graph_timing.release_idle_cache()
    assert cuda.calls == []
    cuda.memory.update(reserved=40, allocated=10)  # 30 idle: returned
    graph_timing.release_idle_cache()
    assert cuda.calls == [1]


def test_idle_cache_released_between_captures_keeps_the_cublas_workspaces(cuda, monkeypatch):
    """A colocation captures every member before replaying any; the first member's GEMMs point
    into its stream's cuBLAS workspace, so freeing workspaces before the second capture made
    the replay fault (compiled ImageBind `small`, H200, 2026-12-02)."""
    freed: list[str] = []
    monkeypatch.setattr(graph_timing, "fresh_cublas_workspaces", lambda: freed.append("cublas"))
    monkeypatch.setattr(_FakeGraph, "refusals", 0)
    cuda.memory.update(reserved=90, allocated=10)
    _bench().capture(stream=None)  # emptying is due: 80 of 100 idle
    assert cuda.calls == [1]
    assert freed == []
    graph_timing.free_device_memory()  # between measurements, no graph alive: both go
    assert freed == ["cublas"]
