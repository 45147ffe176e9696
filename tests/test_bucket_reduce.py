"""grad_sync='overlapped': a module's flat gradient buffer summed bucket by bucket during its
backward (engine/bucket_reduce.py). One process, the collective replaced by a recorder; the
two-process runs (gloo) are in test_engine_dist.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mosaic.engine import comm
from mosaic.engine.bucket_reduce import InBackwardReduce, buckets_of
from mosaic.engine.comm import FlatGrads


def _stack(widths=(8, 8, 8, 8)) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False)])


class Recorder:
    """dist.all_reduce stand-in: doubles the piece (two replicas with the same gradient) and
    notes which slice of which buffer it summed, and how many gradients had arrived then."""

    def __init__(self, flat: FlatGrads) -> None:
        self.flat, self.sums, self.arrived = flat, [], 0

    def __call__(self, t, group=None, async_op=False):
        base = next(b for b in self.flat.buffers.values() if b.dtype == t.dtype)
        start = (t.data_ptr() - base.data_ptr()) // t.element_size()
        self.sums.append((start, start + t.numel(), self.arrived))
        t.mul_(2)
        return _Done() if async_op else None


class _Done:
    def wait(self):
        pass


def test_buckets_are_whole_slices_cut_in_backward_order():
    model = _stack()
    flat = FlatGrads(list(model.parameters()))
    buckets = buckets_of(flat, 8 * 8 * 4)  # a weight (256 bytes) closes a bucket
    # last layer first; each bucket its layer's bias and weight, one slice of the buffer
    assert [b.awaited for b in buckets] == [(5, 4), (3, 2), (1, 0)]
    assert [(b.start, b.stop) for b in buckets] == [(144, 216), (72, 144), (0, 72)]
    assert sum(b.stop - b.start for b in buckets) == flat.buffers[torch.float32].numel()
    whole = buckets_of(flat, 2**30)
    assert len(whole) == 1 and (whole[0].start, whole[0].stop) == (0, 216)


def test_buckets_split_by_dtype_and_leave_out_what_awaits_nothing():
    model = _stack()
    model[1].to(torch.bfloat16)
    flat = FlatGrads(list(model.parameters()))
    buckets = buckets_of(flat, 2**30, awaited={0, 1, 2, 3})  # layer 2 unused
    assert {b.dtype for b in buckets} == {torch.float32, torch.bfloat16}
    fp32 = next(b for b in buckets if b.dtype == torch.float32)
    assert fp32.awaited == (1, 0) and (fp32.start, fp32.stop) == (0, 144)  # layer 2's views too
    assert buckets_of(flat, 2**30, awaited={2, 3})[0].dtype == torch.bfloat16


def test_eager_sums_start_during_the_backward_in_bucket_order_and_match_flat(monkeypatch):
    model = _stack()
    flat = FlatGrads(list(model.parameters()))
    recorder = Recorder(flat)
    monkeypatch.setattr(comm.dist, "all_reduce", recorder)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: setattr(recorder, "arrived",
                                                              recorder.arrived + 1))
    reducer = InBackwardReduce(flat, group=None, divide_by=2, bucket_bytes=8 * 8 * 4)
    flat.attach()
    reducer.start()
    model(torch.ones(3, 8)).sum().backward()
    works = reducer.finish()
    assert len(works) == 3
    assert [(start, stop) for start, stop, _ in recorder.sums] == [(144, 216), (72, 144), (0, 72)]
    # each sum started when its bucket's second (last) gradient arrived, before the next
    # layer's: the counting hooks run before the reducer's
    assert [arrived for *_, arrived in recorder.sums] == [2, 4, 6]

    expected = _stack()  # the same weights, summed whole after the backward
    expected_flat = FlatGrads(list(expected.parameters()))
    expected_flat.attach()
    expected(torch.ones(3, 8)).sum().backward()
    monkeypatch.setattr(comm.dist, "all_reduce", Recorder(expected_flat))
    expected_flat.reduce(group=None, divide_by=2)
    assert torch.equal(flat.buffers[torch.float32], expected_flat.buffers[torch.float32])
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), flat.views,
                                                                 strict=True))


def test_a_parameter_without_a_gradient_is_summed_at_the_end_as_zeros(monkeypatch):
    """A parameter unused this step holds up its bucket (and, in order, the later ones) until
    finish(), which sums them with zeros there, as every replica must send."""
    model = _stack()
    flat = FlatGrads(list(model.parameters()))
    recorder = Recorder(flat)
    monkeypatch.setattr(comm.dist, "all_reduce", recorder)
    reducer = InBackwardReduce(flat, group=None, bucket_bytes=8 * 8 * 4)
    flat.attach()
    reducer.start()
    model[0].bias.grad = None  # e.g. a user's zero_grad(set_to_none=True)
    # after start() hooked it: the backward now leaves it without a gradient
    model[0].bias.requires_grad_(False)
    model(torch.ones(3, 8)).sum().backward()
    assert len(recorder.sums) == 2  # the first layer's bucket waits for its bias
    reducer.finish()
    assert [(start, stop) for start, stop, _ in recorder.sums][-1] == (0, 72)
    assert torch.equal(model[0].bias.grad, torch.zeros(8))
    assert model[0].bias.grad.data_ptr() == flat.views[1].data_ptr()


def test_hooks_last_only_for_the_backward_they_sum(monkeypatch):
    model = _stack()
    flat = FlatGrads(list(model.parameters()))
    recorder = Recorder(flat)
    monkeypatch.setattr(comm.dist, "all_reduce", recorder)
    reducer = InBackwardReduce(flat, group=None)
    flat.attach()
    reducer.start()
    model(torch.ones(3, 8)).sum().backward()
    reducer.finish()
    count = len(recorder.sums)
    model(torch.ones(3, 8)).sum().backward()  # another program's backward over the weights
    assert len(recorder.sums) == count


def test_the_engine_and_its_variants_accept_overlapped():
    from mosaic.engine.measure import engine_variant
    from mosaic.engine.runner import RunnerConfig, gradient_home
    from mosaic.engine.session import EngineConfig

    assert engine_variant(EngineConfig(), {"grad_sync": "overlapped"}).grad_sync == "overlapped"
    config = RunnerConfig(graphs=True, grad_sync="overlapped")
    home = gradient_home(config, plain=True, data_parallel=True, accumulating=False)
    assert home.flat_sync and home.reduce_in_backward and home.graph_mode == "copy"
    accumulating = gradient_home(config, plain=True, data_parallel=True, accumulating=True)
    assert accumulating.flat_sync and not accumulating.reduce_in_backward
    assert not gradient_home(config, plain=True, data_parallel=False,
                             accumulating=False).reduce_in_backward


def test_a_captured_sum_of_cpu_gradients_is_refused():
    from mosaic.engine.bucket_reduce import BucketReduceError

    model = _stack()
    reducer = InBackwardReduce(FlatGrads(list(model.parameters())), group=None)
    with pytest.raises(BucketReduceError, match="on the CPU"), \
            reducer.captured(list(model.parameters())):
        pass


def test_buckets_completed_out_of_order_wait_only_where_summed_in_order():
    """A parameter registered last but used first (its gradient arrives last) completes the
    first bucket last: summed in order (eager), every bucket waits for it; as completed (a
    captured backward, whose order is the same on every rank), none does."""
    model = _stack()
    flat = FlatGrads(list(model.parameters()))
    sums = []
    late = 5  # the last layer's bias: in the first bucket summed
    for in_order in (True, False):
        reducer = InBackwardReduce(flat, group=None, bucket_bytes=8 * 8 * 4)
        reducer._arm(reducer._every)
        sums.clear()
        for i in [4, 3, 2, 1, 0, late]:
            reducer._arrived(i, lambda bucket: sums.append(bucket.start), in_order)
        assert sorted(reducer.order) == [0, 1, 2]
        assert sums == ([144, 72, 0] if in_order else [72, 0, 144])


def test_only_a_backward_alone_on_its_gpus_sums_inside_itself():
    """Two modules' backwards side by side on the same GPUs (a concurrent stage) would replay
    their captured sums on one communicator in an order no rank controls: they sum after the
    stage's backward, as 'flat' does. A temporal stage runs its modules one at a time."""
    from mosaic.engine.runner import RunnerConfig, gradient_home
    from mosaic.plan import Placement, Plan, Stage

    both, one = (0, 1), (0,)
    plan = Plan(model="m", planner="p", num_gpus=2, stages=(
        Stage(sharing="free", placements=(Placement(module="a", gpus=both),
                                          Placement(module="b", gpus=both))),
        Stage(sharing="partition", placements=(Placement(module="c", gpus=both),
                                               Placement(module="d", gpus=(1,)))),
        Stage(sharing="free", placements=(Placement(module="e", gpus=one),
                                          Placement(module="f", gpus=(1,)))),
        Stage(sharing="temporal", placements=(Placement(module="g", gpus=both),
                                              Placement(module="h", gpus=both)))))
    alone = {m: plan.stages[plan.stage_of(m)].runs_alone(m) for m in "abcdefgh"}
    assert alone == {"a": False, "b": False, "c": False, "d": False, "e": True, "f": True,
                     "g": True, "h": True}
    config = RunnerConfig(graphs=True, grad_sync="overlapped")
    beside = gradient_home(config, plain=True, data_parallel=True, accumulating=False,
                           backward_alone=False)
    assert beside.flat_sync and beside.graph_mode == "copy" and not beside.reduce_in_backward


def test_a_module_without_trainable_parameters_has_nothing_to_sum():
    frozen = _stack()
    for p in frozen.parameters():
        p.requires_grad_(False)
    reducer = InBackwardReduce(FlatGrads(list(frozen.parameters())), group=None)
    with reducer.captured([]):
        pass
    assert reducer.buckets == [] and reducer.order == []
    reducer.start()
    assert reducer.finish() == []
