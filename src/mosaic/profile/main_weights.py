"""The bf16 main-weights update per module, in both gradient layouts, measured.

With bf16 weights (engine/main_weights.py) the engine updates a module's bf16 weights either
in one launch over a flat gradient buffer, which the backward fills by copying each gradient
into it, or a launch per weight, reading each gradient where the backward left it. The
performance model prices the flat layout from the measured optimizer bandwidth
(profile/optimizer.py). The per-weight one is not a law of the weights' count and size: on
the H200 the per-weight update took 0.83-2.3x the flat one over the same weights, and a
straight-line fit in (weights, parameters) over 23 modules missed by 38% held out. So the
profiler measures it per module, as it measures each module's surface, and the model adds
each module's measured difference (per-weight update, less flat update and gradient copy)
where a plan updates a weight at a time.

Each update is captured as a CUDA graph, as in a training step (the host's launches do not
count), and timed by CUDA events: the median of TIMED replays after WARM. Stored in the
ProfileDB's `fits` table under FIT_NAME, one entry per module signature (the module's cost
facts: equal modules, equal weights).
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mosaic.profile.db import FitRecord, ProfileDB, module_signature

FIT_NAME = "main_weights.update"
WARM, TIMED = 4, 20


@dataclass(frozen=True, slots=True)
class UpdatePoint:
    """One module's bf16 update, seconds a step in each layout."""

    model: str
    preset: str
    module: str
    bf16_weights: int
    bf16_parameters: int
    per_weight_s: float
    flat_update_s: float
    gradient_copy_s: float
    code: str = ""
    """Digest of the update's code when measured (update_code_digest); "" where not recorded
    or where there is nothing to update."""
    per_weight_bf16_moments_s: float | None = None
    flat_update_bf16_moments_s: float | None = None
    """The two layouts' update with the moments in bf16 (`--bf16-moments`); None where not
    measured (entries from before it)."""
    per_weight_no_main_s: float | None = None
    flat_update_no_main_s: float | None = None
    """The two layouts' update with bf16 moments and no fp32 main weights
    (`--bf16-moments --no-fp32-main-weights`: engine/rounded_weights.py); None where not
    measured."""
    rounded_code: str = ""
    """Digest of engine/rounded_weights.py when those two were measured (rounded_code_digest)."""

    @property
    def bf16_moments_saving_s(self) -> float | None:
        """What keeping the moments in bf16 saves the flat update a step; None unmeasured (0
        for a module without bf16 weights: its moments stay fp32)."""
        if not self.bf16_weights:
            return 0.0
        moments = self.flat_update_bf16_moments_s
        return None if moments is None else self.flat_update_s - moments

    @property
    def no_main_saving_s(self) -> float | None:
        """What dropping the fp32 main weights saves the flat update with bf16 moments; None
        unmeasured (0 for a module without bf16 weights)."""
        if not self.bf16_weights:
            return 0.0
        with_main, without = self.flat_update_bf16_moments_s, self.flat_update_no_main_s
        return None if with_main is None or without is None else with_main - without

    @property
    def per_weight_extra_s(self) -> float:
        """What updating a weight at a time adds to a step over the flat layout (negative: it
        saves), the flat layout paying for its gradient copy too."""
        return self.per_weight_s - self.flat_update_s - self.gradient_copy_s

    def per_weight_extra_with(self, bf16_moments: bool, no_main: bool = False) -> float:
        """per_weight_extra_s with the moments in bf16 (and without main weights) where asked
        and measured so (else the difference with main weights, else with fp32 moments)."""
        if no_main and bf16_moments and None not in (self.per_weight_no_main_s,
                                                     self.flat_update_no_main_s):
            return self.per_weight_no_main_s - self.flat_update_no_main_s - self.gradient_copy_s
        pw, flat = self.per_weight_bf16_moments_s, self.flat_update_bf16_moments_s
        if not bf16_moments or pw is None or flat is None:
            return self.per_weight_extra_s
        return pw - flat - self.gradient_copy_s


UPDATE_CODE = Path(__file__).parents[1] / "engine" / "main_weights.py"
"""The engine's bf16 update: a change to it can change what the update costs (capturing the
fp32 parameters' AdamW with it made Qwen3-VL's per-weight LLM update 5.09 -> 3.31 ms)."""


ROUNDED_CODE = UPDATE_CODE.with_name("rounded_weights.py")
"""The update without main weights, which builds on UPDATE_CODE's."""


