"""CLIP (Radford et al. 2021): the paper's running example, a vision and a text encoder
aligned by a contrastive head. No Table 1 row: `paper` is OpenAI's ViT-B/16 at 224 px."""

from __future__ import annotations

from mosaic.zoo.base import Preset, ZooModel
from mosaic.zoo.configs import ContrastiveConfig, TextConfig, TokenOutput, VisionConfig

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
    vision=VisionConfig(
        num_layers=12,
        hidden_dim=768,
        num_heads=12,
        mlp_dim=3072,
        image_size=224,
        patch_size=16,
        output=POOLED,
    ),
    text=TextConfig(
        num_layers=12, hidden_dim=512, num_heads=8, mlp_dim=2048, vocab_size=49408, seq_len=77
    ),
    embed_dim=512,
)
SMALL = _preset(
    "small",
    32,
    vision=VisionConfig(
        num_layers=8,
        hidden_dim=512,
        num_heads=8,
        mlp_dim=2048,
        image_size=224,
        patch_size=16,
        output=POOLED,
    ),
    text=TextConfig(
        num_layers=8, hidden_dim=512, num_heads=8, mlp_dim=2048, vocab_size=49408, seq_len=77
    ),
    embed_dim=512,
)
TINY = _preset(
    "tiny",
    8,
    vision=VisionConfig(
        num_layers=2,
        hidden_dim=32,
        num_heads=2,
        mlp_dim=64,
        image_size=32,
        patch_size=8,
        output=POOLED,
    ),
    text=TextConfig(
        num_layers=2, hidden_dim=32, num_heads=2, mlp_dim=64, vocab_size=128, seq_len=16
    ),
    embed_dim=32,
)

MODEL = ZooModel(
    name="clip",
    description="CLIP: ViT vision + text transformer, contrastive alignment head",
    edges=(("vision", "align"), ("text", "align")),
    presets={p.name: p for p in (PAPER, SMALL, TINY)},
)
