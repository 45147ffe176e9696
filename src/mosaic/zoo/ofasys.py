"""OFASys (Bai et al. 2022) as the paper uses it: the most heterogeneous model, seven modality
modules (three ViT-B-sized, three small sensor/record encoders, the text embedding) feeding a
36 x 1280 LLM. Table 1's TFLOPs for it are cut off in the source, so `paper` follows the
DESIGN measurements: 8 samples of 512 LLM tokens each.

Per sample: a 224 px image (196 patches -> 49 tokens), 4 s of audio (468 patches -> 117), an
8-frame 224 px clip (784 tubelets -> 98), 256 IMU steps x 6 channels (64 tokens), 196 motion
frames x 263 HumanML3D features (49 tokens), a 32-field record (32 tokens) and 103 text tokens.
"""

from __future__ import annotations

from mosaic.zoo.base import Preset, ZooModel
from mosaic.zoo.configs import (
    TINY_BLOCKS,
    TINY_LLM,
    AudioConfig,
    EmbeddingConfig,
    LLMConfig,
    SignalConfig,
    TableConfig,
    TokenOutput,
    VideoConfig,
    VisionConfig,
    vit_blocks,
)

ENCODERS = ("vision", "audio", "video", "imu", "motion", "structured")
SENSOR_BLOCKS = {"num_layers": 4, "hidden_dim": 256, "num_heads": 4, "mlp_dim": 1024}
TABLE_BLOCKS = {"num_layers": 2, "hidden_dim": 256, "num_heads": 4, "mlp_dim": 1024}


def _preset(
    name: str,
    global_batch: int,
    *,
    blocks: dict,
    sensor: dict,
    table: dict,
    llm: LLMConfig,
    image_size: int,
    patch_size: int,
    audio: dict,
    num_frames: int,
    num_steps: tuple[int, int],
    num_fields: int,
    note: str = "",
) -> Preset:
    """Vision, audio and video share `blocks`; IMU and motion `sensor` (and `num_steps`)."""
    modules = {
        "vision": VisionConfig(
            **blocks, image_size=image_size, patch_size=patch_size, output=TokenOutput(merge=4)
        ),
        "audio": AudioConfig(**blocks, **audio, output=TokenOutput(merge=4)),
        "video": VideoConfig(
            **blocks,
            num_frames=num_frames,
            image_size=image_size,
            patch_size=patch_size,
            output=TokenOutput(merge=8),
        ),
        "imu": SignalConfig(**sensor, num_steps=num_steps[0], num_channels=6, stride=4),
        "motion": SignalConfig(**sensor, num_steps=num_steps[1], num_channels=263, stride=4),
        "structured": TableConfig(**table, num_fields=num_fields),
        "text": EmbeddingConfig(
            hidden_dim=llm.hidden_dim, vocab_size=llm.vocab_size, seq_len=llm.text_len
        ),
        "llm": llm,
    }
    return Preset(name=name, global_batch=global_batch, modules=modules, note=note)


PAPER = _preset(
    "paper",
    8,
    blocks=vit_blocks(12, 768),
    sensor=SENSOR_BLOCKS,
    table=TABLE_BLOCKS,
    llm=LLMConfig(
        num_layers=36,
        hidden_dim=1280,
        num_heads=20,
        num_kv_heads=20,
        mlp_dim=3456,
        vocab_size=50272,
        text_len=103,
    ),
    image_size=224,
    patch_size=16,
    audio={"num_mel_bins": 128, "num_frames": 400},
    num_frames=8,
    num_steps=(256, 196),
    num_fields=32,
    note="LLM 36 x 1280 at 512 tokens, encoders 12 x 768 and 4 x 256 / 2 x 256 (DESIGN.md)",
)
SMALL = _preset(
    "small",
    8,
    blocks=vit_blocks(6, 512),
    sensor=SENSOR_BLOCKS,
    table=TABLE_BLOCKS,
    llm=LLMConfig(
        num_layers=12,
        hidden_dim=1024,
        num_heads=16,
        num_kv_heads=16,
        mlp_dim=2816,
        vocab_size=32000,
        text_len=103,
    ),
    image_size=224,
    patch_size=16,
    audio={"num_mel_bins": 128, "num_frames": 400},
    num_frames=8,
    num_steps=(256, 196),
    num_fields=32,
)
TINY = _preset(
    "tiny",
    8,
    blocks=TINY_BLOCKS,
    sensor=TINY_BLOCKS,
    table=TINY_BLOCKS,
    llm=LLMConfig(**TINY_LLM),
    image_size=32,
    patch_size=8,
    audio={"num_mel_bins": 32, "num_frames": 64, "stride": 16},
    num_frames=4,
    num_steps=(32, 32),
    num_fields=8,
)

MODEL = ZooModel(
    name="ofasys",
    description="OFASys: vision, audio, video, IMU, motion, structured and text modules feeding an LLM",
    edges=tuple((name, "llm") for name in (*ENCODERS, "text")),
    presets={p.name: p for p in (PAPER, SMALL, TINY)},
)
