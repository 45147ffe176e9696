"""`mosaic profile-recipe`: the commands that rebuild a ProfileDB, read from its contents."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
import typer

from mosaic.cli import app, main
from mosaic.profile.db import (
    ColocPoint,
    ColocWork,
    CommPoint,
    ModulePoint,
    ProfileDB,
    default_db_path,
)
from mosaic.profile.recipe import rebuild_recipe
from tests.helpers import spec

ROOT = Path(__file__).resolve().parents[1]


def _parses(command: str) -> None:
    """The command line is one the CLI accepts (parsed and its callbacks run, nothing done)."""
    words = shlex.split(command)
    args = words[words.index("mosaic") + 1:]
    group = typer.main.get_command(app)
    parent = click.Context(group, info_name="mosaic")
    sub = group.get_command(parent, args[0])
    assert sub is not None, command
    sub.make_context(args[0], args[1:], parent=parent)


def test_the_shipped_profiles_recipe_covers_everything_it_holds_and_every_command_parses():
    db_path = default_db_path("h200")
    steps = rebuild_recipe(db_path, "runs/p.sqlite", ROOT / "benchmarks" / "results")
    profile = [s for s in steps if s.command.startswith("mosaic profile ")]
    assert "--update" not in profile[0].command and "--surfaces-only" not in profile[0].command
    assert all("--update" in s.command for s in profile[1:])
    with ProfileDB.open(db_path) as db:
        held = {(m.kernels, m.preset, m.model) for m in db.modules()}
        comm_counts = {p.num_gpus for p in db.comm() if p.source == "measured"}
        engine_terms = {f.name for f in db.fits() if f.name.startswith("engine_term.")}
    for kernels, preset, model in held:
        assert any(f" {model} " in s.command and f"--preset {preset}" in s.command
                   and (kernels == "eager") != (f"--kernels {kernels}" in s.command)
                   for s in profile), (kernels, preset, model)
    assert {s.needs for s in steps if "--collectives" in s.command} == {
        f"{n} GPUs (torchrun)" for n in comm_counts}
    refits = [s for s in steps if "--fit-engine-term" in s.command]
    assert len(refits) == len(engine_terms)
    for step in refits:  # every bench run a term was fitted on is found in benchmarks/results
        files = shlex.split(step.command)[3::2][:-2]
        assert files and all((ROOT / f).is_file() or Path(f).is_file() for f in files), files
    for step in steps:
        _parses(step.command)


def test_models_with_and_without_colocations_get_their_own_commands(tmp_path):
    """Per kernels: eager colocations, compiled ones, and surfaces-only runs, each with the
    budget its own run recorded."""
    path = tmp_path / "p.sqlite"
    db = ProfileDB.create(path, hardware="h200", num_sms=132, config={"budget_s": 120})
    a = db.add_module("clip", "small", spec("vision"))
    b = db.add_module("ofasys", "small", spec("audio", dim=768))
    c = db.add_module("clip", "paper", spec("vision", dim=1024), kernels="compile-default")
    d = db.add_module("ofasys", "paper", spec("audio", dim=512), kernels="compile-default")
    db.add_points([ModulePoint(signature=s, per_gpu_batch=4, num_sms=132, time_s=0.01)
                   for s in (a, b, c, d)])
    for signature, model, preset in ((a, "clip", "small"), (c, "clip", "paper")):
        work = ColocWork(module="vision", signature=signature, per_gpu_batch=4, num_sms=64)
        db.add_colocation(ColocPoint(model=model, preset=preset, sharing="free",
                                     works=(work, work), group_time_s=0.01))
    # a compiled colocation run and a surfaces-only run of the same kernels and preset
    db.set_meta("profile.compile-default.paper.colocations", '{"budget_s": 90}')
    db.set_meta("profile.compile-default.paper", '{"budget_s": 60}')
    db.add_comm([CommPoint(kind="allreduce", num_gpus=2, num_bytes=4096, time_s=1e-5,
                           source="measured"),
                 CommPoint(kind="allreduce", num_gpus=8, num_bytes=4096, time_s=1e-5,
                           source="analytic")])
    db.close()
    commands = [s.command for s in rebuild_recipe(path, "out.sqlite")]
    assert commands == [
        "mosaic profile clip --preset small --budget 120 --db out.sqlite",
        "mosaic profile ofasys --preset small --surfaces-only --budget 120 --update "
        "--db out.sqlite",
        "mosaic profile clip --preset paper --kernels compile-default --budget 90 --update "
        "--db out.sqlite",
        "mosaic profile ofasys --preset paper --kernels compile-default --surfaces-only "
        "--budget 60 --update --db out.sqlite",
        "torchrun --standalone --nproc-per-node 2 -m mosaic profile --collectives "
        "--db out.sqlite"]


def test_profile_recipe_prints_the_script(capsys):
    try:
        main(["profile-recipe"])
    except SystemExit as exit_:
        assert not exit_.code
    out = capsys.readouterr().out
    assert out.startswith("# 1. [1 GPU] eager `small` surfaces")
    assert "-m mosaic profile --collectives" in out
