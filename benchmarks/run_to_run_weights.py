"""How far two identical training runs' weights drift apart, per attention kernel choice.

The GPU NaN-guard test compares a run that skipped a step with a clean run weight by weight;
that comparison only means something if two clean runs agree. This trains the test's
configuration (ImageBind `small`, bf16 weights, CUDA graphs, 6 steps) twice with the default
attention kernels and twice on the math kernels, and prints how many weights differ:

    PYTHONPATH=src python benchmarks/run_to_run_weights.py OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_engine import one_gpu_plans, state_of  # noqa: E402

from mosaic.engine.session import EngineConfig  # noqa: E402
from mosaic.engine.trainer import TrainConfig, train  # noqa: E402
from mosaic.zoo import get_model  # noqa: E402

TOLERANCE = 1e-5


def trained_weights(steps: int) -> dict:
    plan = one_gpu_plans(get_model("imagebind").graph("small"))["temporal"]
    engine = EngineConfig(graphs=True, compile=None, bf16_weights=True)
    result = train(TrainConfig(model="imagebind", preset="small", plan=plan, steps=steps,
                               warmup_steps=1, engine=engine, device="cuda", progress=False,
                               skip_nonfinite=True))
    return state_of(result.modules)


def compare(kernels: str, steps: int) -> dict:
    chosen = sdpa_kernel(SDPBackend.MATH) if kernels == "math" else contextlib.nullcontext()
    with chosen:
        first, second = trained_weights(steps), trained_weights(steps)
    differing = {name: int((first[name].float() - second[name].float()).abs()
                           .gt(TOLERANCE).sum()) for name in first}
    return {"kernels": kernels, "steps": steps, "tensors": len(first),
            "elements": sum(t.numel() for t in first.values()),
            "differing": {name: n for name, n in differing.items() if n}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = [compare(kernels, args.steps) for kernels in ("default", "math")]
    args.out.write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(f"{row['kernels']}: {len(row['differing'])} of {row['tensors']} tensors, "
              f"{sum(row['differing'].values())} of {row['elements']} elements differ by more "
              f"than {TOLERANCE} between two clean runs")


if __name__ == "__main__":
    main()
