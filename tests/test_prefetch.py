"""The trainer makes the next steps' host rows on background threads: the same rows as made
inline, in step order, with a data source's error raised on the training thread."""

import pytest
import torch

from mosaic.engine.rows import RowPrefetcher, pinned
from mosaic.engine.session import batch_loader
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
