"""The multimodal model as a DAG of modules, with the cost facts every later stage needs.

An `MMGraph` is plain data (JSON round trip): the profiler, the performance model, the
planners and the engine all read it, none of them needs the nn.Modules themselves.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mosaic.errors import MosaicError

if TYPE_CHECKING:  # networkx takes a noticeable part of a second to import: the DAG walks
    import networkx as nx  # below are plain Python, networkx only for to_networkx()

MODULE_KINDS = ("encoder", "embedding", "llm", "head")


class GraphError(MosaicError):
    """A model graph that cannot be planned; the message names the field and the fix."""


BYTES_PER_PARAM_STEP = 40.0
"""Weights read forward and backward, fp32 gradient written, AdamW state read and written."""
ACTIVATION_PASSES = 3.0
"""Activations written forward, read backward, and their gradients written."""
FP32_STATE_BYTES = 16.0
"""An fp32 parameter's weight, gradient and two AdamW moments, 4 bytes each."""
BF16_WEIGHT_STATE_BYTES = 8.0
"""A bf16 weight 2, its fp32 main copy 4 and its bf16 gradient 2, moments apart."""
MAIN_WEIGHT_BYTES = 4.0
"""The fp32 main copy of a bf16 weight, which `--no-fp32-main-weights` does without."""
BF16_GRAD_BYTES = 2.0
"""A bf16 gradient's copy in the flat update's buffer (ModuleSpec.static_bytes)."""
FP32_MOMENT_BYTES = 8.0
BF16_MOMENT_BYTES = 4.0


