"""The optimizer step as the engine runs it, measured: seconds per parameter on this GPU.

The performance model adds one optimizer step per iteration (the module surfaces time forward
and backward only). Priced from the datasheet bandwidth (fused AdamW moves about 28 bytes per
fp32 parameter), Unified-IO 2 `paper`'s 3.78 B parameters took 22 ms a step; a torch.profiler
trace of the engine measured 30.3 ms for the fused AdamW kernel alone on the H200, and the
model's iteration came out 8% short. So the profiler times the engine's own optimizer
(engine.session.make_optimizer: fused AdamW on CUDA) over transformer-shaped parameters of
several total sizes (kernel time: the host's launch is hidden, as in training) and stores a
straight-line fit, fixed + per-parameter, in the ProfileDB's
`fits` table, where the model reads it (perf.profiled).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mosaic.profile.db import FitRecord, ProfileDB

FIT_NAME = "optimizer.adamw"
HIDDEN = 1024
LAYERS = (2, 8, 32, 128)
"""Transformer layers of width HIDDEN per measured size: 25 M to 1.6 B parameters."""
REPEATS = 10
SLEEP_CYCLES_PER_S = 2.0e9
"""GPU clock cycles per second for torch.cuda._sleep (the H200 boosts to 1.98 GHz); the
sleep only has to outlast the host's launch, so a rough figure is enough."""


@dataclass(frozen=True, slots=True)
class OptimizerPoint:
    num_params: int
    num_tensors: int
    step_s: float


@dataclass(frozen=True, slots=True)
class OptimizerFit:
    fixed_s: float
    s_per_param: float

    def seconds(self, num_params: float) -> float:
        return self.fixed_s + self.s_per_param * num_params if num_params > 0 else 0.0

    @classmethod
    def from_record(cls, record: FitRecord) -> OptimizerFit:
        return cls(fixed_s=float(record.params["fixed_s"]),
                   s_per_param=float(record.params["s_per_param"]))


def layer_shapes(hidden: int) -> list[tuple[int, ...]]:
    """One transformer layer's parameter shapes: attention and MLP weights and biases, two
    norms' weights and biases (the tensor mix the fused kernel walks in a real model)."""
    h = hidden
    return [(3 * h, h), (3 * h,), (h, h), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,),
            (h,), (h,), (h,), (h,)]


def measure_step(layers: int, device: Any, hidden: int = HIDDEN,
                 repeats: int = REPEATS) -> OptimizerPoint:
    """Median seconds of one optimizer step over `layers` layers' parameters (fp32, with
    gradients), timed with CUDA events after a warm-up step that creates the states."""
    import torch

    from mosaic.engine.session import make_optimizer

    params = [torch.nn.Parameter(torch.zeros(shape, device=device))
              for _ in range(layers) for shape in layer_shapes(hidden)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = make_optimizer("adamw", params, lr=1e-4)
    optimizer.step()
    times = [_timed_step(optimizer, device) for _ in range(repeats)]
    point = OptimizerPoint(num_params=sum(p.numel() for p in params), num_tensors=len(params),
                           step_s=float(np.median(times)))
    del optimizer, params
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return point


def _timed_step(optimizer: Any, device: Any) -> float:
    """Seconds of one step: CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    if torch.device(device).type != "cuda":
        start_s = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - start_s
    torch.cuda.synchronize()
    host_s = time.perf_counter()
    optimizer.step()
    host_s = time.perf_counter() - host_s
    torch.cuda.synchronize()
    # The GPU sleeps while the host enqueues the step, so the events time the kernels alone:
    # in training the step is launched while the backward still runs, and its host time
    # (a Python loop over the tensors, ~7 ms for 1536 of them) hides behind it. Without the
    # sleep a first H200 run measured 11 ps per parameter; the engine's trace, 8.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(2 * host_s * SLEEP_CYCLES_PER_S) + 1000)
    start.record()
    optimizer.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def fit(points: Sequence[OptimizerPoint]) -> tuple[OptimizerFit, float]:
    """Least-squares fixed + per-parameter seconds, and its mean absolute percentage error
    over the points."""
    if len(points) < 2:
        raise ValueError(f"an optimizer fit needs two or more sizes, got {len(points)}")
    n = np.array([p.num_params for p in points], dtype=float)
    t = np.array([p.step_s for p in points])
    (fixed, per_param), *_ = np.linalg.lstsq(np.vstack([np.ones_like(n), n]).T, t, rcond=None)
    result = OptimizerFit(fixed_s=max(float(fixed), 0.0), s_per_param=float(per_param))
    mape = float(np.mean([abs(result.seconds(p.num_params) / p.step_s - 1) for p in points]))
    return result, 100.0 * mape


def profile_optimizer(db: ProfileDB, device: Any = None,
                      layers: Sequence[int] = LAYERS, hidden: int = HIDDEN) -> OptimizerFit:
    """Measure the engine's optimizer step at each size and store the fit in `db`."""
    import torch

    device = device or torch.device("cuda")
    points = [measure_step(n, device, hidden) for n in layers]
    result, mape = fit(points)
    db.add_fit(FitRecord(
        name=FIT_NAME, params={"fixed_s": result.fixed_s, "s_per_param": result.s_per_param,
                               "optimizer": "adamw (engine.session.make_optimizer)",
                               "points": [[p.num_params, p.num_tensors, p.step_s]
                                          for p in points]},
        mape=mape, n_points=len(points),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")))
    return result


def stored_fit(db: ProfileDB) -> OptimizerFit | None:
    """The DB's measured optimizer fit, None when it holds none (older DBs)."""
    record = next((f for f in db.fits() if f.name == FIT_NAME), None)
    return OptimizerFit.from_record(record) if record is not None else None
