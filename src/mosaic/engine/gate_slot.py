"""The slot in front of a block through which a gated update makes it wait (update_gates.py).

Apart from update_gates.py so that compile.py, which puts a slot in front of every block it
compiles, needs nothing of the optimizer."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_ACTIVE: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar(
    "mosaic_update_gates", default=None)
"""id(block) -> the event its forward waits for, while a gated forward runs (else None)."""


class GateSlot(nn.Module):
    """`inner` (a block, or its compiled wrapper), preceded by a wait for the update of
    `block`'s weights while a gated forward runs (update_gates.py). It keeps the block's id,
    not the block, which must not be registered twice in a view that holds `inner`."""

    def __init__(self, inner: nn.Module, block: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.key = id(block)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        events = _ACTIVE.get()
        if events is not None and (event := events.get(self.key)) is not None:
            torch.cuda.current_stream().wait_event(event)
        return self.inner(*args, **kwargs)


def slotted(block: nn.Module, inner: nn.Module | None = None) -> GateSlot:
    """`block` behind a slot: called as itself, or as `inner` (its compiled wrapper)."""
    return GateSlot(block if inner is None else inner, block)


@contextlib.contextmanager
def waiting_blocks(events: dict[int, Any]) -> Iterator[None]:
    """Inside, each slot whose block's id is in `events` waits for its event."""
    token = _ACTIVE.set(events)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
