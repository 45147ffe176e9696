"""A deployment plan: stages of placements, each module on a GPU set with an SM share.

Stages run one after another (forward in stage order, backward in reverse); inside a stage,
modules placed on the same GPU share it in the stage's sharing mode:

- `temporal`:  one module after another, each with the whole GPU (Megatron/DistMM/Spindle).
- `partition`: disjoint SM quotas (the paper's green-context partitions); shares on a GPU sum <= 1.
- `cap`:       overlapping upper bounds: small modules capped, share 1.0 means uncapped.
- `free`:      concurrent streams with no quota; `priority` 1 marks the critical-path module.

The plan is plain data with a JSON round trip; `validate` is the one gate every plan passes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mosaic.errors import MosaicError
from mosaic.files import write_text_atomic
from mosaic.graph import MMGraph
from mosaic.hardware import ClusterSpec

SHARING_MODES = ("temporal", "partition", "cap", "free")
PLAN_FORMAT_VERSION = 1
MEMORY_MARGIN = 0.10
"""Fraction of GPU memory kept free for the allocator, NCCL buffers and CUDA graphs."""


class PlanError(MosaicError):
    """A plan that cannot run; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    module: str
    gpus: tuple[int, ...]
    """Global GPU ids holding one data-parallel replica each: DP degree = len(gpus)."""
    sm_share: float = 1.0
    """Fraction of each GPU's SMs: quota (partition), upper bound (cap), 1.0 otherwise."""
    priority: int = 0
    """Stream priority: 1 = high (critical path), 0 = normal."""

    @property
    def dp_degree(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    placements: tuple[Placement, ...]
    sharing: str = "temporal"

    @property
    def modules(self) -> list[str]:
        return [p.module for p in self.placements]

    def on_gpu(self, gpu: int) -> list[Placement]:
        return [p for p in self.placements if gpu in p.gpus]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    model: str
    planner: str
    num_gpus: int
    stages: tuple[Stage, ...]
    predicted_iteration_s: float | None = None
    perf_model: str = ""
    micro_batches: int = 1
    """Split the batch into this many micro-batches (gradients accumulate: the same update as
    one batch) so the last stage of micro-batch k overlaps the earlier stages of k+1 — the LLM
    runs while the next micro-batch's encoders do. One GPU only, for now."""
    meta: dict[str, Any] = field(default_factory=dict)

    def placement(self, module: str) -> Placement:
        for stage in self.stages:
            for p in stage.placements:
                if p.module == module:
                    return p
        raise PlanError(f"plan has no placement for module {module!r}")

    def stage_of(self, module: str) -> int:
        for i, stage in enumerate(self.stages):
            if module in stage.modules:
                return i
        raise PlanError(f"plan has no placement for module {module!r}")

    def with_prediction(self, seconds: float, perf_model: str) -> Plan:
        return replace(self, predicted_iteration_s=seconds, perf_model=perf_model)

    # --- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format_version": PLAN_FORMAT_VERSION, **asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise PlanError("plan JSON must be an object with keys model, planner, num_gpus, stages")
        version = d.get("format_version", PLAN_FORMAT_VERSION)
        if version != PLAN_FORMAT_VERSION:
            raise PlanError(f"plan format_version {version} is not supported (expected {PLAN_FORMAT_VERSION})")
        try:
            stages = tuple(
                Stage(
                    sharing=str(s.get("sharing", "temporal")),
                    placements=tuple(
                        Placement(
                            module=str(p["module"]),
                            gpus=tuple(int(g) for g in p["gpus"]),
                            sm_share=float(p.get("sm_share", 1.0)),
                            priority=int(p.get("priority", 0)),
                        )
                        for p in s["placements"]
                    ),
                )
                for s in d["stages"]
            )
            return cls(
                model=str(d["model"]),
                planner=str(d.get("planner", "manual")),
                num_gpus=int(d["num_gpus"]),
                stages=stages,
                predicted_iteration_s=d.get("predicted_iteration_s"),
                perf_model=str(d.get("perf_model", "")),
                micro_batches=int(d.get("micro_batches", 1)),
                meta=dict(d.get("meta", {})),
            )
        except KeyError as exc:
            raise PlanError(f"plan JSON is missing key {exc}; see docs for the plan format") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"plan JSON has a malformed field: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan file is not valid JSON ({exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            return cls.from_json(Path(path).read_text())
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:  # found by tests/test_fuzz.py: binary garbage
            raise PlanError(f"plan file {path} is not UTF-8 text ({exc.reason} at byte "
                            f"{exc.start}); pass a plan JSON from `mosaic plan --out`") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_text_atomic(path, self.to_json())  # a crash never leaves half a plan

    def validate(self, graph: MMGraph, cluster: ClusterSpec) -> Plan:
        validate_plan(self, graph, cluster)
        return self


def validate_plan(plan: Plan, graph: MMGraph, cluster: ClusterSpec) -> None:
    """Raise PlanError on the first rule the plan breaks (DESIGN.md's rules of the house)."""
    if plan.model != graph.name:
        raise PlanError(f"plan is for model {plan.model!r} but the graph is {graph.name!r}")
    if plan.num_gpus != cluster.num_gpus:
        raise PlanError(
            f"plan needs num_gpus={plan.num_gpus} but the cluster has {cluster.num_gpus}; "
            "re-plan for this cluster"
        )
    if not plan.stages:
        raise PlanError("plan has no stages")
    _check_each_module_once(plan, graph)
    for index, stage in enumerate(plan.stages):
        _check_stage(index, stage, graph, cluster)
    _check_dag_order(plan, graph)
    _check_micro_batches(plan, graph)
    _check_memory(plan, graph, cluster)


def _check_micro_batches(plan: Plan, graph: MMGraph) -> None:
    m = plan.micro_batches
    if m == 1:
        return
    if m < 1 or graph.global_batch % m:
        raise PlanError(f"micro_batches={m} must be >= 1 and divide global_batch {graph.global_batch}")
    if plan.num_gpus != 1 or len(plan.stages) < 2:
        raise PlanError(f"micro_batches={m} overlaps the last stage with the earlier ones on one "
                        "GPU: it needs num_gpus=1 and at least two stages; use micro_batches=1")


def _check_each_module_once(plan: Plan, graph: MMGraph) -> None:
    placed = [p.module for s in plan.stages for p in s.placements]
    for name in placed:
        if name not in graph.names:
            raise PlanError(f"plan places unknown module {name!r}; the model has {graph.names}")
    duplicates = sorted({n for n in placed if placed.count(n) > 1})
    if duplicates:
        raise PlanError(f"modules {duplicates} are placed more than once; place each exactly once")
    missing = sorted(set(graph.names) - set(placed))
    if missing:
        raise PlanError(f"modules {missing} are not placed; every module needs a placement")


def _check_stage(index: int, stage: Stage, graph: MMGraph, cluster: ClusterSpec) -> None:
    where = f"stage {index}"
    if stage.sharing not in SHARING_MODES:
        raise PlanError(f"{where}: sharing={stage.sharing!r}; use one of {SHARING_MODES}")
    if not stage.placements:
        raise PlanError(f"{where} has no placements")
    for p in stage.placements:
        _check_placement(where, p, stage.sharing, graph, cluster)
    if stage.sharing == "partition":
        gpu = cluster.gpu
        for g in sorted({g for p in stage.placements for g in p.gpus}):
            sms = [gpu.round_sms(p.sm_share) for p in stage.on_gpu(g)]
            if sum(sms) > gpu.num_sms:
                names = [p.module for p in stage.on_gpu(g)]
                raise PlanError(
                    f"{where}: disjoint partitions of {names} on GPU {g} need {sum(sms)} SMs "
                    f"({sms}, rounded up to multiples of {gpu.sm_granularity}) but it has "
                    f"{gpu.num_sms}; lower their sm_share"
                )


def _check_placement(where: str, p: Placement, sharing: str, graph: MMGraph, cluster: ClusterSpec) -> None:
    what = f"{where}, module {p.module!r}"
    if not p.gpus:
        raise PlanError(f"{what}: gpus is empty; give at least one GPU id")
    if len(set(p.gpus)) != len(p.gpus):
        raise PlanError(f"{what}: gpus {list(p.gpus)} repeats an id")
    bad = [g for g in p.gpus if not 0 <= g < cluster.num_gpus]
    if bad:
        raise PlanError(f"{what}: GPU ids {bad} do not exist (cluster has 0..{cluster.num_gpus - 1})")
    if not 0 < p.sm_share <= 1:
        raise PlanError(f"{what}: sm_share={p.sm_share} must be in (0, 1] (a quota beyond the GPU)")
    if sharing in ("temporal", "free") and p.sm_share != 1.0:
        raise PlanError(f"{what}: sm_share={p.sm_share} but sharing={sharing!r} takes no quota; use 1.0 or 'cap'")
    if p.priority not in (0, 1):
        raise PlanError(f"{what}: priority={p.priority} must be 0 (normal) or 1 (high)")
    if graph.global_batch % p.dp_degree:
        raise PlanError(
            f"{what}: DP degree {p.dp_degree} does not divide global_batch {graph.global_batch}; "
            "use a GPU count that divides the batch"
        )


def _check_dag_order(plan: Plan, graph: MMGraph) -> None:
    for src, dst in graph.edges:
        if plan.stage_of(src) >= plan.stage_of(dst):
            raise PlanError(
                f"module {dst!r} (stage {plan.stage_of(dst)}) consumes {src!r} (stage "
                f"{plan.stage_of(src)}): a consumer must be in a later stage than its producers"
            )


def gpu_memory_bytes(plan: Plan, graph: MMGraph) -> dict[int, float]:
    """Peak bytes per GPU: every placed module's weights + optimizer state + activations.

    Activations of all stages are live at once (all forwards run before the backwards).
    """
    used: dict[int, float] = defaultdict(float)
    for stage in plan.stages:
        for p in stage.placements:
            m = graph.module(p.module)
            per_gpu_batch = graph.global_batch // p.dp_degree
            for g in p.gpus:
                used[g] += m.static_bytes + m.activation_bytes_per_sample * per_gpu_batch
    return dict(used)


def _check_memory(plan: Plan, graph: MMGraph, cluster: ClusterSpec) -> None:
    budget = cluster.gpu.memory_bytes * (1 - MEMORY_MARGIN)
    for g, used in sorted(gpu_memory_bytes(plan, graph).items()):
        if used > budget:
            raise PlanError(
                f"GPU {g} needs {used / 2**30:.1f} GiB (weights, optimizer state, activations) but "
                f"{budget / 2**30:.1f} GiB is usable on {cluster.gpu.name}; spread the modules "
                "over more GPUs or lower the batch"
            )
