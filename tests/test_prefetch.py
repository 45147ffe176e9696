"""The trainer makes the next steps' host rows on background threads: the same rows as made
inline, in step order, with a data source's error raised on the training thread."""

import pytest
import torch

from mosaic.engine.rows import PINNING, RowPrefetcher, pinned
from mosaic.engine.session import batch_loader
from mosaic.engine.steps import may_capture, step_optimizer
from tests.test_engine import ToyModel

RANGES = {"vision": (1, 3), "text": (0, 4)}


def _prefetcher(model, steps: range, threads: int = 1) -> RowPrefetcher:
    def make(step: int):
        return [batch_loader(model, "tiny", 4, 7, step)(RANGES)]

    return RowPrefetcher(make, steps, threads=threads)


def test_prefetched_rows_equal_inline_rows_in_step_order():
    model = ToyModel("toyclip")
    with _prefetcher(model, range(2, 6)) as rows:
        got = [rows.get(step) for step in range(2, 6)]
    asked = [r["step"] for r in model.requested]
    assert asked == [2, 3, 4, 5]
    for step, (mine,) in zip(range(2, 6), got, strict=True):
        inline = batch_loader(model, "tiny", 4, 7, step)(RANGES)
        for name, tensors in inline.items():
            for a, b in zip(mine[name], tensors, strict=True):
                assert torch.equal(a, b)


def test_several_threads_make_the_same_rows_steps_ahead():
    model = ToyModel("toyclip")
    with _prefetcher(model, range(0, 8), threads=3) as rows:
        got = [rows.get(step) for step in range(8)]
        assert sorted(r["step"] for r in model.requested) == list(range(8))
    for step, (mine,) in enumerate(got):
        inline = batch_loader(model, "tiny", 4, 7, step)(RANGES)
        for name, tensors in inline.items():
            for a, b in zip(mine[name], tensors, strict=True):
                assert torch.equal(a, b)


def test_a_data_source_error_reaches_the_training_thread():
    class Broken(ToyModel):
        def make_rows(self, *args, **kwargs):
            raise OSError("shard 3 unreadable")

    with _prefetcher(Broken("toyclip"), range(0, 3)) as rows, \
            pytest.raises(OSError, match="shard 3"):
        rows.get(0)


def test_settle_waits_for_the_rows_asked_for():
    model = ToyModel("toyclip")
    with _prefetcher(model, range(0, 3)) as rows:
        rows.get(0)  # asks for step 1 in the background
        rows.settle()
        assert [r["step"] for r in model.requested] == [0, 1]


def test_rows_stay_as_they_are_off_cuda():
    rows = [{"vision": (torch.ones(2),)}]
    assert pinned(rows, pin=False) is rows


@pytest.mark.gpu
def test_rows_are_pinned_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (row,) = pinned([{"vision": (torch.ones(2), torch.zeros(3))}], pin=True)
    assert all(t.is_pinned() for t in row["vision"])


def test_only_a_model_that_draws_on_the_device_is_asked_to():
    """The zoo's synthetic rows take a device; a data source or a user's model is never
    handed one (its make_rows has no such argument) and stays on the host."""
    from mosaic.zoo import get_model

    clip = get_model("clip")
    on_cpu = batch_loader(clip, "tiny", 4, 7, 3, torch.device("cpu"))(RANGES)
    host = batch_loader(clip, "tiny", 4, 7, 3)(RANGES)
    for name, tensors in host.items():  # the same generators, on the device asked for
        assert all(torch.equal(a, b) for a, b in zip(on_cpu[name], tensors, strict=True))
    toy = ToyModel("toyclip")  # make_rows(preset, ranges, *, step, seed, global_batch) only
    batch_loader(toy, "tiny", 4, 7, 3, torch.device("cuda"))(RANGES)
    assert toy.requested[-1]["step"] == 3


def test_the_trainer_draws_synthetic_rows_on_the_gpu_and_loads_real_data_on_threads():
    from types import SimpleNamespace

    from mosaic.engine.rows import RowsOnDevice
    from mosaic.engine.trainer import TrainConfig, _row_prefetcher
    from mosaic.zoo import get_model
    from tests.test_engine import one_gpu_plans

    graph = get_model("clip").graph("tiny")
    config = TrainConfig(model="clip", preset="tiny", steps=3, device="cpu",
                         plan=one_gpu_plans(graph)["free"])

    def source(model, device: str):
        session = SimpleNamespace(runner=SimpleNamespace(device=torch.device(device)))
        return type(_row_prefetcher(model, config, graph, session, 0))

    from mosaic.data import with_dataset

    assert source(get_model("clip"), "cuda") is RowsOnDevice
    assert source(ToyModel("toyclip"), "cuda") is RowPrefetcher
    assert source(with_dataset(get_model("clip"), "digits", "tiny"), "cuda") is RowPrefetcher
    assert source(get_model("clip"), "cpu") is RowPrefetcher


@pytest.mark.gpu
def test_synthetic_rows_drawn_on_the_gpu_are_the_same_for_every_split():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mosaic.zoo import get_model

    clip, cuda = get_model("clip"), torch.device("cuda")
    whole = clip.make_rows("tiny", {"vision": (0, 4)}, step=5, seed=1, global_batch=4,
                           device=cuda)
    halves = [clip.make_rows("tiny", {"vision": r}, step=5, seed=1, global_batch=4, device=cuda)
              for r in ((0, 2), (2, 4))]
    assert whole["vision"][0].is_cuda
    joined = torch.cat([h["vision"][0] for h in halves])
    assert torch.equal(whole["vision"][0], joined)
    again = clip.make_rows("tiny", {"vision": (0, 4)}, step=5, seed=1, global_batch=4,
                           device=cuda)
    assert torch.equal(whole["vision"][0], again["vision"][0])


class _Pinnable:
    """Stands in for a host tensor: records whether pinning it held the pinning lock."""

    def __init__(self, seen: list[bool]) -> None:
        self.seen = seen

    def pin_memory(self) -> "_Pinnable":
        self.seen.append(PINNING.locked())
        return self


class _CapturingOptimizer:
    """An optimizer whose step records whether the row threads were kept from pinning, with
    no captured step yet (as MainWeightsAdamW before its capture) or one replayed."""

    def __init__(self, graphs: dict) -> None:
        self.graphs, self.capture_failed, self.seen = graphs, None, []

    def step(self) -> None:
        self.seen.append(PINNING.locked())


def test_no_row_is_pinned_while_the_optimizer_may_capture_its_step():
    """A capture in progress fails if another thread pins memory (rows.PINNING): pinning
    holds the lock, and so does an optimizer step that may capture; once the step replays
    a captured graph, it does not wait for pinning."""
    seen: list[bool] = []
    pinned([{"vision": (_Pinnable(seen), _Pinnable(seen))}], pin=True)
    assert seen == [True, True] and not PINNING.locked()
    first, captured = _CapturingOptimizer({}), _CapturingOptimizer({("key",): object()})
    failed = _CapturingOptimizer({})
    failed.capture_failed = "RuntimeError: capture failed"
    for optimizer in (first, captured, failed):
        step_optimizer(optimizer)
    assert (first.seen, captured.seen, failed.seen) == ([True], [False], [False])
    overlapped = type("PerModule", (), {"optimizers": {"llm": captured, "vision": first}})()
    assert may_capture(overlapped) and not may_capture(torch.optim.SGD([torch.zeros(1)], 0.1))
