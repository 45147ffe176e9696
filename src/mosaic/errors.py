"""Which exceptions are the user's to fix (one line, exit 2) and which are our bugs (traceback).

Every stage defines its own ValueError subclass (GraphError, PlanError, HardwareError,
ProfileDBError, PoolError, ...) whose message names the field and the fix; the CLI treats any
ValueError subclass defined inside the `mosaic` package as a user error.
"""

from __future__ import annotations

import os


def is_user_error(exc: BaseException) -> bool:
    if os.environ.get("MOSAIC_DEBUG"):
        return False
    cls = type(exc)
    return issubclass(cls, ValueError) and cls.__module__.startswith("mosaic.")
