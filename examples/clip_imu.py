"""Bring your own model: a CLIP-style model plus an IMU encoder, planned and trained by mosaic.

    python examples/clip_imu.py            # CPU, one process, about half a minute
    torchrun --standalone --nproc-per-node 2 examples/clip_imu.py --gpus 2   # on 2 GPUs
    python examples/clip_imu.py --bench    # instead of training: the plans against your own
                                           # program (eager; on a GPU also torch.compile)

* vision: `transformers.CLIPVisionModel` and text: `CLIPTextModel`, both from tiny configs
  (built offline, random weights: nothing is downloaded);
* imu: a small Conv1d + transformer encoder written here;
* align: a contrastive head (symmetric InfoNCE image<->text and imu<->image) with
  `needs_global_batch = True`: its loss is over the whole batch.

Data: 8x8 images of the digits 0-9 drawn from a 3x5 pixel font (random shift and noise),
captioned "a photo of the digit N" (a character tokenizer), and an IMU trace whose frequency
is the digit. The script plans the model for 2 GPUs and for 1 GPU with `mosaic.api.plan`,
trains it with the plan for this world size, prints the loss and, at the end, the zero-shot
accuracy: each test image is given the caption of the digit whose text embedding is nearest.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPVisionConfig, CLIPVisionModel

import mosaic.api as mosaic

WIDTH = 32
SEQ_LEN = 24
IMU_CHANNELS, IMU_LEN = 6, 64

# --- data ----------------------------------------------------------------------------------
FONT = {  # 3x5 glyphs, rows top to bottom
    0: ("111", "101", "101", "101", "111"), 1: ("010", "110", "010", "010", "111"),
    2: ("111", "001", "111", "100", "111"), 3: ("111", "001", "111", "001", "111"),
    4: ("101", "101", "111", "001", "001"), 5: ("111", "100", "111", "001", "111"),
    6: ("111", "100", "111", "101", "111"), 7: ("111", "001", "010", "010", "010"),
    8: ("111", "101", "111", "101", "111"), 9: ("111", "101", "111", "001", "111"),
}
VOCAB = "<>" + " abcdefghijklmnopqrstuvwxyz0123456789"  # '<' pad (id 0), '>' end of text (id 1)
PAD, EOS = 0, 1


def tokenize(text: str) -> Tensor:
    """A character tokenizer: ids of the characters, the end-of-text id, padding."""
    ids = [VOCAB.index(c) for c in text.lower()][: SEQ_LEN - 1] + [EOS]
    return torch.tensor(ids + [PAD] * (SEQ_LEN - len(ids)))


def caption(digit: int) -> str:
    return f"a photo of the digit {digit}"


def digit_images(digits: Tensor, g: torch.Generator) -> Tensor:
    """[B, 3, 8, 8]: the glyph at a random offset, plus noise."""
    images = torch.zeros(len(digits), 3, 8, 8)
    for i, d in enumerate(digits.tolist()):
        glyph = torch.tensor([[float(c) for c in row] for row in FONT[d]])
        dy, dx = torch.randint(0, 4, (2,), generator=g).tolist()
        images[i, :, dy:dy + 5, dx:dx + 3] = glyph
    return images + 0.3 * torch.randn(images.shape, generator=g)


def imu_traces(digits: Tensor, g: torch.Generator) -> Tensor:
    """[B, 6, 64]: sinusoids whose frequency is the digit, random phase, plus noise."""
    t = torch.linspace(0, 1, IMU_LEN)
    phase = 2 * torch.pi * torch.rand(len(digits), IMU_CHANNELS, 1, generator=g)
    freq = (digits.float() + 1).view(-1, 1, 1)
    return torch.sin(2 * torch.pi * freq * t + phase) + 0.3 * torch.randn(
        len(digits), IMU_CHANNELS, IMU_LEN, generator=g)


def batch(step: int, batch_size: int, seed: int = 0) -> dict[str, Tensor]:
    """The global batch of `step` (a function of the step only: the same on every rank)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    digits = torch.randint(0, 10, (batch_size,), generator=g)
    return {"vision": digit_images(digits, g),
            "text": torch.stack([tokenize(caption(d)) for d in digits.tolist()]),
            "imu": imu_traces(digits, g)}


# --- modules -------------------------------------------------------------------------------
class VisionTower(nn.Module):
    """transformers' CLIP vision transformer, returning one tensor (the pooled embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = CLIPVisionModel(CLIPVisionConfig(
            hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
            num_attention_heads=2, image_size=8, patch_size=2, num_channels=3))

    def forward(self, pixels_BCHW: Tensor) -> Tensor:
        return self.model(pixel_values=pixels_BCHW).pooler_output


class TextTower(nn.Module):
    """transformers' CLIP text transformer, pooled at the end-of-text token."""

    def __init__(self) -> None:
        super().__init__()
        self.model = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(VOCAB), hidden_size=WIDTH, intermediate_size=2 * WIDTH,
            num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=SEQ_LEN,
            pad_token_id=PAD, bos_token_id=EOS, eos_token_id=EOS))

    def forward(self, ids_BT: Tensor) -> Tensor:
        return self.model(input_ids=ids_BT, attention_mask=(ids_BT != PAD).long()).pooler_output


