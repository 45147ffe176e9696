"""SIGTERM while a long command runs: what `timeout`, torchrun and cluster schedulers send
before they kill a process. The bench turns it into an exception that keeps what it measured;
the trainer into a request to stop after a step every rank agrees on, checkpointed."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def handling_sigterm(handler: Callable[[], None]) -> Iterator[None]:
    """`handler()` runs on SIGTERM inside the block, and the previous handler is back after
    it. Only the main thread can install one: elsewhere the block runs unhandled."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        handler()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def restore_default_sigterm() -> None:
    """A second SIGTERM ends the process as the default handler does."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
