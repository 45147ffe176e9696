"""Data sources: each rank loads only its rows, any split gives the same samples; the digits
data set and its tokenizer; a user's DataLoader and ShardedDataset plug into mosaic.api.train."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import mosaic.api as api
from mosaic.data import DataError, ShardedDataset, with_dataset
from mosaic.data import digits as digits_data
from mosaic.user_model import UserModel, UserModelError
from mosaic.zoo import get_model
from tests.test_user_model import EDGES, modules, one_gpu_plan

ROOT = Path(__file__).resolve().parents[1]
SPLITS = [{"a": (0, 16)}, {"a": (0, 5), "b": (5, 16)}, {"a": (8, 16), "b": (0, 8)}]


class Samples:
    """Map-style dataset of 40 samples for the toy modules a (4 wide) and b (6 wide)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        x = torch.randn(4, generator=torch.Generator().manual_seed(i))
        return {"a": x, "b": (torch.cat([x, x[:2]]),)}


def _whole(source, step: int, batch: int = 16) -> dict:
    return source.rows(step, {"a": (0, batch), "b": (0, batch)}, batch)


@pytest.mark.parametrize("ranges", SPLITS)
def test_sharded_dataset_rows_of_any_split_are_the_whole_batch_rows(ranges):
    source = ShardedDataset(Samples(), seed=3)
    for step in (0, 2, 7):  # 7 * 16 rows: past the end of the first epochs
        whole = _whole(source, step)
        for module, (start, stop) in ranges.items():
            assert torch.equal(source.rows(step, ranges, 16)[module][0], whole[module][0][start:stop])


def test_sharded_dataset_visits_every_item_once_per_epoch():
    source = ShardedDataset(Samples(), seed=1)
    epoch = [source.index(step, i, 8) for step in range(5) for i in range(8)]  # 40 = one epoch
    assert sorted(epoch) == list(range(40)) and epoch != list(range(40))
    following = [source.index(step, i, 8) for step in range(5, 10) for i in range(8)]
    assert sorted(following) == list(range(40)) and following != epoch  # reshuffled
    assert [ShardedDataset(Samples(), shuffle=False).index(1, i, 8) for i in range(3)] == [8, 9, 10]


def test_sharded_dataset_refuses_what_is_not_a_dataset():
    with pytest.raises(DataError, match="map-style dataset"):
        ShardedDataset(iter([1, 2]))


def test_zoo_synthetic_rows_of_any_split_are_the_whole_batch_rows():
    model = get_model("clip")
    whole = model.make_rows("tiny", None, step=4, seed=1, global_batch=8)
    part = model.make_rows("tiny", {"vision": (2, 6), "text": (5, 8), "align": (0, 8)},
                           step=4, seed=1, global_batch=8)
    assert set(part) == {"vision", "text"}  # the head has no inputs of its own
    assert torch.equal(part["vision"][0], whole["vision"][0][2:6])
    assert torch.equal(part["text"][0], whole["text"][0][5:8])
    other = model.make_rows("tiny", None, step=5, seed=1, global_batch=8)
    assert not torch.equal(other["vision"][0], whole["vision"][0])


def test_a_dataloader_and_the_sharded_dataset_train_alike():
    """The DataLoader of global batches and the per-rank source of the same samples give the
    same losses; the per-rank source is asked for the rows of each module only."""
    graph = api.graph_from_modules("mine", modules(), EDGES, {"a": torch.randn(1, 4),
                                                              "b": torch.randn(1, 6)}, 16)
    loader = DataLoader(Samples(), batch_size=16, drop_last=True)  # 2 batches: one epoch
    by_loader = api.train(graph, modules(), one_gpu_plan(), loader, lr=1e-2, steps=2,
                          device="cpu", progress=False)
    asked = []

    class Recorded(ShardedDataset):
        def rows(self, step, ranges, global_batch):
            asked.append(dict(ranges))
            return super().rows(step, ranges, global_batch)

    sharded = api.train(graph, modules(), one_gpu_plan(), Recorded(Samples(), shuffle=False),
                        lr=1e-2, steps=2, device="cpu", progress=False)
    assert [s["loss"] for s in sharded.steps] == pytest.approx([s["loss"] for s in by_loader.steps])
    assert asked == [{"a": (0, 16), "b": (0, 16), "head": (0, 16)}] * 2


def test_a_row_source_with_the_wrong_rows_is_named():
    graph = api.graph_from_modules("mine", modules(), EDGES, {"a": torch.randn(1, 4),
                                                              "b": torch.randn(1, 6)}, 8)

    class Short:
        def rows(self, step, ranges, global_batch):
            return {"a": torch.zeros(3, 4)}

    model = UserModel(graph, modules(), Short())
    with pytest.raises(UserModelError, match=r"\['a'\]\[0\] has shape \(3, 4\).*4 rows, samples "
                                             r"\[4, 8\) of the global batch \(8\)"):
        model.make_rows("custom", {"a": (4, 8)}, step=0, seed=0, global_batch=8)


