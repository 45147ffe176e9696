"""The update under the next step's forward (engine/update_gates.py) on a GPU: the event
mechanism between two CUDA graphs, and the trained weights against MainWeightsAdamW's
(skipped without CUDA).

    PYTHONPATH=src python -m pytest -m gpu tests/gpu/test_update_gates_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 50_000_000
"""About 25 ms at the H200's clock: far longer than the host takes to launch the second graph."""


def test_a_graph_waits_for_the_external_event_another_graph_records():
    """What the gates rest on: graph A (a long sleep, then a copy, then an external event
    record) replayed on one stream, graph B (an external wait, then a read) on another,
    launched right after it, reads what this replay of A wrote, not the replay before."""
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    source, written, read = (torch.zeros(1, device="cuda") for _ in range(3))
    event = torch.cuda.Event(external=True)
    event.record(producer)  # created before the captures (a wait on no event is dropped)
    torch.cuda.synchronize()
    write, read_back = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(write, stream=producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        written.copy_(source)
        event.record()
    with torch.cuda.graph(read_back, stream=consumer):
        torch.cuda.current_stream().wait_event(event)
        read.copy_(written)
    for value in range(1, 4):
        with torch.cuda.stream(producer):
            source.fill_(value)
            write.replay()
        with torch.cuda.stream(consumer):
            read_back.replay()
        torch.cuda.synchronize()
        assert read.item() == value


@pytest.mark.parametrize("delay", ["none", "before", "within"])
@pytest.mark.parametrize(("planner", "flat"), [("mosaic", True), ("megatron", False)])
def test_a_deferred_gated_update_trains_as_main_weights_adamw(planner, flat, delay):
    """Six steps, the update under the next forward from the capture on (no join between
    steps): the weights come out as MainWeightsAdamW's after each backward, also when the
    update stream sleeps before each update or after each module's own update (a forward, or
    a block, that did not wait would read the weights before it). Megatron's plan runs its
    temporal stages on high-priority streams under a gated update (runner.py)."""
    from tests.test_update_gates import gated_against_plain

    states, deferred = gated_against_plain("cuda", graphs=True, steps=6, defer=True,
                                           planner=planner, flat=flat,
                                           delay_cycles=0 if delay == "none" else SLEEP_CYCLES,
                                           delay_within=delay == "within")
    assert deferred >= 4
    differ = _differing(states)
    assert not differ, f"{len(differ)} of {len(states['plain'])} differ: {differ[:12]}"


def _differing(states) -> list[str]:
    return [name for name, want in states["plain"].items()
            if not torch.equal(states["gated"][name], want)]


@pytest.mark.parametrize("delay_within", [False, True])
def test_a_deferred_update_of_modules_compiled_by_blocks_trains_as_main_weights_adamw(
        delay_within):
    """The modules compiled by blocks, each block behind its slot (compile.py)."""
    from tests.test_update_gates import gated_against_plain

    states, deferred = gated_against_plain("cuda", graphs=True, steps=6, defer=True,
                                           planner="megatron", flat=False,
                                           delay_cycles=SLEEP_CYCLES, compiled=True,
                                           delay_within=delay_within)
    assert deferred >= 4
    differ = _differing(states)
    assert not differ, f"{len(differ)} of {len(states['plain'])} differ: {differ[:12]}"


@pytest.mark.parametrize("delay_within", [False, True])
@pytest.mark.parametrize("flat", [False, True])
def test_unified_io_2s_deferred_update_trains_as_main_weights_adamw(flat, delay_within):
    """Unified-IO 2 `tiny` (an LLM fed by three encoders), one module a stage (on
    high-priority streams under a gated update), the update stream asleep before each update,
    or after each module's own update (`delay_within`: then the blocks wait in their graphs
    for theirs). With gradients left in the graph's pool and that pool shared by the forward
    graph, every weight came out different here and the loss went NaN (graphed.py)."""
    from tests.test_update_gates import gated_against_plain

    states, deferred = gated_against_plain("cuda", graphs=True, steps=6, defer=True,
                                           planner="megatron", flat=flat,
                                           delay_cycles=SLEEP_CYCLES, delay_within=delay_within,
                                           model_name="unified-io-2")
    assert deferred >= 4
    differ = _differing(states)
    assert not differ, f"{len(differ)} of {len(states['plain'])} differ: {differ[:12]}"


@pytest.mark.parametrize("flat", [False, True])
def test_a_deferred_update_on_a_green_context_trains_as_main_weights_adamw(flat):
    """The update's stream a green context of 32 SMs (`update_sms`), Unified-IO 2 `tiny`, the
    update asleep after each module's own update. (Before the backward graphs kept their own
    pool, every weight came out different here: docs/engine.md.)"""
    from tests.test_update_gates import gated_against_plain

    states, deferred = gated_against_plain("cuda", graphs=True, steps=6, defer=True,
                                           planner="megatron", flat=flat,
                                           delay_cycles=SLEEP_CYCLES, delay_within=True,
                                           update_sms=32, model_name="unified-io-2")
    assert deferred >= 4
    differ = _differing(states)
    assert not differ, f"{len(differ)} of {len(states['plain'])} differ: {differ[:12]}"
