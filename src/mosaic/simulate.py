"""Event simulation of a plan: per-GPU stream events from the performance model.

Every GPU has a compute stream per module and one comm stream. The simulator replays a plan
the way the performance model composes it, but as events with start and end times, so the
result is a timeline (Chrome trace), per-GPU busy time and the iteration time:

- compute: a stage's modules on one GPU run as the sharing mode says (`temporal`: one after
  another at the whole GPU; `partition` / `cap` / `free`: concurrent streams). The group's
  end is `colocated_time_s` (interference as the model defines it); a module of a concurrent
  group ends at min(group, alone on its share), a partition's at the group's end, exactly
  as `report.timeline` draws them.
- tensor parallelism: a TP shard's event lasts `PerfModel.work_time_s` (1/t of the replica's
  compute plus the TP all-reduces, inside the compute event as they block the stream).
- gradient all-reduce: one event per module on the comm stream of each GPU of its DP group
  (with TP: of each shard's group, all at once).
  With `overlap=False` (the model's composition) it starts at the stage barrier, when the
  slowest GPU of the stage is done; stage time = slowest compute + slowest all-reduce. With
  `overlap=True` a group's all-reduce starts when its own GPUs are done, overlapping slower
  groups' compute, and the next stage starts on each GPU once every group is reduced (what
  DDP on separate process groups can do; the model does not count this saving). An engine
  that sums during the backward (grad_sync='overlapped'), and FSDP2's gathers and
  reduce-scatter beside the compute (sharded placements), expose only what outlasts it
  (`PerfModel.exposed_allreduce_s`): its event ends that long after the compute.
- activations: an edge whose ends sit on different GPU sets moves its activations and, in
  backward, their gradients: two transfers after the producer's stage (the model times a
  module's forward and backward as one event, so both directions are charged there).
- optimizer: after the last stage, each GPU steps its own parameters.
- micro-batches (one GPU): the model's pipelined form, E, then n - 1 overlapped E||L, then L.

With overlap off the iteration time equals `PerfModel.iteration_time_s` (tests pin 1e-6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from mosaic.graph import MMGraph
from mosaic.perf.base import PerfModel, Work
from mosaic.plan import Plan
from mosaic.report.timeline import TimelineEvent

COMPUTE = "fwd+bwd"


@dataclass(slots=True)
class Simulation:
    """What one simulated iteration gives: time, per-GPU busy seconds, events."""

    iteration_s: float
    num_gpus: int
    events: list[TimelineEvent] = field(default_factory=list)
    compute_busy_s: dict[int, float] = field(default_factory=dict)
    comm_busy_s: dict[int, float] = field(default_factory=dict)

    def utilisation(self) -> dict[int, float]:
        """Per GPU: share of the iteration its compute streams are busy (0 for idle GPUs)."""
        if self.iteration_s <= 0:
            return {g: 0.0 for g in range(self.num_gpus)}
        return {g: min(1.0, self.compute_busy_s.get(g, 0.0) / self.iteration_s)
                for g in range(self.num_gpus)}

    def summary(self) -> dict:
        util = list(self.utilisation().values())
        busy = [u for u in util if u > 0]
        return {"iteration_s": self.iteration_s, "num_gpus": self.num_gpus,
                "events": len(self.events), "gpus_used": len(busy),
                "mean_utilisation": sum(util) / len(util) if util else 0.0,
                "mean_utilisation_of_used": sum(busy) / len(busy) if busy else 0.0}


class _Sim:
    """Event builder: keeps per-GPU stream clocks and busy time while emitting events."""

    def __init__(self, plan: Plan, graph: MMGraph, perf: PerfModel) -> None:
        self.plan, self.graph, self.perf = plan, graph, perf
        self.out = Simulation(iteration_s=0.0, num_gpus=plan.num_gpus)
        self._group_cache: dict[tuple, float] = {}

    def emit(self, name: str, stage: int, gpu: int, start: float, end: float, share: float,
             phase: str, lane: float = 0.0, bar: float | None = None) -> None:
        self.out.events.append(TimelineEvent(name, stage, gpu, start, end, share, lane, phase,
                                             bar))
        busy = self.out.compute_busy_s if phase == COMPUTE else self.out.comm_busy_s
        busy[gpu] = busy.get(gpu, 0.0) + (end - start)

    def group_s(self, works: Sequence[Work], sharing: str) -> float:
        # Many GPUs of a large cluster hold the same works: one model call per distinct group.
        key = (sharing, tuple((w.module.name, w.per_gpu_batch, w.sm_share, w.priority,
                               w.tensor_parallel) for w in works))
        if key not in self._group_cache:
            self._group_cache[key] = self.perf.colocated_time_s(works, sharing)
        return self._group_cache[key]

    def gpu_compute(self, stage: int, gpu: int, works: Sequence[Work], sharing: str, t0: float) -> float:
        """Emit one GPU's compute events of a stage; returns when its last module ends."""
        perf = self.perf
        if sharing == "temporal" or len(works) == 1:
            start = t0
            for w in works:
                end = start + perf.work_time_s(w, 1.0)
                self.emit(w.module.name, stage, gpu, start, end, 1.0, COMPUTE)
                start = end
            return start
        group = self.group_s(works, sharing)
        lane = 0.0
        for w in works:
            bar = w.sm_share if sharing in ("partition", "cap") else 1.0 / len(works)
            alone = perf.work_time_s(w, 1.0 if sharing == "free" else w.sm_share)
            duration = group if sharing == "partition" else min(group, alone)
            self.emit(w.module.name, stage, gpu, t0, t0 + duration, w.sm_share, COMPUTE, lane,
                      bar)
            lane = min(1.0, lane + bar)
        return t0 + group

    def stage(self, index: int, t0: float, overlap: bool) -> float:
        """Compute then all-reduce of one stage from t0; returns the stage's end."""
        stage, graph = self.plan.stages[index], self.graph
        done = {gpu: self.gpu_compute(index, gpu, works, stage.sharing, t0)
                for gpu, works in sorted(self.perf.stage_works(stage, graph).items())}
        barrier = max(done.values())
        end = barrier
        for p in stage.placements:
            module = graph.module(p.module)
            ar = self.perf.placement_allreduce_s(module, p)
            exposed = self.perf.exposed_allreduce_s(module, p, graph, stage)
            start = max(done[g] for g in p.gpus) if overlap else barrier
            if ar > 0:
                what = ("all-gather + reduce-scatter" if p.shard else "allreduce"
                        if exposed >= ar else "allreduce during backward")
                for g in p.gpus:  # one beside the compute began before its end
                    self.emit(f"{p.module} {what}", index, g, max(t0, start + exposed - ar),
                              start + exposed, 1.0, "allreduce")
            end = max(end, start + exposed)
        return end

    def transfers(self, index: int, t0: float) -> float:
        """Activations (and their gradients) of edges leaving this stage's modules, one after
        another on the comm streams of both ends."""
        mods = {p.module for p in self.plan.stages[index].placements}
        t = t0
        for src, dst in self.graph.edges:
            if src not in mods:
                continue
            a, b = self.plan.placement(src), self.plan.placement(dst)
            num_bytes = self.graph.module(src).output_bytes_per_sample * self.graph.global_batch
            # As PerfModel.edge_transfer_s: every GPU of a TP end gets its replica's share.
            moves = (("activations", self.perf.transfer_s(num_bytes * b.tensor_parallel, a.gpus, b.gpus)),
                     ("gradients", self.perf.transfer_s(num_bytes * a.tensor_parallel, a.gpus, b.gpus)))
            for what, one in moves:
                if one <= 0:
                    continue
                for g in sorted({*a.gpus, *b.gpus}):
                    self.emit(f"{src}->{dst} {what}", index, g, t, t + one, 1.0, "transfer")
                t += one
        return t

    def optimizer(self, t0: float) -> float:
        params: dict[int, float] = {}
        for stage in self.plan.stages:
            for p in stage.placements:
                for g in p.gpus:
                    share = p.tensor_parallel * p.states_over  # as optimizer_s
                    params[g] = params.get(g, 0) + self.graph.module(p.module).num_params / share
        end = t0
        for g, n in sorted(params.items()):
            step = self.perf.optimizer_step_s(n)
            if step <= 0:
                continue
            self.emit("optimizer", len(self.plan.stages), g, t0, t0 + step, 1.0, COMPUTE)
            end = max(end, t0 + step)
        return end

    def engine_term(self, t0: float) -> float:
        """The model's fitted per-step engine term (perf/engine_term.py), which the planners'
        predictions include: one event on every GPU when it adds time. A negative term (the
        engine's kernels faster than the profiled ones) compresses every event uniformly."""
        term = getattr(self.perf, "engine_term_s", None)
        seconds = term(self.plan, self.graph) if term is not None else 0.0
        if seconds > 0:
            for g in range(self.plan.num_gpus):
                self.emit("engine term (fitted)", len(self.plan.stages), g, t0, t0 + seconds,
                          1.0, COMPUTE)
        elif seconds < 0 and t0 > 0:
            self._compress((t0 + seconds) / t0)
        return t0 + seconds

    def _compress(self, factor: float) -> None:
        out = self.out
        out.events = [replace(e, start_s=e.start_s * factor, end_s=e.end_s * factor)
                      for e in out.events]
        for busy in (out.compute_busy_s, out.comm_busy_s):
            for g in busy:
                busy[g] *= factor

    def pipelined(self) -> float:
        """The model's one-GPU micro-batch overlap as three segments (see PerfModel.pipelined_s)."""
        plan, graph, perf = self.plan, self.graph, self.perf
        n, micro = plan.micro_batches, graph.global_batch // plan.micro_batches
        *early, last = plan.stages
        e_s = sum(perf.stage_compute_s(s, graph, micro) for s in early)
        l_s = perf.stage_compute_s(last, graph, micro)
        works = [w for s in plan.stages for ws in perf.stage_works(s, graph, micro).values() for w in ws]
        pair_s = min(max(perf.colocated_time_s(works, "free"), e_s, l_s), e_s + l_s)
        gpus = sorted({g for s in plan.stages for p in s.placements for g in p.gpus})
        t = 0.0
        for name, dur in [("early stages", e_s), *[("early||last", pair_s)] * (n - 1), ("last stage", l_s)]:
            for g in gpus:
                self.emit(name, 0, g, t, t + dur, 1.0, COMPUTE)
            t += dur
        return t


def simulate(plan: Plan, graph: MMGraph, perf: PerfModel, *, overlap: bool = False) -> Simulation:
    """Replay one iteration of a validated plan as per-GPU stream events (module docstring)."""
    sim = _Sim(plan, graph, perf)
    if plan.micro_batches > 1:
        t = sim.pipelined()
        for i in range(len(plan.stages)):
            t = sim.transfers(i, t)
    else:
        t = 0.0
        for i in range(len(plan.stages)):
            t = sim.stage(i, t, overlap)
            t = sim.transfers(i, t)
    sim.out.iteration_s = sim.engine_term(sim.optimizer(t))
    return sim.out
