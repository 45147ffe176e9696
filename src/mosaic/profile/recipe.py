"""The commands that rebuild a ProfileDB from nothing, read from what the DB holds.

A DB grows over several runs (`mosaic profile --update` adds kernels, presets and models;
collectives come from a torchrun launch; engine terms are refitted from bench results), and
its meta keeps only the last run's settings per part. So the recipe is derived from the
contents themselves: one `mosaic profile` per (kernels, preset), split where some models have
colocations and others only surfaces; one collectives launch per GPU count measured; one
engine-term refit per engine kind, naming the bench results it was fitted on; one run per
preset of the bf16 weight updates measured per module. The
interference fits need no command of their own: `mosaic profile` stores them whenever it
measured colocations, and the surfaces' fits after every run. Run on your own GPUs, the recipe gives the same kind of DB for them.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mosaic.profile.db import TOPOLOGY_KEY, ProfileDB, colocation_kernels, profile_meta_key
from mosaic.profile.main_weights import stored_updates
from mosaic.profile.optimizer import FIT_NAME as OPTIMIZER_FIT

ENGINE_TERM_PREFIX = "engine_term."
EAGER_SMALL = ("eager", "small")
"""The first run: it creates the DB (and measured the colocations and signatures)."""


@dataclass(frozen=True, slots=True)
class RecipeStep:
    command: str
    what: str
    """What the step put in the DB, with the counts it holds now."""
    needs: str
    """Where it runs: '1 GPU', 'N GPUs (torchrun)', or 'CPU' (a refit)."""


def rebuild_recipe(db_path: str | Path, out: str = "runs/profile.sqlite",
                   results: str | Path = "benchmarks/results") -> list[RecipeStep]:
    """The steps that rebuild `db_path`'s contents into the DB `out`, in order; the engine
    terms' bench results are looked up under `results` (named as recorded where absent)."""
    with ProfileDB.open(db_path) as db:
        steps = _profile_steps(db, out)
        steps += _main_weights_steps(db, out)
        steps += _collective_steps(db, out)
        steps += _engine_term_steps(db, out, Path(results))
    return steps


def _profile_steps(db: ProfileDB, out: str) -> list[RecipeStep]:
    from mosaic.zoo import MODEL_NAMES

    held: dict[tuple[str, str], dict[str, set[str]]] = {}
    for record in db.modules():
        held.setdefault((record.kernels, record.preset), {}).setdefault(
            record.model, set()).add(record.signature)
    points: dict[str, int] = {}
    for point in db.points():
        points[point.signature] = points.get(point.signature, 0) + 1
    kernels_of = {record.signature: record.kernels for record in db.modules()}
    colocations = [(c, colocation_kernels(c, kernels_of)) for c in db.colocations()]
    colocated = {(c.model, c.preset, kernels) for c, kernels in colocations}
    busy: dict[str, int] = {}
    for point in db.busy():
        busy[point.signature] = busy.get(point.signature, 0) + 1
    order = sorted(held, key=lambda key: (key != EAGER_SMALL, key[0] != "eager", key))
    steps: list[RecipeStep] = []
    last_surfaces = -1
    for kernels, preset in order:
        models = sorted(held[kernels, preset], key=MODEL_NAMES.index)
        with_coloc = [m for m in models if (m, preset, kernels) in colocated]
        for group, surfaces_only in ((with_coloc, False),
                                     ([m for m in models if m not in with_coloc], True)):
            if not group:
                continue
            signatures = set().union(*(held[kernels, preset][m] for m in group))
            budget = _budget(db, kernels, preset, colocations=not surfaces_only)
            command = _profile_command(group, preset, kernels,
                                       " --surfaces-only" if surfaces_only else "", budget,
                                       update=bool(steps), out=out)
            count = sum(points.get(s, 0) for s in signatures)
            what = (f"{kernels} `{preset}` surfaces of {len(signatures)} modules "
                    f"({count} points)")
            if not surfaces_only:
                n = sum(1 for c, k in colocations
                        if c.model in group and c.preset == preset and k == kernels)
                signatures_measured = sum(1 for p in db.signatures()
                                          if p.signature in signatures)
                what += (f", {n} colocations and the interference fits, "
                         f"{signatures_measured} bandwidth signature points")
            steps.append(RecipeStep(command, what, "1 GPU"))
            last_surfaces = len(steps) - 1
        steps += _busy_steps(db, kernels, preset, held[kernels, preset], with_coloc, busy, out)
    optimizer = next((f for f in db.fits() if f.name == OPTIMIZER_FIT), None)
    if last_surfaces >= 0 and optimizer is not None:  # every run measuring surfaces measures it
        last = steps[last_surfaces]
        steps[last_surfaces] = RecipeStep(last.command, f"{last.what}; the optimizer-step fit "
                                          f"({optimizer.n_points} sizes)", last.needs)
    return steps


def _profile_command(models: list[str], preset: str, kernels: str, part: str,
                     budget: float | None, update: bool, out: str) -> str:
    """`mosaic profile` of `models` with `part` (its flag, or "") and the recorded budget."""
    return (f"mosaic profile {' '.join(models)} --preset {preset}"
            + ("" if kernels == "eager" else f" --kernels {kernels}") + part
            + (f" --budget {budget:g}" if budget else "")
            + (" --update" if update else "") + f" --db {shlex.quote(out)}")


