"""Reading `mosaic bench` results JSON: what the accuracy gate, the engine-term fit and the
BENCHMARKS renderer all read, kept apart from the models they judge (no import cycle)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mosaic.errors import MosaicError

__all__ = ["BenchResultsError", "bench_result_files", "graph_of", "load_bench_result"]


class BenchResultsError(MosaicError):
    """A path given to `iteration_error` that holds no bench results; the message says which."""


def load_bench_result(path: str | Path) -> dict[str, Any] | None:
    """The parsed file when it is a `mosaic bench` results object, else None.

    results/ also holds probes, plans and traces: a file counts only when some row of its
    "results" list has both "measured_iteration_s" and "predicted_iteration_s".
    """
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    rows = obj.get("results") if isinstance(obj, dict) else None
    if not isinstance(rows, list):
        return None
    keys = ("measured_iteration_s", "predicted_iteration_s")
    return obj if any(isinstance(r, dict) and all(k in r for k in keys) for r in rows) else None


def bench_result_files(paths_or_dir: str | Path | Iterable[str | Path]) -> list[tuple[str, Path]]:
    """(display name, path) of every bench result: files as given, directories recursively.

    Order is sorted per directory so reports are deterministic; the display name is relative
    to the directory it was found under.
    """
    paths = [paths_or_dir] if isinstance(paths_or_dir, str | Path) else list(paths_or_dir)
    found: list[tuple[str, Path]] = []
    for given in map(Path, paths):
        if given.is_dir():
            # Chrome traces sit next to bench.json and can be large: never results, skip them.
            found += [(str(f.relative_to(given)), f) for f in sorted(given.rglob("*.json"))
                      if not f.name.endswith(".trace.json") and load_bench_result(f) is not None]
        elif given.is_file():
            if load_bench_result(given) is None:
                raise BenchResultsError(f"{given} is not a `mosaic bench` results JSON (no "
                                        f"results rows with measured/predicted_iteration_s)")
            found.append((str(given), given))
        else:
            raise BenchResultsError(f"{given} does not exist")
    if not found:
        where = ", ".join(map(str, paths))
        raise BenchResultsError(f"no `mosaic bench` results JSON under {where}")
    return found


def graph_of(report: dict[str, Any], cache: dict | None = None) -> Any:
    """The model graph a result's plans ran on: its recorded `graph` (the module facts as they
    were then; a zoo change such as new kernels changes them, and with them which profiled
    surface applies), else, for results written before it was recorded, today's zoo graph."""
    from mosaic.graph import MMGraph

    cache = {} if cache is None else cache
    key = (report["model"], report["preset"], int(report["global_batch"]),
           json.dumps(report.get("graph"), sort_keys=True))
    if key not in cache:
        if report.get("graph"):
            cache[key] = MMGraph.from_dict(report["graph"])
        else:
            from mosaic.zoo import get_model

            cache[key] = get_model(key[0]).graph(key[1], global_batch=key[2])
    return cache[key]
