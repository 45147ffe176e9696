"""ImageBind (Girdhar et al. 2023) as in Table 1 of the paper: vision, audio and text encoders
bound to the vision embedding by contrastive heads (InfoNCE vision-text and vision-audio).

`paper` sizes follow Table 1 (vision 24 x 1024, audio and text 12 x 768). Inputs are chosen so
that 8 samples land on the table's TFLOPs per iteration: 224 px images (ViT-L/14), 4 s audio
clips (400 frames x 128 mel bins, 16 x 16 patches at stride 10, as ImageBind), 256 text tokens.
"""

from __future__ import annotations

from mosaic.zoo.base import Preset, ZooModel
from mosaic.zoo.configs import (
    TINY_BLOCKS,
    AudioConfig,
    ContrastiveConfig,
    TextConfig,
    TokenOutput,
    VisionConfig,
    vit_blocks,
)

POOLED = TokenOutput(pooled=True)


def _preset(
    name: str,
    global_batch: int,
    *,
    vision: VisionConfig,
    audio: AudioConfig,
    text: TextConfig,
    embed_dim: int,
    note: str = "",
) -> Preset:
    modules = {
        "vision": vision,
        "audio": audio,
        "text": text,
        "align": ContrastiveConfig(hidden_dim=embed_dim),
    }
    return Preset(name=name, global_batch=global_batch, modules=modules, note=note)


PAPER = _preset(
    "paper",
    8,
    vision=VisionConfig(**vit_blocks(24, 1024), image_size=224, patch_size=14, output=POOLED),
    audio=AudioConfig(
        **vit_blocks(12, 768),
        num_mel_bins=128,
        num_frames=400,
        stride=10,
        output=POOLED,
    ),
    text=TextConfig(**vit_blocks(12, 768), vocab_size=49408, seq_len=256),
    embed_dim=1024,
    note="Table 1 sizes; global batch 8 matches the table's TFLOPs per iteration",
)
SMALL = _preset(
    "small",
    32,
    vision=VisionConfig(**vit_blocks(12, 768), image_size=224, patch_size=16, output=POOLED),
    audio=AudioConfig(
        **vit_blocks(8, 512),
        num_mel_bins=128,
        num_frames=400,
        stride=10,
        output=POOLED,
    ),
    text=TextConfig(**vit_blocks(8, 512), vocab_size=49408, seq_len=77),
    embed_dim=512,
)
TINY = _preset(
    "tiny",
    8,
    vision=VisionConfig(**TINY_BLOCKS, image_size=32, patch_size=8, output=POOLED),
    audio=AudioConfig(**TINY_BLOCKS, num_mel_bins=32, num_frames=48, stride=16, output=POOLED),
    text=TextConfig(**TINY_BLOCKS, vocab_size=128, seq_len=16),
    embed_dim=32,
)

MODEL = ZooModel(
    name="imagebind",
    description="ImageBind: vision, audio and text encoders bound to vision by InfoNCE",
    edges=(("vision", "align"), ("audio", "align"), ("text", "align")),
    presets={p.name: p for p in (PAPER, SMALL, TINY)},
    paper_tflops={"vision": 4.17, "audio": 2.09, "text": 1.04},
)
