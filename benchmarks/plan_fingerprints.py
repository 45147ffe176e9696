"""Do the planners make the same plans on every machine from the shipped profile?

GAHC's plan of OFASys `paper` b8 came out `free` on a CPU machine and `cap` on the GPU
machine (2026-12-03) from the same code and ProfileDB; surfaces fitted on load differed
slightly between numpy/scipy builds, which is why the DB now stores them. This script makes
every planner's plan of a set of zoo rows and writes what identifies each (stages, sharing,
shares, priorities, predicted iteration), or compares with a file written elsewhere:

    PYTHONPATH=src python benchmarks/plan_fingerprints.py OUT.json
    PYTHONPATH=src python benchmarks/plan_fingerprints.py OUT.json --against benchmarks/plans/fingerprints_cpu.json

The comparison prints each row whose plan differs and exits 1 if any does. A stage's
placements may come in any order (the model prices a stage as a set, and GAHC breaks a tie
between equal modules either way), and predictions must agree to RELATIVE: after the stored
fits, the GPU machine's predictions still differed from this CPU's by up to 9e-7 relative
(2026-12-03), float noise in what is still computed on load, far below any plan's margin.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

ROWS = (("clip", "small", 32), ("clip", "paper", 32), ("imagebind", "small", 32),
        ("imagebind", "paper", 8), ("ofasys", "small", 8), ("ofasys", "paper", 8),
        ("unified-io-2", "small", 8), ("qwen3-vl", "small", 8))
PLANNERS = ("mosaic", "gahc", "megatron", "distmm", "spindle")
RELATIVE = 1e-5


def fingerprints() -> dict[str, dict]:
    from mosaic.hardware import make_cluster
    from mosaic.perf import make_perf_model
    from mosaic.planners import plan_all
    from mosaic.zoo import get_model

    cluster = make_cluster(1, "h200")
    out = {}
    for model, preset, batch in ROWS:
        graph = get_model(model).graph(preset, global_batch=batch)
        perf = make_perf_model("auto", cluster, preset=preset)
        for plan in plan_all(graph, cluster, perf, list(PLANNERS)):
            out[f"{model}:{preset}:{batch}:{plan.planner}"] = {
                "stages": [[s.sharing, *(f"{p.module}@{p.sm_share:.6f}/{p.priority}"
                                         for p in s.placements)] for s in plan.stages],
                "predicted_s": plan.predicted_iteration_s}
    return out


def _as_sets(stages: list[list[str]]) -> list[tuple[str, frozenset[str]]]:
    """Each stage's sharing mode and its placements in any order."""
    return [(sharing, frozenset(placements)) for sharing, *placements in stages]


def differences(mine: dict[str, dict], theirs: dict[str, dict]) -> list[str]:
    lines = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            lines.append(f"{key}: only {'here' if b is None else 'there'}")
        elif _as_sets(a["stages"]) != _as_sets(b["stages"]):
            lines.append(f"{key}: here {a['stages']} there {b['stages']}")
        elif abs(a["predicted_s"] - b["predicted_s"]) > RELATIVE * b["predicted_s"]:
            lines.append(f"{key}: predicted {a['predicted_s']!r} here, {b['predicted_s']!r} there")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--against", help="fingerprints written on another machine")
    args = parser.parse_args()
    import numpy
    import scipy

    mine = fingerprints()
    with open(args.out, "w") as f:
        json.dump({"python": platform.python_version(), "numpy": numpy.__version__,
                   "scipy": scipy.__version__, "plans": mine}, f, indent=1, sort_keys=True)
    if args.against:
        with open(args.against) as f:
            theirs = json.load(f)
        lines = differences(mine, theirs["plans"])
        print(f"{len(mine)} plans here (numpy {numpy.__version__}, scipy {scipy.__version__}) "
              f"against {len(theirs['plans'])} there (numpy {theirs['numpy']}, scipy "
              f"{theirs['scipy']}): {len(lines)} differ")
        print("\n".join(lines))
        sys.exit(1 if lines else 0)


if __name__ == "__main__":
    main()
