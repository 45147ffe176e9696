"""The Python entry points: plan a graph, and plan once for a whole torchrun world.

    import mosaic.api as mosaic
    plan = mosaic.plan(graph, gpus=8, planner="mosaic")   # -> Plan (JSON with plan.save)

`mosaic plan`, `mosaic bench` and `mosaic train` all plan through `plan`, so the same model,
GPUs, preset and performance model give the same plan whichever command asks.
"""

from __future__ import annotations

from typing import Any

from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.plan import Plan


def plan(graph: MMGraph, gpus: int = 1, hardware: str = "h200", planner: str = "mosaic",
         perf_model: str = "auto") -> Plan:
    """A validated, predicted plan of `graph` on `gpus` GPUs of kind `hardware`."""
    from mosaic.planners import make_plan

    return make_plan(graph, make_cluster(gpus, hardware), planner, perf_model)


def plan_on_rank0(graph: MMGraph, gpus: int, device: Any, *, hardware: str = "h200",
                  planner: str = "mosaic", perf_model: str = "auto") -> Plan:
    """`plan` on rank 0, the same plan on every rank of the running world (a planner with a
    time limit need not be deterministic); rank 0's error is raised on every rank."""
    from mosaic.engine.comm import share_from_rank0

    return Plan.from_dict(share_from_rank0(
        lambda: plan(graph, gpus, hardware, planner, perf_model).to_dict(), device))
