"""Profile zoo models on one GPU into a ProfileDB, then report the model's held-out error.

    PYTHONPATH=src python3 benchmarks/profile_h200.py --models clip imagebind qwen3-vl \
        unified-io-2 ofasys --preset small --out runs/profile --db runs/profile/h200.sqlite

Prints one row per model (points measured vs the full grid, colocations, wall time) and the
model-error table per kernel kind with colocations (eager; compile-default once profiled with
--kernels compile-default); writes profile_summary.json and model_error_<kernels>.json under
--out, and stores each variant's fitted coefficients and held-out MAPE in the DB's `fits`
table.

Measured on the lent H200 (torch 2.11+cu130, 2026-11-29), all five models at `small`:
169 s wall, 446 points of a 1632-point full grid (27%), 100 colocations, 21 bandwidth
signatures; that DB ships as src/mosaic/profile/data/h200.sqlite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mosaic.hardware import make_cluster
from mosaic.perf.accuracy import (
    kernels_with_colocations,
    model_error,
    print_model_error,
    store_interference_fits,
)
from mosaic.profile.db import FitRecord, ProfileDB
from mosaic.profile.profiler import ModelReport, ProfilerConfig, profile_models

ALL_MODELS = ("clip", "imagebind", "qwen3-vl", "unified-io-2", "ofasys")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(ALL_MODELS))
    p.add_argument("--preset", default="small")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--out", type=Path, default=Path("runs/profile"))
    p.add_argument("--db", type=Path, default=None, help="DB path (default: OUT/<hardware>.sqlite)")
    p.add_argument("--budget", type=float, default=220.0, help="wall-clock seconds for profiling")
    p.add_argument("--refine-budget", type=int, default=8)
    p.add_argument("--no-antagonist", action="store_true")
    p.add_argument("--kernels", default="eager",
                   help="eager, or compile-default (the modules as the compiled engine runs them)")
    p.add_argument("--update", action="store_true",
                   help="add to --db instead of replacing it (modules already there are kept)")
    return p.parse_args(argv)


def summary_table(reports: list[ModelReport], wall_s: float) -> Table:
    table = Table(title=f"profile: {wall_s:.0f} s wall")
    for col in ("model", "modules", "distinct", "points", "full grid", "colocations",
                "signatures", "wall s"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in reports:
        table.add_row(r.model, str(r.num_modules), str(r.num_distinct), str(r.points),
                      str(r.full_grid), str(r.colocations), str(r.signatures), f"{r.wall_s:.1f}")
    tot = lambda f: sum(getattr(r, f) for r in reports)  # noqa: E731
    table.add_row("total", str(tot("num_modules")), str(tot("num_distinct")), str(tot("points")),
                  str(tot("full_grid")), str(tot("colocations")), str(tot("signatures")),
                  f"{tot('wall_s'):.1f}")
    return table


def store_fits(db_path: Path, result: dict, hardware: str) -> None:
    """Interference coefficients of `result`'s kernels beside their held-out error; for eager
    kernels also the analytic calibration."""
    kernels = result.get("kernels", "eager")
    store_interference_fits(db_path, hardware, kernels, held_out=result)
    if kernels != "eager":
        return
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    single = result["rows"]["profiled-aware"]
    with ProfileDB.open(db_path, readonly=False) as db:
        db.add_fit(FitRecord(name="model_error.single", params={"calibration": result["calibration"]},
                             mape=single["single_mape"], n_points=single["n_points"]["single"],
                             created=now))


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    console = Console(width=140)
    args.out.mkdir(parents=True, exist_ok=True)
    db_path = args.db or args.out / f"{args.hardware}.sqlite"
    cfg = ProfilerConfig(hardware=args.hardware, preset=args.preset, budget_s=args.budget,
                         refine_budget=args.refine_budget, antagonist=not args.no_antagonist,
                         kernels=args.kernels)
    t0 = time.perf_counter()
    reports = profile_models(args.models, str(db_path), cfg, update=args.update,
                             log=lambda s: console.print(s, markup=False, highlight=False))
    wall = time.perf_counter() - t0
    console.print(summary_table(reports, wall))
    points, grid = sum(r.points for r in reports), sum(r.full_grid for r in reports)
    console.print(f"points measured {points} of a full grid of {grid} "
                  f"({100 * points / max(grid, 1):.1f}%), profiling wall {wall:.1f} s")
    summary = {"wall_s": wall, "points": points, "full_grid": grid, "config": asdict(cfg),
               "models": [asdict(r) for r in reports]}
    (args.out / "profile_summary.json").write_text(json.dumps(summary, indent=2))
    try:
        for kernels in kernels_with_colocations(db_path):
            result = model_error(db_path, make_cluster(1, args.hardware), kernels=kernels)
            print_model_error(result, console)
            (args.out / f"model_error_{kernels}.json").write_text(json.dumps(result, indent=2))
            store_fits(db_path, result, args.hardware)
    except Exception:  # the profile itself is saved; report why the error table is missing
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
