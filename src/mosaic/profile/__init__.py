"""Profiling: measured module times, colocations and comm curves in a ProfileDB (SQLite).

`db` is light (stdlib only) and is what planning reads; `profiler` and `graph_timing` (CUDA-graph
timings of modules on SM-quota'd streams) need a GPU.
"""

from mosaic.profile.db import (
    SCHEMA_VERSION,
    ProfileDB,
    ProfileDBError,
    default_db_path,
    has_shipped_db,
    module_signature,
)

__all__ = [
    "SCHEMA_VERSION",
    "ProfileDB",
    "ProfileDBError",
    "default_db_path",
    "has_shipped_db",
    "module_signature",
]
