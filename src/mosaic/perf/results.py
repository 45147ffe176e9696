"""Reading `mosaic bench` results JSON: what the accuracy gate, the engine-term fit and the
BENCHMARKS renderer all read, kept apart from the models they judge (no import cycle)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mosaic.errors import MosaicError

__all__ = ["BenchResultsError", "SUPERSEDED_FILE", "bench_result_files", "graph_of",
           "load_bench_result", "load_current_result", "superseded", "superseded_labels",
           "without_superseded_rows"]


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


SUPERSEDED_FILE = "superseded.json"
"""In a results directory: {file name or "*": {"by": the rerun's path relative to the directory,
"why": what changed, optionally "labels": [contender labels]}}. A run of an engine or zoo that
has changed since, measured again; with "labels", only those contenders' rows (a variant whose
code changed), the run's other rows standing."""


def superseded(path: str | Path, label: str | None = None) -> dict[str, Any] | None:
    """{"by", "why"} when its directory's superseded.json names this results file (or "*") and,
    if the entry lists "labels", `label` is one of them (no `label`: the file as a whole, which
    such an entry leaves standing); else None. The iteration gate lists such rows but does not
    judge today's model by them: they measured code that no longer runs. Only a rerun that
    exists can supersede a run."""
    return superseded_labels(path)(label)


def superseded_labels(path: str | Path) -> Callable[[str | None], dict[str, Any] | None]:
    """`superseded(path, label)` for any label, the marker read once."""
    path = Path(path)
    entry = _entry(path)
    if entry is None:
        return lambda label: None
    found = {"by": str(entry["by"]), "why": str(entry["why"])}
    labels = entry.get("labels")
    return lambda label: found if labels is None or label in labels else None


def _entry(path: Path) -> dict[str, Any] | None:
    """The superseded.json entry naming `path` (or "*"), checked; None without one."""
    marker = path.parent / SUPERSEDED_FILE
    if not marker.is_file():
        return None
    try:
        entries = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BenchResultsError(f"{marker} is not readable JSON ({err}); fix or delete it") from err
    entry = entries.get(path.name, entries.get("*")) if isinstance(entries, dict) else None
    if entry is not None:
        _check_entry(marker, path.name, entry)
    return entry


def _check_entry(marker: Path, name: str, entry: Any) -> None:
    if not isinstance(entry, dict) or not entry.get("by") or not entry.get("why"):
        raise BenchResultsError(f'{marker}: the entry for {name} needs "by" (the rerun that '
                                f'replaces it) and "why" (what changed)')
    labels = entry.get("labels", [""])
    if not (isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels)):
        raise BenchResultsError(f'{marker}: "labels" of {name} must be a non-empty list of the '
                                "superseded contenders' labels (or left out: the whole run)")
    if not (marker.parent / entry["by"]).exists():
        raise BenchResultsError(f'{marker}: "by" of {name} is {entry["by"]}, which does not '
                                f"exist: name the rerun's file or directory, relative to "
                                f"{marker.parent}")


def without_superseded_rows(report: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """`report` without the rows of contenders that superseded.json lists by label."""
    replaced = superseded_labels(path)
    rows = [r for r in report.get("results", [])
            if not (isinstance(r, dict) and replaced(r.get("planner")))]
    return report if len(rows) == len(report.get("results", [])) else {**report, "results": rows}


def load_current_result(path: str | Path) -> dict[str, Any] | None:
    """The bench results at `path` without its superseded rows; None where the whole run is
    superseded or the file holds no bench results (what the model's fits and checks read)."""
    if superseded(path):
        return None
    report = load_bench_result(path)
    return None if report is None else without_superseded_rows(report, path)


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
