"""Where a traced step's GPU time goes: a torch.profiler Chrome trace, its kernels by class.

`mosaic train --torch-trace DIR` writes the trace of its last steps and then this summary
beside each rank's (`kernel-time-rank<r>.json`); `mosaic kernel-time TRACE` prints it for any
torch.profiler trace.
Per GPU: the span from the first kernel's start to the last one's end, the time some kernel
ran (the union of their intervals: streams that overlap count once), the idle rest, and the
kernel time over busy time (above 1: kernels of several streams ran at once, as colocated
modules do), and where the idle lies: in gaps of a millisecond or more (the host's: a sync
between steps, a host-bound stretch) or in the many short ones between kernels. Per class of kernel, by name: GEMMs, attention, the optimizer's multi-tensor
kernels, copies and casts, Inductor's fused Triton kernels, other elementwise kernels,
collectives. Memory-bound classes (optimizer, copies, elementwise) against GEMMs and
attention say whether a step is bound by FLOPs or by bytes.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""torch.profiler's Chrome-trace categories of work on the GPU."""
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("collective", r"nccl"),
    ("attention", r"flash|fmha|attention|attn|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|wgmma|sm90_|sm80_"),
    ("optimizer", r"multi_tensor|adam|sgd"),
    ("triton (fused)", r"^triton"),
    ("copy/cast", r"memcpy|memset|copy|cast|convert"),
    ("elementwise/reduce", r"elementwise|vectorized|reduce|unrolled|fill|where|index"),
)
"""First match wins, case-insensitive; anything else is `other`. Inductor's fused kernels
come before copies: their names list every op fused, `_to_copy` among them (a cast fused into
a layer norm is no copy kernel; summaries before 2026-12-01's fourth session counted them so)."""
TOP_KERNELS = 15


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace, plain or gzipped (torch.profiler's export_chrome_trace writes both)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def kernel_time(trace: dict[str, Any], steps: int | None = None) -> dict[str, Any]:
    """The summary of `trace` (see the module docstring), times in ms per step; `steps`: the
    steps it covers (default: its torch.profiler `ProfilerStep#N` marks, else 1)."""
    events = trace.get("traceEvents", [])
    steps = traced_steps(events) if steps is None else steps
    kernels = gpu_work(events)
    devices: dict[int, list[dict[str, Any]]] = {}
    for e in kernels:
        devices.setdefault(int(e.get("args", {}).get("device", e.get("pid", 0))), []).append(e)
    return {"steps": steps,
            "devices": {str(d): _device_summary(events, steps) for d, events in sorted(devices.items())}}


def traced_steps(events: list[dict[str, Any]]) -> int:
    """The steps a trace covers: its torch.profiler `ProfilerStep#N` marks, at least 1."""
    return max(1, len({e.get("name") for e in events
                       if str(e.get("name", "")).startswith("ProfilerStep#")}))


def gpu_work(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's complete events of work on a GPU (kernels, copies, sets) that took time."""
    return [e for e in events
            if e.get("ph") == "X" and e.get("cat") in KERNEL_CATEGORIES and e.get("dur")]


def summarise_trace_dir(directory: str | Path) -> list[Path]:
    """`kernel-time-rank<r>.json` beside every `trace-rank<r>.json.gz` of `directory` (what
    `mosaic train --torch-trace` leaves); the files written."""
    written = []
    for trace in sorted(Path(directory).glob("trace-rank*.json.gz")):
        rank = trace.name.removeprefix("trace-rank").removesuffix(".json.gz")
        out = trace.with_name(f"kernel-time-rank{rank}.json")
        out.write_text(json.dumps(kernel_time(load_trace(trace)), indent=1))
        written.append(out)
    return written


def _device_summary(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    per_step = 1e-3 / steps  # trace times are microseconds
    start = min(e["ts"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - start
    busy = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in events])
    total = sum(e["dur"] for e in events)
    classes: dict[str, dict[str, float]] = {}
    names: dict[str, list[float]] = {}
    for e in events:
        entry = classes.setdefault(kernel_class(e["name"]), {"ms": 0.0, "count": 0})
        entry["ms"] += e["dur"] * per_step
        entry["count"] += 1 / steps
        names.setdefault(e["name"], []).append(e["dur"])
    for entry in classes.values():
        entry["share_of_kernel_time"] = entry["ms"] / (total * per_step)
    top = sorted(names.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    return {"span_ms": span * per_step, "busy_ms": busy * per_step,
            "idle_ms": (span - busy) * per_step, "kernel_ms": total * per_step,
            "idle_gaps": _idle_gaps([(e["ts"], e["ts"] + e["dur"]) for e in events], steps),
            "concurrency": total / busy if busy else 0.0,
            "classes": dict(sorted(classes.items(), key=lambda item: -item[1]["ms"])),
            "top_kernels": [{"name": name, "class": kernel_class(name),
                             "ms": sum(durs) * per_step, "count": len(durs) / steps}
                            for name, durs in top]}


LONG_GAP_US = 1000.0
"""An idle gap this long (1 ms) is the host's, not a launch's: a sync between steps (the
bench reads each step's loss), a host-bound stretch or a wait on data. Gaps between a
step's kernels are a few microseconds each, many of them."""


def _idle_gaps(intervals: list[tuple[float, float]], steps: int) -> dict[str, Any]:
    """Where the idle time lies: in gaps of LONG_GAP_US or more (ms a step, and the longest
    few in ms as they were) or in the many short ones between kernels (ms a step)."""
    gaps, reach = [], None
    for begin, end in sorted(intervals):
        if reach is not None and begin > reach:
            gaps.append(begin - reach)
        reach = end if reach is None else max(reach, end)
    long = sorted((g for g in gaps if g >= LONG_GAP_US), reverse=True)
    return {"long_ms": sum(long) / 1e3 / steps, "short_ms": (sum(gaps) - sum(long)) / 1e3 / steps,
            "short_count": (len(gaps) - len(long)) / steps,
            "longest_ms": [g / 1e3 for g in long[:5]]}


def _union_length(intervals: list[tuple[float, float]]) -> float:
    covered, reach = 0.0, float("-inf")
    for begin, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(begin, reach)
        reach = end
    return covered


def format_kernel_time(summary: dict[str, Any]) -> str:
    """A few plain-text lines per GPU: span, busy, idle, then each class's share."""
    lines = []
    for device, s in summary["devices"].items():
        lines.append(f"GPU {device}, per step: span {s['span_ms']:.2f} ms, busy "
                     f"{s['busy_ms']:.2f} ms, idle {s['idle_ms']:.2f} ms, kernel time "
                     f"{s['kernel_ms']:.2f} ms ({s['concurrency']:.2f}x overlap)")
        if gaps := s.get("idle_gaps"):
            longest = ", ".join(f"{g:.2f}" for g in gaps["longest_ms"]) or "none"
            lines.append(f"  idle: {gaps['long_ms']:.2f} ms in gaps of 1 ms or more (longest "
                         f"{longest} ms), {gaps['short_ms']:.2f} ms in "
                         f"{gaps['short_count']:.0f} shorter ones")
        for label, c in s["classes"].items():
            lines.append(f"  {label:20s} {c['ms']:8.2f} ms  {c['share_of_kernel_time']:6.1%}  "
                         f"{c['count']:8.1f} kernels")
        for k in s["top_kernels"][:5]:
            lines.append(f"    {k['ms']:7.2f} ms  {k['class']:18s} {k['name'][:90]}")
    return "\n".join(lines)
