"""Unified-IO 2 (Lu et al. 2024) as in Table 1 of the paper: CLIP-style vision and AST audio
encoders (11 layers: UIO2 reads the penultimate layer of its 12-layer towers) resampled into a
48 x 3072 LLM, whose token embedding is a module of its own.

The real model is an encoder-decoder; here its 48 layers are one decoder-only stack (Llama
layers, SwiGLU 3584, T5's 32128-token vocabulary), which keeps the paper's 3.8B parameters.
`paper`: 4 samples per iteration of a 384 px image (576 patches, 4 x 4 windows merged into 36
tokens, standing in for UIO2's perceiver resampler), 9.6 s of audio (960 frames x 128 mel
bins, 480 patches merged 16 to 1 into 30 tokens) and 128 text tokens: 194 LLM tokens.
"""

from __future__ import annotations

from mosaic.zoo.base import Preset, ZooModel
from mosaic.zoo.configs import (
    TINY_BLOCKS,
    TINY_LLM,
    AudioConfig,
    EmbeddingConfig,
    LLMConfig,
    TokenOutput,
    VisionConfig,
    vit_blocks,
)


def _preset(
    name: str,
    global_batch: int,
    *,
    vision: VisionConfig,
    audio: AudioConfig,
    llm: LLMConfig,
    note: str = "",
) -> Preset:
    text = EmbeddingConfig(
        hidden_dim=llm.hidden_dim, vocab_size=llm.vocab_size, seq_len=llm.text_len
    )
    return Preset(
        name=name,
        global_batch=global_batch,
        modules={"vision": vision, "audio": audio, "text": text, "llm": llm},
        note=note,
    )


PAPER = _preset(
    "paper",
    4,
    vision=VisionConfig(
        **vit_blocks(11, 768),
        image_size=384,
        patch_size=16,
        output=TokenOutput(merge=16),
    ),
    audio=AudioConfig(
        **vit_blocks(11, 768),
        num_mel_bins=128,
        num_frames=960,
        stride=16,
        output=TokenOutput(merge=16),
    ),
    llm=LLMConfig(
        num_layers=48,
        hidden_dim=3072,
        num_heads=24,
        num_kv_heads=24,
        mlp_dim=3584,
        vocab_size=32128,
        text_len=128,
    ),
    note="Table 1 sizes; global batch 4 matches the table's TFLOPs per iteration",
)
SMALL = _preset(
    "small",
    8,
    vision=VisionConfig(
        **vit_blocks(8, 512),
        image_size=224,
        patch_size=16,
        output=TokenOutput(merge=4),
    ),
    audio=AudioConfig(
        **vit_blocks(8, 512),
        num_mel_bins=128,
        num_frames=512,
        stride=16,
        output=TokenOutput(merge=4),
    ),
    llm=LLMConfig(
        num_layers=12,
        hidden_dim=1536,
        num_heads=12,
        num_kv_heads=12,
        mlp_dim=4096,
        vocab_size=32128,
        text_len=143,
    ),
)
TINY = _preset(
    "tiny",
    8,
    vision=VisionConfig(**TINY_BLOCKS, image_size=32, patch_size=8, output=TokenOutput(merge=4)),
    audio=AudioConfig(
        **TINY_BLOCKS, num_mel_bins=32, num_frames=48, stride=16, output=TokenOutput(merge=2)
    ),
    llm=LLMConfig(**TINY_LLM),
)

MODEL = ZooModel(
    name="unified-io-2",
    description="Unified-IO 2: vision and audio encoders and text embedding feeding a 48-layer LLM",
    edges=(("vision", "llm"), ("audio", "llm"), ("text", "llm")),
    presets={p.name: p for p in (PAPER, SMALL, TINY)},
    paper_tflops={"llm": 16.70, "vision": 1.48, "audio": 1.06, "text": 0.10},
)
