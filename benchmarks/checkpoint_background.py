"""How long a checkpoint save holds training up: written before the next step, or in the
background (`mosaic train --checkpoint-background`).

    PYTHONPATH=src python benchmarks/checkpoint_background.py clip --preset small \
        --dir /tmp/ck --rounds 3 --out results/checkpoint-background/cpu_clip_small.json

One process: a zoo model's modules and a fused-where-possible AdamW with its moments (one
step taken), on the GPU when there is one. Each round saves once each way, alternating, into
`--dir` (a local disk: what is measured includes its write speed): the seconds until training
could go on (`save_checkpoint` returning; `begin_checkpoint` returning, the tensors copied to
host memory) and until the checkpoint was published. While a background save is written, the
script trains (batch --batch of synthetic rows) and times those steps against as many steps
with no save: what the writing thread costs the steps it overlaps. Medians go to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mosaic.engine.checkpoint import begin_checkpoint, save_checkpoint
from mosaic.engine.measure import environment
from mosaic.engine.session import build_modules, make_optimizer
from mosaic.zoo import get_model

MODES = ("before the next step", "background")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dir", type=Path, required=True, help="where to write (emptied)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="samples a training step")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args()


def training_state(model_name: str, preset: str, device: torch.device):
    """Modules and an AdamW whose moments exist (one step on zero gradients)."""
    model = get_model(model_name)
    modules = build_modules(model, preset, list(model.graph(preset).names), seed=0)
    modules = {name: m.to(device) for name, m in modules.items()}
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = make_optimizer("adamw", params, 1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return modules, optimizer, sum(p.numel() for p in params)


def train_step(model, preset: str, batch: int, modules, optimizer, device) -> float:
    """Seconds of one training step on synthetic rows (synchronised on a GPU)."""
    inputs = model.make_inputs(preset, batch, torch.Generator().manual_seed(0), device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model.loss(modules, inputs)
    loss.backward()
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def save_once(mode: str, root: Path, step: int, modules, optimizer,
              train: Callable[[], float]) -> dict[str, Any]:
    """Seconds until training could go on and until published; in the background, also the
    steps trained while the save was written, and as many steps with no save."""
    start = time.perf_counter()
    if mode != "background":
        save_checkpoint(root, step, modules, optimizer, keep_last=1)
        held = time.perf_counter() - start
        return {"held_s": held, "published_s": held}
    pending = begin_checkpoint(root, step, modules, optimizer, keep_last=1)
    held = time.perf_counter() - start
    during = [train()]
    while not (root / "latest").is_file() or (root / "latest").read_text().strip() != \
            f"step-{step:06d}":
        during.append(train())
    pending.wait()
    published = time.perf_counter() - start
    alone = [train() for _ in during]
    return {"held_s": held, "published_s": published,
            "step_during_write_s": statistics.median(during),
            "step_alone_s": statistics.median(alone), "steps_during_write": len(during)}


def main() -> None:
    args = arguments()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modules, optimizer, params = training_state(args.model, args.preset, device)
    model = get_model(args.model)

    def train() -> float:
        return train_step(model, args.preset, args.batch, modules, optimizer, device)

    train()  # first-step allocations out of the timing
    shutil.rmtree(args.dir, ignore_errors=True)
    runs = []
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            run = save_once(mode, args.dir, len(runs) + 1, modules, optimizer, train)
            runs.append({"mode": mode, "round": r, **run})
            print(f"round {r} {mode:>20}: training held {run['held_s']:6.2f} s, published "
                  f"after {run['published_s']:6.2f} s" + (
                      f"; {run['steps_during_write']} steps meanwhile, "
                      f"{run['step_during_write_s'] * 1e3:.0f} ms a step against "
                      f"{run['step_alone_s'] * 1e3:.0f} ms alone" if "step_alone_s" in run
                      else ""), flush=True)
    size = sum(f.stat().st_size for f in args.dir.rglob("*") if f.is_file())
    shutil.rmtree(args.dir, ignore_errors=True)
    median = {mode: {key: statistics.median(x[key] for x in runs if x["mode"] == mode)
                     for key in ("held_s", "published_s", "step_during_write_s", "step_alone_s")
                     if all(key in x for x in runs if x["mode"] == mode)} for mode in MODES}
    result = {"model": args.model, "preset": args.preset, "device": str(device),
              "train_batch": args.batch,
              "parameters": params, "checkpoint_bytes": size, "rounds": args.rounds,
              "runs": runs, "median": median, "environment": environment()}
    print(f"{args.model} {args.preset}: {params / 1e6:.0f} M parameters, {size / 2**30:.2f} GiB "
          f"a checkpoint; training held {median['before the next step']['held_s']:.2f} s "
          f"written before the next step, {median['background']['held_s']:.2f} s in the "
          f"background")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
