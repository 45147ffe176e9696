"""The optimizer step under the next step's forward: each block waits only for its own weights.

With bf16 weights the update is memory-bound and runs alone on the GPU once the backward ends:
on the H200, Unified-IO 2 `paper` at batch 4 moves 20 bytes for each of 3.68 B parameters
(~18 ms of a 65 ms step) while no compute runs. The LLM's backward ends before the encoders'
short one starts, so an update started as gradients become final (`optimizer_overlap`) has
little to hide under. The next step's forward is compute that needs the new weights, but only
a block at a time: block k of a transformer reads block k's weights and nothing of blocks
k+1.. . So here the update runs on a side stream (`UpdateGates.stream`) in forward order,
module by module and block by block, recording one event after each; the forward of each
module waits for its module's event (its weights outside the blocks, and every fp32
parameter, updated first), and each block for its own. The update of block k then runs
beside the forward of blocks < k.

Events are CUDA-graph "external" events: the optimizer's captured step records them as event
record nodes and a module's captured forward waits on them as event wait nodes, so two graphs
replayed on two streams keep the order without the host. They are recorded once when made:
torch creates an event at its first record, and a wait on an event not yet created is
dropped, from a capture too.

`GateSlot` (gate_slot.py) wraps each block of a module's repeated-block list
(compile.repeated_block_lists) where the runner calls it; it waits only while a runner's
forward has its gates `active()`, so other programs calling the same blocks (a bench's
baselines) never wait.

Measured on the H200 (docs/engine.md): Unified-IO 2 `paper` b4 1.007-1.019x. With the
forward's temporal stages on high-priority streams (PlanRunner._pipeline_streams) the update
runs beside the forward, but the two slow each other down (both want the HBM bandwidth); on a
green context of 48 SMs (`stream`, EngineConfig.update_sms) the update is slower still.

What it changes: nothing in the arithmetic (the same update kernels on the same tensors, in
another order: each tensor's update is elementwise and its own). What a caller must do: wait
for the update stream (`settle`) before reading weights or optimizer state outside a forward
(a checkpoint, an evaluation, the end of a run), and not free, zero or reuse gradients between
steps (`PlanRunner.grads_stay_put`: flat buffers, or gradients a backward graph leaves in a
memory pool apart from its forward graph's, graphed.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mosaic.engine.compile import repeated_block_lists
from mosaic.engine.gate_slot import waiting_blocks
from mosaic.engine.main_weights import MainWeightsAdamW, _adjacent_runs, _flat


class UpdateGates:
    """The update stream and one event per module and per block of `modules` (this rank's,
    in forward order), with the parameters each event stands for (`groups`, in the order the
    update must go)."""

    def __init__(self, order: list[str], modules: dict[str, nn.Module],
                 device: torch.device, stream: Any = None) -> None:
        """`stream`: the update's (a green context's, to hold it to its SMs); default a new
        plain stream."""
        self.cuda = device.type == "cuda"
        self.stream = (stream or torch.cuda.Stream(device)) if self.cuda else None
        self.module_events: dict[str, Any] = {}
        self.block_events: dict[int, Any] = {}
        self.groups: list[tuple[Any, list[nn.Parameter]]] = []
        seen: set[int] = set()
        for m in order:
            blocks = [block for _, blocks in repeated_block_lists(modules[m]) for block in blocks]
            in_blocks = {id(p) for block in blocks for p in block.parameters()}
            outside = [p for p in modules[m].parameters() if id(p) not in in_blocks]
            self.module_events[m] = self._event()
            self.groups.append((self.module_events[m], self._new(outside, seen)))
            for block in blocks:
                self.block_events[id(block)] = self._event()
                self.groups.append((self.block_events[id(block)],
                                    self._new(list(block.parameters()), seen)))

    @staticmethod
    def _new(params: list[nn.Parameter], seen: set[int]) -> list[nn.Parameter]:
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        return fresh

    def _event(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(external=True)
        event.record(self.stream)  # created now: see the module doc
        return event

    def active(self) -> Any:
        """A context inside which blocks wait for their update (GateSlot)."""
        return waiting_blocks(self.block_events)

    def wait_module(self, module: str, stream: Any) -> None:
        """`stream` (about to run `module`'s forward) waits for the module's own update."""
        event = self.module_events.get(module)
        if event is not None and stream is not None:
            stream.wait_event(event)

    def record(self, event: Any) -> None:
        if event is not None:
            event.record(torch.cuda.current_stream())

    def settle(self) -> None:
        """The caller's stream waits for every update launched so far."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


class GatedMainWeightsAdamW(MainWeightsAdamW):
    """MainWeightsAdamW whose step runs on `gates.stream`, group by group in forward order,
    recording each group's event (module doc). `defer` False: the caller's stream waits for
    the whole update at the end of `step()`, as after MainWeightsAdamW's; True: it does not,
    and the next forward's gates order it (set it only where gradients stay put)."""

    def __init__(self, params: Any, lr: float, *, gates: UpdateGates, **kwargs: Any) -> None:
        super().__init__(params, lr, **kwargs)
        self.gates = gates
        self.defer = False
        mine = {id(p) for p in self.bf16}
        grouped = [(event, [p for p in group if id(p) in mine]) for event, group in gates.groups]
        missing = mine - {id(p) for _, group in grouped for p in group}
        if missing:
            raise ValueError(f"{len(missing)} bf16 weights belong to no module of the gates: "
                             "build the optimizer over the session's parameters")
        self._groups = grouped

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        stream = self.gates.stream
        if stream is None:
            return super().step()
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)  # the gradients, found_inf and grad_scale are final there
        with torch.cuda.stream(stream):
            super().step()
        if not self.defer:
            caller.wait_stream(stream)
        return None

    def settle(self) -> None:
        self.gates.settle()

    def _update_all(self) -> None:
        # As MainWeightsAdamW's, but _bf16_step runs without bf16 weights too: every gate's
        # event must be recorded after `rest`, or a forward would not wait for its fp32 update.
        if self.rest is not None:
            self.rest.step()
        self._bf16_step()

    def _bf16_step(self) -> None:
        """MainWeightsAdamW's update, a group at a time, each group's event recorded after it.
        (Its body repeated, not called: main_weights.py's source is the profiled update's key.)"""
        if not self.bf16:  # fp32 weights only (all in `rest`): the gates still open
            for event, _ in self._groups:
                self.gates.record(event)
            return
        beta1, beta2 = self.param_groups[0]["betas"]
        self._step += 1 - self._found_inf
        step_size = self._lr / (1 - torch.pow(beta1, self._step))
        bias2_sqrt = torch.sqrt(1 - torch.pow(beta2, self._step))
        for event, params in self._groups:
            for run in self._runs([p for p in params if p.grad is not None]):
                n = sum(p.numel() for p in run)
                state = self.state[run[0]]
                tensors = (state["main"], run[0].grad, state["exp_avg"], state["exp_avg_sq"],
                           run[0].data)
                self._kernel(n)(*(_flat(t, n) for t in tensors), self._lr, step_size,
                                bias2_sqrt, self._found_inf, self._grad_scale, self._step)
            self.gates.record(event)

    def _runs(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """launch_runs over `params` only: a group's weights, updated by one launch where
        their weights, gradients and states each lie side by side."""
        runs = []
        for run in _adjacent_runs(params, lambda p: p.data):
            for grads_run in _adjacent_runs(run, lambda p: p.grad):
                runs += _adjacent_runs(grads_run, lambda p: self.state[p]["main"])
        return runs
