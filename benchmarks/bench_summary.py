"""One line per `mosaic bench` results JSON: model, batch, GPUs, and per contender the
measured and predicted ms and MFU (and, where run, the step in flight and its MFU), then
the GPU memory each plan's graphs held (allocated,
and their private pools) beside the memory model's estimate of the
whole GPU (weights, states and activations: not the same quantity), and each group's peak
(what a device-call script prints at its end); a run stopped early says so.

    python3 benchmarks/bench_summary.py OUT/bench_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(path: Path) -> str:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"{path}: no results"
    rows = [(r["planner"], round(r["measured_iteration_s"] * 1e3, 2),
             round((r.get("predicted_iteration_s") or 0) * 1e3, 2), round(r.get("mfu") or 0, 3),
             *_in_flight(r)) for r in d["results"]]
    memory = {r["planner"]: (_gib(r.get("graph_memory_bytes")),
                             _gib(r.get("graph_pool_bytes")),
                             _gib(r.get("predicted_memory_bytes")))
              for r in d["results"] if r.get("graph_memory_bytes")}
    peaks = [_gib(p) for p in (d.get("checks") or {}).get("peak_memory_bytes") or []]
    status = "" if d.get("complete", True) else f" INCOMPLETE {d.get('interrupted')}"
    return (f"{d['model']} batch {d['global_batch']} on {d['gpus']} GPU(s){status}: {rows}"
            + (f"; GiB per plan (graphs allocated, graphs' pools, memory model's whole GPU "
               f"estimate) {memory}, peak {peaks}" if memory or any(peaks) else ""))


def _in_flight(row: dict) -> tuple:
    """("in flight", ms, MFU) where the run timed steps in flight, else nothing."""
    if not row.get("in_flight_median_s"):
        return ()
    return ("in flight", round(row["in_flight_median_s"] * 1e3, 2),
            round(row["mfu_in_flight"], 3))


def _gib(value: float | None) -> float | None:
    return None if value is None else round(value / 2**30, 1)


def main(argv: list[str] | None = None) -> None:
    for name in (sys.argv[1:] if argv is None else argv):
        print(summary(Path(name)))


if __name__ == "__main__":
    main()