class ImuEncoder(nn.Module):
    """Conv1d stem (downsample 4x) + a 2-layer transformer encoder, mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv1d(IMU_CHANNELS, WIDTH, 5, stride=2, padding=2), nn.GELU(),
            nn.Conv1d(WIDTH, WIDTH, 5, stride=2, padding=2), nn.GELU())
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x_BCT: Tensor) -> Tensor:
        return self.blocks(self.stem(x_BCT).transpose(1, 2)).mean(dim=1)


class ContrastiveHead(nn.Module):
    """Symmetric InfoNCE of image<->text and imu<->image; the loss is over the whole batch."""

    needs_global_batch = True

    def __init__(self, embed_dim: int = WIDTH) -> None:
        super().__init__()
        self.vision = nn.Linear(WIDTH, embed_dim, bias=False)
        self.text = nn.Linear(WIDTH, embed_dim, bias=False)
        self.imu = nn.Linear(WIDTH, embed_dim, bias=False)
        self.scale = 10.0  # a fixed temperature: a learnt one collapses to 0 before the
        # random-init encoders tell samples apart (every logit equal: loss = log(batch))

    def embed(self, vision: Tensor, text: Tensor, imu: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (F.normalize(self.vision(vision), dim=-1), F.normalize(self.text(text), dim=-1),
                F.normalize(self.imu(imu), dim=-1))

    def forward(self, vision: Tensor, text: Tensor, imu: Tensor) -> Tensor:
        v, t, m = self.embed(vision, text, imu)
        return (info_nce(v, t, self.scale) + info_nce(m, v, self.scale)) / 2


def info_nce(a: Tensor, b: Tensor, scale: float) -> Tensor:
    logits = scale * a @ b.t()
    targets = torch.arange(len(a))
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


def build() -> dict[str, nn.Module]:
    torch.manual_seed(0)  # every rank builds the same weights
    return {"vision": VisionTower(), "text": TextTower(), "imu": ImuEncoder(),
            "align": ContrastiveHead()}


EDGES = [("vision", "align"), ("text", "align"), ("imu", "align")]


@torch.no_grad()
def zero_shot_accuracy(modules: dict[str, nn.Module], n: int = 200) -> float:
    """Each test image gets the digit whose caption embeds nearest; the fraction right."""
    for m in modules.values():
        m.eval()
    g = torch.Generator().manual_seed(12345)
    digits = torch.randint(0, 10, (n,), generator=g)
    captions = torch.stack([tokenize(caption(d)) for d in range(10)])
    head = modules["align"]
    image = F.normalize(head.vision(modules["vision"](digit_images(digits, g))), dim=-1)
    text = F.normalize(head.text(modules["text"](captions)), dim=-1)
    for m in modules.values():
        m.train()
    return (image @ text.t()).argmax(dim=1).eq(digits).float().mean().item()


def bench(graph, modules: dict[str, nn.Module], gpus: int, rank0: bool) -> None:
    """Every planner's plan and the user's own program, timed in one process (on a CPU only
    the eager program, in short rounds: it shows that everything runs, not what is faster)."""
    from mosaic.engine.measure import BenchConfig
    from mosaic.report.bench_report import print_bench_table

    config = None if torch.cuda.is_available() else BenchConfig(
        rounds=2, steps_per_round=2, warmup_steps=1, nvml_seconds=0,
        user_programs=("torch-eager",))
    run = mosaic.bench(graph, modules, batch, gpus=gpus, config=config)
    if rank0:
        print_bench_table(run.report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--gpus", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--bench", action="store_true",
                        help="measure the plans against the same modules as a plain program")
    args = parser.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    t0 = time.perf_counter()

    modules = build()
    example = {name: t[:1] for name, t in batch(0, 1).items()}
    graph = mosaic.graph_from_modules("clip-imu", modules, EDGES, example, global_batch=args.batch)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        for m in graph.modules:
            print(f"  {m.name:7s} {m.kind:8s} {m.num_params / 1e3:7.1f} k params  "
                  f"{m.flops_per_sample / 1e6:7.2f} MFLOP/sample  {m.num_kernels:4d} kernels")
        for gpus in (2, 1):
            p = mosaic.plan(graph, gpus=gpus)
            print(f"plan for {gpus} GPU(s): {p.planner}, predicted "
                  f"{p.predicted_iteration_s * 1e3:.2f} ms/iteration on the H200, "
                  f"{len(p.stages)} stage(s)")
    if args.bench:
        bench(graph, modules, args.gpus, rank0)
        return
    plan = mosaic.plan(graph, gpus=args.gpus)
    if rank0:
        print(f"zero-shot accuracy before training: {zero_shot_accuracy(modules):.2f}")
    result = mosaic.train(graph, modules, plan, batch, lr=args.lr, steps=args.steps,
                          progress=False)
    if rank0:
        losses = [s["loss"] for s in result.steps]
        for s in result.steps[:: max(1, len(losses) // 8)]:
            print(f"step {s['step']:3d}  loss {s['loss']:.4f}")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        if args.gpus == 1:  # the whole model is on this rank
            print(f"zero-shot accuracy after training: {zero_shot_accuracy(modules):.2f}")
        print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
