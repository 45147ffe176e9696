"""Compile one module with Inductor, with the narrow per-module workarounds it needs, or run it
eagerly and say why once.

Kernel fusion is worth more than colocation on its own: on the H200, CLIP `small` at batch 128
trained in 47.9 ms eager and 29.8 ms with `torch.compile` per module (docs/engine.md). So every
module the engine runs is compiled first, then captured as a CUDA graph on its own stream by
the runner. Capture is the runner's, not Inductor's: a graph must be captured on the module's
green-context stream to keep its SM quota, and Inductor's own CUDA graphs
(`mode="reduce-overhead"`) capture on a stream of their choosing. So the engine compiles with
`mode="default"` (or a tuning mode below), never with Inductor's CUDA graphs.

Tuned kernels. Inductor's `max-autotune-no-cudagraphs` benchmarks generated Triton GEMMs
against cuBLAS and also coordinate-descent-tunes every pointwise and reduction kernel; on CLIP
`small` at batch 128 the latter kept a cold compile beyond six minutes on the H200. The GEMM
choice is where tuning paid there (Triton won 7 of 8 forward GEMMs by 5-41% and the patch
convolution by 1.41x), so `max-autotune-gemm` is the GEMM and convolution tuning alone
(Inductor's `max_autotune_gemm` option), a user-visible option of its own.

Inductor caches compiled kernels and FX graphs on disk (`TORCHINDUCTOR_CACHE_DIR`, on by
default in torch >= 2.4), so the second run of the same module and shapes starts much faster.

Compile scope. `module` compiles each module whole: Dynamo unrolls every layer, so compile time
grows with depth (the `paper` LLMs have 36-48 layers). `blocks` compiles the repeated layers of
a module (the outermost ModuleList of two or more blocks of one class) one by one, the way
torchtitan compiles an LLM: Dynamo traces the block once and every layer reuses that code
(measured on the CPU: OFASys `small` vision, 12 layers, first forward + backward 35.9 s whole
vs 13.2 s by blocks), at the price of no fusion across layer boundaries. A module without such
a list is compiled whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mosaic.engine.gate_slot import slotted

log = logging.getLogger(__name__)

COMPILE_MODES = ("default", "max-autotune-gemm", "max-autotune-no-cudagraphs")
"""Compile modes the engine may use: none of them captures CUDA graphs of its own."""
MOSAIC_MODES = {
    "max-autotune-gemm": {"max_autotune_gemm": True},
    "reduce-overhead-max-autotune-gemm": {"triton.cudagraphs": True, "max_autotune_gemm": True},
}
"""Modes named here, not by torch: Inductor options that torch has no mode name for (the
second is the user program's reduce-overhead with tuned GEMMs)."""
COMPILE_SCOPES = ("module", "blocks")
"""What one torch.compile call covers: a whole module, or each of its repeated blocks."""


@dataclass(frozen=True, slots=True)
class Workaround:
    """Inductor options for modules that contain a submodule of class `contains`."""

    contains: str
    options: dict[str, Any]
    why: str


WORKAROUNDS = (
    # torch 2.11's coalescing analysis asserts in tiling_utils.get_pw_red_splits on the
    # transformers ASTModel (PyTorch issue #197077); switching the analysis off for that module
    # alone compiles it (measured on the H200: fwd+bwd in about 31 s) and leaves every other
    # module's tiling as it was.
    Workaround("ASTModel", {"triton.coalesce_tiling_analysis": False},
               "Inductor's coalescing analysis fails on ASTModel (pytorch#197077)"),
)


@dataclass(slots=True)
class CompileReport:
    """What happened to each module: compiled (with which options) or eager (and why)."""

    compiled: dict[str, dict[str, Any]] = field(default_factory=dict)
    eager: dict[str, str] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds of the first call of each compiled module (where Inductor compiles)."""

    def to_dict(self) -> dict[str, Any]:
        return {"compiled": self.compiled, "eager": self.eager, "compile_s": self.compile_s,
                "total_compile_s": sum(self.compile_s.values())}


def workaround_options(module: nn.Module) -> tuple[dict[str, Any], list[str]]:
    """Inductor options this module needs, and why (empty when it needs none)."""
    classes = {type(m).__name__ for m in module.modules()}
    options: dict[str, Any] = {}
    reasons = []
    for w in WORKAROUNDS:
        if w.contains in classes:
            options.update(w.options)
            reasons.append(w.why)
    return options, reasons


RECOMPILE_LIMIT = 64
"""Dynamo's per-function limit of compiled variants (8 by default), raised. Static shapes
make one variant per batch (the profiler's grid, micro-batches), and blocks of different
classes can share one function: transformers' layers all run
`GradientCheckpointingLayer.__call__`. Past the limit Dynamo runs the function eagerly and
only warns: on the H200, OFASys `paper` with a second copy of its modules in bf16 (seven
block classes twice) ran its LLM's 36 blocks eagerly, 2x slower."""


def raise_recompile_limit() -> None:
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)


def compiled_update(update: Callable, device_type: str, **inductor_options: Any) -> Callable:
    """An optimizer's update function as it is launched: itself off CUDA; on CUDA compiled
    for each set of shapes it meets (an update compiles once a length or a group of them),
    Dynamo's recompile limit raised."""
    if device_type != "cuda":
        return update
    raise_recompile_limit()
    return torch.compile(update, dynamic=False, options=inductor_options or None)


class CompiledModule(nn.Module):
    """`module` behind torch.compile; on the first call's failure, the module itself, eagerly.

    The module is held, not copied: the compiled and eager paths share its parameters, so
    the optimizer and every plan that trains the module see one set of weights.
    """

    def __init__(self, name: str, module: nn.Module, mode: str, report: CompileReport,
                 scope: str = "module") -> None:
        super().__init__()
        raise_recompile_limit()
        self.inner = module
        self.name, self.mode, self.scope = name, mode, scope
        self._report = report
        extra, reasons = workaround_options(module)
        # torch.compile takes a mode or options, not both: spell the mode out as its options.
        options = {**mode_options(mode), **extra}

        def compiled(m: nn.Module) -> nn.Module:
            return torch.compile(m, options=options or None, dynamic=False)

        def compiled_block(block: nn.Module) -> nn.Module:
            # Behind a slot where a gated update (update_gates.py) makes it wait for its
            # weights; the slot does nothing for other callers.
            return slotted(block, compiled(block))

        lists = repeated_block_lists(module) if scope == "blocks" else []
        # Kept out of the module tree (object.__setattr__): the compiled wrapper would register
        # the same parameters a second time under another name.
        object.__setattr__(self, "_compiled", blockwise_view(module, lists, compiled_block) if lists
                           else compiled(module))
        report.compiled[name] = {"mode": mode, "options": extra, "why": reasons,
                                 "scope": "blocks" if lists else "module",
                                 "blocks": sum(len(blocks) for _, blocks in lists)}
        self._first_call = True

    def traced_anew(self) -> CompiledModule:
        """A new view of the same module, compiled at its first call, in place of this one
        in the report: for a module changed in place since this view was made (FSDP2's
        `fully_shard` swaps its class, parameters and hooks; TP its parameters)."""
        return CompiledModule(self.name, self.inner, self.mode, self._report, self.scope)

    def forward(self, *args: torch.Tensor) -> Any:
        if self._compiled is None:
            return self.inner(*args)
        if not self._first_call:
            return self._compiled(*args)
        start = time.perf_counter()
        try:
            self._compile_backward(args)
            out = self._compiled(*args)
        except Exception as exc:  # any compiler failure: this module alone runs eagerly
            self._fall_back(exc)
            return self.inner(*args)
        self._first_call = False
        self._report.compile_s[self.name] = time.perf_counter() - start
        return out

    def _compile_backward(self, args: tuple[torch.Tensor, ...]) -> None:
        """AOTAutograd compiles the backward at its first use, which is inside the runner's
        backward, where a failure could not fall back any more: compile it here, on a
        throwaway forward (once). Not on the real forward's graph: keeping that graph for the
        real backward (retain_graph) is refused when the compiled backward donates buffers,
        as the OFASys `paper` vision encoder's does."""
        if not torch.is_grad_enabled():
            return
        out = self._compiled(*args)
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return
        wrt = [t for t in (*args, *self.inner.parameters()) if t.requires_grad]
        torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)  # accumulates no .grad

    def _fall_back(self, exc: BaseException) -> None:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        log.warning("module %r runs eagerly: torch.compile failed (%s)", self.name, reason)
        self._report.compiled.pop(self.name, None)
        self._report.eager[self.name] = reason
        object.__setattr__(self, "_compiled", None)


