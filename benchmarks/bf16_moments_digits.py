"""Does keeping AdamW's moments in bf16 change what a model learns? CPU, real data.

The tiny CLIP trained on scikit-learn's handwritten digits (`--data digits`, zero-shot accuracy
on the held-out split) with fp32 weights, with bf16 weights and fp32 moments, with bf16
weights and bf16 moments (`--bf16-moments`: stochastic rounding), and with those and no fp32
main weights (`--no-fp32-main-weights`: the weights rounded stochastically too), a few seeds
each (`--settings` picks some by name, comma-separated). The tiny
model's weights are below `main_weights.MIN_ELEMENTS`, which keeps small weights fp32, so the
bf16 runs lower it to 1: every GEMM weight is bf16, as a `paper` model's are.

    PYTHONPATH=src python benchmarks/bf16_moments_digits.py --out benchmarks/results/DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mosaic.api import plan
from mosaic.engine import main_weights
from mosaic.engine.session import EngineConfig
from mosaic.engine.trainer import TrainConfig, train
from mosaic.zoo import get_model

SETTINGS = {"fp32 weights": {}, "bf16 weights": {"bf16_weights": True},
            "bf16 weights and moments": {"bf16_weights": True, "bf16_moments": True},
            "bf16 weights and moments without main weights": {
                "bf16_weights": True, "bf16_moments": True, "fp32_main_weights": False}}
TAIL = 20
"""Steps the final loss is averaged over."""


def run(setting: dict, seed: int, steps: int, batch: int, lr: float) -> dict:
    main_weights.MIN_ELEMENTS = 1 if setting else 1 << 16
    graph = get_model("clip").graph("tiny", global_batch=batch)
    start = time.perf_counter()
    result = train(TrainConfig(
        model="clip", preset="tiny", plan=plan(graph, 1, planner="megatron", perf_model="analytic"),
        steps=steps, warmup_steps=0, lr=lr, seed=seed, global_batch=batch, device="cpu",
        data="digits", progress=False, engine=EngineConfig(amp=True, **setting)))
    losses = [s["loss"] for s in result.steps]
    return {"seed": seed, "final_loss": statistics.fmean(losses[-TAIL:]), "first_loss": losses[0],
            "zero_shot_accuracy": result.summary["eval"]["zero_shot_accuracy"],
            "seconds": time.perf_counter() - start}


def digits_arguments(description: str) -> argparse.ArgumentParser:
    """The options of a digits run: where to write, how many seeds, steps, batch and lr."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser


def main() -> None:
    parser = digits_arguments(__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    names = [name.strip() for name in args.settings.split(",") if name.strip()]
    if unknown := sorted(set(names) - set(SETTINGS)):
        parser.error(f"--settings {unknown}: use some of {list(SETTINGS)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs = {name: [run(SETTINGS[name], seed, args.steps, args.batch, args.lr)
                   for seed in range(args.seeds)] for name in names}
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "hardware": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
              "torch": torch.__version__, "model": "clip", "preset": "tiny", "data": "digits",
              "steps": args.steps, "batch": args.batch, "lr": args.lr, "tail_steps": TAIL,
              "runs": runs}
    (args.out / "bf16_moments_digits.json").write_text(json.dumps(record, indent=1))
    for name, rows in runs.items():
        print(name, [(round(r["final_loss"], 4), round(r["zero_shot_accuracy"], 3)) for r in rows])


if __name__ == "__main__":
    main()
