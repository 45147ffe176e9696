"""scikit-learn's handwritten digits as CLIP data: real images, captions and a zero-shot test.

`sklearn.datasets.load_digits` ships inside the scikit-learn wheel (1797 8x8 grey images of
the digits 0-9, 0-16 ink levels; BSD licence), so the CPU demo trains on real data without a
download. A fixed split (`SPLIT_SEED`) keeps 20% of the images out of training for the test.

* vision: each image scaled to the preset's `image_size` (nearest neighbour, so every pixel
  stays a sharp block), normalised by the training images' mean and spread, copied to 3
  channels: [3, S, S] as the zoo's ViT takes it.
* text: one caption per (image, template), e.g. "a handwritten 7" or "the number seven",
  tokenised by `tokenize` with a word-level vocabulary (`WORDS`, ids from 2; 0 pads, 1 is an
  unknown word) framed by the zoo text model's begin and end ids (vocab_size - 2 and
  vocab_size - 1; its pooled embedding is read at the end id): [seq_len] int64.
* zero-shot: the 10 class captions "a photo of the digit N" are embedded by the text tower,
  the held-out images by the vision tower, each through its projection of the contrastive
  head; an image's prediction is the class of the most similar caption (cosine).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mosaic.data import DataError, ShardedDataset

TEMPLATES = ("a photo of the digit {digit}", "a handwritten {digit}", "the number {name}",
             "a scan of a handwritten {name}", "an image of the digit {name}")
"""Training captions vary the wording and write the digit as a numeral or a word."""
CLASS_TEMPLATE = TEMPLATES[0]
"""The zero-shot class captions."""
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PAD, UNKNOWN, FIRST_WORD = 0, 1, 2
WORDS: tuple[str, ...] = tuple(sorted(
    {w for t in TEMPLATES for w in t.split() if "{" not in w} | set(NAMES)
    | {str(d) for d in range(10)}))
"""The whole vocabulary, sorted: word WORDS[k] has id FIRST_WORD + k."""
SPLIT_SEED, TEST_FRACTION = 0, 0.2


def caption(digit: int, template: str = CLASS_TEMPLATE) -> str:
    return template.format(digit=digit, name=NAMES[digit])


def tokenize(text: str, vocab_size: int, seq_len: int) -> Tensor:
    """[seq_len] int64: begin id, one id per word, end id, then padding."""
    words = text.lower().split()
    if len(words) + 2 > seq_len:
        raise DataError(f"caption {text!r} has {len(words)} words but the text model takes "
                        f"seq_len={seq_len} tokens (two are the begin and end ids)")
    ids = [vocab_size - 2, *(FIRST_WORD + WORDS.index(w) if w in WORDS else UNKNOWN
                             for w in words), vocab_size - 1]
    return torch.tensor(ids + [PAD] * (seq_len - len(ids)), dtype=torch.int64)


@functools.cache
def load_split() -> dict[str, Tensor]:
    """The digits as float [N, 8, 8] in [0, 1] and int64 labels, split train / test."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("data='digits' needs scikit-learn (it ships the images): "
                        "pip install 'mosaic-mm[data]', or use data='synthetic'") from None
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test = int(len(labels) * TEST_FRACTION)
    return {"train_images": images[order[test:]], "train_labels": labels[order[test:]],
            "test_images": images[order[:test]], "test_labels": labels[order[:test]]}


class DigitCaptions:
    """Map-style dataset: item i is training image i // len(TEMPLATES) with caption template
    i % len(TEMPLATES), as {"vision": [3, S, S], "text": [seq_len]}."""

    def __init__(self, image_size: int, vocab_size: int, seq_len: int) -> None:
        split = load_split()
        self.images, self.labels = split["train_images"], split["train_labels"]
        self.mean, self.std = self.images.mean().item(), self.images.std().item()
        self.image_size, self.vocab_size, self.seq_len = image_size, vocab_size, seq_len
        self.captions = [[tokenize(caption(d, t), vocab_size, seq_len) for t in TEMPLATES]
                         for d in range(10)]

    def __len__(self) -> int:
        return len(self.labels) * len(TEMPLATES)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        image, template = divmod(i, len(TEMPLATES))
        return {"vision": self.pixels(self.images[image:image + 1])[0],
                "text": self.captions[int(self.labels[image])][template]}

    def pixels(self, images: Tensor) -> Tensor:
        """[B, 8, 8] in [0, 1] -> [B, 3, S, S], normalised as in training."""
        x = F.interpolate(images[:, None], size=(self.image_size,) * 2, mode="nearest")
        return ((x - self.mean) / self.std).expand(-1, 3, -1, -1).contiguous()