def traced_anew(views: dict[str, nn.Module], changed: Collection[str]) -> dict[str, nn.Module]:
    """`views` with the compiled view of each module in `changed` (sharded in place since
    it was made) made anew (CompiledModule.traced_anew); other views as they are."""
    return {m: v.traced_anew() if m in changed and isinstance(v, CompiledModule) else v
            for m, v in views.items()}


def repeated_block_lists(module: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """(path, list) of the outermost ModuleLists holding two or more blocks of one class
    (a transformer's layers); lists inside them are part of their blocks."""
    found: list[tuple[str, nn.ModuleList]] = []
    for path, child in module.named_modules():
        if any(path.startswith(f"{outer}.") for outer, _ in found):
            continue
        if (isinstance(child, nn.ModuleList) and len(child) > 1
                and len({type(block) for block in child}) == 1):
            found.append((path, child))
    return found


def blockwise_view(module: nn.Module, lists: list[tuple[str, nn.ModuleList]],
                   compile_block: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """`module` with every block of `lists` behind `compile_block`, as a new tree of shallow
    copies from the root down to each list: the module itself is left as it is (eager
    programs keep running it), and every parameter is shared."""
    view = _shallow(module)
    for path, blocks in lists:
        *ancestors, last = path.split(".")
        parent = view
        for part in ancestors:
            parent._modules[part] = _shallow(parent._modules[part])
            parent = parent._modules[part]
        parent._modules[last] = nn.ModuleList(compile_block(block) for block in blocks)
    return view


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of the module object whose child table is its own (parameters shared). Not
    copy.copy: on a module FSDP2 has sharded, its class's `__new__` builds the module's own
    class anew by calling `__init__()` without arguments."""
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = dict(module._modules)
    return clone


def mode_options(mode: str) -> dict[str, Any]:
    """The Inductor options a compile mode (torch's or one of MOSAIC_MODES) stands for."""
    if mode == "default":
        return {}
    if mode in MOSAIC_MODES:
        return dict(MOSAIC_MODES[mode])
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def compile_modules(modules: dict[str, nn.Module], mode: str | None,
                    report: CompileReport | None = None, scope: str = "module",
                    ) -> tuple[dict[str, nn.Module], CompileReport]:
    """A compiled view of each module (mode None: the modules themselves) and the report.
    Compile once per module and share the view between plans: Inductor's work is per module
    and shapes, not per plan."""
    report = report or CompileReport()
    if mode is None:
        return dict(modules), report
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}; use one of {COMPILE_MODES} (the engine "
                         "captures CUDA graphs itself, on each module's stream)")
    _check_scope(scope)
    return {name: CompiledModule(name, m, mode, report, scope)
            for name, m in modules.items()}, report


def compile_fn(report: CompileReport, scope: str = "module", program: str = "",
               ) -> Callable[[str, nn.Module, str], nn.Module]:
    """`(name, module, mode) -> module` for programs that compile module by module (the
    user-program baseline): the same workarounds, scope and fallback as the engine, reported
    as `program/name` beside the engine's modules. Any torch mode is allowed there
    (`reduce-overhead` included), since no green-context stream is involved."""
    _check_scope(scope)
    prefix = f"{program}/" if program else ""
    return lambda name, module, mode: CompiledModule(f"{prefix}{name}", module, mode, report,
                                                     scope)


def _check_scope(scope: str) -> None:
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile scope {scope!r}; use one of {COMPILE_SCOPES}")
