"""Qwen3-VL (8B) as in Table 1 of the paper: a ViT with a patch merger feeding an LLM, the
LLM's token embedding a module of its own.

`paper`: LLM 36 x 4096 (GQA 32/8 heads, SwiGLU 12288, vocabulary 151936, Qwen2 decoder
layers). Vision: 27 layers as in the table, but 1152 wide, the real Qwen3-VL-8B vision tower
(SigLIP2-so400m); the table's 4096 is the merger's output width (the LLM's). A 27 x 4096
tower alone would hold 5.4B parameters, far from the model's 8.1B, and could not match the
table's 2.58 TFLOPs with a sensible image. 2 samples per iteration of a 352 px image
(22 x 22 patches of 16 px, merged 2 x 2 into 121 tokens) and 135 text tokens: 256 LLM tokens.
"""

from __future__ import annotations

from mosaic.zoo.base import Preset, ZooModel
from mosaic.zoo.configs import (
    TINY_BLOCKS,
    EmbeddingConfig,
    LLMConfig,
    TokenOutput,
    VisionConfig,
    vit_blocks,
)


def _preset(
    name: str, global_batch: int, *, vision: VisionConfig, llm: LLMConfig, note: str = ""
) -> Preset:
    text = EmbeddingConfig(
        hidden_dim=llm.hidden_dim, vocab_size=llm.vocab_size, seq_len=llm.text_len
    )
    return Preset(
        name=name,
        global_batch=global_batch,
        modules={"vision": vision, "text": text, "llm": llm},
        note=note,
    )


PAPER = _preset(
    "paper",
    2,
    vision=VisionConfig(
        num_layers=27,
        hidden_dim=1152,
        num_heads=16,
        mlp_dim=4304,
        image_size=352,
        patch_size=16,
        output=TokenOutput(merge=4, out_dim=4096),
    ),
    llm=LLMConfig(
        num_layers=36,
        hidden_dim=4096,
        num_heads=32,
        num_kv_heads=8,
        mlp_dim=12288,
        vocab_size=151936,
        text_len=135,
        family="qwen2",
    ),
    note="Table 1 layers and LLM width; vision 1152 wide (see module docstring)",
)
SMALL = _preset(
    "small",
    8,
    vision=VisionConfig(
        **vit_blocks(12, 768),
        image_size=224,
        patch_size=16,
        output=TokenOutput(merge=4, out_dim=2048),
    ),
    llm=LLMConfig(
        num_layers=8,
        hidden_dim=2048,
        num_heads=16,
        num_kv_heads=4,
        mlp_dim=6144,
        vocab_size=32000,
        text_len=207,
        family="qwen2",
    ),
)
TINY = _preset(
    "tiny",
    8,
    vision=VisionConfig(
        **TINY_BLOCKS,
        image_size=32,
        patch_size=8,
        output=TokenOutput(merge=4, out_dim=64),
    ),
    llm=LLMConfig(
        num_layers=2,
        hidden_dim=64,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=128,
        vocab_size=128,
        text_len=12,
        family="qwen2",
    ),
)

MODEL = ZooModel(
    name="qwen3-vl",
    description="Qwen3-VL: ViT + patch merger and text embedding feeding a 36-layer LLM",
    edges=(("vision", "llm"), ("text", "llm")),
    presets={p.name: p for p in (PAPER, SMALL, TINY)},
    paper_tflops={"llm": 22.27, "vision": 2.58, "text": 0.15},
)