def _busy_steps(db: ProfileDB, kernels: str, preset: str, held: dict[str, set[str]],
                measured_whole: list[str], busy: dict[str, int], out: str) -> list[RecipeStep]:
    """A --busy-only run for the models with a busy fraction for every module (such a run
    measures them all; a module shared with another preset or model is no sign of one) and
    whose colocation run, which measures them too, is not in the recipe; `busy`: points per
    signature."""
    from mosaic.zoo import MODEL_NAMES

    models = sorted((m for m, sigs in held.items()
                     if m not in measured_whole and sigs <= set(busy)), key=MODEL_NAMES.index)
    if not models:
        return []
    signatures = set().union(*(held[m] for m in models)) & set(busy)
    budget = _budget(db, kernels, preset, colocations=False, busy_only=True)
    command = _profile_command(models, preset, kernels, " --busy-only", budget, update=True,
                               out=out)
    what = (f"{kernels} `{preset}` busy fractions of {len(signatures)} modules "
            f"({sum(busy[s] for s in signatures)} points)")
    return [RecipeStep(command, what, "1 GPU")]


def _budget(db: ProfileDB, kernels: str, preset: str, colocations: bool,
            busy_only: bool = False) -> float | None:
    """The --budget the part's last run used, where the DB recorded it."""
    key = ("config" if (kernels, preset) == EAGER_SMALL and not busy_only
           else profile_meta_key(kernels, preset, colocations, busy_only))
    try:
        return float(json.loads(db.meta[key])["budget_s"])
    except (KeyError, TypeError, ValueError):
        return None


def _main_weights_steps(db: ProfileDB, out: str) -> list[RecipeStep]:
    """One --main-weights-only run per preset, for the models whose bf16 updates it holds."""
    from mosaic.zoo import MODEL_NAMES

    by_preset: dict[str, dict[str, int]] = {}
    for point in stored_updates(db).values():
        models = by_preset.setdefault(point.preset, {})
        models[point.model] = models.get(point.model, 0) + 1
    return [RecipeStep(
        _profile_command(sorted(models, key=MODEL_NAMES.index), preset, "eager",
                         " --main-weights-only", None, update=True, out=out),
        f"`{preset}` bf16 weight updates, a weight at a time and flat, of "
        f"{sum(models.values())} modules", "1 GPU") for preset, models in sorted(by_preset.items())]


def _collective_steps(db: ProfileDB, out: str) -> list[RecipeStep]:
    measured: dict[int, set[str]] = {}
    for point in db.comm():
        if point.source == "measured":
            measured.setdefault(point.num_gpus, set()).add(point.kind)
    steps = []
    for n, kinds in sorted(measured.items()):
        topology: dict[str, Any] = db.topology().get(n, {})
        device = topology.get("device", "GPU")
        steps.append(RecipeStep(
            f"torchrun --standalone --nproc-per-node {n} -m mosaic profile --collectives "
            f"--db {shlex.quote(out)}",
            f"measured {', '.join(sorted(kinds))} on {n} x {device} "
            f"({sum(1 for p in db.comm() if p.num_gpus == n and p.source == 'measured')} "
            f"points; topology in meta {TOPOLOGY_KEY}.{n})",
            f"{n} GPUs (torchrun)"))
    return steps


def _engine_term_steps(db: ProfileDB, out: str, results: Path) -> list[RecipeStep]:
    steps = []
    for fit in db.fits():
        if not fit.name.startswith(ENGINE_TERM_PREFIX):
            continue
        kind = fit.name.removeprefix(ENGINE_TERM_PREFIX)
        files = _bench_files(fit.params.get("groups", []), results)
        mape = f"{fit.mape:.1f}%" if fit.mape is not None else "not recorded"
        steps.append(RecipeStep(
            "mosaic model-error " + " ".join(f"--fit-engine-term {shlex.quote(f)}" for f in files)
            + f" --engine-kind {kind} --db {shlex.quote(out)}",
            f"the {kind} engine term: {fit.n_points} iterations of {len(files)} bench runs, "
            f"held-out MAPE {mape}", "CPU"))
    return steps


def _bench_files(names: list[str], results: Path) -> list[str]:
    """A fit's bench runs, recorded relative to the directory they were fitted from: the file
    under `results` each names, a name found in several folders taken from the folder its
    siblings came from; else the name as recorded."""
    found = {name: ([results / name] if (results / name).is_file() else
                    sorted(results.rglob(name)) if results.is_dir() else []) for name in names}
    folders = {paths[0].parent for paths in found.values() if len(paths) == 1}
    out = []
    for name, paths in found.items():
        if len(paths) > 1:
            paths = [p for p in paths if p.parent in folders]
        out.append(str(paths[0]) if len(paths) == 1 else name)
    return out


def format_recipe(steps: list[RecipeStep]) -> str:
    """The steps as a shell script: each command under a comment saying what it adds."""
    lines = []
    for i, step in enumerate(steps, 1):
        lines.append(f"# {i}. [{step.needs}] {step.what}")
        lines.append(step.command)
    return "\n".join(lines)
