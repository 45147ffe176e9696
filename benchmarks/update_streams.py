"""Would the bf16 update a weight at a time run faster over several streams, or grouped?

The profiler finds Unified-IO 2 `paper`'s LLM updated a weight at a time (339 launches, bf16
moments, no main weights) 13% slower than in one launch over flat buffers: 14.37 against
12.67 ms on the H200 (2026-12-04). Each launch ends in a tail where the GPU's memory system
idles; launches on two or more streams, forked and joined inside the captured step, could fill
them. Before the engine does that (it would edit the update's code, whose every measured entry
then needs profiling again), this measures it: the module's weights as the zoo builds them,
RoundedWeightsAdamW's step (bf16 moments) with its launches dealt round-robin over N streams
(N = 1 is the engine's), captured as the engine captures it; and the flat update over the same
weights (no gradient copy counted). And grouped (engine/grouped_update.py, the engine's
`update_group`): weights of one shape K at a time through one compiled function with
Inductor's combo kernels. GPU time per step: profile/main_weights.py timed_s.

    PYTHONPATH=src python benchmarks/update_streams.py unified-io-2 paper llm --lanes 1,2,4 \
        --groups 4,8 --out X.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from mosaic.engine.grouped_update import GroupedRoundedWeightsAdamW
from mosaic.engine.rounded_weights import RoundedWeightsAdamW
from mosaic.profile.main_weights import (
    bf16_params,
    cast_zoo_modules,
    flat_views,
    fresh_kernel_budget,
    timed_s,
    update_s,
)


class LanedRoundedWeightsAdamW(RoundedWeightsAdamW):
    """RoundedWeightsAdamW whose per-launch kernels are dealt round-robin over `lanes`
    streams: the caller's and lanes - 1 side streams, which wait for the caller's stream at
    the first launch (after the step's scalars are computed there) and are waited for at
    the end of the step."""

    lanes = 1

    def _side_streams(self) -> list[torch.cuda.Stream]:
        if not hasattr(self, "_sides"):
            self._sides = [torch.cuda.Stream() for _ in range(self.lanes - 1)]
        return self._sides

    def _bf16_step(self) -> None:
        self._forked, self._launched = False, 0
        super()._bf16_step()
        caller = torch.cuda.current_stream()
        for side in self._side_streams():
            done = torch.cuda.Event()
            done.record(side)
            caller.wait_event(done)

    def _kernel(self, length: int):
        kernel = super()._kernel(length)

        def launch(*args) -> None:
            streams = [torch.cuda.current_stream(), *self._side_streams()]
            if not self._forked:
                fork = torch.cuda.Event()
                fork.record(streams[0])
                for side in streams[1:]:
                    side.wait_event(fork)
                self._forked = True
            stream = streams[self._launched % len(streams)]
            self._launched += 1
            with torch.cuda.stream(stream):
                kernel(*args)
        return launch


def _captured_step_s(params: list[torch.nn.Parameter], grads: list[torch.Tensor],
                     make_optimizer) -> tuple[float, bool]:
    """GPU seconds of one step of a fresh optimizer (`make_optimizer(params, lr, moments=)`)
    over `params` with `grads`, and whether its step was captured."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    optimizer = make_optimizer(params, 1e-5, moments="bf16")
    seconds = timed_s(optimizer.step, params[0].device)
    return seconds, bool(optimizer.graphs)


def measure(model: str, preset: str, module: str, lanes: list[int],
            groups: list[int] = ()) -> dict:
    fresh_kernel_budget()
    _, modules = cast_zoo_modules(model, preset, "cuda")
    params = bf16_params(modules[module])
    for name in [m for m in modules if m != module]:
        del modules[name]
    torch.cuda.empty_cache()
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    rows = {}
    for n in lanes:
        laned = type(f"Laned{n}", (LanedRoundedWeightsAdamW,), {"lanes": n})
        seconds, captured = _captured_step_s(params, grads, laned)
        rows[f"a weight at a time, {n} stream(s)"] = {"gpu_ms": seconds * 1e3,
                                                     "captured": captured}
        torch.cuda.empty_cache()
    for k in groups:
        grouped = functools.partial(GroupedRoundedWeightsAdamW, group=k)
        seconds, captured = _captured_step_s(params, grads, grouped)
        rows[f"a weight at a time, {k} of a shape a launch"] = {"gpu_ms": seconds * 1e3,
                                                                "captured": captured}
        torch.cuda.empty_cache()
    rows["flat, one launch"] = {"gpu_ms": update_s(params, flat_views(params), moments="bf16",
                                                   fp32_main_weights=False) * 1e3,
                                "captured": True}
    return {"model": model, "preset": preset, "module": module, "weights": len(params),
            "parameters": sum(p.numel() for p in params),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("preset")
    parser.add_argument("module")
    parser.add_argument("--lanes", default="1,2,4")
    parser.add_argument("--groups", default="4,8",
                        help="weights of one shape a combo-kernel launch (empty: none)")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = measure(args.model, args.preset, args.module,
                     [int(n) for n in args.lanes.split(",")],
                     [int(k) for k in args.groups.split(",") if k])
    print(f"{result['model']} {result['preset']} {result['module']}: {result['weights']} "
          f"bf16 weights, {result['parameters'] / 1e9:.2f} B parameters")
    for name, row in result["rows"].items():
        print(f"  {name:36s} {row['gpu_ms']:8.3f} ms{'' if row['captured'] else ' (eager)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
