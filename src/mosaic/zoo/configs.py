"""Typed size configs of the zoo's modules: each builds its nn.Module and its synthetic data.

A config is plain frozen data (the knobs a preset turns); `build` makes a randomly initialised
module from transformers configs (never downloading anything) and `make_inputs` draws the
module's own data inputs for a batch. Shapes are per sample, without the batch axis.

Configs are read without torch (the shipped cost table is keyed by their reprs, and planning
never builds a module), so torch, transformers and the nn.Modules of `common` are imported
inside `build` and `make_inputs`, the only places that use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mosaic.graph import GraphError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from mosaic.zoo.common import TokenMerger, ZooModule

Shape = tuple[int, ...]

TINY_BLOCKS = {"num_layers": 2, "hidden_dim": 32, "num_heads": 2, "mlp_dim": 64}
"""Transformer blocks of the `tiny` presets (CPU tests)."""
TINY_LLM = {"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "num_kv_heads": 4, "mlp_dim": 128,
            "vocab_size": 128, "text_len": 12}
"""The `tiny` presets' LLM."""


def vit_blocks(num_layers: int, hidden_dim: int) -> dict[str, int]:
    """A ViT / BERT tower's block sizes: heads 64 wide, an MLP 4x the width (ViT-B: 12 x 768,
    ViT-L: 24 x 1024)."""
    return {"num_layers": num_layers, "hidden_dim": hidden_dim, "num_heads": hidden_dim // 64,
            "mlp_dim": 4 * hidden_dim}

def _hf_common() -> dict[str, Any]:
    """Every transformers module runs on fused SDPA (flash / memory-efficient kernels on a GPU)
    without mask tensors (common.unpadded_sdpa), and no module has dropout, so a training step
    is a deterministic function of its inputs."""
    from mosaic.zoo.common import unpadded_sdpa

    return {"attn_implementation": unpadded_sdpa()}


def token_ids(vocab_size: int, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """Uniform random token ids, on the generator's device (synthetic data)."""
    import torch

    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator,
                         device=generator.device)


def _randn(batch_size: int, shape: Shape, generator: torch.Generator) -> Tensor:
    """Standard normal samples [batch, *shape], on the generator's device (synthetic data)."""
    import torch

    return torch.randn(batch_size, *shape, generator=generator, device=generator.device)

@dataclass(frozen=True, kw_only=True)
class ModuleConfig:
    """Size knobs of one module; subclasses say how to build and feed it."""

    kind: ClassVar[str] = "encoder"
    num_layers: int = 1
    """Transformer blocks (1 for embeddings and heads)."""
    hidden_dim: int
    """Width of the residual stream."""

    @property
    def input_shape(self) -> Shape:
        """Per-sample shape of the module's own data input; () when it has none."""
        return ()

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        """The module's own data inputs for `batch_size` samples, on the generator's device."""
        return ()

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        """Per-sample output shape given the predecessors' per-sample output shapes."""
        raise NotImplementedError

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        """Sequence length the module processes per sample."""
        raise NotImplementedError

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        """A randomly initialised module (on the current default device)."""
        raise NotImplementedError

    @property
    def max_tensor_parallel(self) -> int:
        """Largest TP degree the built module has a plan for (1: none; see ModuleSpec)."""
        return 1

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            raise GraphError(f"{type(self).__name__}: {message}")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig(ModuleConfig):
    num_heads: int
    mlp_dim: int

    def __post_init__(self) -> None:
        self._check(
            self.hidden_dim % self.num_heads == 0,
            f"hidden_dim={self.hidden_dim} must be a multiple of num_heads={self.num_heads}",
        )

    def hf_sizes(self) -> dict[str, int]:
        """The block sizes as transformers' configs name them."""
        return {"hidden_size": self.hidden_dim, "intermediate_size": self.mlp_dim,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads}


@dataclass(frozen=True, kw_only=True)
class TokenOutput:
    """How an encoder hands its tokens on: pooled, all patch tokens, or merged groups."""

    pooled: bool = False
    """Return one embedding per sample [B, D] (contrastive heads)."""
    merge: int = 1
    """Tokens per merged output token (vision: an m x m window, m*m = merge; others: a run)."""
    out_dim: int = 0
    """Width of merged tokens (0: the encoder's width)."""