class DigitsSource(ShardedDataset):
    """The digits' training captions as a RowSource, and the held-out zero-shot test."""

    def __init__(self, dataset: DigitCaptions, vision: str, text: str, head: str,
                 seed: int = 0) -> None:
        super().__init__(dataset, seed=seed)
        self.vision, self.text, self.head = vision, text, head

    @torch.no_grad()
    def evaluate(self, modules: Mapping[str, nn.Module]) -> dict[str, Any]:
        """Zero-shot accuracy on the held-out images (modules are left in train mode)."""
        split, data = load_split(), self.dataset
        captions = torch.stack([tokenize(caption(d), data.vocab_size, data.seq_len)
                                for d in range(10)])
        vision, text, head = (modules[n] for n in (self.vision, self.text, self.head))
        device = next(head.parameters()).device
        for m in (vision, text, head):
            m.eval()
        try:
            classes = _embed(head, 1, text(captions.to(device)))
            images = [_embed(head, 0, vision(data.pixels(chunk).to(device)))
                      for chunk in split["test_images"].split(256)]
        finally:
            for m in (vision, text, head):
                m.train()
        predicted = (torch.cat(images) @ classes.t()).argmax(dim=1).cpu()
        accuracy = predicted.eq(split["test_labels"]).float().mean().item()
        return {"zero_shot_accuracy": accuracy, "test_images": len(predicted), "chance": 0.1}


def _embed(head: nn.Module, index: int, features: Tensor) -> Tensor:
    """A tower's features through the contrastive head's projection `index`, unit length."""
    return F.normalize(head.projections[index](features.float()), dim=-1)


def source_for(model: Any, preset: str, seed: int = 0) -> DigitsSource:
    """The digits for a zoo model with CLIP's shape (see `check_model`)."""
    vision, text, head = check_model(model, preset)
    dataset = DigitCaptions(vision.image_size, text.vocab_size, text.seq_len)
    return DigitsSource(dataset, "vision", "text", head, seed=seed)


def check_model(model: Any, preset: str) -> tuple[Any, Any, str]:
    """The vision and text configs and the head's name of a CLIP-shaped zoo model: a ViT
    `vision` and a text `text` tower feeding a contrastive head (projections in edge order:
    vision first, then text), with room in the vocabulary for `WORDS`; DataError otherwise."""
    from mosaic.zoo.configs import ContrastiveConfig, TextConfig, VisionConfig

    if not hasattr(model, "preset"):  # a user's own modules bring their own data
        raise DataError(f"data='digits' feeds the zoo's clip; model {model.name!r} is not a zoo "
                        "model: pass your data to mosaic.api.train instead")
    configs = model.preset(preset).modules
    vision, text = configs.get("vision"), configs.get("text")
    heads = [n for n, c in configs.items() if isinstance(c, ContrastiveConfig)]
    if not (isinstance(vision, VisionConfig) and isinstance(text, TextConfig) and heads
            and model.predecessors(heads[0]) == ["vision", "text"]):
        raise DataError(f"data='digits' feeds a CLIP-shaped model (vision and text towers into "
                        f"a contrastive head); model {model.name!r} is not one: train "
                        "clip with --data digits, or this model with --data synthetic")
    needed = FIRST_WORD + len(WORDS) + 2
    if text.vocab_size < needed:
        raise DataError(f"data='digits' needs a text vocabulary of {needed} ids; preset "
                        f"{preset!r} has vocab_size={text.vocab_size}")
    return vision, text, heads[0]
