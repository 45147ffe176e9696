"""A deployment plan: stages of placements, each module on a GPU set with an SM share.

Stages run one after another (forward in stage order, backward in reverse); inside a stage,
modules placed on the same GPU share it in the stage's sharing mode:

- `temporal`:  one module after another, each with the whole GPU (Megatron/DistMM/Spindle).
- `partition`: disjoint SM quotas (the paper's green-context partitions); shares on a GPU sum <= 1.
- `cap`:       overlapping upper bounds: small modules capped, share 1.0 means uncapped.
- `free`:      concurrent streams with no quota; `priority` 1 marks the critical-path module.

A placement's GPUs hold data-parallel replicas, each on `tensor_parallel` consecutive GPUs of
one node (tensor parallelism, mosaic.tensor_parallel; 1 GPU per replica by default).

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
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import ClusterSpec
from mosaic.sharding import added_bytes, saved_bytes
from mosaic.tensor_parallel import bf16_precision_saving, bytes_per_gpu

SHARING_MODES = ("temporal", "partition", "cap", "free")
PLAN_FORMAT_VERSION = 1
MEMORY_MARGIN = 0.10
"""Fraction of GPU memory kept free for the allocator, NCCL buffers and CUDA graphs."""


class PlanError(MosaicError):
    """A plan that cannot run; the message names the field and the fix."""


class MemoryPlanError(PlanError):
    """A plan, or a module of it, that does not fit in GPU memory: the message names the GPU
    or module, by how much, and what would free it."""


class TensorParallelError(PlanError):
    """A placement's `tensor_parallel` that cannot run: the degree, its GPUs or the module."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    module: str
    gpus: tuple[int, ...]
    """Global GPU ids; each run of `tensor_parallel` of them holds one data-parallel replica:
    DP degree = len(gpus) // tensor_parallel."""
    sm_share: float = 1.0
    """Fraction of each GPU's SMs: quota (partition), upper bound (cap), 1.0 otherwise."""
    priority: int = 0
    """Stream priority: 1 = high (critical path), 0 = normal."""
    tensor_parallel: int = 1
    """GPUs per replica: `gpus` is cut into runs of this many consecutive GPUs (inside one
    node), each holding one replica sharded across them, all seeing the same samples
    (mosaic.tensor_parallel). 1: plain data parallelism."""
    shard: bool = False
    """Shard the module's weights, gradients and optimizer state over its GPUs (FSDP2,
    mosaic.sharding) instead of a full copy on each: 1/DP of the states per GPU, at the
    price of all-gathering the weights (forward and backward) and reduce-scattering the
    gradients in place of the all-reduce. Needs a DP degree >= 2."""
    shard_degree: int = 0
    """With `shard`: the GPUs one copy of the states is sharded over (FSDP2's hybrid sharding,
    HSDP): `gpus` is cut into runs of this many consecutive GPUs, each run holding a whole
    sharded copy, and the runs' reduce-scattered gradients are all-reduced with each other. So
    a module's gathers stay inside a node while it is data-parallel over several. 0: all of
    its GPUs (plain FSDP)."""

    @property
    def dp_degree(self) -> int:
        return len(self.gpus) // self.tensor_parallel

    @property
    def states_over(self) -> int:
        """GPUs one copy of the states is spread over: the shard degree (the DP degree
        unless `shard_degree` says otherwise) when sharded, else 1."""
        if not self.shard:
            return 1
        return self.shard_degree or self.dp_degree

    @property
    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each sharded copy of the states (one group: plain FSDP)."""
        return _runs(self.gpus, self.states_over)

    @property
    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """GPUs holding the same shard, one per copy: HSDP all-reduces their gradients."""
        return _strided(self.gpus, self.states_over)

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each replica, in DP order (replica i holds the i-th sample range)."""
        return _runs(self.gpus, self.tensor_parallel)

    @property
    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """GPUs holding the same shard, one per replica: their gradients are all-reduced."""
        return _strided(self.gpus, self.tensor_parallel)


def _runs(gpus: tuple[int, ...], k: int) -> tuple[tuple[int, ...], ...]:
    """`gpus` cut into consecutive runs of k."""
    return tuple(gpus[i:i + k] for i in range(0, len(gpus), k))


def _strided(gpus: tuple[int, ...], k: int) -> tuple[tuple[int, ...], ...]:
    """The i-th GPU of every run of k, for each i: the GPUs in the same position."""
    return tuple(gpus[r::k] for r in range(k))


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    placements: tuple[Placement, ...]
    sharing: str = "temporal"

    @property
    def modules(self) -> list[str]:
        return [p.module for p in self.placements]

    def on_gpu(self, gpu: int) -> list[Placement]:
        return [p for p in self.placements if gpu in p.gpus]

    def runs_alone(self, module: str) -> bool:
        """Whether no other module of the stage runs beside `module` on its GPUs: a temporal
        stage runs its modules one after another on one stream; another stage, side by side
        (so an engine summing gradients during a backward does so only where this holds)."""
        gpus = set(next(p.gpus for p in self.placements if p.module == module))
        return self.sharing == "temporal" or not any(
            gpus & set(p.gpus) for p in self.placements if p.module != module)


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

    def sharded_modules(self) -> list[str]:
        """The modules whose training states are sharded (FSDP2), sorted."""
        return sorted(p.module for s in self.stages for p in s.placements if p.shard)

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
                            tensor_parallel=int(p.get("tensor_parallel", 1)),
                            shard=_flag(p.get("shard", False), "shard"),
                            shard_degree=int(p.get("shard_degree", 0)),
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


