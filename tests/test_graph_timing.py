"""The profiler's capture fallbacks, with CUDA faked on the CPU (graph_timing.GraphBench)."""

from __future__ import annotations

import contextlib

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
def emptied(monkeypatch) -> list[int]:
    """CUDA faked for GraphBench.capture; one entry per torch.cuda.empty_cache() call."""
    calls: list[int] = []
    monkeypatch.setattr(graph_timing.torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(graph_timing.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graph_timing.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(graph_timing.torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


def _bench() -> graph_timing.GraphBench:
    return graph_timing.GraphBench(torch.nn.Linear(4, 2), [torch.randn(3, 4)], amp=False)


def test_a_capture_out_of_memory_is_retried_after_emptying_the_cache(emptied):
    _FakeGraph.refusals = 1
    bench = _bench()
    graph = bench.capture(stream=None)
    assert isinstance(graph, _FakeGraph) and not bench.eager
    assert emptied == [1] and bench.mode == "global"
    assert "out of memory" in bench.capture_errors[0]


def test_a_module_that_never_fits_is_timed_eagerly_and_says_why(emptied):
    _FakeGraph.refusals = 10
    bench = _bench()
    graph = bench.capture(stream=None)
    assert bench.eager and not isinstance(graph, _FakeGraph)
    assert len(bench.capture_errors) == 4  # global, again after emptying, relaxed, again
