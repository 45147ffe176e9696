"""Measure several plans of one model with this engine, in one process, fairly.

Every plan trains the SAME modules (one set of weights, one optimizer) on the same batch, so
a speedup is a ratio of two runs of this engine, same model, batch, hardware and run. Plans are
interleaved in rounds whose order rotates, so clock or thermal drift cannot favour one. Before
timing, every plan's loss at identical weights must equal the first plan's (eagerly, and again
after CUDA-graph capture): a plan that computes something else is not measured.

One process per GPU: run under `torchrun --nproc-per-node N` for N-GPU plans (gloo on CPU for a
logic check, NCCL on GPUs). Each rank builds the modules any plan places on it; a step's time
is the slowest rank's, and the loss is summed over ranks, outside the timed region.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mosaic.engine.comm import PlanComm, broadcast_bytes
from mosaic.engine.green import SMPartitionPool, requests_for_plan
from mosaic.engine.runner import PlanRunner, RunnerConfig
from mosaic.engine.timer import Timer
from mosaic.engine.trainer import Dist, build_modules, make_batch, make_optimizer, start_distributed
from mosaic.graph import MMGraph
from mosaic.hardware import GPUSpec
from mosaic.plan import Plan

LOSS_TOLERANCE = 3e-2
"""Relative loss agreement between plans under bf16 autocast (kernels differ per SM count)."""


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message says the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    rounds: int = 6
    steps_per_round: int = 5
    warmup_steps: int = 5
    graphs: bool = True
    """Per-module CUDA graphs (eager PyTorch is launch-bound: DESIGN.md)."""
    lr: float = 1e-5
    seed: int = 0
    nvml_seconds: float = 1.0
    """Seconds of extra steps per plan while NVML samples GPU utilisation (0: skip)."""

    def __post_init__(self) -> None:
        for name in ("rounds", "steps_per_round"):
            if getattr(self, name) < 1:
                raise BenchError(f"{name}={getattr(self, name)} must be >= 1")


@dataclass(slots=True)
class PlanMeasurement:
    label: str
    plan: Plan
    step_times_s: list[float] = field(default_factory=list)
    pool: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    gpu_util: float | None = None

    @property
    def median_s(self) -> float:
        return float(np.median(self.step_times_s))

    def summary(self) -> dict[str, Any]:
        t = np.array(self.step_times_s)
        return {
            "median_s": float(np.median(t)), "p10_s": float(np.percentile(t, 10)),
            "p90_s": float(np.percentile(t, 90)),
            "spread_s": float(np.percentile(t, 90) - np.percentile(t, 10)),
            "num_steps": len(t), "quotas_enforced": bool(self.pool.get("enforced")),
            "pool_backend": self.pool.get("backend"), "measured_gpu_util": self.gpu_util,
        }


@dataclass(slots=True)
class _Setup:
    dist: Dist
    runners: dict[str, PlanRunner]
    comms: dict[str, PlanComm]
    pools: dict[str, SMPartitionPool]
    optimizer: torch.optim.Optimizer | None
    params: list[torch.nn.Parameter]
    data: dict[str, dict[str, tuple[torch.Tensor, ...]]]
    """Per plan: this rank's samples (they depend on the placement)."""
    timer: Timer

    @property
    def device(self) -> torch.device:
        return self.dist.device


def _setup(model, preset: str, graph: MMGraph, plans: dict[str, Plan], gpu: GPUSpec,
           config: BenchConfig) -> _Setup:
    d = start_distributed(None)
    for label, plan in plans.items():
        if plan.num_gpus != d.world_size:
            raise BenchError(f"plan {label!r} uses {plan.num_gpus} GPUs but {d.world_size} "
                             f"process(es) run: launch `torchrun --standalone --nproc-per-node "
                             f"{plan.num_gpus} -m mosaic bench ...`")
    graphs = config.graphs and d.device.type == "cuda"
    local = sorted({p.module for plan in plans.values() for s in plan.stages
                    for p in s.placements if d.rank in p.gpus})
    modules = build_modules(model, preset, local, config.seed, d.device)
    params = [p for m in modules.values() for p in m.parameters()]
    pools, runners, comms, data = {}, {}, {}, {}
    batch = make_batch(model, preset, graph.global_batch, config.seed, 0)
    for label, plan in plans.items():
        pools[label] = SMPartitionPool.create(requests_for_plan(plan, d.rank, gpu),
                                              d.device.index if d.device.type == "cuda" else None, gpu)
        comms[label] = PlanComm.create(plan, d.device)
        runners[label] = PlanRunner(plan=plan, graph=graph, modules=modules, comm=comms[label],
                                    pool=pools[label], config=RunnerConfig(graphs=graphs),
                                    device=d.device)
        data[label] = runners[label].local_batch(batch)
    optimizer = make_optimizer("adamw", params, config.lr) if params else None
    return _Setup(d, runners, comms, pools, optimizer, params, data, Timer(d.device))


def _zero_grads(s: _Setup) -> None:
    for p in s.params:
        p.grad = None


def _losses(s: _Setup) -> dict[str, float]:
    """Every plan's loss at the current (identical) weights, summed over ranks; no update."""
    losses = {}
    for label, runner in s.runners.items():
        _zero_grads(s)
        local = float(runner.step(s.data[label]).loss.item())
        (losses[label],) = s.comms[label].all_reduce_scalars([local], "sum")
    _zero_grads(s)
    return losses


def _check_losses(when: str, losses: dict[str, float]) -> None:
    first, ref = next(iter(losses.items()))
    for label, value in losses.items():
        if not math.isfinite(value) or abs(value - ref) > LOSS_TOLERANCE * max(1.0, abs(ref)):
            raise BenchError(f"{when}: plan {label!r} gives loss {value:.5f} but {first!r} gives "
                             f"{ref:.5f} at the same weights; the plan computes something else")


