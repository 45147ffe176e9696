"""CLIP (Radford et al. 2021): the paper's running example, a vision and a text encoder
aligned by a contrastive head. No Table 1 row: `paper` is OpenAI's ViT-B/16 at 224 px."""

from __future__ import annotations

from mosaic.zoo.base import Preset, ZooModel
from mosaic.zoo.configs import (
    TINY_BLOCKS,
    ContrastiveConfig,
    TextConfig,
    TokenOutput,
    VisionConfig,
    vit_blocks,
)

POOLED = TokenOutput(pooled=True)


def _preset(
    name: str, global_batch: int, *, vision: VisionConfig, text: TextConfig, embed_dim: int
) -> Preset:
    return Preset(
        name=name,
        global_batch=global_batch,
        modules={"vision": vision, "text": text, "align": ContrastiveConfig(hidden_dim=embed_dim)},
    )


PAPER = _preset(
    "paper",
    32,
    vision=VisionConfig(**vit_blocks(12, 768), image_size=224, patch_size=16, output=POOLED),
    text=TextConfig(**vit_blocks(12, 512), vocab_size=49408, seq_len=77),
    embed_dim=512,
)
SMALL = _preset(
    "small",
    32,
    vision=VisionConfig(**vit_blocks(8, 512), image_size=224, patch_size=16, output=POOLED),
    text=TextConfig(**vit_blocks(8, 512), vocab_size=49408, seq_len=77),
    embed_dim=512,
)
TINY = _preset(
    "tiny",
    8,
    vision=VisionConfig(**TINY_BLOCKS, image_size=32, patch_size=8, output=POOLED),
    text=TextConfig(**TINY_BLOCKS, vocab_size=128, seq_len=16),
    embed_dim=32,
)

MODEL = ZooModel(
    name="clip",
    description="CLIP: ViT vision + text transformer, contrastive alignment head",
    edges=(("vision", "align"), ("text", "align")),
    presets={p.name: p for p in (PAPER, SMALL, TINY)},
)
