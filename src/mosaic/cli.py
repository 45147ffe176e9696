"""The `mosaic` command: models, plan, train, profile, model-error, bench-planner, bench.

Every user error ends as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and train multimodal models with modules colocated on GPUs (SM quotas).")

DEFAULT_PLANNERS = "megatron,distmm,spindle,mosaic"


def _fail(message: str) -> None:
    typer.echo(f"mosaic: error: {message}", err=True)
    raise typer.Exit(2)


def load_graph(model: str, preset: str, global_batch: int | None = None):
    """A zoo model by name, or a custom graph from a JSON file."""
    from mosaic.graph import MMGraph

    if model.endswith(".json"):
        path = Path(model)
        if not path.exists():
            _fail(f"graph file {model} does not exist")
        return MMGraph.from_json(path.read_text())
    from mosaic.zoo import get_model

    return get_model(model).graph(preset, global_batch=global_batch)


def load_perf_model(name: str, cluster, preset: str = "small"):
    from mosaic.perf import make_perf_model

    return make_perf_model(name, cluster, preset=preset)


@app.command()
def models(preset: Annotated[str, typer.Option(help="paper | small | tiny")] = "paper",
           as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the model zoo with per-module parameters and FLOPs."""
    from mosaic.report.tables import models_table
    from mosaic.zoo import MODELS

    graphs = [MODELS[name].graph(preset) for name in MODELS]
    if as_json:
        typer.echo(json.dumps([g.to_dict() for g in graphs], indent=2))
        return
    models_table(graphs)


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="zoo model name, or a graph .json file")],
    gpus: Annotated[int, typer.Option(help="number of GPUs")] = 8,
    hardware: Annotated[str, typer.Option(help="h200 | h100")] = "h200",
    preset: Annotated[str, typer.Option(help="paper | small | tiny")] = "paper",
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    planners: Annotated[str, typer.Option(help="comma-separated planners")] = DEFAULT_PLANNERS,
    perf_model: Annotated[str, typer.Option("--perf-model", help="auto | profiled | analytic")] = "auto",
    out: Annotated[Path | None, typer.Option(help="directory for plan JSON and timeline PNGs")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Plan MODEL on GPUS with every planner; compare predicted iteration times."""
    from mosaic.hardware import make_cluster
    from mosaic.planners import plan_all
    from mosaic.report.plans import plans_summary, write_plan_artifacts

    cluster = make_cluster(gpus, hardware)
    graph = load_graph(model, preset, batch)
    perf = load_perf_model(perf_model, cluster, preset)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    plans = plan_all(graph, cluster, perf, names)
    out = out or Path("runs") / f"plan-{graph.name}-{gpus}"
    files = write_plan_artifacts(plans, graph, perf, out)
    summary = plans_summary(plans, graph, perf, files, hardware=hardware)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        from mosaic.report.tables import print_plan_table

        print_plan_table(summary)


def main() -> None:
    """Console entry point: user errors become one line and exit status 2."""
    from mosaic.errors import is_user_error

    try:
        app()
    except ValueError as exc:
        if not is_user_error(exc):
            raise
        typer.echo(f"mosaic: error: {exc}", err=True)
        sys.exit(2)
