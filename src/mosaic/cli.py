"""The `mosaic` command: models, plan, train, profile, model-error, bench-planner, bench.

Every user error ends as one line on stderr and exit status 2, never a traceback: our own
(MosaicError) and click's usage errors alike (see `main`). Arguments are checked before any
work: fixed choices are enums, names and output paths are checked by option callbacks, which
run while the command line is parsed.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from mosaic.errors import MosaicError
from mosaic.files import check_out_dir, check_out_file
from mosaic.hardware import GPUS, GPUS_PER_NODE, MAX_GPUS
from mosaic.perf import PERF_MODELS
from mosaic.zoo import MODEL_NAMES, PRESETS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and train multimodal models with modules colocated on GPUs (SM quotas).")

DEFAULT_PLANNERS = "megatron,distmm,spindle,mosaic"


def _fail(message: str) -> None:
    typer.echo(f"mosaic: error: {message}", err=True)
    raise typer.Exit(2)


class OptionError(MosaicError):
    """A command-line value that cannot work; the message names the option and the fix."""


# Fixed choices: typer lists them in --help and refuses anything else (a usage error, exit 2)
# before the command runs. Built from the tables the code itself accepts, so a new preset,
# GPU or performance model needs no edit here.
PresetName = StrEnum("PresetName", {name: name for name in PRESETS})
HardwareName = StrEnum("HardwareName", {name: name for name in GPUS})
PerfModelName = StrEnum("PerfModelName", {name: name for name in PERF_MODELS})


def _zoo_model(value: str) -> str:
    from mosaic.zoo import get_model

    get_model(value)  # GraphError naming the valid models; imports no torch
    return value


def _model_or_graph(value: str) -> str:
    if value.endswith(".json"):
        if not Path(value).is_file():
            raise OptionError(f"MODEL {value}: no such graph file; pass an MMGraph JSON file "
                              f"or a zoo model ({', '.join(MODEL_NAMES)})")
        return value
    return _zoo_model(value)


def _zoo_models(values: list[str]) -> list[str]:
    return [_zoo_model(v) for v in values]


def _planner_names(value: str) -> list[str]:
    from mosaic.planners import PLANNERS

    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANNERS]
    if unknown or not names:
        raise OptionError(f"--planners {value!r}: unknown planner(s) {', '.join(unknown) or '(none given)'}; "
                          f"choose from {', '.join(PLANNERS)} (comma-separated)")
    return names


def _check_planners(value: str) -> str:
    _planner_names(value)
    return value


def _check_planner(value: str | None) -> str | None:
    if value is not None:
        _planner_names(value)
    return value


def _sm_steps(value: str) -> list[float | None]:
    """`hw` (the hardware's 8-SM grid) or SM-share steps in (0, 1], comma-separated."""
    steps: list[float | None] = []
    for item in (s.strip() for s in value.split(",") if s.strip()):
        try:
            step = None if item == "hw" else float(item)
        except ValueError:
            step = -1.0
        if step is not None and not 0 < step <= 1:
            raise OptionError(f"--sm-steps {value}: {item!r} is not a share in (0, 1] nor 'hw'; "
                              f"give e.g. 0.25,0.125 or hw (the 8-SM grid)")
        steps.append(step)
    if not steps:
        raise OptionError("--sm-steps is empty; give e.g. 0.25,0.125 or hw (the 8-SM grid)")
    return steps


def _check_sm_steps(value: str) -> str:
    _sm_steps(value)
    return value


def _out_dir(value: Path | None) -> Path | None:
    return None if value is None else check_out_dir(value, "--out")


def _out_file(option: str):
    def check(value: Path | None) -> Path | None:
        return None if value is None else check_out_file(value, option)

    return check


def _has_cuda() -> bool:
    """torch.cuda.is_available(), without the seconds of importing torch on a Linux machine
    that has no NVIDIA device node at all (where the answer cannot be yes; WSL2 has /dev/dxg)."""
    nodes = [*Path("/dev").glob("nvidia[0-9]*"), Path("/dev/dxg")]
    if sys.platform.startswith("linux") and not any(p.exists() for p in nodes):
        return False
    import torch

    return torch.cuda.is_available()


def _check_gpus_useful(gpus: int, graph) -> None:
    """Refuse GPU counts no plan can use (make_cluster refuses absurd ones). Data parallelism
    splits a module's batch over at most `global_batch` GPUs, and at most every module runs
    at once on GPUs of its own, so no plan uses more than global_batch x modules. (Not just
    global_batch: the paper presets plan batch 2 on 8 GPUs, a module per GPU group.) One node
    is always accepted: it is what one has, even when a plan leaves some of it idle."""
    modules = len(graph.modules)
    useful = graph.global_batch * modules
    if gpus > max(useful, GPUS_PER_NODE):
        raise OptionError(
            f"--gpus {gpus}: no plan can use more than {useful} GPUs here, since data parallelism "
            f"splits the global batch of {graph.global_batch} over at most {graph.global_batch} "
            f"GPUs per module ({modules} modules); use --gpus {useful} or fewer, or "
            f"--batch {-(-gpus // modules)} or more")


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
def models(preset: Annotated[PresetName, typer.Option(help="size of the zoo models")] = PresetName.paper,
           as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the model zoo with per-module parameters and FLOPs."""
    from mosaic.report.tables import models_table
    from mosaic.zoo import get_model

    graphs = [get_model(name).graph(str(preset)) for name in MODEL_NAMES]
    if as_json:
        typer.echo(json.dumps([g.to_dict() for g in graphs], indent=2))
        return
    models_table(graphs)


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="zoo model name, or a graph .json file",
                                         callback=_model_or_graph)],
    gpus: Annotated[int, typer.Option(help="number of GPUs")] = 8,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind", case_sensitive=False)] = HardwareName.h200,
    preset: Annotated[PresetName, typer.Option(help="size of a zoo model")] = PresetName.paper,
    batch: Annotated[int | None, typer.Option(min=1, help="global batch (default: the preset's)")] = None,
    planners: Annotated[str, typer.Option(help="comma-separated planners",
                                          callback=_check_planners)] = DEFAULT_PLANNERS,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    out: Annotated[Path | None, typer.Option(help="directory for plan JSON and timeline PNGs",
                                             callback=_out_dir)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Plan MODEL on GPUS with every planner; compare predicted iteration times."""
    from mosaic.hardware import make_cluster
    from mosaic.planners import plan_all

    cluster = make_cluster(gpus, str(hardware))
    graph = load_graph(model, str(preset), batch)
    _check_gpus_useful(gpus, graph)
    out = check_out_dir(out or Path("runs") / f"plan-{graph.name}-{gpus}")
    perf = load_perf_model(str(perf_model), cluster, str(preset))
    plans = plan_all(graph, cluster, perf, _planner_names(planners))
    _emit_plans(plans, graph, perf, out, str(hardware), as_json)


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
    model: Annotated[str, typer.Argument(help="zoo model name, or a graph .json file",
                                         callback=_model_or_graph)],
    plan_file: Annotated[Path, typer.Option("--plan", help="plan JSON (hand-written or from `mosaic plan`)")],
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind", case_sensitive=False)] = HardwareName.h200,
    preset: Annotated[PresetName, typer.Option(help="size of a zoo model")] = PresetName.paper,
    batch: Annotated[int | None, typer.Option(min=1, help="global batch (default: the preset's)")] = None,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    out: Annotated[Path | None, typer.Option(help="directory for the timeline PNG and trace",
                                             callback=_out_dir)] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Validate a plan and predict its iteration time on any cluster size."""
    from mosaic.hardware import make_cluster
    from mosaic.plan import Plan

    plan_obj = Plan.load(plan_file)
    cluster = make_cluster(plan_obj.num_gpus, str(hardware))
    graph = load_graph(model, str(preset), batch)
    out = check_out_dir(out or Path("runs") / f"simulate-{graph.name}-{plan_obj.num_gpus}")
    perf = load_perf_model(str(perf_model), cluster, str(preset))
    predicted = perf.predict(plan_obj.validate(graph, cluster), graph)
    _emit_plans([predicted], graph, perf, out, str(hardware), as_json)


@app.command()
def train(
    model: Annotated[str, typer.Argument(help="zoo model name", callback=_zoo_model)],
    plan_file: Annotated[Path | None, typer.Option("--plan", help="plan JSON to train with")] = None,
    planner: Annotated[str | None, typer.Option(help="plan with this planner instead of --plan",
                                                callback=_check_planner)] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs (= processes); default: the world size")] = None,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 20,
    preset: Annotated[PresetName, typer.Option(help="size of the zoo model")] = PresetName.tiny,
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    metrics: Annotated[Path | None, typer.Option(help="JSONL file, one line per step",
                                                 callback=_out_file("--metrics"))] = None,
    graphs: Annotated[bool, typer.Option(help="per-module CUDA graphs (GPU)")] = False,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-4,
    seed: Annotated[int, typer.Option(help="seed of weights and synthetic data")] = 0,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind (for planning)",
                                                   case_sensitive=False)] = HardwareName.h200,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    compile_mode: Annotated[str | None, typer.Option("--compile", help="Inductor per module: default | max-autotune-no-cudagraphs (GPU)")] = None,
    grad_sync: Annotated[str, typer.Option(help="ddp | bucketed")] = "ddp",
    reduce_dtype: Annotated[str, typer.Option(help="gradient all-reduce precision: fp32 | bf16")] = "fp32",
    accumulation: Annotated[int, typer.Option(help="gradient-accumulation micro-steps per step")] = 1,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="directory for atomic checkpoints (torch.distributed.checkpoint)")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="checkpoint every K steps (and at the end); 0: only at the end")] = 0,
    resume: Annotated[bool, typer.Option(help="continue from the latest checkpoint in --checkpoint-dir")] = False,
    out: Annotated[Path | None, typer.Option(help="directory for summary.json and plan.json",
                                             callback=_out_dir)] = None,
) -> None:
    """Train MODEL with a plan: `torchrun --standalone --nproc-per-node N -m mosaic train ...`."""
    import torch

    from mosaic.api import plan_on_rank0
    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.engine.session import EngineConfig, start_distributed
    from mosaic.engine.trainer import train_from_cli
    from mosaic.zoo import get_model

    d = start_distributed(None)  # planning on rank 0 needs the world to broadcast to
    try:
        plan_obj = None
        if plan_file is None:
            graph = get_model(model).graph(preset, global_batch=batch)
            plan_obj = plan_on_rank0(graph, gpus or d.world_size, d.device, hardware=hardware,
                                     planner=planner or "mosaic", perf_model=perf_model)
        engine = EngineConfig(graphs=graphs, compile=compile_mode, grad_sync=grad_sync,
                              reduce_dtype=reduce_dtype, accumulation=accumulation)
        ckpt = (CheckpointConfig(directory=str(checkpoint_dir), every_steps=checkpoint_every)
                if checkpoint_dir else None)
        result = train_from_cli(model, preset, str(plan_file) if plan_file else None, gpus, steps,
                                str(metrics) if metrics else None, plan=plan_obj, engine=engine,
                                lr=lr, seed=seed, global_batch=batch, hardware=hardware,
                                checkpoint=ckpt, resume=resume)
    finally:
        if d.owns_group:
            torch.distributed.destroy_process_group()
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
    model: Annotated[str, typer.Argument(help="zoo model name", callback=_zoo_model)],
    gpus: Annotated[int, typer.Option(help="GPUs (this command runs one process: 1)")] = 1,
    preset: Annotated[PresetName, typer.Option(help="size of the zoo model")] = PresetName.small,
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    planners: Annotated[str, typer.Option(help="comma-separated planners",
                                          callback=_check_planners)] = DEFAULT_PLANNERS,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind", case_sensitive=False)] = HardwareName.h200,
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 6,
    steps_per_round: Annotated[int, typer.Option(help="timed steps per plan per round")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed steps per plan first")] = 5,
    graphs: Annotated[bool, typer.Option(help="per-module CUDA graphs")] = True,
    compile_mode: Annotated[str, typer.Option("--compile", help="Inductor per module before capture: auto (default on a GPU, none on CPU) | default | max-autotune-no-cudagraphs | none")] = "auto",
    grad_sync: Annotated[str, typer.Option(help="ddp | bucketed")] = "ddp",
    reduce_dtype: Annotated[str, typer.Option(help="gradient all-reduce precision: fp32 | bf16")] = "fp32",
    accumulation: Annotated[int, typer.Option(help="gradient-accumulation micro-steps per step")] = 1,
    user_programs: Annotated[str, typer.Option(help="the user's own programs to measure too: torch-eager,torch-compile (empty: none)")] = "torch-eager,torch-compile",
    plans_dir: Annotated[Path | None, typer.Option("--plans", help="measure the plan JSONs in this "
                                                   "directory (from `mosaic plan --out`) instead of planning")] = None,
    cpu_smoke: Annotated[bool, typer.Option("--cpu-smoke", help="run on CPU with tiny settings "
                                            "(1 round, 1 step, no CUDA graphs): checks that it "
                                            "runs, measures nothing")] = False,
    out: Annotated[Path | None, typer.Option(help="directory for results JSON and timelines",
                                             callback=_out_dir)] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Plan MODEL with every planner and train each plan, and the user's own program (eager and
    torch.compile), in one run: measured vs predicted, gradients checked equal first."""
    if cpu_smoke:
        rounds, steps_per_round, warmup, graphs = 1, 1, 1, False
    elif not _has_cuda():  # refuse now, not after planning and building
        _fail("mosaic bench measures on CUDA GPUs and this machine has none; run it on a GPU "
              "machine, or pass --cpu-smoke to check on CPU that it runs")
    import torch

    from mosaic.engine.comm import share_from_rank0
    from mosaic.engine.measure import BenchConfig, bench_report, measure_plans
    from mosaic.engine.session import EngineConfig, start_distributed
    from mosaic.hardware import make_cluster
    from mosaic.perf import make_perf_model
    from mosaic.plan import Plan
    from mosaic.planners import plan_all
    from mosaic.report.bench_report import print_bench_table, write_bench_artifacts
    from mosaic.zoo import get_model

    cluster = make_cluster(gpus, hardware)
    zoo_model = get_model(model)
    graph = zoo_model.graph(preset, global_batch=batch)
    perf = make_perf_model(perf_model, cluster, preset=preset)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    users = tuple(n.strip() for n in user_programs.split(",") if n.strip() not in ("", "none"))
    config = BenchConfig(rounds=rounds, steps_per_round=steps_per_round, warmup_steps=warmup,
                         engine=EngineConfig(graphs=graphs, compile=_compile_mode(compile_mode),
                                             grad_sync=grad_sync, reduce_dtype=reduce_dtype,
                                             accumulation=accumulation),
                         user_programs=users)

    def make_plans() -> dict:
        if plans_dir is None:
            plans = {p.planner: p for p in plan_all(graph, cluster, perf, names)}
        else:
            plans = {k: perf.predict(p, graph)
                     for k, p in load_plans(plans_dir, names, graph, cluster).items()}
        return {k: p.to_dict() for k, p in plans.items()}

    d = start_distributed(None)
    try:
        plans = {k: Plan.from_dict(v) for k, v in share_from_rank0(make_plans, d.device).items()}
        measurements, checks = measure_plans(zoo_model, preset, graph, plans, cluster.gpu, config)
    finally:
        if d.owns_group:
            torch.distributed.destroy_process_group()
    if d.rank != 0:
        return
    report = bench_report(graph, measurements, cluster.gpu, preset, gpus)
    report["perf_model"] = perf.describe()
    report["checks"] = checks
    report["engine"] = {"graphs": graphs, "compile": _compile_mode(compile_mode), "grad_sync": grad_sync,
                        "reduce_dtype": reduce_dtype, "accumulation": accumulation}
    out = out or Path("runs") / f"bench-{graph.name}-{preset}-{gpus}"
    write_bench_artifacts(report, measurements, out)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        print_bench_table(report)


def _compile_mode(name: str) -> str | None:
    """`auto`: Inductor on a GPU (fusion pays there), none on a CPU (compile time dominates)."""
    import torch

    if name == "auto":
        return "default" if torch.cuda.is_available() else None
    return None if name == "none" else name


@app.command()
def profile(
    models_: Annotated[list[str], typer.Argument(metavar="MODEL...", help="zoo models to profile",
                                                 callback=_zoo_models)],
    preset: Annotated[PresetName, typer.Option(help="size of the zoo models")] = PresetName.small,
    hardware: Annotated[HardwareName, typer.Option(help="the GPU this runs on",
                                                   case_sensitive=False)] = HardwareName.h200,
    db: Annotated[Path, typer.Option(help="ProfileDB to write (SQLite; replaced when done)",
                                     callback=_out_file("--db"))] = Path("runs/profile.sqlite"),
    budget_s: Annotated[float, typer.Option("--budget", min=1.0, help="wall-clock seconds for profiling")] = 220.0,
) -> None:
    """Measure scaling surfaces and colocations on this GPU into a ProfileDB (needs CUDA)."""
    from mosaic.files import atomic_path
    from mosaic.profile.profiler import ProfilerConfig, profile_models

    if not _has_cuda():  # refuse now, before the profiler builds anything
        _fail("mosaic profile measures on a CUDA GPU and this machine has none; run it on the "
              "GPU to profile, or plan here with the shipped profile (--perf-model profiled)")
    db.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(db) as tmp:  # the old DB stays until the new one is complete
        reports = profile_models(models_, str(tmp), ProfilerConfig(
            hardware=str(hardware), preset=str(preset), budget_s=budget_s))
    for r in reports:
        typer.echo(f"{r.model}: {r.points} of {r.full_grid} grid points, {r.colocations} "
                   f"colocations, {r.wall_s:.1f} s{'; ' + '; '.join(r.notes) if r.notes else ''}")
    typer.echo(f"wrote {db}")


@app.command("model-error")
def model_error(
    db: Annotated[Path | None, typer.Option(help="ProfileDB (default: the shipped one)")] = None,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind of the shipped DB",
                                                   case_sensitive=False)] = HardwareName.h200,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    iterations: Annotated[Path | None, typer.Option(
        "--iterations", help="instead: whole-iteration error of the `mosaic bench` results "
        "JSON under this directory, gated (<=10% each, median <=5%); a report, exit 0")] = None,
) -> None:
    """Prediction error on held-out measured points: aware vs unaware vs linear interference."""
    from mosaic.perf.accuracy import model_error as compute
    from mosaic.perf.accuracy import print_model_error
    from mosaic.profile.db import default_db_path

    if iterations is not None:
        from mosaic.perf.accuracy import iteration_error, print_iteration_error

        report = iteration_error(iterations)
        if as_json:
            typer.echo(json.dumps(report, indent=2))
        else:
            print_iteration_error(report)
        return
    result = compute(db or default_db_path(hardware))
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_model_error(result)