@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleSpec:
    """One module of a multimodal model and what it costs per sample."""

    name: str
    """Unique name inside the graph, e.g. `vision`."""
    kind: str
    """One of MODULE_KINDS; the alignment head / LLM consumes encoder outputs."""
    input_shape: tuple[int, ...]
    """Per-sample shape of the module's own synthetic input (without the batch axis)."""
    num_params: int
    """Trainable parameters."""
    num_layers: int = 1
    """Transformer blocks (or equivalent); drives the kernel-count latency term."""
    hidden_dim: int = 0
    """Width of the main residual stream."""
    tokens_per_sample: int = 1
    """Sequence length the module processes per sample."""
    flops_per_sample: float
    """Forward + backward FLOPs for one sample (counted on the real module)."""
    activation_bytes_per_sample: float
    """Bytes of activations kept for backward, per sample (bf16)."""
    output_bytes_per_sample: float
    """Bytes sent to each consumer module per sample (activations forward, grads back)."""
    num_kernels: int = 0
    """Kernel launches in one forward + backward (0: estimated from layers)."""
    max_tensor_parallel: int = 1
    """Largest tensor-parallel degree the module has a TP plan for (1: none); any degree that
    divides it splits its attention heads, KV heads and MLP width evenly (see
    `mosaic.tensor_parallel`)."""
    bf16_weight_params: int = 0
    """Parameters `--bf16-weights` stores in bf16: the weights of nn.Linear and of convolutions
    with at least 65,536 elements, not tied elsewhere (counted on the real module with the
    engine's own rule; 0: unknown, every parameter counted fp32)."""
    bf16_weights: bool = False
    """Training stores those weights in bf16 with fp32 main copies (`MMGraph.with_precision`)."""
    bf16_moments: bool = False
    """...and their AdamW moments in bf16 too (needs bf16_weights)."""
    bf16_flat_grads: bool = True
    """...and the backward copies their gradients into one flat buffer for the one-launch
    update (2 more bytes a weight; False: updated a weight at a time, where they lie)."""
    fp32_main_weights: bool = True
    """...with an fp32 main copy of each in the optimizer (False: none; the update rounds the
    new bf16 weight stochastically; needs bf16_weights)."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise GraphError(f"module name {self.name!r}: use letters, digits, '_' or '-'")
        if self.kind not in MODULE_KINDS:
            raise GraphError(f"module {self.name!r}: kind {self.kind!r} is not one of {MODULE_KINDS}")
        for fname in ("num_params", "flops_per_sample", "activation_bytes_per_sample"):
            if getattr(self, fname) < 0:
                raise GraphError(f"module {self.name!r}: {fname} must be >= 0")
        if self.max_tensor_parallel < 1:
            raise GraphError(f"module {self.name!r}: max_tensor_parallel="
                             f"{self.max_tensor_parallel} must be >= 1 (1: no tensor parallelism)")
        if not 0 <= self.bf16_weight_params <= self.num_params:
            raise GraphError(f"module {self.name!r}: bf16_weight_params="
                             f"{self.bf16_weight_params} must be between 0 and num_params "
                             f"({self.num_params})")
        if self.bf16_moments and not self.bf16_weights:
            raise GraphError(f"module {self.name!r}: bf16_moments=true keeps the bf16 weights' "
                             "moments in bf16: set bf16_weights=true too, or drop it")
        if not self.fp32_main_weights and not self.bf16_weights:
            raise GraphError(f"module {self.name!r}: fp32_main_weights=false drops the bf16 "
                             "weights' fp32 copies: set bf16_weights=true too, or drop it")

    @property
    def kernels_per_step(self) -> int:
        # About 14 forward kernels per transformer block and twice that backward.
        return self.num_kernels or max(8, 42 * self.num_layers)

    @property
    def stored_bf16_params(self) -> int:
        """Parameters training stores in bf16 (0 unless bf16_weights)."""
        return self.bf16_weight_params if self.bf16_weights else 0

    @property
    def static_bytes(self) -> float:
        """Weights, gradients and AdamW's two moments: 4 + 4 + 4 + 4 bytes an fp32 parameter
        (the engine trains fp32 weights under bf16 autocast); a bf16 weight's are the bf16
        weight 2, its fp32 main copy 4 (unless fp32_main_weights is off), its bf16 gradient 2
        (and its copy in the flat update's buffer, 2, unless bf16_flat_grads is off) and the
        moments, 8 in fp32 or 4 in bf16. The
        bf16 copy of each fp32 weight that autocast keeps for the backward is counted with the
        activations (tensor_parallel.autocast_weight_bytes)."""
        bf16 = self.stored_bf16_params
        per_bf16 = (BF16_WEIGHT_STATE_BYTES + BF16_GRAD_BYTES * self.bf16_flat_grads
                    - MAIN_WEIGHT_BYTES * (not self.fp32_main_weights)
                    + (BF16_MOMENT_BYTES if self.bf16_moments else FP32_MOMENT_BYTES))
        return FP32_STATE_BYTES * (self.num_params - bf16) + per_bf16 * bf16

    def step_traffic_bytes(self, per_gpu_batch: int) -> float:
        """Device-memory bytes one forward + backward + optimizer step moves (a count, not a
        measurement): what the roofline, the interference model and the profiler share."""
        return (BYTES_PER_PARAM_STEP * self.num_params
                + ACTIVATION_PASSES * self.activation_bytes_per_sample * per_gpu_batch)


@dataclass(frozen=True, kw_only=True, slots=True)
class MMGraph:
    """A multimodal model: modules and the edges feeding encoders' outputs to consumers."""

    name: str
    modules: tuple[ModuleSpec, ...]
    edges: tuple[tuple[str, str], ...]
    global_batch: int
    """Samples per training iteration (every module processes each sample once)."""
    preset: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_graph(self)

    # --- lookups -----------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [m.name for m in self.modules]

    def module(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise GraphError(f"graph {self.name!r} has no module {name!r}; modules: {self.names}")

    def predecessors(self, name: str) -> list[str]:
        return [src for src, dst in self.edges if dst == name]

    def successors(self, name: str) -> list[str]:
        return [dst for src, dst in self.edges if src == name]

    def to_networkx(self) -> nx.DiGraph:
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(self.names)
        g.add_edges_from(self.edges)
        return g

    def levels(self) -> list[list[str]]:
        """Topological generations: modules of one level are mutually independent."""
        return [sorted(level) for level in _generations(self.names, self.edges)]

    def topo_order(self) -> list[str]:
        return [name for level in self.levels() for name in level]

    def ancestors(self, name: str) -> set[str]:
        found: set[str] = set()
        todo = [name]
        while todo:
            for p in self.predecessors(todo.pop()):
                if p not in found:
                    found.add(p)
                    todo.append(p)
        return found

    def independent(self, a: str, b: str) -> bool:
        return a not in self.ancestors(b) and b not in self.ancestors(a)

    @property
    def sinks(self) -> list[str]:
        return [n for n in self.names if not self.successors(n)]

    def with_precision(self, *, bf16_weights: bool, bf16_moments: bool = False,
                       bf16_flat_grads: bool = True, fp32_main_weights: bool = True) -> MMGraph:
        """The graph as `mosaic train` with these flags holds it: what its memory counts
        (ModuleSpec.static_bytes) follows the weights' and moments' dtypes, the main copies
        and the update's layout."""
        return replace(self, modules=tuple(
            replace(m, bf16_weights=bf16_weights, bf16_moments=bf16_moments,
                    bf16_flat_grads=bf16_flat_grads, fp32_main_weights=fp32_main_weights)
            for m in self.modules))

    def total_flops(self) -> float:
        """Forward + backward FLOPs of one training iteration."""
        return sum(m.flops_per_sample for m in self.modules) * self.global_batch

    # --- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["edges"] = [list(e) for e in self.edges]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MMGraph:
        try:
            modules = tuple(_module_from_dict(m, i) for i, m in enumerate(d["modules"]))
            edges = tuple((str(a), str(b)) for a, b in d["edges"])
            return cls(
                name=d["name"],
                modules=modules,
                edges=edges,
                global_batch=int(d["global_batch"]),
                preset=d.get("preset", "custom"),
                meta=d.get("meta", {}),
            )
        # ValueError, AttributeError: found by tests/test_fuzz.py (an edge of one name, a
        # count that is not a number, a list where an object belongs)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, GraphError):
                raise
            raise GraphError(f"malformed graph JSON: {exc}; expected keys name, modules, edges, global_batch") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> MMGraph:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise GraphError(f"graph file is not valid JSON: {exc}") from exc


_NUMBER_FIELDS = {"num_params": int, "num_layers": int, "hidden_dim": int,
                  "tokens_per_sample": int, "flops_per_sample": float,
                  "activation_bytes_per_sample": float, "output_bytes_per_sample": float,
                  "num_kernels": int, "max_tensor_parallel": int, "bf16_weight_params": int}
_FLAG_FIELDS = ("bf16_weights", "bf16_moments", "bf16_flat_grads", "fp32_main_weights")
_REQUIRED_FIELDS = ("name", "kind", "input_shape", "num_params", "flops_per_sample",
                    "activation_bytes_per_sample", "output_bytes_per_sample")


def _module_from_dict(m: Any, index: int) -> ModuleSpec:
    """One module of a graph JSON, each field checked by name: a user writes these by hand
    (`"num_params": "85M"` must say which field of which module, not a Python internal)."""
    where = f"modules[{index}]" + (f" ({m.get('name')!r})" if isinstance(m, dict) else "")
    if not isinstance(m, dict):
        raise GraphError(f"{where}: a module must be an object with keys {list(_REQUIRED_FIELDS)}")
    missing = [k for k in _REQUIRED_FIELDS if k not in m]
    optional = sorted({*_NUMBER_FIELDS, *_FLAG_FIELDS} - set(_REQUIRED_FIELDS))
    unknown = sorted(set(m) - set(_REQUIRED_FIELDS) - set(optional))
    if missing or unknown:
        raise GraphError(f"{where}: missing {missing} / unknown {unknown} keys; a module has "
                         f"{list(_REQUIRED_FIELDS)} and optionally {optional}")
    for key in _FLAG_FIELDS:
        if key in m and not isinstance(m[key], bool):
            raise GraphError(f"{where}: {key} = {m[key]!r} must be true or false")
    for key, kind in _NUMBER_FIELDS.items():
        value = m.get(key)
        if key in m and (isinstance(value, bool) or not isinstance(value, int | float)
                         or (kind is int and value != int(value))):
            raise GraphError(f"{where}: {key} = {value!r} must be a plain {kind.__name__} "
                             "(e.g. 85000000, not '85M')")
    if not isinstance(m["input_shape"], list | tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in m["input_shape"]):
        raise GraphError(f"{where}: input_shape = {m['input_shape']!r} must be a list of ints")
    fields = {k: (_NUMBER_FIELDS[k](v) if k in _NUMBER_FIELDS else v) for k, v in m.items()}
    return ModuleSpec(**{**fields, "input_shape": tuple(m["input_shape"])})


def validate_graph(graph: MMGraph) -> None:
    """Reject graphs no planner can handle, naming the offending field."""
    if not graph.modules:
        raise GraphError(f"graph {graph.name!r} has no modules: add at least one ModuleSpec")
    if graph.global_batch < 1:
        raise GraphError(f"graph {graph.name!r}: global_batch={graph.global_batch} must be >= 1")
    seen: set[str] = set()
    for m in graph.modules:
        if m.name in seen:
            raise GraphError(f"graph {graph.name!r}: duplicate module name {m.name!r}; names must be unique")
        seen.add(m.name)
    for src, dst in graph.edges:
        for end in (src, dst):
            if end not in seen:
                raise GraphError(
                    f"graph {graph.name!r}: edge {src!r} -> {dst!r} names unknown module {end!r}; "
                    f"modules are {sorted(seen)}"
                )
        if src == dst:
            raise GraphError(f"graph {graph.name!r}: self-loop on {src!r}")
    placed = set().union(*_generations(list(seen), graph.edges))
    if len(placed) < len(seen):
        cycle = " -> ".join(_a_cycle(seen - placed, graph.edges))
        raise GraphError(f"graph {graph.name!r} has a cycle ({cycle}): module edges must form a DAG")


def _generations(names: list[str], edges: tuple[tuple[str, str], ...]) -> list[set[str]]:
    """Kahn's algorithm level by level (networkx's topological_generations); modules on a
    cycle, and those after one, are in no level."""
    indegree = dict.fromkeys(names, 0)
    for _, dst in edges:
        indegree[dst] += 1
    level = {n for n, d in indegree.items() if d == 0}
    generations = []
    while level:
        generations.append(level)
        following = set()
        for src, dst in edges:
            if src in level:
                indegree[dst] -= 1
                if indegree[dst] == 0:
                    following.add(dst)
        level = following
    return generations


def _a_cycle(unplaced: set[str], edges: tuple[tuple[str, str], ...]) -> list[str]:
    """One cycle among the modules Kahn could not place, in edge order, closed (a -> b -> a).
    Each of them has a predecessor among them, so walking predecessors must revisit one."""
    predecessor = {dst: src for src, dst in edges if src in unplaced and dst in unplaced}
    walk, node = [], min(unplaced)
    while node not in walk:
        walk.append(node)
        node = predecessor[node]
    cycle = list(reversed(walk[walk.index(node):]))
    return [*cycle, cycle[0]]
