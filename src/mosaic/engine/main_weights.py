"""bf16 weights for the GEMMs, fp32 main weights in the optimizer (Megatron's bf16 recipe).

Under bf16 autocast with fp32 weights, every step pays for the weights three times beyond the
GEMMs: autocast casts each weight to bf16 in the forward (read 4 bytes, write 2), the backward
casts each bf16 weight gradient to fp32 (read 2, write 4), and fused AdamW reads the fp32
gradient. Measured on the H200, Unified-IO 2 `paper` (3.78 B parameters) spent about 20 ms of
its 87 ms step in such casts. Here the large weights that autocast would cast anyway (those of
`nn.Linear` and the convolutions) are stored in bf16, so the forward casts nothing and the
backward leaves bf16 gradients; the optimizer keeps an fp32 main copy of each and writes the
bf16 weight in the same pass that updates it (reads main weight, gradient and both moments,
writes those three and the weight: 28 bytes a parameter, as fused AdamW's, against 40 with
autocast's casts).

The forward and backward compute exactly what they computed under autocast (autocast rounded
the fp32 weight to the same bf16 value); only the optimizer's arithmetic order differs from
torch's fused AdamW. Other parameters (biases, norms, embeddings, tied weights, small
weights: little traffic, many tensors) stay fp32 under torch's fused AdamW.

On CUDA the update is one Inductor kernel, launched once per module: a module's bf16 weights
lie end to end in one buffer, their gradients in the engine's flat gradient buffer and their
states in flat buffers laid out alike (one launch over the module streamed 4.0-4.1 TB/s on the
H200). Where the gradients stay where the backward left them, it is launched once per weight,
a kernel compiled for each length (a model's weights come in 5-15 lengths), so each is
autotuned on its own length (3.8-5.1 TB/s from 1 M elements on); past MAX_STATIC_KERNELS
lengths, one kernel for every length, tuned on a large one (TUNING_LENGTH). That update and
fused AdamW's of the fp32 parameters are captured as one CUDA graph once the gradients sit at
the same addresses a few steps running (the engine's backward graphs write them in place):
the host launches one graph.

With `moments="bf16"` the bf16 weights' two moments are kept in bf16, as Megatron's
precision-aware optimizer and DeepSeek-V3's training keep them: 20 bytes a parameter moved
instead of 28, 12 held instead of 16. They are computed in fp32 and stored by stochastic
rounding (stochastic_bf16): rounded to nearest, the second moment stalls, since with beta2 =
0.999 its step's change (0.1%) is below half a bf16 unit (0.2%) and is rounded away.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mosaic.plan import Plan

BF16_WEIGHT_OWNERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Modules whose weights autocast casts to bf16 for their GEMM or convolution."""
MIN_ELEMENTS = 1 << 16
"""Smaller weights stay fp32: their casts cost little, and each bf16 weight is one kernel."""
STEPS_BEFORE_CAPTURE = 2
"""Eager steps with the same gradient addresses before the step is captured (the first
compiles the update kernel; capture replays what ran)."""
MAX_GRAPHS = 32
"""Captured steps kept, one per gradient layout: a bench's plans sharing one optimizer leave
their gradients at addresses of their own (training keeps one layout). A bench times every
planner's plan and its variants with the one optimizer: past this many, the later ones would
update eagerly while timed. A layout is captured only after repeating three steps running."""
MAX_STATIC_KERNELS = 48
"""Update kernels compiled for one length each in a process (every optimizer's, every
hyperparameter set's), below Dynamo's recompile limit (compile.RECOMPILE_LIMIT), which counts
every compiled variant of the update's function. One kernel for all lengths was autotuned on
whichever call came first: in a bench of Unified-IO 2 `paper` on the H200 (2026-12-04) it
streamed about 2.5 TB/s even after its tuning call on TUNING_LENGTH zeros (87.3 ms a step
against 71.8 the day before), while kernels of one length each, as the flat update's, ran
at their rate in every bench."""
_STATIC_LENGTHS: set[tuple[Any, ...]] = set()
"""(hyperparameters, moments' dtype, length) of the update kernels compiled for one length so
far."""
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The bf16 weights' AdamW moments: as the main weights, or in bf16 (module doc)."""
TUNING_LENGTH = 1 << 24
"""The length the update kernel for every length (past MAX_STATIC_KERNELS) is compiled and
autotuned on, before any weight. Inductor picks a pointwise kernel's blocks from the length its first call saw, and
autotunes them on that call: a kernel first called on a 65536-element weight streamed
3.4 TB/s on the H200 for every larger one, one first called on 16M elements 4.0 TB/s
(benchmarks/update_size_hint.py)."""