def update_code_digest(path: Path = UPDATE_CODE) -> str:
    """A digest of the update's code: its source file parsed (no torch import) and written
    back without comments, docstrings and layout (ast.unparse), so that an edit of the prose
    does not mark every measured update stale. Python 3.11 to 3.13 unparse the engine's files
    alike (checked on both files), which matters: the GPU machine measures under 3.12."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not _is_docstring(s)] or [ast.Pass()]
    return hashlib.sha1(ast.unparse(tree).encode()).hexdigest()[:12]


def _is_docstring(statement: ast.stmt) -> bool:
    """A bare string: a module's, class's or function's docstring, or an attribute's."""
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def rounded_code_digest() -> str:
    return update_code_digest(ROUNDED_CODE)


def timed_s(fn: Callable[[], Any], device: Any, warm: int = WARM, timed: int = TIMED) -> float:
    """Median seconds of `fn`: CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    on_gpu = torch.device(device).type == "cuda"
    times = []
    for i in range(warm + timed):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        if i >= warm:
            times.append(elapsed)
    return statistics.median(times)


def captured(fn: Callable[[], Any], device: Any) -> Callable[[], Any]:
    """`fn` captured once as a CUDA graph (its replay), or `fn` itself off the GPU."""
    import torch

    if torch.device(device).type != "cuda":
        return fn
    fn()  # allocations and compiles happen before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def update_s(params: list[Any], grads: list[Any], dynamic: bool = True,
             moments: str = "fp32", fp32_main_weights: bool = True) -> float:
    """Seconds of MainWeightsAdamW's step over `params` with gradients `grads` (it captures
    its own step on a GPU once the gradients stay put), its moments in `moments`; without
    main weights, RoundedWeightsAdamW's (kernels of one length each: `dynamic` is moot),
    whose lengths are then struck from the process's kernel budget
    (main_weights.MAX_STATIC_KERNELS): counted, they used it up before OFASys's LLM, the last
    module measured, whose update with main weights then ran the kernel for every length
    (2.5x its time on the H200, 2026-12-04)."""
    from mosaic.engine import main_weights
    from mosaic.engine.main_weights import MainWeightsAdamW
    from mosaic.engine.rounded_weights import RoundedWeightsAdamW

    for p, g in zip(params, grads, strict=True):
        p.grad = g
    optimizer = (MainWeightsAdamW(params, 1e-5, dynamic=dynamic, moments=moments)
                 if fp32_main_weights else RoundedWeightsAdamW(params, 1e-5, moments=moments))
    budget = set(main_weights._STATIC_LENGTHS)
    seconds = timed_s(optimizer.step, params[0].device)
    if not fp32_main_weights:  # a training process keeps main weights or not, never both
        main_weights._STATIC_LENGTHS.intersection_update(budget)
    if params[0].device.type == "cuda" and not optimizer.graphs:
        raise RuntimeError(f"the update was never captured: {optimizer.capture_failed}")
    return seconds


def flat_views(params: list[Any]) -> list[Any]:
    """Views into one zeroed bf16 buffer shaped as `params`, laid end to end (the engine's flat
    gradient buffer)."""
    import torch

    flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16,
                       device=params[0].device)
    views, start = [], 0
    for p in params:
        views.append(flat[start:start + p.numel()].view(p.shape))
        start += p.numel()
    return views


def bf16_params(module: Any) -> list[Any]:
    import torch

    return [p for p in module.parameters() if p.dtype == torch.bfloat16 and p.requires_grad]


def measure_module(module: Any) -> dict[str, float] | None:
    """The module's per-weight update, flat update (each with fp32 and with bf16 moments) and
    gradient copy (seconds), or None when it has no bf16 weights (cast them first:
    main_weights.cast_weights_bf16)."""
    import torch

    params = bf16_params(module)
    if not params:
        return None
    device = params[0].device
    fresh = [torch.randn_like(p) * 1e-3 for p in params]  # where the backward leaves them
    views = flat_views(params)
    per_weight = update_s(params, fresh)
    flat = update_s(params, views)
    copy = timed_s(captured(lambda: torch._foreach_copy_(views, fresh), device), device)
    per_weight_moments = update_s(params, fresh, moments="bf16")
    flat_moments = update_s(params, views, moments="bf16")
    per_weight_no_main = update_s(params, fresh, moments="bf16", fp32_main_weights=False)
    flat_no_main = update_s(params, views, moments="bf16", fp32_main_weights=False)
    for p in params:
        p.grad = None
    return {"bf16_weights": len(params), "bf16_parameters": sum(p.numel() for p in params),
            "per_weight_s": per_weight, "flat_update_s": flat, "gradient_copy_s": copy,
            "per_weight_bf16_moments_s": per_weight_moments,
            "flat_update_bf16_moments_s": flat_moments,
            "per_weight_no_main_s": per_weight_no_main, "flat_update_no_main_s": flat_no_main,
            "rounded_code": rounded_code_digest()}


def cast_zoo_modules(name: str, preset: str, device: Any) -> tuple[Any, dict[str, Any]]:
    """Zoo model `name`'s graph at `preset` and its modules on `device`, bf16 weights cast as
    the engine casts them."""
    import torch

    from mosaic.engine.main_weights import cast_weights_bf16
    from mosaic.zoo import get_model

    graph = get_model(name).graph(preset)
    modules = get_model(name).build_modules(preset, torch.device(device), torch.float32,
                                            names=graph.names, seed=0)
    cast_weights_bf16(modules.values())
    return graph, modules