def test_own_model_doc_dataloader_snippet_runs():
    """docs/own-model.md's DataLoader example, as printed there."""
    text = (ROOT / "docs" / "own-model.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "DataLoader(" in b)
    scope: dict = {}
    exec(compile(snippet, "docs/own-model.md", "exec"), scope)
    losses = [s["loss"] for s in scope["result"].steps]
    assert len(losses) == 8 and losses[-1] < losses[0]


# --- the digits --------------------------------------------------------------------------------
def test_tokenize_frames_known_words_with_the_text_models_begin_and_end_ids():
    ids = digits_data.tokenize("a handwritten seven", vocab_size=128, seq_len=8)
    words = digits_data.WORDS
    assert ids.tolist() == [126, 2 + words.index("a"), 2 + words.index("handwritten"),
                            2 + words.index("seven"), 127, 0, 0, 0]
    assert digits_data.tokenize("a photo of a cat", 128, 8)[5] == digits_data.UNKNOWN
    with pytest.raises(DataError, match="seq_len=4"):
        digits_data.tokenize("a photo of the digit 3", 128, 4)


def test_digits_feed_clip_tiny_and_split_held_out_images():
    model = with_dataset(get_model("clip"), "digits", "tiny", seed=0)
    rows = model.make_rows("tiny", {"vision": (0, 6), "text": (0, 6), "align": (0, 6)},
                           step=0, seed=0, global_batch=6)
    assert rows["vision"][0].shape == (6, 3, 32, 32) and rows["text"][0].shape == (6, 16)
    assert int(rows["text"][0].max()) == 127 and rows["vision"][0].std() > 0.5
    split = digits_data.load_split()
    assert len(split["train_labels"]) + len(split["test_labels"]) == 1797
    assert len(split["test_labels"]) == 359


def test_digits_zero_shot_accuracy_of_untrained_clip_is_a_fraction():
    model = with_dataset(get_model("clip"), "digits", "tiny")
    result = model.evaluate(model.build_modules("tiny"))
    assert 0.0 <= result["zero_shot_accuracy"] <= 1.0 and result["test_images"] == 359


def test_digits_zero_shot_accuracy_after_training_with_bf16_weights(monkeypatch):
    """The evaluation runs the modules under the training's bf16 autocast: with bf16 weights
    (every tiny weight cast here) it failed on fp32 inputs ("mat2 must have the same dtype")."""
    from mosaic.engine import main_weights
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, train

    monkeypatch.setattr(main_weights, "MIN_ELEMENTS", 1)
    graph = get_model("clip").graph("tiny", global_batch=16)
    result = train(TrainConfig(
        model="clip", preset="tiny", plan=api.plan(graph, 1, planner="megatron",
                                                   perf_model="analytic"),
        steps=2, warmup_steps=0, global_batch=16, device="cpu", data="digits", progress=False,
        engine=EngineConfig(bf16_weights=True, bf16_moments=True)))
    assert any(p.dtype == torch.bfloat16 for m in result.modules.values() for p in m.parameters())
    assert 0.0 <= result.summary["eval"]["zero_shot_accuracy"] <= 1.0


def test_digits_refuse_a_model_that_is_not_clip_shaped():
    with pytest.raises(DataError, match="CLIP-shaped"):
        with_dataset(get_model("imagebind"), "digits", "tiny")
    with pytest.raises(DataError, match="use one of synthetic, digits"):
        with_dataset(get_model("clip"), "mnist", "tiny")


def test_on_a_gpu_each_module_draws_its_whole_batch_once_and_keeps_its_rows(monkeypatch):
    """A GPU's cost is launching: one draw of a module's global batch, not one per sample; a
    split still sees the samples the whole batch has."""
    from mosaic.zoo import base

    monkeypatch.setattr(base, "_draws_whole_batch", lambda device: True)  # the CUDA path
    model = get_model("clip")
    config = type(model.preset("tiny").modules["vision"])
    calls = []
    real = config.make_inputs
    monkeypatch.setattr(config, "make_inputs",
                        lambda self, n, gen: calls.append(n) or real(self, n, gen))
    whole = model.make_rows("tiny", None, step=4, seed=1, global_batch=8)
    assert calls == [8]
    part = model.make_rows("tiny", {"vision": (2, 6), "text": (5, 8)}, step=4, seed=1,
                           global_batch=8)
    assert torch.equal(part["vision"][0], whole["vision"][0][2:6])
    assert torch.equal(part["text"][0], whole["text"][0][5:8])
    assert part["vision"][0].untyped_storage().nbytes() == part["vision"][0].nbytes  # no view
    again = model.make_rows("tiny", None, step=4, seed=1, global_batch=8)
    assert torch.equal(again["vision"][0], whole["vision"][0])
    other = model.make_rows("tiny", None, step=5, seed=1, global_batch=8)
    assert not torch.equal(other["vision"][0], whole["vision"][0])
