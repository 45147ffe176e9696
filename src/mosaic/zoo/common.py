"""The nn.Modules the zoo models are made of: encoder towers, embeddings, heads, LLM sinks.

Every class follows the engine's calling convention (see `mosaic.zoo.base`): `forward` takes
the module's own data inputs first, then its predecessors' outputs in edge order; encoders
return one tensor with the batch on axis 0, sinks return a scalar loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ZooModule(nn.Module):
    """Base of every zoo module; tells the engine what the module needs from data parallelism."""

    needs_global_batch: ClassVar[bool] = False
    """True for losses over the whole batch (contrastive): the engine all-gathers their inputs."""


class TokenMerger(nn.Module):
    """Qwen-VL's patch merger: `group` neighbouring tokens are concatenated, then an MLP.

    With `grid_size` set, tokens are a square raster and a group is an m x m window
    (m*m = group); otherwise a group is `group` consecutive tokens.
    """

    def __init__(self, in_dim: int, group: int, out_dim: int, grid_size: int = 0) -> None:
        super().__init__()
        self.group = group
        self.grid_size = grid_size
        self.norm = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(group * in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x_BND: Tensor) -> Tensor:
        x_BND = self.norm(x_BND)
        if self.grid_size:
            x_BND = _windows_first(x_BND, self.grid_size, math.isqrt(self.group))
        batch, num_tokens, dim = x_BND.shape
        x_BGK = x_BND.reshape(batch, num_tokens // self.group, self.group * dim)
        return self.fc2(F.gelu(self.fc1(x_BGK)))


def _windows_first(x_BND: Tensor, grid_size: int, window: int) -> Tensor:
    """Reorder a raster of grid x grid tokens so each window x window block is contiguous."""
    batch, _, dim = x_BND.shape
    cells = grid_size // window
    x = x_BND.view(batch, cells, window, cells, window, dim).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, -1, dim)


class Block(nn.Module):
    """Pre-LN transformer block on fused SDPA, for the small modality encoders."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, dim)

    def forward(self, x_BTD: Tensor) -> Tensor:
        batch, num_tokens, dim = x_BTD.shape
        qkv = self.qkv(self.norm1(x_BTD)).view(batch, num_tokens, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn_BHTd = F.scaled_dot_product_attention(q, k, v)
        x_BTD = x_BTD + self.proj(attn_BHTd.transpose(1, 2).reshape(batch, num_tokens, dim))
        return x_BTD + self.fc2(F.gelu(self.fc1(self.norm2(x_BTD))))


class HFEncoder(ZooModule):
    """A transformers encoder (CLIP vision/text, AST, VideoMAE) as one zoo module.

    Returns the pooled embedding [B, D] (`pooled`), or the sequence without its special
    tokens [B, N, D], optionally shortened by a TokenMerger to [B, N / group, out_dim].
    """

    def __init__(
        self,
        backbone: nn.Module,
        *,
        pooled: bool = False,
        num_special_tokens: int = 0,
        merger: TokenMerger | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.pooled = pooled
        self.num_special_tokens = num_special_tokens
        self.merger = merger

    def forward(self, x: Tensor) -> Tensor:
        out = self.backbone(x)
        if self.pooled:
            return out.pooler_output
        tokens_BND = out.last_hidden_state[:, self.num_special_tokens :]
        return tokens_BND if self.merger is None else self.merger(tokens_BND)


UNPADDED_SDPA = "mosaic_unpadded_sdpa"
"""Attention implementation of every zoo transformers module (see `unpadded_sdpa`)."""


def unpadded_sdpa() -> str:
    """SDPA with no mask tensor, ever: the zoo feeds whole, unpadded, unpacked sequences, so
    every attention is full or plainly causal, which SDPA's `is_causal` flag (set per attention
    layer by transformers) expresses on its own.

    transformers leaves the mask out only when it is not "tracing", and tracing includes
    torch.compile and CUDA-graph capture (its packed-sequence check cannot run traced either).
    So (1) every compiled module ran SDPA with an explicit mask: no flash kernel, and a causal
    mask computed in full; (2) a layer compiled alone (compile scope `blocks`) met no mask in
    the warm-up and a mask in the capture, so Dynamo recompiled inside the capture, which CUDA
    refuses. tests/test_zoo.py checks every zoo transformers module against explicit masks.
    Where transformers has no mask interfaces (before 4.53), plain "sdpa"."""
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return "sdpa"
    AttentionInterface.register(UNPADDED_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(UNPADDED_SDPA, partial(_no_mask_unless_padded, sdpa_mask))
    return UNPADDED_SDPA


def _no_mask_unless_padded(sdpa_mask: Callable[..., Any], *args: Any,
                           attention_mask: Tensor | None = None, local_size: int | None = None,
                           **kwargs: Any) -> Tensor | None:
    """None without a padding mask or a local window (the zoo's case); else transformers'."""
    if attention_mask is None and local_size is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, local_size=local_size, **kwargs)


class TokenEmbedding(ZooModule):
    """The LLM's input embedding as its own module: token ids [B, T] -> [B, T, D]."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, ids_BT: Tensor) -> Tensor:
        return self.embed(ids_BT)


class SignalEncoder(ZooModule):
    """Time series (IMU, motion capture) [B, T, C]: a strided Conv1d stem, then transformer blocks."""

    def __init__(
        self,
        *,
        num_channels: int,
        num_steps: int,
        stride: int,
        dim: int,
        num_layers: int,
        num_heads: int,
        mlp_dim: int,
    ) -> None:
        super().__init__()
        self.stem = nn.Conv1d(num_channels, dim, kernel_size=stride, stride=stride)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, num_steps // stride, dim))
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x_BTC: Tensor) -> Tensor:
        x_BND = self.stem(x_BTC.transpose(1, 2)).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x_BND = block(x_BND)
        return self.norm(x_BND)


class TableEncoder(ZooModule):
    """Structured records [B, F] of numeric fields: one token per field, then transformer blocks."""

    def __init__(
        self, *, num_fields: int, dim: int, num_layers: int, num_heads: int, mlp_dim: int
    ) -> None:
        super().__init__()
        # A field's token is value * w_field + b_field: each field gets its own embedding line.
        self.field_weight = nn.Parameter(0.02 * torch.randn(num_fields, dim))
        self.field_bias = nn.Parameter(0.02 * torch.randn(num_fields, dim))
        self.blocks = nn.ModuleList(Block(dim, num_heads, mlp_dim) for _ in range(num_layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x_BF: Tensor) -> Tensor:
        x_BFD = x_BF.unsqueeze(-1) * self.field_weight + self.field_bias
        for block in self.blocks:
            x_BFD = block(x_BFD)
        return self.norm(x_BFD)


class ContrastiveHead(ZooModule):
    """CLIP/ImageBind alignment: project each modality, symmetric InfoNCE against the first.

    The loss is over the batch it is given, so the engine must hand it the global batch.
    """

    needs_global_batch: ClassVar[bool] = True

    def __init__(self, in_dims: list[int], embed_dim: int) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Linear(d, embed_dim, bias=False) for d in in_dims)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, *features_BD: Tensor) -> Tensor:
        z = [F.normalize(p(f), dim=-1) for p, f in zip(self.projections, features_BD, strict=True)]
        # CLIP clamps the temperature at 100 so the logits cannot blow up early in training.
        scale = self.logit_scale.exp().clamp(max=100.0)
        return torch.stack([symmetric_info_nce(z[0], other, scale) for other in z[1:]]).mean()


def symmetric_info_nce(a_BE: Tensor, b_BE: Tensor, scale: Tensor) -> Tensor:
    """Mean of a->b and b->a cross-entropies; pair i is the positive of row i."""
    logits_BB = scale * a_BE @ b_BE.t()
    targets = torch.arange(a_BE.shape[0], device=a_BE.device)
    return (F.cross_entropy(logits_BB, targets) + F.cross_entropy(logits_BB.t(), targets)) / 2


class CausalLM(ZooModule):
    """Decoder-only LLM sink: projects each input to its width, concatenates them in edge order
    (text embedding last), and returns the mean next-token loss over the last T positions,
    T = labels' length (the text tokens)."""

    def __init__(self, backbone: nn.Module, in_dims: list[int], dim: int, vocab_size: int) -> None:
        super().__init__()
        self.adapters = nn.ModuleList(
            nn.Identity() if d == dim else nn.Linear(d, dim) for d in in_dims
        )
        # The `text` module owns the token embedding; an unused table here would hold
        # parameters without gradients, which data-parallel all-reduce trips over.
        backbone.embed_tokens = None
        self.backbone = backbone
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, labels_BT: Tensor, *inputs_BND: Tensor) -> Tensor:
        parts = [adapt(x) for adapt, x in zip(self.adapters, inputs_BND, strict=True)]
        hidden_BSD = self.backbone(inputs_embeds=torch.cat(parts, dim=1), use_cache=False)
        text_BTD = hidden_BSD.last_hidden_state[:, -labels_BT.shape[1] :]
        logits_BTV = self.lm_head(text_BTD)
        return F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten())