@app.command("bench-planner")
def bench_planner(
    modules: Annotated[int, typer.Option(min=1, help="modules of the synthetic graphs")] = 8,
    gpus: Annotated[int, typer.Option(min=1, max=MAX_GPUS, help="GPUs")] = 8,
    sm_steps: Annotated[str, typer.Option(help="comma-separated SM-share steps in (0, 1]; 'hw' = "
                                          "8-SM granularity", callback=_check_sm_steps)] = "hw",
    seeds: Annotated[int, typer.Option(min=1, help="seeded graphs per configuration")] = 3,
    exhaustive_limit_s: Annotated[float, typer.Option(min=0.1, help="exhaustive search budget per graph")] = 60.0,
    plot: Annotated[Path | None, typer.Option(help="PNG of search time and optimality",
                                              callback=_out_file("--plot"))] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Planner search time and optimality ratio vs exhaustive (or the best known) on synthetic graphs."""
    from mosaic.hardware import make_cluster
    from mosaic.planners.search_bench import bench_planner as run
    from mosaic.planners.search_bench import plot_bench

    make_cluster(gpus)  # a GPU count that is not whole nodes fails here, before any search
    rows = run(modules, gpus, _sm_steps(sm_steps), seeds=tuple(range(seeds)),
               exhaustive_time_limit_s=exhaustive_limit_s)
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


# click's exceptions as typer raises them: typer >= 0.2x vendors click as `typer._click`, older
# typer uses `click` itself; BadParameter is exported by both and lives beside the others.
_click_errors = importlib.import_module(typer.BadParameter.__module__)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors -- ours (MosaicError) and click's usage errors (bad
    choice, missing argument) -- become one line on stderr and exit status 2; bugs keep their
    traceback. Not standalone mode, so click's errors reach us instead of its usage box."""
    from mosaic.errors import is_user_error

    try:
        code = app(args=argv, prog_name="mosaic", standalone_mode=False)
    except ValueError as exc:
        if not is_user_error(exc):
            raise
        _exit_one_line(str(exc), 2)
    except _click_errors.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `mosaic`: the help, as before
            exc.show()
            sys.exit(exc.exit_code)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        _exit_one_line(exc.format_message() + hint, exc.exit_code)
    except typer.Abort:  # Ctrl-D at a prompt, as typer raises it
        _exit_one_line("aborted", 1)
    sys.exit(code if isinstance(code, int) else 0)


def _exit_one_line(message: str, code: int) -> None:
    typer.echo(f"mosaic: error: {' '.join(message.split())}", err=True)
    sys.exit(code)
