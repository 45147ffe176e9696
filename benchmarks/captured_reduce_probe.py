"""Can a module's gradient all-reduce run inside its captured backward, overlapping it?

The engine captures each module's backward as one CUDA graph and sums a data-parallel
module's gradients with one all-reduce per flat buffer after that graph (`grad_sync=flat`):
the sum overlaps only the earlier stages' backward. At `paper` sizes on two GPUs the
performance model then predicts weak scaling far below 1.85x (Unified-IO 2 b4 a GPU: 86.87
ms on one GPU, 131.19 ms on two, 1.32x; the LLM's 3.6 B fp32 gradients are ~40 ms of
NVLink), while a user's DDP program overlaps its buckets with its backward. Before the engine
captures collectives, this measures on two GPUs, one process each (torchrun), a stack of
linear layers standing in for an LLM, every variant CUDA-graphed, median of the timed steps:

- `compute`: forward and backward graphs, no sum (the floor);
- `after`: the same, then one all-reduce of the flat gradient buffer (the engine today);
- `captured`: the backward graph also holds the sums: as each bucket of layers (in backward
  order) has its gradients, they are copied into the flat buffer's slice and all-reduced on a
  side stream forked and joined inside the capture (a hook on each parameter).

It checks that `captured` sums what `after` sums, and prints the share of the exposed sum
that capturing hid: (after - captured) / (after - compute).

    torchrun --standalone --nproc-per-node 2 benchmarks/captured_reduce_probe.py \
        --layers 24 --width 4096 --tokens 4096 --buckets 1,4,12 --out X.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn

WARMUP = 3


def _stack(layers: int, width: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks).to(device=device, dtype=torch.bfloat16)


class Variant:
    """Forward and backward graphs of `model` on `x`, the gradients landing in `flat`
    (copied in by the backward graph); with `buckets` > 0 the backward graph also all-reduces
    them, bucket by bucket, on a side stream."""

    def __init__(self, model: nn.Sequential, x: torch.Tensor, flat: torch.Tensor,
                 buckets: int) -> None:
        self.model, self.x, self.flat = model, x, flat
        self.params = list(model.parameters())
        self.views, start = [], 0
        for p in self.params:
            self.views.append(flat[start:start + p.numel()].view_as(p))
            start += p.numel()
        self.side = torch.cuda.Stream()
        self.buckets = self._buckets(buckets) if buckets else []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: eager, every path the capture takes
            for _ in range(WARMUP):
                self._backward(self.model(self.x))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, stream=stream):
            self.out = self.model(self.x)
        with torch.cuda.graph(self.bwd, stream=stream):
            self._backward(self.out)

    def _buckets(self, count: int) -> list[list[int]]:
        """Parameter indices in `count` runs of whole layers, last layer first."""
        order = list(range(len(self.params)))[::-1]
        size = -(-len(order) // count)
        return [order[i:i + size] for i in range(0, len(order), size)]

    def _backward(self, out: torch.Tensor) -> None:
        # Tensor hooks, not register_multi_grad_hook: autograd.grad over leaves refuses the
        # latter (torch 2.13). A bucket is summed when its last gradient arrives.
        handles = []
        for bucket in self.buckets:
            ready: dict[int, torch.Tensor] = {}
            for i in bucket:
                handles.append(self.params[i].register_hook(
                    self._collector(bucket, i, ready)))
        grads = torch.autograd.grad(out, self.params, torch.ones_like(out))
        for handle in handles:
            handle.remove()
        if not self.buckets:
            torch._foreach_copy_(self.views, list(grads))
        else:  # the join the capture needs (the side stream forked in the hooks)
            torch.cuda.current_stream().wait_stream(self.side)

    def _collector(self, bucket: list[int], index: int, ready: dict[int, torch.Tensor]):
        def collect(grad: torch.Tensor) -> None:
            ready[index] = grad
            if len(ready) == len(bucket):
                self._reduce(bucket, [ready.pop(i) for i in bucket])
        return collect

    def _reduce(self, bucket: list[int], grads: list[torch.Tensor]) -> None:
        """Copies the bucket's gradients into its slice of the flat buffer (a run of whole
        parameters, so one slice) and sums that slice on the side stream."""
        torch._foreach_copy_([self.views[i] for i in bucket], grads)
        size = self.flat.element_size()
        lo = min(self.views[i].data_ptr() for i in bucket) - self.flat.data_ptr()
        hi = max(self.views[i].data_ptr() + self.views[i].numel() * size
                 for i in bucket) - self.flat.data_ptr()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            dist.all_reduce(self.flat[lo // size:hi // size])

    def step(self, reduce_after: bool) -> None:
        self.fwd.replay()
        self.bwd.replay()
        if reduce_after:
            dist.all_reduce(self.flat)


def _timed_ms(variant: Variant, reduce_after: bool, steps: int) -> float:
    times = []
    for _ in range(WARMUP + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        variant.step(reduce_after)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--grad-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="the flat buffer's dtype (the engine's fp32 weights sum in fp32)")
    parser.add_argument("--buckets", default="1,4,12")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    dist.all_reduce(torch.ones(1, device=device))  # the communicator, before any capture
    model = _stack(args.layers, args.width, device)
    x = torch.randn(args.tokens, args.width, device=device, dtype=torch.bfloat16) * (rank + 1)
    numel = sum(p.numel() for p in model.parameters())
    dtype = torch.float32 if args.grad_dtype == "fp32" else torch.bfloat16
    flat = torch.zeros(numel, device=device, dtype=dtype)
    plain = Variant(model, x, flat, 0)
    rows = {"compute": _timed_ms(plain, False, args.steps),
            "after": _timed_ms(plain, True, args.steps)}
    expected = flat.float().clone()
    for count in (int(b) for b in args.buckets.split(",")):
        captured = Variant(model, x, torch.zeros_like(flat), count)
        rows[f"captured, {count} buckets"] = _timed_ms(captured, False, args.steps)
        captured.step(False)
        torch.cuda.synchronize()
        error = float((captured.flat.float() - expected).norm() / expected.norm())
        rows[f"captured, {count} buckets: relative difference"] = error
    exposed = rows["after"] - rows["compute"]
    if rank == 0:
        for name, value in rows.items():
            hid = ("" if "difference" in name or not name.startswith("captured") or exposed <= 0
                   else f"  hid {(rows['after'] - value) / exposed:.0%} of the exposed sum")
            print(f"{name:45s} {value:10.4g}{hid}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "params": numel, "gpu": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "ms_or_difference": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
