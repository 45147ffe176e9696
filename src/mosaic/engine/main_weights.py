"""bf16 weights for the GEMMs, fp32 main weights in the optimizer (Megatron's bf16 recipe).

Under bf16 autocast with fp32 weights, every step pays for the weights three times beyond the
GEMMs: autocast casts each weight to bf16 in the forward (read 4 bytes, write 2), the backward
casts each bf16 weight gradient to fp32 (read 2, write 4), and fused AdamW reads the fp32
gradient. Measured on the H200, Unified-IO 2 `paper` (3.78 B parameters) spent about 20 ms of
its 87 ms step in such casts. Here the large weights that autocast would cast anyway (those of
`nn.Linear` and the convolutions) are stored in bf16, so the forward casts nothing and the
backward leaves bf16 gradients; the optimizer keeps an fp32 main copy of each and writes the
bf16 weight in the same pass that updates it (reads main weight, gradient and both moments,
writes those three and the weight: 26 bytes a parameter against 40).

The forward and backward compute exactly what they computed under autocast (autocast rounded
the fp32 weight to the same bf16 value); only the optimizer's arithmetic order differs from
torch's fused AdamW. Other parameters (biases, norms, embeddings, tied weights, small
weights: little traffic, many tensors) stay fp32 under torch's fused AdamW.

On CUDA the update is one Inductor kernel per weight (compiled once, any size), and that part
of the step is captured as a CUDA graph once the gradients sit at the same addresses a few
steps running (the engine's backward graphs write them in place): the host launches one graph.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

BF16_WEIGHT_OWNERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
"""Modules whose weights autocast casts to bf16 for their GEMM or convolution."""
MIN_ELEMENTS = 1 << 16
"""Smaller weights stay fp32: their casts cost little, and each bf16 weight is one kernel."""
STEPS_BEFORE_CAPTURE = 2
"""Eager steps with the same gradient addresses before the step is captured (the first
compiles the update kernel; capture replays what ran)."""
MAX_GRAPHS = 4


def cast_weights_bf16(modules: Iterable[nn.Module],
                      min_elements: int = MIN_ELEMENTS) -> list[nn.Parameter]:
    """Store in bf16, in place, the weight of every `BF16_WEIGHT_OWNERS` submodule of
    `modules` with at least `min_elements` elements (autocast computes with it in bf16
    anyway). A weight some other module also holds (tied to an embedding) stays fp32: that
    module computes in fp32 with it. Returns the parameters cast."""
    modules = list(modules)
    elsewhere = {id(p) for m in modules for sub in m.modules()
                 if not isinstance(sub, BF16_WEIGHT_OWNERS)
                 for p in sub.parameters(recurse=False)}
    cast: dict[int, nn.Parameter] = {}
    for m in modules:
        for sub in m.modules():
            p = getattr(sub, "weight", None) if isinstance(sub, BF16_WEIGHT_OWNERS) else None
            if (isinstance(p, nn.Parameter) and p.dtype == torch.float32
                    and p.numel() >= min_elements and id(p) not in elsewhere):
                p.data = p.data.to(torch.bfloat16)
                cast[id(p)] = p
    return list(cast.values())


def _adamw_update(main: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, weight: torch.Tensor, lr: torch.Tensor,
                  step_size: torch.Tensor, bias2_sqrt: torch.Tensor, *, beta1: float,
                  beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step of one tensor (torch.optim.AdamW's arithmetic), writing the bf16
    `weight` from the new fp32 `main`. Elementwise only, so Inductor fuses it into one
    kernel."""
    g = grad.float()
    m = exp_avg + (g - exp_avg) * (1 - beta1)
    v = exp_avg_sq * beta2 + g * g * (1 - beta2)
    new = main * (1 - lr * weight_decay) - step_size * m / (v.sqrt() / bias2_sqrt + eps)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    main.copy_(new)
    weight.copy_(new)


@functools.lru_cache(maxsize=8)
def _update_fn(device_type: str, beta1: float, beta2: float, eps: float, weight_decay: float,
               dynamic: bool):
    """The update with its constants bound; compiled on CUDA: one kernel for every size
    (`dynamic`), else one per size (Dynamo's recompile limit bounds the sizes: past it, the
    update of further sizes runs eagerly, unfused)."""
    update = functools.partial(_adamw_update, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay)
    if device_type != "cuda":
        return update
    if not dynamic:
        from mosaic.engine.compile import raise_recompile_limit

        raise_recompile_limit()
    return torch.compile(update, dynamic=dynamic, fullgraph=dynamic)


class MainWeightsAdamW:
    """AdamW over `params`: fp32 main copies of the bf16 ones, updated by this class (module
    doc); the fp32 ones by torch's fused AdamW. One step count for all bf16 weights: torch's
    AdamW keeps one per parameter, which differ only for parameters that skip steps."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, dynamic: bool = True) -> None:
        params = [p for p in params if p.requires_grad]
        self.params = [p for p in params if p.dtype == torch.bfloat16]
        rest = [p for p in params if p.dtype != torch.bfloat16]
        if not all(p.is_contiguous() for p in self.params):
            raise ValueError("MainWeightsAdamW updates each bf16 weight as one flat view: make "
                             "the parameters contiguous (not channels_last)")
        cuda = bool(params) and params[0].is_cuda
        self.rest = (torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, fused=cuda or None)
                     if rest else None)
        device = params[0].device if params else torch.device("cpu")
        self.mains = [p.detach().float().clone() for p in self.params]
        self.exp_avgs = [torch.zeros_like(m) for m in self.mains]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.mains]
        self.beta1, self.beta2 = betas
        self._lr = torch.tensor(float(lr), device=device)
        self._step = torch.zeros((), device=device)
        self._update = _update_fn(device.type, self.beta1, self.beta2, eps, weight_decay,
                                  dynamic)
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self._last_key: tuple[int, ...] | None = None
        self._repeats = 0

    @property
    def lr(self) -> float:
        return float(self._lr)

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr.fill_(value)
        if self.rest is not None:
            for group in self.rest.param_groups:
                group["lr"] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.rest is not None:
            self.rest.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def step(self) -> None:
        if self.rest is not None:
            self.rest.step()
        if not self.params:
            return
        key = tuple(p.grad.data_ptr() if p.grad is not None else 0 for p in self.params)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        self._repeats = self._repeats + 1 if key == self._last_key else 1
        self._last_key = key
        if not (self._step.is_cuda and self._repeats > STEPS_BEFORE_CAPTURE
                and len(self.graphs) < MAX_GRAPHS):
            self._bf16_step()
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._bf16_step()
        self.graphs[key] = graph
        graph.replay()  # capture records the step without running it

    def _bf16_step(self) -> None:
        self._step += 1
        step_size = self._lr / (1 - torch.pow(self.beta1, self._step))
        bias2_sqrt = torch.sqrt(1 - torch.pow(self.beta2, self._step))
        for p, main, m, v in zip(self.params, self.mains, self.exp_avgs, self.exp_avg_sqs,
                                 strict=True):
            if p.grad is not None:
                self._update(main.view(-1), p.grad.view(-1), m.view(-1), v.view(-1),
                             p.data.view(-1), self._lr, step_size, bias2_sqrt)
