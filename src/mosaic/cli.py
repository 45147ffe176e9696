"""The `mosaic` command: models, plan, train, profile, model-error, bench-planner, bench.

Every user error ends as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import os
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


def load_plans(directory: Path, names: list[str], graph, cluster) -> dict:
    """`<planner>.json` for each name, validated against this graph and cluster."""
    from mosaic.plan import Plan

    plans = {}
    for name in names:
        path = directory / f"{name}.json"
        if not path.exists():
            _fail(f"--plans {directory}: no {path.name}; run `mosaic plan ... --out {directory}` "
                  f"with --planners {','.join(names)}")
        plans[name] = Plan.load(path).validate(graph, cluster)
    return plans


def load_perf_model(name: str, cluster, preset: str = "small"):
    """`auto`: the measured profile shipped for this hardware when there is one, else analytic."""
    from mosaic.perf import make_perf_model
    from mosaic.profile.db import has_shipped_db

    if name == "auto":
        name = "profiled" if has_shipped_db(cluster.gpu.name) else "analytic"
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

    cluster = make_cluster(gpus, hardware)
    graph = load_graph(model, preset, batch)
    perf = load_perf_model(perf_model, cluster, preset)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    plans = plan_all(graph, cluster, perf, names)
    out = out or Path("runs") / f"plan-{graph.name}-{gpus}"
    _emit_plans(plans, graph, perf, out, hardware, as_json)


def _emit_plans(plans, graph, perf, out: Path, hardware: str, as_json: bool) -> None:
    """Plan JSON, Gantt PNG and trace per plan into `out`; the summary as a table or JSON."""
    from mosaic.report.plans import plans_summary, write_plan_artifacts
    from mosaic.report.tables import print_plan_table

    files = write_plan_artifacts(plans, graph, perf, out)
    summary = plans_summary(plans, graph, perf, files, hardware=hardware)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        print_plan_table(summary)


@app.command()
def simulate(
    model: Annotated[str, typer.Argument(help="zoo model name, or a graph .json file")],
    plan_file: Annotated[Path, typer.Option("--plan", help="plan JSON (hand-written or from `mosaic plan`)")],
    hardware: Annotated[str, typer.Option(help="h200 | h100")] = "h200",
    preset: Annotated[str, typer.Option(help="paper | small | tiny")] = "paper",
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    perf_model: Annotated[str, typer.Option("--perf-model", help="auto | profiled | analytic")] = "auto",
    out: Annotated[Path | None, typer.Option(help="directory for the timeline PNG and trace")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Validate a plan and predict its iteration time on any cluster size."""
    from mosaic.hardware import make_cluster
    from mosaic.plan import Plan

    plan_obj = Plan.load(plan_file)
    cluster = make_cluster(plan_obj.num_gpus, hardware)
    graph = load_graph(model, preset, batch)
    perf = load_perf_model(perf_model, cluster, preset)
    predicted = perf.predict(plan_obj.validate(graph, cluster), graph)
    out = out or Path("runs") / f"simulate-{graph.name}-{plan_obj.num_gpus}"
    _emit_plans([predicted], graph, perf, out, hardware, as_json)