def cast_weights_bf16(modules: Iterable[nn.Module],
                      min_elements: int | None = None) -> list[nn.Parameter]:
    """Store in bf16, in place, the weight of every `BF16_WEIGHT_OWNERS` submodule of
    `modules` with at least `min_elements` (default MIN_ELEMENTS) elements: autocast computes
    with it in bf16 anyway. A weight some other module also holds (tied to an embedding)
    stays fp32: that module computes in fp32 with it. Returns the parameters cast."""
    min_elements = MIN_ELEMENTS if min_elements is None else min_elements
    modules = list(modules)
    elsewhere = {id(p) for m in modules for sub in m.modules()
                 if not isinstance(sub, BF16_WEIGHT_OWNERS)
                 for p in sub.parameters(recurse=False)}
    cast: dict[int, nn.Parameter] = {}
    for m in modules:
        mine: dict[int, nn.Parameter] = {}
        for sub in m.modules():
            p = getattr(sub, "weight", None) if isinstance(sub, BF16_WEIGHT_OWNERS) else None
            if (isinstance(p, nn.Parameter) and p.dtype == torch.float32
                    and p.numel() >= min_elements and id(p) not in elsewhere
                    and id(p) not in cast):
                mine[id(p)] = p
        _into_one_buffer(list(mine.values()))
        cast.update(mine)
    return list(cast.values())