def _one_step(s: _Setup, label: str) -> float:
    """Seconds of one training step on the slowest rank."""
    _zero_grads(s)
    start = s.timer.mark()
    out = s.runners[label].step(s.data[label])
    if s.optimizer is not None:
        s.optimizer.step()
    seconds = s.timer.seconds(start, s.timer.mark())
    if not math.isfinite(out.loss.item()):
        raise BenchError(f"plan {label!r}: loss became non-finite; lower --lr")
    (slowest,) = s.comms[label].all_reduce_scalars([seconds], "max")
    return slowest


def _timed_rounds(s: _Setup, config: BenchConfig) -> dict[str, list[float]]:
    labels = list(s.runners)
    for label in labels:
        for _ in range(config.warmup_steps):
            _one_step(s, label)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(config.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            times[label].extend(_one_step(s, label) for _ in range(config.steps_per_round))
    return times


def _timeline(s: _Setup, label: str) -> list[dict[str, Any]]:
    """One step's module timeline, every rank's events gathered (in memory only)."""
    runner = s.runners[label]
    runner.record_timeline = True
    try:
        _zero_grads(s)
        out = runner.step(s.data[label])
        if s.optimizer is not None:
            s.optimizer.step()
        events = runner.timeline(out)
    finally:
        runner.record_timeline = False
    if s.dist.world_size > 1:
        gathered: list[Any] = [None] * s.dist.world_size
        torch.distributed.all_gather_object(gathered, events)
        events = [e for part in gathered for e in part]
    return events


def _nvml_util(s: _Setup, label: str, seconds: float) -> float | None:
    """Mean NVML GPU utilisation over the GPUs while only this plan runs (per device, not per
    SM). Every rank runs the same number of steps, so collectives stay matched."""
    if s.device.type != "cuda" or seconds <= 0:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception:  # NVML is optional: no library, no permission
        return None
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    steps = max(1, round(seconds / max(1e-4, _one_step(s, label))))
    for _ in range(steps):
        _one_step(s, label)
    stop.set()
    thread.join()
    pynvml.nvmlShutdown()
    mean = float(np.mean(samples)) / 100 if samples else 0.0
    (total,) = s.comms[label].all_reduce_scalars([mean], "sum")
    return total / s.dist.world_size


def measure_plans(model, preset: str, graph: MMGraph, plans: dict[str, Plan], gpu: GPUSpec,
                  config: BenchConfig | None = None) -> list[PlanMeasurement]:
    """Time every plan on this machine's GPU (or CPU), interleaved; see the module docstring."""
    config = config or BenchConfig()
    s = _setup(model, preset, graph, plans, gpu, config)
    try:
        _check_losses("eager", _losses(s))
        for runner in s.runners.values():
            runner.capture_graphs()
        if any(r.graphed for r in s.runners.values()):
            _check_losses("after CUDA-graph capture", _losses(s))
        times = _timed_rounds(s, config)
        results = []
        for label, plan in plans.items():
            results.append(PlanMeasurement(
                label=label, plan=plan, step_times_s=times[label],
                pool=s.pools[label].describe(), timeline=_timeline(s, label),
                gpu_util=_nvml_util(s, label, config.nvml_seconds)))
        return results
    finally:
        for pool in s.pools.values():
            pool.close()
        if s.dist.owns_group:
            torch.distributed.destroy_process_group()


def environment(device_name: str | None = None) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "hardware": device_name or (torch.cuda.get_device_name(0) if cuda else "cpu"),
        "num_sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }


BASELINES = ("megatron", "distmm", "spindle")


def same_plans_everywhere(plans: dict[str, Plan], d: Dist) -> dict[str, Plan]:
    """Rank 0's plans on every rank: a planner with a time limit need not be deterministic."""
    if d.world_size == 1:
        return plans
    payload = json.dumps({k: p.to_dict() for k, p in plans.items()}).encode() if d.rank == 0 else None
    received = json.loads(broadcast_bytes(payload, d.device))
    return {k: Plan.from_dict(v) for k, v in received.items()}


def bench_report(graph: MMGraph, measurements: list[PlanMeasurement], gpu: GPUSpec,
                 preset: str) -> dict[str, Any]:
    """The results object of `mosaic bench` (keys documented in the README)."""
    medians = {m.label: m.median_s for m in measurements}
    flops = graph.total_flops()
    rows = []
    for m in measurements:
        row = {"planner": m.label, "measured_iteration_s": m.median_s, **m.summary(),
               "predicted_iteration_s": m.plan.predicted_iteration_s,
               "samples_per_s": graph.global_batch / m.median_s,
               "mfu": flops / (m.plan.num_gpus * gpu.peak_bf16_flops * m.median_s),
               "speedup_vs": {b: medians[b] / m.median_s for b in BASELINES if b in medians},
               "plan": m.plan.to_dict()}
        if m.plan.predicted_iteration_s:
            row["prediction_error"] = m.plan.predicted_iteration_s / m.median_s - 1
        rows.append(row)
    baselines = [medians[b] for b in BASELINES if b in medians]
    best = min(baselines) if baselines else None
    return {
        "model": graph.name, "preset": preset, "global_batch": graph.global_batch,
        "gpus": measurements[0].plan.num_gpus, **environment(),
        "model_tflop_per_iteration": flops / 1e12,
        "best_baseline_s": best,
        "mosaic_speedup_vs_best_baseline": (best / medians["mosaic"]
                                            if best and "mosaic" in medians else None),
        "results": rows,
    }