def _merged_shape(cfg: TransformerConfig, out: TokenOutput, num_patches: int) -> Shape:
    if out.pooled:
        return (cfg.hidden_dim,)
    if out.merge == 1:
        return (num_patches, cfg.hidden_dim)
    return (num_patches // out.merge, out.out_dim or cfg.hidden_dim)


def _merger(cfg: TransformerConfig, out: TokenOutput, grid_size: int = 0) -> TokenMerger | None:
    if out.pooled or out.merge == 1:
        return None
    from mosaic.zoo.common import TokenMerger

    return TokenMerger(cfg.hidden_dim, out.merge, out.out_dim or cfg.hidden_dim, grid_size)


@dataclass(frozen=True, kw_only=True)
class VisionConfig(TransformerConfig):
    """A ViT (transformers CLIPVisionModel) over square images [3, H, W]."""

    image_size: int
    patch_size: int
    output: TokenOutput = TokenOutput()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(
            self.image_size % self.patch_size == 0, "image_size must be a multiple of patch_size"
        )
        window = round(self.output.merge**0.5)
        self._check(
            window * window == self.output.merge and self.grid_size % window == 0,
            f"merge={self.output.merge} must be m*m with m dividing the {self.grid_size}-patch grid",
        )

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def input_shape(self) -> Shape:
        return (3, self.image_size, self.image_size)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (_randn(batch_size, self.input_shape, generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return _merged_shape(self, self.output, self.grid_size**2)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.grid_size**2 + 1  # + CLS

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        import torch
        import transformers

        from mosaic.zoo.common import HFEncoder

        hf = transformers.CLIPVisionConfig(
            **self.hf_sizes(),
            image_size=self.image_size,
            patch_size=self.patch_size,
            attention_dropout=0.0,
            **_hf_common(),
        )
        backbone = transformers.CLIPVisionModel(hf)
        if not self.output.pooled:
            # CLIP normalises only the pooled CLS token; unused, its weights would get no
            # gradient, which data-parallel all-reduce trips over. The merger normalises.
            # (transformers 4.5x nests the tower in `vision_model`, 5.x does not.)
            getattr(backbone, "vision_model", backbone).post_layernorm = torch.nn.Identity()
        return HFEncoder(
            backbone,
            pooled=self.output.pooled,
            num_special_tokens=1,
            merger=_merger(self, self.output, self.grid_size),
        )


@dataclass(frozen=True, kw_only=True)
class AudioConfig(TransformerConfig):
    """An Audio Spectrogram Transformer (transformers ASTModel) over [frames, mel bins]."""

    num_mel_bins: int
    num_frames: int
    patch_size: int = 16
    stride: int = 10
    """Patch stride on both axes (AST and ImageBind overlap patches with stride 10)."""
    output: TokenOutput = TokenOutput()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(
            self.num_patches % self.output.merge == 0,
            f"merge={self.output.merge} must divide the {self.num_patches} patches",
        )

    @property
    def num_patches(self) -> int:
        freq = (self.num_mel_bins - self.patch_size) // self.stride + 1
        time = (self.num_frames - self.patch_size) // self.stride + 1
        return freq * time

    @property
    def input_shape(self) -> Shape:
        return (self.num_frames, self.num_mel_bins)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (_randn(batch_size, self.input_shape, generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return _merged_shape(self, self.output, self.num_patches)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.num_patches + 2  # + CLS and distillation tokens

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        import transformers

        from mosaic.zoo.common import HFEncoder

        hf = transformers.ASTConfig(
            **self.hf_sizes(),
            patch_size=self.patch_size,
            frequency_stride=self.stride,
            time_stride=self.stride,
            max_length=self.num_frames,
            num_mel_bins=self.num_mel_bins,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **_hf_common(),
        )
        return HFEncoder(
            transformers.ASTModel(hf),
            pooled=self.output.pooled,
            num_special_tokens=2,
            merger=_merger(self, self.output),
        )


@dataclass(frozen=True, kw_only=True)
class VideoConfig(TransformerConfig):
    """A video ViT with tubelet patches (transformers VideoMAEModel) over [frames, 3, H, W]."""

    num_frames: int
    image_size: int
    patch_size: int = 16
    tubelet_size: int = 2
    output: TokenOutput = TokenOutput()

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(not self.output.pooled, "VideoMAE has no pooled output: set merge instead")
        self._check(
            self.num_patches % self.output.merge == 0,
            f"merge={self.output.merge} must divide the {self.num_patches} patches",
        )

    @property
    def num_patches(self) -> int:
        spatial = (self.image_size // self.patch_size) ** 2
        return spatial * (self.num_frames // self.tubelet_size)

    @property
    def input_shape(self) -> Shape:
        return (self.num_frames, 3, self.image_size, self.image_size)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (_randn(batch_size, self.input_shape, generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return _merged_shape(self, self.output, self.num_patches)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.num_patches

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        import transformers

        from mosaic.zoo.common import HFEncoder

        hf = transformers.VideoMAEConfig(
            **self.hf_sizes(),
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_frames=self.num_frames,
            tubelet_size=self.tubelet_size,
            use_mean_pooling=False,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **_hf_common(),
        )
        backbone = transformers.VideoMAEModel(hf)
        _as_buffer(backbone.embeddings, "position_embeddings")
        return HFEncoder(backbone, merger=_merger(self, self.output))


def _as_buffer(module: torch.nn.Module, name: str) -> None:
    """Re-register a plain tensor attribute as a buffer so that `.to(device)` moves it.

    VideoMAE keeps its sinusoidal table as a plain CPU tensor and copies it to the device
    in every forward; a host-to-device copy there would also break CUDA graph capture.
    """
    value = getattr(module, name)
    delattr(module, name)
    module.register_buffer(name, value, persistent=False)


@dataclass(frozen=True, kw_only=True)
class TextConfig(TransformerConfig):
    """A causal text transformer (transformers CLIPTextModel) returning the EOS embedding."""

    vocab_size: int
    seq_len: int

    @property
    def input_shape(self) -> Shape:
        return (self.seq_len,)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        # The pooled embedding is read at the EOS token: put it last, as a tokenizer would.
        import torch

        eos = self.vocab_size - 1
        body = torch.randint(
            0, eos - 1, (batch_size, self.seq_len - 1), generator=generator, device=generator.device
        )
        return (torch.cat([body, torch.full_like(body[:, :1], eos)], dim=1),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return (self.hidden_dim,)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.seq_len

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        import transformers

        from mosaic.zoo.common import HFEncoder

        hf = transformers.CLIPTextConfig(
            vocab_size=self.vocab_size,
            **self.hf_sizes(),
            max_position_embeddings=self.seq_len,
            attention_dropout=0.0,
            pad_token_id=0,
            bos_token_id=self.vocab_size - 2,
            eos_token_id=self.vocab_size - 1,
            **_hf_common(),
        )
        return HFEncoder(transformers.CLIPTextModel(hf), pooled=True)


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig(ModuleConfig):
    """The LLM's token embedding as its own module (the paper's `text` module)."""

    kind: ClassVar[str] = "embedding"
    vocab_size: int
    seq_len: int

    @property
    def input_shape(self) -> Shape:
        return (self.seq_len,)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (token_ids(self.vocab_size, batch_size, self.seq_len, generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return (self.seq_len, self.hidden_dim)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.seq_len

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        from mosaic.zoo.common import TokenEmbedding

        return TokenEmbedding(self.vocab_size, self.hidden_dim)


@dataclass(frozen=True, kw_only=True)
class SignalConfig(TransformerConfig):
    """A sensor time series [steps, channels] (IMU, motion capture): Conv1d stem + blocks."""

    num_steps: int
    num_channels: int
    stride: int
    """Conv1d kernel and stride: time steps per token."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(self.num_steps % self.stride == 0, "num_steps must be a multiple of stride")

    @property
    def input_shape(self) -> Shape:
        return (self.num_steps, self.num_channels)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (_randn(batch_size, self.input_shape, generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return (self.num_steps // self.stride, self.hidden_dim)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.num_steps // self.stride

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        from mosaic.zoo.common import SignalEncoder

        return SignalEncoder(
            num_channels=self.num_channels,
            num_steps=self.num_steps,
            stride=self.stride,
            dim=self.hidden_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
        )


@dataclass(frozen=True, kw_only=True)
class TableConfig(TransformerConfig):
    """Structured records of `num_fields` numeric fields, one token per field."""

    num_fields: int

    @property
    def input_shape(self) -> Shape:
        return (self.num_fields,)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (_randn(batch_size, (self.num_fields,), generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return (self.num_fields, self.hidden_dim)

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return self.num_fields

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        from mosaic.zoo.common import TableEncoder

        return TableEncoder(
            num_fields=self.num_fields,
            dim=self.hidden_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            mlp_dim=self.mlp_dim,
        )


@dataclass(frozen=True, kw_only=True)
class ContrastiveConfig(ModuleConfig):
    """Alignment head: projections to a shared `hidden_dim` space and a learnable temperature."""

    kind: ClassVar[str] = "head"

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return ()

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return 1

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        self._check(len(in_shapes) >= 2, "needs at least two pooled inputs to contrast")
        self._check(
            all(len(s) == 1 for s in in_shapes), f"inputs must be pooled [B, D], got {in_shapes}"
        )
        from mosaic.zoo.common import ContrastiveHead

        return ContrastiveHead([s[0] for s in in_shapes], self.hidden_dim)


# family -> (config class, model class, extra config), by name in transformers (resolved in
# `build`, so reading a config needs no transformers): Qwen2's sliding window is off by
# default but transformers 4.5x still warns unless the window itself is None.
_LLM_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaModel", {}),
    "qwen2": (
        "Qwen2Config",
        "Qwen2Model",
        {"use_sliding_window": False, "sliding_window": None},
    ),
}


@dataclass(frozen=True, kw_only=True)
class LLMConfig(TransformerConfig):
    """Decoder-only LLM sink (transformers LlamaModel / Qwen2Model) with an LM-loss head.

    Its own data input is the labels of the text tokens [text_len]; its sequence is all its
    inputs' tokens concatenated (encoder tokens first, text embedding last).
    """

    kind: ClassVar[str] = "llm"
    num_kv_heads: int
    vocab_size: int
    text_len: int
    family: str = "llama"

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check(
            self.family in _LLM_FAMILIES,
            f"family={self.family!r}: use one of {sorted(_LLM_FAMILIES)}",
        )
        self._check(
            self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
        )

    @property
    def input_shape(self) -> Shape:
        return (self.text_len,)

    @property
    def max_tensor_parallel(self) -> int:
        # Attention heads, KV heads and MLP columns split evenly (mosaic.engine.tensor_parallel).
        return math.gcd(self.num_heads, self.num_kv_heads, self.mlp_dim)

    def make_inputs(self, batch_size: int, generator: torch.Generator) -> tuple[Tensor, ...]:
        return (token_ids(self.vocab_size, batch_size, self.text_len, generator),)

    def out_shape(self, in_shapes: Sequence[Shape]) -> Shape:
        return ()

    def tokens_per_sample(self, in_shapes: Sequence[Shape]) -> int:
        return sum(s[0] for s in in_shapes)

    def build(self, in_shapes: Sequence[Shape]) -> ZooModule:
        self._check(
            all(len(s) == 2 for s in in_shapes),
            f"inputs must be token sequences [B, N, D], got {in_shapes}",
        )
        self._check(
            in_shapes[-1][0] == self.text_len,
            f"the last input (text) must have text_len={self.text_len} tokens, got {in_shapes[-1]}",
        )
        import transformers

        from mosaic.zoo.common import CausalLM

        config_name, model_name, extra = _LLM_FAMILIES[self.family]
        config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
        hf = config_cls(
            # vocab_size=1: the text module owns the real embedding table (see CausalLM).
            vocab_size=1,
            **self.hf_sizes(),
            num_key_value_heads=self.num_kv_heads,
            attention_dropout=0.0,
            max_position_embeddings=max(4096, self.tokens_per_sample(in_shapes)),
            tie_word_embeddings=False,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            **extra,
            **_hf_common(),
        )
        return CausalLM(model_cls(hf), [s[1] for s in in_shapes], self.hidden_dim, self.vocab_size)