def plan_key(plan: Plan) -> tuple:
    """The placement structure: equal keys run identically, whatever planner made them."""
    return (plan.micro_batches, tuple(
        (s.sharing, tuple(sorted((p.module, tuple(p.gpus), round(p.sm_share, 4), p.priority, p.shard,
                                  p.tensor_parallel, p.shard_degree) for p in s.placements))) for s in plan.stages))


def run_key(plan: Plan) -> tuple:
    """`plan_key` of the plan as the engine runs it, for choosing which plans to measure: a
    run of modules one by one (temporal stages, one temporal stage of several, or stages of
    one module on the whole GPU in any mode) is the same in any order, and a cap stage whose
    caps are all the whole GPU runs plain streams, as a free stage does."""
    stages: list[Stage] = []
    one_by_one: list[Placement] = []
    for stage in (*plan.stages, None):
        alone = stage is not None and len(stage.placements) == 1 and (
            stage.placements[0].sm_share >= 1.0)
        if stage is not None and (stage.sharing == "temporal" or alone):
            one_by_one += [replace(p, priority=0) for p in stage.placements]
            continue
        stages += [Stage(placements=(p,), sharing="temporal")
                   for p in sorted(one_by_one, key=lambda p: p.module)]
        one_by_one = []
        if stage is not None and stage.sharing == "cap" and all(
                p.sm_share >= 1.0 for p in stage.placements):
            stage = replace(stage, sharing="free")
        if stage is not None:
            stages.append(stage)
    return plan_key(replace(plan, stages=tuple(stages)))


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
    _check_tensor_parallel(what, p, graph, cluster)
    _check_shard(what, p)
    if graph.global_batch % p.dp_degree:
        raise PlanError(
            f"{what}: DP degree {p.dp_degree} does not divide global_batch {graph.global_batch}; "
            "use a GPU count that divides the batch"
        )


def _check_tensor_parallel(what: str, p: Placement, graph: MMGraph, cluster: ClusterSpec) -> None:
    t = p.tensor_parallel
    if t == 1:
        return
    if t < 1 or len(p.gpus) % t:
        raise TensorParallelError(
            f"{what}: tensor_parallel={t} must be >= 1 and divide its {len(p.gpus)} GPUs "
            "(DP degree = GPUs / tensor_parallel); use 1 or a divisor of the GPU count")
    most = graph.module(p.module).max_tensor_parallel
    if most % t:
        fix = ("it has no tensor-parallel plan (max_tensor_parallel=1): use tensor_parallel=1, "
               "or give the module a `tp_plan(tensor_parallel)` method and a "
               "`max_tensor_parallel` attribute (docs/own-model.md)"
               if most == 1 else f"its heads and MLP split evenly only by divisors of {most} "
               "(max_tensor_parallel): use one of those")
        raise TensorParallelError(f"{what}: tensor_parallel={t} but {fix}")
    for group in p.tp_groups:
        if cluster.spans_nodes(group):
            raise TensorParallelError(
                f"{what}: tensor_parallel group {list(group)} spans nodes "
                f"{sorted(cluster.nodes_of(group))} ({cluster.gpus_per_node} GPUs per node); "
                "TP all-reduces run every layer and need NVLink: list gpus so that each run of "
                f"{t} is inside one node, or lower tensor_parallel")


def _check_shard(what: str, p: Placement) -> None:
    """Sharding over one GPU saves nothing (the GPU holds every shard) but FSDP's overhead, so
    a plan asking for it expects memory it would not get: refused rather than ignored."""
    if not p.shard:
        if p.shard_degree:
            raise PlanError(f"{what}: shard_degree={p.shard_degree} without shard=true; set "
                            "shard to true or shard_degree to 0")
        return
    if p.tensor_parallel != 1:
        raise PlanError(f"{what}: shard=true with tensor_parallel={p.tensor_parallel}: sharded "
                        "states and tensor parallelism together are not supported; set one of "
                        "them off (shard=false or tensor_parallel=1)")
    if p.dp_degree < 2:
        raise PlanError(f"{what}: shard=true needs a DP degree >= 2 (it has {p.dp_degree}): "
                        "its states are split over its GPUs; give it more GPUs or set shard "
                        "to false")
    k = p.shard_degree
    if k and (k < 2 or p.dp_degree % k):
        raise PlanError(f"{what}: shard_degree={k} must be >= 2 and divide the DP degree "
                        f"{p.dp_degree} (each run of {k} GPUs holds one sharded copy); use a "
                        "divisor of it, or 0 to shard over all its GPUs")