@app.command()
def train(
    model: Annotated[str, typer.Argument(help="zoo model name")],
    plan_file: Annotated[Path | None, typer.Option("--plan", help="plan JSON to train with")] = None,
    planner: Annotated[str | None, typer.Option(help="plan with this planner instead of --plan")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs (= processes); default: the world size")] = None,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 20,
    preset: Annotated[str, typer.Option(help="paper | small | tiny")] = "tiny",
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    metrics: Annotated[Path | None, typer.Option(help="JSONL file, one line per step")] = None,
    graphs: Annotated[bool, typer.Option(help="per-module CUDA graphs (GPU)")] = False,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-4,
    seed: Annotated[int, typer.Option(help="seed of weights and synthetic data")] = 0,
    hardware: Annotated[str, typer.Option(help="h200 | h100 (for planning)")] = "h200",
    out: Annotated[Path | None, typer.Option(help="directory for summary.json and plan.json")] = None,
) -> None:
    """Train MODEL with a plan: `torchrun --standalone --nproc-per-node N -m mosaic train ...`."""
    from mosaic.engine.trainer import train_from_cli

    if plan_file is None and planner is None:
        planner = "mosaic"
    result = train_from_cli(model, preset, str(plan_file) if plan_file else None, planner, gpus,
                            steps, str(metrics) if metrics else None, graphs, lr=lr, seed=seed,
                            global_batch=batch, hardware=hardware)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    summary = result.summary
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        result.plan.save(out / "plan.json")
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    typer.echo(
        f"{summary['model']} ({summary['preset']}) plan={summary['planner']} "
        f"gpus={summary['num_gpus']}: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"step {summary['step_time_median_s'] * 1e3:.1f} ms median "
        f"(p90 {summary['step_time_p90_s'] * 1e3:.1f}), {summary['samples_per_s']:.1f} samples/s, "
        f"SM quotas: {_quota_state(result.plan, summary['pool'])}"
    )


def _quota_state(plan, pool: dict) -> str:
    if not any(s.sharing in ("partition", "cap") for s in plan.stages):
        return "none in this plan"
    return "enforced (green contexts)" if pool.get("enforced") else f"NOT enforced ({pool.get('backend')})"


@app.command()
def bench(
    model: Annotated[str, typer.Argument(help="zoo model name")],
    gpus: Annotated[int, typer.Option(help="GPUs (this command runs one process: 1)")] = 1,
    preset: Annotated[str, typer.Option(help="paper | small | tiny")] = "small",
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    planners: Annotated[str, typer.Option(help="comma-separated planners")] = DEFAULT_PLANNERS,
    perf_model: Annotated[str, typer.Option("--perf-model", help="auto | profiled | analytic")] = "auto",
    hardware: Annotated[str, typer.Option(help="h200 | h100")] = "h200",
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 6,
    steps_per_round: Annotated[int, typer.Option(help="timed steps per plan per round")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed steps per plan first")] = 5,
    graphs: Annotated[bool, typer.Option(help="per-module CUDA graphs")] = True,
    plans_dir: Annotated[Path | None, typer.Option("--plans", help="measure the plan JSONs in this "
                                                   "directory (from `mosaic plan --out`) instead of planning")] = None,
    out: Annotated[Path | None, typer.Option(help="directory for results JSON and timelines")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Plan MODEL with every planner and train each plan in one run: measured vs predicted."""
    import torch

    from mosaic.bench import BenchConfig, bench_report, measure_plans, same_plans_everywhere
    from mosaic.engine.trainer import start_distributed
    from mosaic.hardware import make_cluster
    from mosaic.planners import plan_all
    from mosaic.report.bench import print_bench_table, write_bench_artifacts
    from mosaic.zoo import get_model

    cluster = make_cluster(gpus, hardware)
    zoo_model = get_model(model)
    graph = zoo_model.graph(preset, global_batch=batch)
    perf = load_perf_model(perf_model, cluster, preset)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    if plans_dir is None:
        plans = {p.planner: p for p in plan_all(graph, cluster, perf, names)}
    else:
        plans = {k: perf.predict(p, graph) for k, p in load_plans(plans_dir, names, graph, cluster).items()}
    config = BenchConfig(rounds=rounds, steps_per_round=steps_per_round, warmup_steps=warmup,
                         graphs=graphs)
    d = start_distributed(None)
    plans = same_plans_everywhere(plans, d)
    try:
        measurements = measure_plans(zoo_model, preset, graph, plans, cluster.gpu, config)
    finally:
        if d.owns_group:
            torch.distributed.destroy_process_group()
    if d.rank != 0:
        return
    report = bench_report(graph, measurements, cluster.gpu, preset)
    report["perf_model"] = perf.describe()
    out = out or Path("runs") / f"bench-{graph.name}-{preset}-{gpus}"
    write_bench_artifacts(report, measurements, out)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        print_bench_table(report)


@app.command()
def profile(
    models_: Annotated[list[str], typer.Argument(metavar="MODEL...", help="zoo models to profile")],
    preset: Annotated[str, typer.Option(help="paper | small | tiny")] = "small",
    hardware: Annotated[str, typer.Option(help="the GPU this runs on: h200 | h100")] = "h200",
    db: Annotated[Path, typer.Option(help="ProfileDB to write (SQLite; overwritten)")] = Path("runs/profile.sqlite"),
    budget_s: Annotated[float, typer.Option("--budget", help="wall-clock seconds for profiling")] = 220.0,
) -> None:
    """Measure scaling surfaces and colocations on this GPU into a ProfileDB (needs CUDA)."""
    from mosaic.profile.profiler import ProfilerConfig, profile_models
    from mosaic.zoo import get_model

    for name in models_:
        get_model(name)  # unknown names fail before the GPU is touched
    db.parent.mkdir(parents=True, exist_ok=True)
    reports = profile_models(models_, str(db), ProfilerConfig(hardware=hardware, preset=preset,
                                                              budget_s=budget_s))
    for r in reports:
        typer.echo(f"{r.model}: {r.points} of {r.full_grid} grid points, {r.colocations} "
                   f"colocations, {r.wall_s:.1f} s{'; ' + '; '.join(r.notes) if r.notes else ''}")
    typer.echo(f"wrote {db}")


@app.command("model-error")
def model_error(
    db: Annotated[Path | None, typer.Option(help="ProfileDB (default: the shipped one)")] = None,
    hardware: Annotated[str, typer.Option(help="h200 | h100")] = "h200",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Prediction error on held-out measured points: aware vs unaware vs linear interference."""
    from mosaic.perf.accuracy import model_error as compute
    from mosaic.perf.accuracy import print_model_error
    from mosaic.profile.db import default_db_path

    result = compute(db or default_db_path(hardware))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_model_error(result)


@app.command("bench-planner")
def bench_planner(
    modules: Annotated[int, typer.Option(help="modules of the synthetic graphs")] = 8,
    gpus: Annotated[int, typer.Option(help="GPUs")] = 8,
    sm_steps: Annotated[str, typer.Option(help="comma-separated SM-share steps; 'hw' = 8-SM granularity")] = "hw",
    seeds: Annotated[int, typer.Option(help="seeded graphs per configuration")] = 3,
    exhaustive_limit_s: Annotated[float, typer.Option(help="exhaustive search budget per graph")] = 60.0,
    plot: Annotated[Path | None, typer.Option(help="PNG of search time and optimality")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Planner search time and optimality ratio vs exhaustive (or the best known) on synthetic graphs."""
    from mosaic.planners.bench import bench_planner as run
    from mosaic.planners.bench import plot_bench

    steps = [None if s.strip() == "hw" else float(s) for s in sm_steps.split(",") if s.strip()]
    rows = run(modules, gpus, steps, seeds=tuple(range(seeds)), exhaustive_time_limit_s=exhaustive_limit_s)
    if plot is not None:
        plot_bench(rows, plot)
    if as_json:
        row = rows[0] if len(rows) == 1 else {"configurations": rows}
        typer.echo(json.dumps(row, indent=2, default=str))
        return
    for r in rows:
        step = "hw" if r["sm_step"] is None else r["sm_step"]
        typer.echo(f"{r['num_modules']} modules, {r['num_gpus']} GPUs, sm_step {step}: search "
                   f"{r['search_time_s']:.3f} s (max {r['max_search_time_s']:.3f}), optimality "
                   f"{r['optimality_ratio']:.4f} median, {r['worst_optimality_ratio']:.4f} worst "
                   f"(vs {', '.join(r['reference'])}); GAHC cached {r['gahc_cached_time_s']:.2f} s "
                   f"ratio {r['gahc_cached_optimality_ratio']:.3f}")


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
