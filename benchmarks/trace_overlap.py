"""How much of some kernels' time ran beside kernels of other streams, in a torch.profiler
trace (`mosaic train --torch-trace DIR` leaves DIR/trace-rank0.json.gz).

    python benchmarks/trace_overlap.py TRACE --pattern "foreach_norm|multi_tensor|reduce_kernel"

Prints, per stream, the matching kernels' time per step and the part of it during which some
kernel of another stream ran; and the kernels of all streams per stream. Written to see
whether the NaN guard's check of a module on its side stream (engine/steps.py) ran under
the backward of the modules after it.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from mosaic.report.kernel_time import gpu_work, load_trace, traced_steps


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _covered(begin: float, end: float, merged: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, e) - max(begin, b)) for b, e in merged if b < end and e > begin)


def overlap(trace: dict[str, Any], pattern: str) -> dict[str, Any]:
    events = trace.get("traceEvents", [])
    steps, kernels = traced_steps(events), gpu_work(events)
    by_stream: dict[int, list[dict[str, Any]]] = {}
    for e in kernels:
        by_stream.setdefault(int(e.get("args", {}).get("stream", e.get("tid", 0))), []).append(e)
    streams = {}
    for stream, own in sorted(by_stream.items()):
        others = _merged([(e["ts"], e["ts"] + e["dur"]) for s, es in by_stream.items()
                          if s != stream for e in es])
        matched = [e for e in own if re.search(pattern, e["name"], re.IGNORECASE)]
        streams[str(stream)] = {
            "kernel_ms": sum(e["dur"] for e in own) / 1e3 / steps,
            "matched_ms": sum(e["dur"] for e in matched) / 1e3 / steps,
            "matched_beside_other_streams_ms": sum(
                _covered(e["ts"], e["ts"] + e["dur"], others) for e in matched) / 1e3 / steps,
            "matched_count": len(matched) / steps}
    return {"steps": steps, "pattern": pattern, "streams": streams}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--pattern", required=True, help="regular expression on kernel names")
    parser.add_argument("--out", help="also write the result as JSON here")
    args = parser.parse_args()
    result = overlap(load_trace(args.trace), args.pattern)
    print(f"{'stream':>8} {'kernels ms':>11} {'matched ms':>11} {'beside others':>14} {'count':>6}")
    for stream, s in result["streams"].items():
        print(f"{stream:>8} {s['kernel_ms']:11.2f} {s['matched_ms']:11.2f} "
              f"{s['matched_beside_other_streams_ms']:14.2f} {s['matched_count']:6.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