def fresh_kernel_budget() -> None:
    """Start a model's measurements with the update-kernel budget a training process starts
    with (main_weights.MAX_STATIC_KERNELS lengths compiled each for its own length): Dynamo's
    compiled kernels dropped and the lengths forgotten. Without it the models measured first
    spent the budget, and later ones were timed with the kernel for every length, which a
    training run of them never uses: on the H200 (2026-12-04) the flat update of ImageBind
    `small`'s encoders measured 1.5x its time in a fresh process."""
    import torch

    from mosaic.engine import main_weights

    torch._dynamo.reset()
    main_weights._STATIC_LENGTHS.clear()


def measure_model(name: str, preset: str, device: Any,
                  log: Callable[[str], None] = print) -> dict[str, UpdatePoint]:
    """Every module of zoo model `name` at `preset`, by module signature, timed with the
    update kernels a training process of that model would compile (fresh_kernel_budget)."""
    import torch

    fresh_kernel_budget()
    graph, modules = cast_zoo_modules(name, preset, device)
    points, code = {}, update_code_digest()
    for spec in graph.modules:
        row = measure_module(modules[spec.name])
        point = (UpdatePoint(model=name, preset=preset, module=spec.name, code=code, **row)
                 if row is not None else
                 UpdatePoint(model=name, preset=preset, module=spec.name, **NO_BF16_WEIGHTS))
        points[module_signature(spec)] = point
        log(f"[{name}] {spec.name}: bf16 update a weight at a time {point.per_weight_s * 1e3:.3f} "
            f"ms, flat {point.flat_update_s * 1e3:.3f} + copy {point.gradient_copy_s * 1e3:.3f} "
            f"ms ({point.bf16_weights} weights){_moments_note(point)}")
    del modules
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return points


def _moments_note(point: UpdatePoint) -> str:
    if point.per_weight_bf16_moments_s is None or point.flat_update_bf16_moments_s is None:
        return ""
    note = (f"; bf16 moments {point.per_weight_bf16_moments_s * 1e3:.3f} a weight at a time, "
            f"{point.flat_update_bf16_moments_s * 1e3:.3f} flat")
    if point.per_weight_no_main_s is None or point.flat_update_no_main_s is None:
        return note
    return (f"{note}; without main weights {point.per_weight_no_main_s * 1e3:.3f} a weight at "
            f"a time, {point.flat_update_no_main_s * 1e3:.3f} flat")


NO_BF16_WEIGHTS = {"bf16_weights": 0, "bf16_parameters": 0, "per_weight_s": 0.0,
                   "flat_update_s": 0.0, "gradient_copy_s": 0.0}
"""A module none of whose weights is stored in bf16 (an embedding-only text encoder): the
layouts update nothing, and the model knows it measured nothing to add."""


def weightless_modules(name: str, preset: str) -> dict[str, UpdatePoint]:
    """Zoo model `name`'s modules without a weight stored in bf16, by signature: built on the
    meta device (no memory, no GPU), since which weights are cast is a fact of the shapes."""
    graph, modules = cast_zoo_modules(name, preset, "meta")
    return {module_signature(spec): UpdatePoint(model=name, preset=preset, module=spec.name,
                                                **NO_BF16_WEIGHTS)
            for spec in graph.modules if not bf16_params(modules[spec.name])}


def store(db: ProfileDB, points: Mapping[str, UpdatePoint]) -> None:
    """Add `points` to the DB's entries (a module measured again replaces its entry)."""
    merged = {**stored_updates(db), **points}
    db.add_fit(FitRecord(
        name=FIT_NAME, params={"modules": {sig: asdict(p) for sig, p in sorted(merged.items())}},
        mape=None, n_points=len(merged),
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")))


def profile_main_weights(db: ProfileDB, models: Sequence[str], preset: str, device: Any = None,
                         log: Callable[[str], None] = print) -> dict[str, UpdatePoint]:
    """Measure every module's bf16 update of `models` at `preset` and store them in `db`, a
    model at a time (a stopped run keeps the models done)."""
    import torch

    device = device or torch.device("cuda")
    points: dict[str, UpdatePoint] = {}
    for name in models:
        measured = measure_model(name, preset, device, log)
        store(db, measured)
        points.update(measured)
    return points


def stored_updates(db: ProfileDB) -> dict[str, UpdatePoint]:
    """The DB's measured bf16 updates by module signature (empty for DBs without them)."""
    record = next((f for f in db.fits() if f.name == FIT_NAME), None)
    if record is None:
        return {}
    return {sig: UpdatePoint(**row) for sig, row in record.params["modules"].items()}