def _flag(value: Any, name: str) -> bool:
    """A JSON boolean, strictly: bool("false") would be True."""
    if not isinstance(value, bool):
        raise PlanError(f"{name}={value!r} must be true or false")
    return value


def _check_dag_order(plan: Plan, graph: MMGraph) -> None:
    for src, dst in graph.edges:
        if plan.stage_of(src) >= plan.stage_of(dst):
            raise PlanError(
                f"module {dst!r} (stage {plan.stage_of(dst)}) consumes {src!r} (stage "
                f"{plan.stage_of(src)}): a consumer must be in a later stage than its producers"
            )


def gpu_memory_bytes(plan: Plan, graph: MMGraph) -> dict[int, float]:
    """Peak bytes per GPU: every placed module's weights + optimizer state + activations
    (a TP shard's share of them: mosaic.tensor_parallel.bytes_per_gpu; a sharded placement's
    states: mosaic.sharding.state_bytes, 1/DP of them plus the whole units FSDP gathers).

    Activations of all stages are live at once (all forwards run before the backwards).
    """
    used: dict[int, float] = defaultdict(float)
    for stage in plan.stages:
        for p in stage.placements:
            need = replica_bytes(graph.module(p.module), graph.global_batch, p.dp_degree,
                                 p.tensor_parallel, p.shard, p.states_over)
            for g in p.gpus:
                used[g] += need
    return dict(used)


def replica_bytes(module: ModuleSpec, global_batch: int, dp_degree: int,
                  tensor_parallel: int = 1, shard: bool = False,
                  states_over: int | None = None) -> float:
    """Peak bytes of `module` on one GPU of a placement (`gpu_memory_bytes`); also what a
    user's DDP (`shard` False) or FSDP2 program needs of each module. A sharded module's
    states are spread over `states_over` GPUs (default: all `dp_degree`; fewer with HSDP)."""
    need = bytes_per_gpu(module, global_batch // dp_degree, tensor_parallel)
    if shard:  # sharded states in place of the full copy (mosaic.sharding)
        need += added_bytes(module, states_over or dp_degree)
    return need


def _check_memory(plan: Plan, graph: MMGraph, cluster: ClusterSpec) -> None:
    budget = cluster.gpu.memory_bytes * (1 - MEMORY_MARGIN)
    for g, used in sorted(gpu_memory_bytes(plan, graph).items()):
        if used > budget:
            raise MemoryPlanError(
                f"GPU {g} needs {used / 2**30:.1f} GiB (weights, optimizer state, activations) but "
                f"{budget / 2**30:.1f} GiB is usable on {cluster.gpu.name}; "
                f"{memory_fix(plan, graph, g, used - budget)}"
            )


def memory_fix(plan: Plan, graph: MMGraph, gpu: int, excess: float) -> str:
    """How to free `excess` bytes on `gpu`: shard the states of its unsharded data-parallel
    modules, largest saving first, when that is enough; else spread or shrink."""
    savings = sorted(((saved_bytes(graph.module(p.module), p.dp_degree), p.module)
                      for s in plan.stages for p in s.placements
                      if gpu in p.gpus and not p.shard and p.tensor_parallel == 1), reverse=True)
    chosen, saved = [], 0.0
    for amount, module in savings:
        if amount <= 0 or saved >= excess:
            break
        chosen.append(module)
        saved += amount
    if chosen and saved >= excess:
        names = ", ".join(repr(m) for m in chosen)
        return (f"shard the states of module {names} (\"shard\": true on its placement saves "
                f"{saved / 2**30:.1f} GiB on GPU {gpu}), spread the modules over more GPUs or "
                "lower the batch")
    return f"{_bf16_fix(plan, graph, gpu, excess)}spread the modules over more GPUs or lower the batch"


def _bf16_fix(plan: Plan, graph: MMGraph, gpu: int, excess: float) -> str:
    """'train with FLAGS (saves N GiB on GPU g), ' when bf16 weights and moments (and, where
    they are not enough, no fp32 main weights) would free `excess` there (the engine keeps bf16
    weights only whole: no shard, no TP), else ''."""
    placed = [p for s in plan.stages for p in s.placements if gpu in p.gpus]
    if any(p.shard or p.tensor_parallel > 1 for p in placed):
        return ""
    for main_weights in (True, False):  # the fp32 main copies are the last to go
        savings = [bf16_precision_saving(graph.module(p.module), main_weights=main_weights)
                   for p in placed]
        saved = sum(amount for amount, _ in savings)
        # One precision for the whole graph: the modules that would save name the same flags.
        flags = next((f for _, f in savings if f), "")
        if flags and saved >= excess:
            return f"train with {flags} (saves {saved / 2**30:.1f} GiB on GPU {gpu}), "
    return ""