def _into_one_buffer(params: list[nn.Parameter]) -> None:
    """Each of `params` as bf16, side by side in one buffer in their order (`parameters()`
    order, as the engine's flat gradient buffer holds their gradients), so the optimizer
    updates them all in one launch (MainWeightsAdamW.launch_runs)."""
    if not params:
        return
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16,
                       device=params[0].device)
    start = 0
    for p in params:
        view = flat[start:start + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        start += p.numel()


def bf16_weights_refusal(plan: Plan, *, amp: bool | None, reduce_dtype: str = "fp32",
                         grad_sync: str = "flat") -> str | None:
    """Why the engine cannot run `plan` with bf16 weights, with the fix; None when it can.
    A data-parallel module's bf16 gradients are summed in bf16 (one all-reduce of its bf16
    buffer, as Megatron's `--grad-reduce-in-bf16` and FSDP's bf16 reduce_dtype do): asked for
    by name, reduce_dtype='bf16', rather than implied."""
    if amp is False:
        return ("bf16_weights needs bf16 autocast (a bf16 weight meets fp32 activations): leave "
                "amp unset (bf16 weights turn it on, on the CPU too) or set amp=True")
    placements = [p for stage in plan.stages for p in stage.placements]
    if any(p.shard or p.tensor_parallel > 1 for p in placements):
        return ("bf16_weights runs plans without sharded or tensor-parallel modules so far; use "
                "a plan that keeps each module's weights whole on every GPU, or fp32 weights")
    if any(p.dp_degree > 1 for p in placements) and (reduce_dtype != "bf16" or grad_sync == "bucketed"):
        return ("bf16_weights sums a data-parallel module's bf16 gradients in bf16: set "
                "reduce_dtype='bf16' (--reduce-dtype bf16) with grad_sync 'flat' or 'ddp', or "
                "keep fp32 weights")
    return None


class MicroStepGradients:
    """The micro-steps' bf16 weight gradients added in fp32, as Megatron's main
    gradients are: after each backward but the last two micro-steps' the gradients go into an
    fp32 sum and are zeroed; after the second-to-last the sum, rounded to bf16 once, is left
    in `.grad`, and the last backward adds its gradients to it as usual. So a gradient is
    rounded at most twice, not once per micro-step, and everything after the last backward
    (a data-parallel module's all-reduce inside it, the optimizer, the NaN guard) reads an
    ordinary bf16 gradient. 4 bytes a weight of memory, a foreach add per micro-step."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.dtype == torch.bfloat16 and p.requires_grad]
        self.sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                     for p in self.params]

    def fold(self, micro_step: int, micro_steps: int) -> None:
        """After micro-step `micro_step`'s backward, of `micro_steps`."""
        if not self.params or micro_step >= micro_steps - 1:  # nothing bf16 / the last adds
            return
        if micro_step == 0:
            torch._foreach_zero_(self.sums)  # a parameter may get no gradient this step
        pairs = [(total, p.grad) for total, p in zip(self.sums, self.params, strict=True)
                 if p.grad is not None]
        if not pairs:
            return
        sums, grads = (list(x) for x in zip(*pairs, strict=True))
        torch._foreach_add_(sums, grads)
        if micro_step == micro_steps - 2:
            torch._foreach_copy_(grads, sums)
        else:
            torch._foreach_zero_(grads)


def _adjacent_runs(params: list[nn.Parameter], tensor_of) -> list[list[nn.Parameter]]:
    """`params` cut, in order, into runs whose `tensor_of(p)` lie end to end in one storage."""
    runs: list[list[nn.Parameter]] = []
    end = None
    for p in params:
        t = tensor_of(p)
        start = (t.untyped_storage().data_ptr(), t.data_ptr())
        if runs and t.is_contiguous() and start == end:
            runs[-1].append(p)
        else:
            runs.append([p])
        end = (start[0], t.data_ptr() + t.numel() * t.element_size()) if t.is_contiguous() else None
    return runs


def _flat(t: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` elements of storage from `t`'s first on (a run's tensors end to end; one
    tensor: itself, flat, which must then be contiguous)."""
    return t.view(-1) if t.numel() == n else t.as_strided((n,), (1,))


def stochastic_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16 up or down at random, with the chance of each proportional to
    its nearness, so the rounding is unbiased: `noise` (random int32 in [0, 2^16)) added to
    the 16 bits bf16 drops, then dropped (on the magnitude: IEEE floats are sign and
    magnitude). Values bf16 holds exactly stay exact. Elementwise: it fuses into the update."""
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def hashed_bits(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """32 pseudo-random bits (int32) per element of `x`, from its index, its value's bits and
    `seed` (a 0-d integer tensor), mixed by MurmurHash3's finaliser: a counter-based generator
    of a dozen integer operations an element. torch's generator (Philox, ten rounds a draw)
    made the update compute-bound: 75.7 ms a Unified-IO 2 `paper` b4 step on the H200 against
    70.7 with fp32 moments. Signed int32 arithmetic wraps as uint32's; the masks make the
    arithmetic shifts logical."""
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int32).view(x.shape)
    h = (index * -1640531535) ^ x.view(torch.int32) ^ (seed.to(torch.int32) * 668265263)
    h = (h ^ ((h >> 16) & 0xFFFF)) * -2048144789
    h = (h ^ ((h >> 13) & 0x7FFFF)) * -1028477387
    return h ^ ((h >> 16) & 0xFFFF)


def _adamw_update(main: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, weight: torch.Tensor, lr: torch.Tensor,
                  step_size: torch.Tensor, bias2_sqrt: torch.Tensor, found_inf: torch.Tensor,
                  grad_scale: torch.Tensor, step: torch.Tensor, *, beta1: float, beta2: float,
                  eps: float, weight_decay: float) -> None:
    """One AdamW step of one tensor (torch.optim.AdamW's arithmetic) on the gradient divided
    by `grad_scale` (gradient clipping's factor, read in this pass; 1: none), writing the
    bf16 `weight` from the new fp32 `main`; nothing changes where `found_inf` is set (the
    trainer's guard found a non-finite gradient). The moments are fp32 or bf16 (computed in
    fp32; stored by stochastic rounding seeded by `step`, the step count a checkpoint keeps,
    so a resumed run rounds as the uninterrupted one). Elementwise only: one kernel."""
    skip = found_inf > 0
    g = grad.float() / grad_scale
    m_old, v_old = exp_avg.float(), exp_avg_sq.float()
    m = m_old + (g - m_old) * (1 - beta1)
    v = v_old * beta2 + g * g * (1 - beta2)
    new = main * (1 - lr * weight_decay) - step_size * m / (v.sqrt() / bias2_sqrt + eps)
    new = torch.where(skip, main, new)
    m, v = torch.where(skip, m_old, m), torch.where(skip, v_old, v)
    if exp_avg.dtype == torch.bfloat16:  # one draw of 32 bits: 16 for each moment
        bits = hashed_bits(new, step)
        m, v = stochastic_bf16(m, bits & 0xFFFF), stochastic_bf16(v, (bits >> 16) & 0xFFFF)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    main.copy_(new)
    weight.copy_(new)


def marks_size_hints() -> bool:
    """Whether this torch's `mark_dynamic` takes a size hint (`hint_override`). Asked at the
    first update, not at import: it imports Dynamo."""
    return "hint_override" in inspect.signature(torch._dynamo.mark_dynamic).parameters


def _tuned_on_large_weight(update, length: int):
    """`update`, compiled and autotuned on a `length`-element update of zeros before its
    first real call (256 MB for a moment at 16M elements). The zeros are marked with their
    length as Dynamo's size hint, which Inductor's on-disk cache keys on (it keys a dynamic
    graph on the symbol, not the length): a graph cached by a compile first called on a
    small weight, by an earlier mosaic, is not reused."""
    tuned = False

    def first_tuned(*args: Any) -> None:
        nonlocal tuned
        if not tuned:
            tuned = True
            zeros = [torch.zeros(length, device=t.device, dtype=t.dtype) for t in args[:5]]
            if marks_size_hints():
                for tensor in zeros:
                    torch._dynamo.mark_dynamic(tensor, 0, hint_override=length)
            update(*zeros, *args[5:])
        return update(*args)

    return first_tuned


@functools.lru_cache(maxsize=8)
def _update_fn(device_type: str, beta1: float, beta2: float, eps: float, weight_decay: float,
               moments: str, dynamic: bool, tuning_length: int | None = TUNING_LENGTH):
    """The update with its constants bound; compiled on CUDA: one kernel for every size
    (`dynamic`, tuned on `tuning_length` elements), else one per size (Dynamo's recompile
    limit bounds the sizes: past it, the update of further sizes runs eagerly, unfused).
    `moments` only keys the cache: the kernel follows the tensors' dtypes."""
    update = functools.partial(_adamw_update, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay)
    if device_type != "cuda":
        return update
    if not dynamic:
        from mosaic.engine.compile import raise_recompile_limit

        raise_recompile_limit()
        return torch.compile(update, dynamic=False)
    compiled = torch.compile(update, dynamic=True, fullgraph=True)
    return compiled if tuning_length is None else _tuned_on_large_weight(compiled, tuning_length)


def _adamw_defaults(lr: float, betas: tuple[float, float], eps: float,
                    weight_decay: float) -> dict[str, Any]:
    """torch's fused AdamW's hyperparameters, every key of them (they differ between torch
    versions): a checkpoint then differs from an fp32 run's only in dtypes and `main`."""
    probe = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=lr, betas=betas, eps=eps,
                              weight_decay=weight_decay, fused=True)
    return dict(probe.defaults)


class MainWeightsAdamW(torch.optim.Optimizer):
    """AdamW over one group of parameters: fp32 main copies of the bf16 ones, updated here
    (module doc), the fp32 ones by torch's fused AdamW, which shares this optimizer's state.

    The state is AdamW's (`step`, `exp_avg`, `exp_avg_sq` per parameter) plus `main` for each
    bf16 weight, so a checkpoint holds the fp32 main weights and a resume continues exactly.
    Loading writes into the live tensors (a captured step keeps reading them). `found_inf`
    (a 0-d device tensor set before `step`, as for torch's fused optimizers) skips the update
    on the device; `grad_scale` (likewise) divides the gradients the update reads, as
    gradient clipping asks, without a pass of its own over them. The bf16 weights share one
    step count: torch's AdamW keeps one per parameter, which differ only for parameters that
    skip steps (no gradient). `moments`: the bf16 weights' moments in "fp32" or "bf16"
    (module doc); the fp32 parameters' stay fp32."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, dynamic: bool = True, moments: str = "fp32") -> None:
        super().__init__(list(params), _adamw_defaults(lr, betas, eps, weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("MainWeightsAdamW takes one group of parameters")
        if moments not in MOMENT_DTYPES:
            raise ValueError(f"moments={moments!r}: use one of {sorted(MOMENT_DTYPES)}")
        self.moments = moments
        trainable = [p for p in self.param_groups[0]["params"] if p.requires_grad]
        if not trainable:
            raise ValueError("MainWeightsAdamW got no trainable parameters")
        self.bf16 = [p for p in trainable if p.dtype == torch.bfloat16]
        if not all(p.is_contiguous() for p in self.bf16):
            raise ValueError("MainWeightsAdamW updates each bf16 weight as one flat view: make "
                             "the parameters contiguous (not channels_last)")
        device = trainable[0].device
        self._step = torch.zeros((), device=device)
        self._lr, self._lr_value = torch.tensor(float(lr), device=device), float(lr)
        self._found_inf = torch.zeros((), device=device)
        self._grad_scale = torch.ones((), device=device)
        for run in _adjacent_runs(self.bf16, lambda p: p.data):
            self._add_flat_state(run)
        fp32 = [p for p in trainable if p.dtype != torch.bfloat16]
        for p in fp32:  # AdamW's own layout (fused: a float32 step on the device)
            self.state[p] = {"step": torch.zeros((), device=device),
                             "exp_avg": torch.zeros(p.shape, device=device),
                             "exp_avg_sq": torch.zeros(p.shape, device=device)}
        # Captured with the bf16 update (its lr and skip flag are this optimizer's tensors,
        # read on the device): launching it eagerly cost the host 1.6 of a graphed CLIP
        # `small` step's 11.7 ms under cProfile on the H200.
        self.rest = (torch.optim.AdamW(fp32, lr=self._lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, fused=True, capturable=True)
                     if fp32 else None)
        for p in fp32:
            self.rest.state[p] = self.state[p]  # one state, so one checkpoint holds it
        if self.rest is not None:
            self.rest.found_inf = self._found_inf
        self._trainable = trainable
        self._dynamic, self._told_found_inf = dynamic, False
        self._scales_rest = False
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self._bind_update()
        self._last_key: tuple[int, ...] | None = None
        self._repeats = 0
        self.capture_failed: str | None = None
        """Why the step could not be captured (it then runs eagerly), or None."""
        self._captures = device.type == "cuda"

    def _add_flat_state(self, run: list[nn.Parameter]) -> None:
        """AdamW's state of weights that lie side by side (one module's, cast_weights_bf16),
        as views into flat fp32 buffers laid out as the weights are."""
        n = sum(p.numel() for p in run)
        device = run[0].device
        exp_avg, exp_avg_sq = (torch.zeros(n, device=device, dtype=MOMENT_DTYPES[self.moments])
                               for _ in range(2))
        main = torch.empty(n, device=device)
        start = 0
        for p in run:
            end = start + p.numel()
            self.state[p] = {"step": self._step, "exp_avg": exp_avg[start:end].view(p.shape),
                             "exp_avg_sq": exp_avg_sq[start:end].view(p.shape),
                             "main": main[start:end].view(p.shape)}
            self.state[p]["main"].copy_(p.detach())
            start = end

    def launch_runs(self) -> list[list[nn.Parameter]]:
        """The bf16 weights updated by one launch each: runs whose weights, gradients and
        states each lie side by side (the engine's flat gradient buffer and cast_weights_bf16
        make one run a module; without the flat buffer, each weight is a run)."""
        with_grad = [p for p in self.bf16 if p.grad is not None]
        runs = []
        for run in _adjacent_runs(with_grad, lambda p: p.data):
            for grads_run in _adjacent_runs(run, lambda p: p.grad):
                runs += _adjacent_runs(grads_run, lambda p: self.state[p]["main"])
        return runs

    def _bind_update(self) -> None:
        """The update kernel for the group's hyperparameters (bound into it; steps captured
        with another kernel are dropped)."""
        group = self.param_groups[0]
        constants = (self._step.device.type, *group["betas"], group["eps"], group["weight_decay"],
                     self.moments)
        self._constants = constants
        self._update_any_length = _update_fn(*constants, True) if self._dynamic else None
        self._update_one_length = _update_fn(*constants, False)
        self.graphs = {}

    def _kernel(self, length: int):
        """The update compiled for `length` alone while the process has compiled fewer than
        MAX_STATIC_KERNELS such kernels (or the optimizer was built with dynamic=False), else
        the one kernel for every length."""
        key = (*self._constants, length)
        if (self._update_any_length is None or key in _STATIC_LENGTHS
                or len(_STATIC_LENGTHS) < MAX_STATIC_KERNELS):
            _STATIC_LENGTHS.add(key)
            return self._update_one_length
        return self._update_any_length

    @property
    def mains(self) -> list[torch.Tensor]:
        return [self.state[p]["main"] for p in self.bf16]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        group = self.param_groups[0]
        if group["lr"] != self._lr_value:
            self._lr.fill_(group["lr"])
            self._lr_value = group["lr"]
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            self._found_inf.copy_(found_inf)
        elif self._told_found_inf:  # told before, not now: nothing to skip
            self._found_inf.zero_()
        self._told_found_inf = found_inf is not None
        self._take_grad_scale(getattr(self, "grad_scale", None))
        self._step_once()

    def _take_grad_scale(self, grad_scale: torch.Tensor | None) -> None:
        """Into the tensor the update reads. torch's fused AdamW of the fp32 parameters
        reads it only when told one: it then writes every gradient back, divided."""
        if grad_scale is not None:
            self._grad_scale.copy_(grad_scale)
        elif self._scales_rest:
            self._grad_scale.fill_(1.0)
        self._scales_rest = grad_scale is not None
        if self.rest is not None:
            self.rest.grad_scale = self._grad_scale if self._scales_rest else None

    def _step_once(self) -> None:
        """Replayed from a CUDA graph once the gradients sat at the same addresses
        STEPS_BEFORE_CAPTURE steps running; eagerly until then."""
        key = (self._scales_rest,
               *(p.grad.data_ptr() if p.grad is not None else 0 for p in self._trainable))
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        self._repeats = self._repeats + 1 if key == self._last_key else 1
        self._last_key = key
        if not (self._captures and self._repeats > STEPS_BEFORE_CAPTURE
                and len(self.graphs) < MAX_GRAPHS and self.capture_failed is None):
            self._update_all()
            return
        graph = torch.cuda.CUDAGraph()
        # Captured on the caller's stream where capture may run (not the legacy default
        # stream): a graph captured on another stream ignores a green context's SM quota when
        # replayed on its stream (an overlapped optimizer steps on the module's own stream).
        current = torch.cuda.current_stream()
        stream = None if current == torch.cuda.default_stream() else current
        try:
            with torch.cuda.graph(graph, stream=stream):
                self._update_all()
        except RuntimeError as error:  # the update still runs, launched eagerly from now on
            self.capture_failed = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            warnings.warn(f"the optimizer step runs eagerly: its CUDA-graph capture failed "
                          f"({self.capture_failed})", stacklevel=3)
            self._update_all()
            return
        self.graphs[key] = graph
        graph.replay()  # capture records the step without running it

    def _update_all(self) -> None:
        if self.rest is not None:
            self.rest.step()
        if self.bf16:
            self._bf16_step()

    def _bf16_step(self) -> None:
        beta1, beta2 = self.param_groups[0]["betas"]
        self._step += 1 - self._found_inf
        step_size = self._lr / (1 - torch.pow(beta1, self._step))
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, self._step))
        for run in self.launch_runs():
            state = self.state[run[0]]
            n = sum(p.numel() for p in run)
            tensors = (state["main"], run[0].grad, state["exp_avg"], state["exp_avg_sq"],
                       run[0].data)
            self._kernel(n)(*(_flat(t, n) for t in tensors), self._lr, step_size, bias2_sqrt,
                            self._found_inf, self._grad_scale, self._step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a saved state into the live tensors (captured steps read them), refusing one
        saved with other weights' precision (an fp32 run's has no `main`)."""
        saved_groups, saved = state_dict["param_groups"], state_dict["state"]
        params = self.param_groups[0]["params"]
        if len(saved_groups) != 1 or len(saved_groups[0]["params"]) != len(params):
            raise ValueError("the saved optimizer state is for other parameters")
        for p, index in zip(params, saved_groups[0]["params"], strict=True):
            values = saved.get(index, {})
            if values and set(values) != set(self.state[p]):
                raise ValueError(f"the saved optimizer state holds {sorted(values)} for a "
                                 f"parameter whose state here is {sorted(self.state[p])}: it "
                                 "was saved with the other weights' precision (bf16_weights)")
            for key, value in values.items():
                self.state[p][key].copy_(value)
        for key in ("lr", "betas", "eps", "weight_decay"):
            self.param_groups[0][key] = saved_groups[0][key]
            if self.rest is not None and key != "lr":  # the rest reads self._lr (step sets it)
                self.rest.param_groups[0][key] = saved_groups[0][key]
        self._bind_update()
