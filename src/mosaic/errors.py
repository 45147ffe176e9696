"""Which exceptions are the user's to fix (one line, exit 2) and which are our bugs (traceback).

Every stage defines its own subclass of `MosaicError` (GraphError, PlanError, HardwareError,
ProfileDBError, PerfModelError, ...) whose message names the field and the fix; the CLI prints
any MosaicError as one line and exits 2. MOSAIC_DEBUG=1 turns them back into tracebacks.
"""

from __future__ import annotations

import os


class MosaicError(ValueError):
    """Base of every error that is the user's to fix: the message names the field and the fix."""


def is_user_error(exc: BaseException) -> bool:
    if os.environ.get("MOSAIC_DEBUG"):
        return False
    return isinstance(exc, MosaicError)
