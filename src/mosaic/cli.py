"""The `mosaic` command: models, plan, train, profile, model-error, bench-planner, bench.

Every user error ends as one line on stderr and exit status 2, never a traceback: our own
(MosaicError) and click's usage errors alike (see `main`). Arguments are checked before any
work: fixed choices are enums, names and output paths are checked by option callbacks, which
run while the command line is parsed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from mosaic.data import DATASETS
from mosaic.engine.schedule import DECAYS
from mosaic.errors import MosaicError
from mosaic.files import check_out_dir, check_out_file
from mosaic.graph import (
    BF16_GRAD_BYTES,
    BF16_MOMENT_BYTES,
    BF16_WEIGHT_STATE_BYTES,
    FP32_MOMENT_BYTES,
    MAIN_WEIGHT_BYTES,
)
from mosaic.hardware import GPUS, GPUS_PER_NODE, MAX_GPUS
from mosaic.perf import PERF_MODELS
from mosaic.profile.db import KERNELS
from mosaic.zoo import MODEL_NAMES, PRESETS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan and train multimodal models with modules colocated on GPUs (SM quotas).")

DEFAULT_PLANNERS = "megatron,distmm,spindle,mosaic"


EXIT_INTERRUPTED = 128 + 15
"""Exit status of a command stopped by SIGTERM after writing what it had (the shell's
convention for a process ended by that signal)."""


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"mosaic: error: {message}", err=True)
    raise typer.Exit(code)


class OptionError(MosaicError):
    """A command-line value that cannot work; the message names the option and the fix."""


# Fixed choices: typer lists them in --help and refuses anything else (a usage error, exit 2)
# before the command runs. Built from the tables the code itself accepts, so a new preset,
# GPU or performance model needs no edit here.
PresetName = StrEnum("PresetName", {name: name for name in PRESETS})
HardwareName = StrEnum("HardwareName", {name: name for name in GPUS})
PerfModelName = StrEnum("PerfModelName", {name: name for name in PERF_MODELS})
DataName = StrEnum("DataName", {name: name for name in DATASETS})
LRDecay = StrEnum("LRDecay", {name: name for name in DECAYS})
KernelsName = StrEnum("KernelsName", {name: name for name in KERNELS})
ProfileDbOption = Annotated[Path | None, typer.Option(
    "--profile-db", help="ProfileDB to predict from (`mosaic profile --db`; default: the one "
    "shipped for --hardware)")]
CompileScopeName = StrEnum("CompileScopeName", {name: name for name in ("module", "blocks")})
"""engine.compile.COMPILE_SCOPES, named here without importing torch (`mosaic plan` does not)."""
CompileScopeOption = Annotated[CompileScopeName, typer.Option(
    help="module: one torch.compile per module | blocks: one per repeated layer (compile time "
    "independent of depth)")]
GradSyncName = StrEnum("GradSyncName", {name: name for name in ("flat", "overlapped", "ddp",
                                                                 "bucketed")})
"""engine.runner.GRAD_SYNC, named here without importing torch (`mosaic plan` does not)."""
GradSyncOption = Annotated[GradSyncName, typer.Option(
    help="how data-parallel gradients are summed: flat (one buffer per module, one all-reduce "
    "after its backward; fastest measured) | overlapped (that buffer all-reduced bucket by "
    "bucket during the backward, inside its CUDA graph; not yet measured on GPUs) | ddp (DDP per "
    "module) | bucketed (the old bucketed all-reduce)")]


def _check_resume(value: str | None) -> bool | str:
    """`--resume` alone: a checkpoint must exist; `--resume auto`: resume if one does."""
    if value is None:
        return False
    if value not in ("yes", "auto"):
        raise OptionError(f"--resume {value}: write `--resume` (a checkpoint must exist) or "
                          "`--resume auto` (resume when one exists, else start fresh)")
    return True if value == "yes" else "auto"


def _zoo_model(value: str) -> str:
    from mosaic.zoo import get_model

    get_model(value)  # GraphError naming the valid models; imports no torch
    return value


def _model_or_graph(value: str) -> str:
    if value.endswith(".json") or ".json#" in value:
        if not Path(value.partition("#")[0]).is_file():
            raise OptionError(f"MODEL {value}: no such graph file; pass an MMGraph JSON file "
                              f"or a zoo model ({', '.join(MODEL_NAMES)})")
        return value
    return _zoo_model(value)


def _zoo_models(values: list[str] | None) -> list[str]:
    return [_zoo_model(v) for v in values or []]


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


def _check_tensorboard(value: Path | None) -> Path | None:
    """Refuse --tensorboard now, not after set-up, when the package that writes it is absent."""
    import importlib.util

    if value is not None and importlib.util.find_spec("tensorboard") is None:
        raise OptionError(f"--tensorboard {value} needs the tensorboard package: "
                          "pip install tensorboard, or drop --tensorboard")
    return _out_dir(value)


def _out_dir_of(option: str):
    def check(value: Path | None) -> Path | None:
        return None if value is None else check_out_dir(value, option)

    return check


_out_dir = _out_dir_of("--out")


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


def _check_gpus_useful(cluster, graph) -> None:
    """Refuse GPU counts no plan can use (make_cluster refuses absurd ones). Data parallelism
    splits a module's batch over at most `global_batch` replicas, each on as many GPUs as its
    largest TP degree inside a node, and at most every module runs at once on GPUs of its
    own, so no plan uses more than global_batch x the modules' summed TP degrees. (Not just
    global_batch: the paper presets plan batch 2 on 8 GPUs, a module per GPU group.) One node
    is always accepted: it is what one has, even when a plan leaves some of it idle."""
    from mosaic import tensor_parallel as tp

    gpus = cluster.num_gpus
    widest = sum(max(tp.degrees(m, cluster)) for m in graph.modules)
    useful = graph.global_batch * widest
    if gpus > max(useful, GPUS_PER_NODE):
        raise OptionError(
            f"--gpus {gpus}: no plan can use more than {useful} GPUs here, since data parallelism "
            f"splits the global batch of {graph.global_batch} over at most {graph.global_batch} "
            f"replicas per module, and one replica of each of the {len(graph.modules)} modules "
            f"takes {widest} GPUs at most (tensor parallelism included); use --gpus {useful} or "
            f"fewer, or --batch {-(-gpus // widest)} or more")


def load_graph(model: str, preset: str, global_batch: int | None = None):
    """A zoo model by name, or a custom graph from a JSON file."""
    from mosaic.graph import MMGraph

    path_text, _, wanted = model.partition("#")
    if path_text.endswith(".json"):
        path = Path(path_text)
        if not path.exists():
            _fail(f"graph file {path} does not exist")
        graph = MMGraph.from_json(_one_graph(path, wanted))
        return graph if global_batch is None else replace(graph, global_batch=global_batch)
    from mosaic.zoo import get_model

    return get_model(model).graph(preset, global_batch=global_batch)


def _one_graph(path: Path, wanted: str) -> str:
    """The graph JSON text in `path`: the file's one graph, or from a list (what `mosaic models
    --json` writes) the only one or the one named after '#' (`graphs.json#clip`)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _fail(f"graph file {path}: not valid JSON ({exc})")
    if not isinstance(data, list):
        return json.dumps(data)
    names = [g.get("name") for g in data if isinstance(g, dict)]
    if wanted in names:
        return json.dumps(data[names.index(wanted)])
    if len(data) == 1 and not wanted:
        return json.dumps(data[0])
    _fail(f"graph file {path} holds graphs {names}: pick one with {path}#NAME")


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


def load_perf_model(name: str, cluster, preset: str = "small", db: Path | None = None, **kwargs):
    """`auto`: the measured profile (`db`, else the one shipped for this hardware when there
    is one), else analytic."""
    from mosaic.perf import make_perf_model

    if db is not None and name == "analytic":
        raise OptionError("--profile-db is read by the profiled model; drop --perf-model "
                          "analytic (or --profile-db)")
    return make_perf_model(name, cluster, preset=preset, db=db, **kwargs)


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


_BF16_WEIGHT_FLAGS = {
    "--no-bf16-flat-grads": "chooses how bf16 weights are updated",
    "--bf16-moments": "keeps the bf16 weights' AdamW moments in bf16",
    "--no-fp32-main-weights": "drops the bf16 weights' fp32 copies",
}


def _require_bf16_weights(bf16_weights: bool, given: dict[str, bool]) -> None:
    """The flags that say how bf16 weights are kept or updated need --bf16-weights."""
    for flag, asked in given.items():
        if asked and not bf16_weights:
            raise OptionError(f"{flag} {_BF16_WEIGHT_FLAGS[flag]}: add --bf16-weights, or "
                              "drop it")


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="zoo model name, or a graph .json file",
                                         callback=_model_or_graph)],
    gpus: Annotated[int, typer.Option(help="number of GPUs")] = 8,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind", case_sensitive=False)] = HardwareName.h200,
    preset: Annotated[PresetName, typer.Option(help="size of a zoo model: paper, small or tiny")] = PresetName.paper,
    batch: Annotated[int | None, typer.Option(min=1, help="global batch (default: the preset's)")] = None,
    planners: Annotated[str, typer.Option(help="comma-separated planners",
                                          callback=_check_planners)] = DEFAULT_PLANNERS,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    profile_db: ProfileDbOption = None,
    compile_scope: CompileScopeOption = CompileScopeName.module,
    grad_sync: GradSyncOption = GradSyncName.flat,
    bf16_weights: Annotated[bool, typer.Option(
        help="predict for `mosaic train --bf16-weights` (bf16 GEMM weights, fp32 main weights; "
        "its gradients summed in bf16 on several GPUs) with the flat update; a note names the "
        "plans train would update a weight at a time, with their prediction so")] = False,
    bf16_moments: Annotated[bool, typer.Option(
        help="with --bf16-weights: predict for their AdamW moments kept in bf16 too "
        "(`mosaic train --bf16-moments`)")] = False,
    fp32_main_weights: Annotated[bool, typer.Option(
        "--fp32-main-weights/--no-fp32-main-weights",
        help="with --bf16-weights: predict for fp32 main copies of them (default) or none "
        "(`mosaic train --no-fp32-main-weights`)")] = True,
    per_weight_update: Annotated[bool, typer.Option(
        "--no-bf16-flat-grads",
        help="with --bf16-weights: predict and count memory for `mosaic train "
        "--no-bf16-flat-grads` (updated a weight at a time: no flat copy of the gradients, 2 "
        "bytes a weight); by default the flat update, with a note for each plan train would "
        "update a weight at a time")] = False,
    out: Annotated[Path | None, typer.Option(help="directory for plan JSON and timeline PNGs",
                                             callback=_out_dir)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Plan MODEL on GPUS with every planner; compare predicted iteration times (for the GPU
    engine `mosaic train` runs with the same --compile-scope and --bf16-weights)."""
    from mosaic.hardware import make_cluster
    from mosaic.planners import plan_all

    _require_bf16_weights(bf16_weights, {"--no-bf16-flat-grads": per_weight_update,
                                         "--bf16-moments": bf16_moments,
                                         "--no-fp32-main-weights": not fp32_main_weights})
    cluster = make_cluster(gpus, str(hardware))
    graph = load_graph(model, str(preset), batch).with_precision(
        bf16_weights=bf16_weights, bf16_moments=bf16_moments,
        bf16_flat_grads=not per_weight_update, fp32_main_weights=fp32_main_weights)
    _check_gpus_useful(cluster, graph)
    out = check_out_dir(out or Path("runs") / f"plan-{graph.name}-{gpus}")
    def perf_for(per_weight: bool = False):
        return load_perf_model(str(perf_model), cluster, str(preset), profile_db,
                               engine=planned_engine_kind(gpus, str(compile_scope), bf16_weights,
                                                          per_weight, bf16_moments,
                                                          fp32_main_weights, str(grad_sync)))

    perf = perf_for(per_weight=per_weight_update)
    plans = plan_all(graph, cluster, perf, _planner_names(planners))
    flags = ("--bf16-weights" + (" --bf16-moments" if bf16_moments else "")
             + ("" if fp32_main_weights else " --no-fp32-main-weights"))
    notes = (_update_layout_notes(plans, graph, perf, perf_for, flags)
             if bf16_weights and not per_weight_update else [])
    _emit_plans(plans, graph, perf, out, str(hardware), as_json, notes)


def _update_layout_notes(plans, graph, perf, perf_for, flags: str) -> list[str]:
    """For each plan that `mosaic train` with `flags` would update a weight at a time
    (predicted_update_layout's choice), its prediction so."""
    notes, per_weight_perf = [], None
    for plan in plans:
        saving = per_weight_saving_s(plan, graph, perf)
        if saving is None:
            continue
        per_weight_perf = per_weight_perf or perf_for(per_weight=True)
        notes.append(f"{plan.planner}: `mosaic train {flags}` updates this plan a weight at a "
                     f"time (predicted {saving * 1e3:.2f} ms a step faster than the flat update):"
                     f" {per_weight_perf.iteration_time_s(plan, graph) * 1e3:.2f} ms")
    return notes


def planned_engine_kind(gpus: int, compile_scope: str = "module", bf16_weights: bool = False,
                        per_weight_update: bool = False, bf16_moments: bool = False,
                        fp32_main_weights: bool = True, grad_sync: str = "flat") -> str:
    """The engine kind `mosaic plan` predicts for: the GPU engine `mosaic train` runs with
    these settings (with bf16 weights, data-parallel gradients summed in bf16, which train
    requires of them; the flat update unless `per_weight_update`)."""
    from mosaic.perf.engine_term import GPU_ENGINE, engine_kind

    return engine_kind({**GPU_ENGINE, "compile_scope": compile_scope, "grad_sync": grad_sync,
                        "bf16_weights": bf16_weights,
                        "reduce_dtype": "bf16" if bf16_weights else GPU_ENGINE["reduce_dtype"],
                        "bf16_flat_grads": not per_weight_update,
                        "bf16_moments": bf16_moments,
                        "fp32_main_weights": fp32_main_weights}, gpus)


def _emit_plans(plans, graph, perf, out: Path, hardware: str, as_json: bool,
                notes: list[str] | None = None) -> None:
    """Plan JSON, Gantt PNG and trace per plan into `out`; the summary as a table or JSON,
    with `notes` (in JSON: "notes")."""
    from mosaic.report.plans import plans_summary, write_plan_artifacts
    from mosaic.report.tables import print_plan_table

    files = write_plan_artifacts(plans, graph, perf, out)
    summary = plans_summary(plans, graph, perf, files, hardware=hardware)
    summary["coverage"] = _coverage(plans, graph, perf)
    summary["notes"] = [*_split_notes(plans), *(notes or [])]
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    print_plan_table(summary)
    for note in summary["coverage"] + summary["notes"]:
        typer.echo(f"note: {note}")


def _split_notes(plans) -> list[str]:
    """How each planner fit the modules that fit no GPU whole: TP or sharded states, both
    planned (planners.shard_fallback.plan_fitting), with each way's predicted step."""
    ways = {"tensor_parallel": "split by tensor parallelism", "sharded": "with states sharded (FSDP2)"}

    def predicted(found) -> str:
        return f"predicted {found:.2f} ms" if isinstance(found, float) else "no plan fits"

    notes = []
    for plan in plans:
        split = plan.meta.get("split_by")
        if split:
            other = next(w for w in ways if w != split["chose"])
            notes.append(f"{plan.planner}: {', '.join(split['modules'])} fit a GPU "
                         f"{ways[split['chose']]}, {predicted(split[split['chose']])}; "
                         f"{ways[other]} instead: {predicted(split[other])}")
    return notes


def _coverage(plans, graph, perf) -> list[str]:
    """Where the predictions leave the profile's measurements (batches outside the measured
    range, modules without a surface of the engine's kernels): said, not silently guessed."""
    notes = getattr(perf, "coverage_notes", None)
    if notes is None:
        return []
    return sorted({n for p in plans for n in notes(p, graph)})


@app.command()
def simulate(
    model: Annotated[str, typer.Argument(help="zoo model name, or a graph .json file",
                                         callback=_model_or_graph)],
    plan_file: Annotated[Path | None, typer.Option("--plan", help="plan JSON (hand-written or from "
                                                   "`mosaic plan`); without it, plan with --planner")] = None,
    gpus: Annotated[int | None, typer.Option(min=1, max=MAX_GPUS, help="GPUs (default: the plan's, "
                                             "else 8)")] = None,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node (NVLink inside, "
                                               "InfiniBand between)")] = GPUS_PER_NODE,
    planner: Annotated[str, typer.Option(help="planner when there is no --plan",
                                         callback=_check_planner)] = "mosaic",
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind", case_sensitive=False)] = HardwareName.h200,
    preset: Annotated[PresetName, typer.Option(help="size of a zoo model: paper, small or tiny")] = PresetName.paper,
    batch: Annotated[int | None, typer.Option(min=1, help="global batch (default: the preset's; "
                                              "planned here: the preset's per node x nodes)")] = None,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    profile_db: ProfileDbOption = None,
    overlap: Annotated[bool, typer.Option(help="start each group's all-reduce when its own GPUs are "
                                          "done (the model waits for the stage)")] = False,
    grad_sync: GradSyncOption = GradSyncName.flat,
    out: Annotated[Path | None, typer.Option(help="directory for the plan, trace and summary",
                                             callback=_out_dir)] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Simulate one iteration of a plan as per-GPU stream events: time, utilisation, trace."""
    from mosaic.hardware import make_cluster
    from mosaic.plan import Plan

    plan_obj = Plan.load(plan_file) if plan_file is not None else None
    if plan_obj is not None and gpus not in (None, plan_obj.num_gpus):
        _fail(f"--gpus {gpus}: the plan in {plan_file} is for {plan_obj.num_gpus} GPUs; "
              "drop --gpus or plan again")
    num_gpus = plan_obj.num_gpus if plan_obj is not None else gpus or GPUS_PER_NODE
    cluster = make_cluster(num_gpus, str(hardware), gpus_per_node)
    if plan_obj is None and batch is None:  # weak scaling: the preset's batch per node
        batch = load_graph(model, str(preset)).global_batch * cluster.num_nodes
    graph = load_graph(model, str(preset), batch)
    if plan_obj is None:
        _check_gpus_useful(cluster, graph)
    out = check_out_dir(out or Path("runs") / f"simulate-{graph.name}-{num_gpus}")
    perf = load_perf_model(str(perf_model), cluster, str(preset), profile_db,
                           engine=planned_engine_kind(num_gpus, grad_sync=str(grad_sync)))
    if plan_obj is None:
        from mosaic.planners import make_plan

        plan_obj = make_plan(graph, cluster, planner, perf)
    predicted = perf.predict(plan_obj.validate(graph, cluster), graph)
    _emit_simulation(predicted, graph, perf, out, str(hardware), as_json, overlap)


SIM_PNG_MAX_GPUS = 16
"""Above this many GPUs the Gantt PNG would be metres tall: the Chrome trace scales, it does not."""


def _emit_simulation(plan, graph, perf, out: Path, hardware: str, as_json: bool, overlap: bool) -> None:
    from mosaic.report.plans import plans_summary
    from mosaic.report.tables import print_plan_table
    from mosaic.report.timeline import plot_timeline, write_chrome_trace
    from mosaic.simulate import simulate as run_simulation

    sim = run_simulation(plan, graph, perf, overlap=overlap)
    out.mkdir(parents=True, exist_ok=True)
    files = {plan.planner: plan.save(out / f"{plan.planner}.json")}
    trace = write_chrome_trace(sim.events, out / f"{plan.planner}.sim-trace.json")
    if plan.num_gpus <= SIM_PNG_MAX_GPUS:
        plot_timeline(sim.events, out / f"{plan.planner}.png", f"{graph.name} ({graph.preset}) on "
                      f"{plan.num_gpus} GPUs, {plan.planner}: {sim.iteration_s * 1e3:.1f} ms simulated")
    summary = plans_summary([plan], graph, perf, files, hardware=hardware)
    util = sim.utilisation()
    summary["simulation"] = {**sim.summary(), "overlap": overlap, "trace_file": str(trace),
                             "gpu_utilisation": [util[g] for g in range(plan.num_gpus)]}
    (out / "simulation.json").write_text(json.dumps(summary, indent=2))
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    print_plan_table(summary)
    s = summary["simulation"]
    typer.echo(f"simulated: {s['iteration_s'] * 1e3:.2f} ms per iteration "
               f"({'all-reduce overlapped per group' if overlap else 'as the model composes it'}), "
               f"{s['events']} events, {s['gpus_used']}/{plan.num_gpus} GPUs used, mean compute "
               f"utilisation {s['mean_utilisation']:.0%} ({s['mean_utilisation_of_used']:.0%} of used "
               f"GPUs); trace: {trace}")


@app.command()
def train(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(help="zoo model name (or `model` in --config)",
                                                callback=_optional_zoo_model)] = None,
    plan_file: Annotated[Path | None, typer.Option("--plan", help="plan JSON to train with")] = None,
    planner: Annotated[str | None, typer.Option(help="plan with this planner instead of --plan",
                                                callback=_check_planner)] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs (= processes); default: the world size")] = None,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 20,
    preset: Annotated[PresetName, typer.Option(help="size of the zoo model: paper, small or tiny")] = PresetName.tiny,
    batch: Annotated[int | None, typer.Option(help="global batch (default: the preset's)")] = None,
    metrics: Annotated[Path | None, typer.Option(help="JSONL file, one line per step",
                                                 callback=_out_file("--metrics"))] = None,
    graphs: Annotated[bool, typer.Option(help="per-module CUDA graphs (GPU; off on a CPU)")] = True,
    lr: Annotated[float, typer.Option(help="AdamW learning rate")] = 1e-4,
    weight_decay: Annotated[float, typer.Option(
        "--weight-decay", min=0.0, help="AdamW's decoupled weight decay, on every parameter "
                                        "(0.1 is common for LLMs)")] = 0.0,
    lr_warmup_steps: Annotated[int, typer.Option(
        "--lr-warmup-steps", min=0, help="steps over which the learning rate ramps linearly "
                                         "up to --lr")] = 0,
    lr_decay: Annotated[LRDecay, typer.Option(
        "--lr-decay", help="after warm-up: keep --lr, or decay it linearly or along a cosine "
                           "to --min-lr at the last step (metrics: lr)")] = LRDecay.constant,
    min_lr: Annotated[float, typer.Option("--min-lr", min=0.0, help="the learning rate a "
                                          "decay ends at")] = 0.0,
    clip_grad_norm: Annotated[float | None, typer.Option(
        "--clip-grad-norm", min=0.0, metavar="MAX_NORM",
        help="scale the gradients so that their global norm (every module and GPU) is at most "
             "MAX_NORM before each update, as torch's clip_grad_norm_ (metrics: grad_norm); "
             "default: no clipping")] = None,
    seed: Annotated[int, typer.Option(help="seed of weights and synthetic data")] = 0,
    data: Annotated[DataName, typer.Option(help="synthetic inputs, or digits: scikit-learn's "
                                           "handwritten digits, captioned (clip; prints the "
                                           "zero-shot accuracy)")] = DataName.synthetic,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind (for planning)",
                                                   case_sensitive=False)] = HardwareName.h200,
    perf_model: Annotated[PerfModelName, typer.Option("--perf-model", help="auto: profiled where a "
                                                      "profile is shipped")] = PerfModelName.auto,
    profile_db: ProfileDbOption = None,
    compile_mode: Annotated[str, typer.Option("--compile", help="Inductor per module: auto (default on a GPU, none on a CPU) | default | max-autotune-gemm | max-autotune-no-cudagraphs | none")] = "auto",
    compile_scope: CompileScopeOption = CompileScopeName.module,
    grad_sync: GradSyncOption = GradSyncName.flat,
    reduce_dtype: Annotated[str, typer.Option(help="gradient all-reduce precision: fp32 | bf16")] = "fp32",
    grads_in_graph: Annotated[bool, typer.Option(help="with graphs: each backward graph adds its "
                                                 "module's gradients itself (not under DDP)")] = True,
    accumulation: Annotated[int, typer.Option(help="gradient-accumulation micro-steps per step")] = 1,
    bf16_weights: Annotated[bool, typer.Option(help="keep the GEMM weights in bf16 and fp32 main "
                                               "weights in AdamW (no autocast weight casts; "
                                               "data-parallel plans need --reduce-dtype bf16; "
                                               "not sharded or tensor-parallel ones)")] = False,
    bf16_flat_grads: Annotated[bool | None, typer.Option(
        "--bf16-flat-grads/--no-bf16-flat-grads",
        help="with --bf16-weights: each module's bf16 gradients copied into one buffer and "
        "updated in one launch (CLIP paper b32 1.01-1.03x on the H200), or updated where the "
        "backward left them, a weight at a time (Unified-IO 2 paper b4 1.035x, Qwen3-VL small "
        "b8 1.026x). Default: a weight at a time where the profiled model, from each module's "
        "measured update, predicts it at least 1.5% faster (one GPU, no accumulation; "
        "--autotune measures both), else flat", show_default=False)] = None,
    bf16_moments: Annotated[bool, typer.Option(
        help="with --bf16-weights: keep their AdamW moments in bf16 too, stored by stochastic "
        "rounding (the update moves 20 bytes a parameter, not 28; states 12, not 16)")] = False,
    fp32_main_weights: Annotated[bool, typer.Option(
        "--fp32-main-weights/--no-fp32-main-weights",
        help="with --bf16-weights: keep an fp32 main copy of each bf16 weight in the optimizer, "
        "or none: the update writes each new weight to bf16 by stochastic rounding (6 bytes a "
        "parameter less moved, 4 less held; docs/engine.md)")] = True,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="directory for atomic checkpoints (torch.distributed.checkpoint)")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="checkpoint every K steps (and at the end); 0: only at the end")] = 0,
    checkpoint_background: Annotated[bool, typer.Option(help="write checkpoints in a background thread: a step waits only for the copy to host memory; a checkpoint counts once every rank wrote it")] = False,
    resume: Annotated[str | None, typer.Option(
        help="continue from the latest checkpoint in --checkpoint-dir; `--resume auto`: only "
             "when one exists (for torchrun --max-restarts)", metavar="[auto]",
        callback=_check_resume)] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=0.001, help="longest wait of any "
                                             "collective: a dead or hung rank ends the run after it")] = 600.0,
    skip_nonfinite: Annotated[bool, typer.Option(help="skip a step's update on a NaN/inf loss "
                                                 "or gradient (logged) instead of stopping")] = False,
    autotune: Annotated[int, typer.Option("--autotune", min=0, help="measure the K best predicted "
                                          "plans and the baselines briefly, train the fastest "
                                          "(0: off; not with --plan)")] = 0,
    autotune_skip: Annotated[str, typer.Option("--autotune-skip", help="comma-separated "
                                               "planners whose plans autotune leaves out (one "
                                               "that failed on the GPU)")] = "",
    read_each_step: Annotated[bool, typer.Option(help="wait for each step before launching the "
                                                 "next (errors surface at their own step; "
                                                 "slower)")] = False,
    out: Annotated[Path | None, typer.Option(help="run folder: config, env, plan, metrics, "
                                             "summary, timeline (docs/quickstart.md)",
                                             callback=_out_dir)] = None,
    overwrite: Annotated[bool, typer.Option(help="allow --out to name a non-empty folder")] = False,
    tensorboard: Annotated[Path | None, typer.Option(help="also write loss and step time as "
                                                     "TensorBoard scalars here (needs the "
                                                     "tensorboard package)",
                                                     callback=_check_tensorboard)] = None,
    torch_trace: Annotated[Path | None, typer.Option(
        "--torch-trace", help="run the last 3 steps under torch.profiler: a Chrome trace, a "
        "table of kernels by GPU time and their time by class (mosaic kernel-time) per rank, "
        "here")] = None,
    config: Annotated[Path | None, typer.Option("--config", help="job file (TOML, or YAML): "
                                                "see mosaic.job_config")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a job field: "
                                                   "--set train.lr=1e-4 (repeatable)")] = None,
) -> None:
    """Train MODEL with a plan: `torchrun --standalone --nproc-per-node N -m mosaic train ...`."""
    resolved = {k: (str(v) if isinstance(v, Path) else v) for k, v in locals().items()
                if k not in ("ctx", "config", "set_")}  # the parameters, for the run folder
    if config is not None or set_:  # the job file's values where the command line gave none
        return ctx.invoke(train, **_with_job(ctx, config, set_ or []))
    _check_train_options(resolved)
    skip = _autotune_skip(autotune_skip, autotune)

    from mosaic.data import check_dataset
    from mosaic.engine.checkpoint import CheckpointConfig
    from mosaic.engine.session import EngineConfig, end_distributed, start_distributed
    from mosaic.engine.trainer import train_from_cli
    from mosaic.zoo import get_model

    check_dataset(get_model(model), str(data), str(preset))  # before planning and set-up
    d = start_distributed(None, timeout_s)  # planning on rank 0 needs the world to broadcast to
    try:
        # A CPU has no CUDA graphs, and compile time dominates its brief runs; graphs are
        # captured after the first (eager) step, so a one-step run never replays them.
        engine = EngineConfig(graphs=graphs and d.device.type == "cuda" and steps > 1,
                              compile=_compile_mode(compile_mode), compile_scope=str(compile_scope),
                              grad_sync=str(grad_sync),
                              reduce_dtype=reduce_dtype, grads_in_graph=grads_in_graph,
                              accumulation=accumulation, bf16_weights=bf16_weights,
                              bf16_flat_grads=bf16_flat_grads is not False,
                              bf16_moments=bf16_moments, fp32_main_weights=fp32_main_weights,
                              timeline=out is not None)
        plan_obj, engine = (None, engine) if plan_file is not None else _training_plan(
            model, str(preset), batch, gpus or d.world_size, hardware, planner,
            str(perf_model), profile_db, autotune, engine, d, skip,
            choose_layout=bf16_weights and bf16_flat_grads is None)
        ckpt = (CheckpointConfig(directory=str(checkpoint_dir), every_steps=checkpoint_every,
                                 background=checkpoint_background)
                if checkpoint_dir else None)
        result = train_from_cli(model, preset, str(plan_file) if plan_file else None, gpus, steps,
                                str(metrics) if metrics else None, plan=plan_obj, engine=engine,
                                lr=lr, seed=seed, global_batch=batch, hardware=hardware,
                                checkpoint=ckpt, resume=resume, timeout_s=timeout_s,
                                skip_nonfinite=skip_nonfinite, read_each_step=read_each_step,
                                data=str(data), clip_grad_norm=clip_grad_norm,
                                lr_warmup_steps=lr_warmup_steps, lr_decay=str(lr_decay),
                                min_lr=min_lr, weight_decay=weight_decay,
                                tensorboard_dir=str(tensorboard) if tensorboard else None,
                                torch_trace_dir=str(torch_trace) if torch_trace else None)
    finally:
        end_distributed(d)
    result.summary["predicted_guard_s"] = _guard_estimate(result.plan, model, str(preset), batch,
                                                          engine, hardware)
    if int(os.environ.get("RANK", "0")) == 0:
        _report_training(result, resolved, engine, d.device.type)
    if result.summary.get("stopped") is not None:  # every rank: it stopped (SIGTERM), state kept
        raise typer.Exit(EXIT_INTERRUPTED)


def _check_train_options(options: dict[str, Any]) -> None:
    """What `mosaic train`'s options (its parameters as resolved) ask for together, refused
    before anything is set up."""
    if options["model"] is None:
        raise OptionError("MODEL is missing: name a zoo model, or give `model` in --config")
    if options["out"] is not None:
        from mosaic.report.run_folder import check_run_dir

        check_run_dir(Path(options["out"]), options["overwrite"])
    if options["autotune"] and options["plan_file"] is not None:
        raise OptionError("--autotune picks the plan by measurement, --plan gives one; pass one "
                          "of them")
    _require_bf16_weights(options["bf16_weights"],
                          {"--no-bf16-flat-grads": options["bf16_flat_grads"] is False,
                           "--bf16-moments": options["bf16_moments"],
                           "--no-fp32-main-weights": not options["fp32_main_weights"]})


def _report_training(result, options: dict[str, Any], engine, device_type: str) -> None:
    """Rank 0's account of a finished (or stopped) run: the run folder, the trace's kernel
    table, the closing line. `options`: train's parameters as resolved."""
    if options["out"] is not None:
        _write_run_folder(options, result, engine, device_type)
    if options["torch_trace"] is not None:
        from mosaic.report.kernel_time import summarise_trace_dir

        summarise_trace_dir(Path(options["torch_trace"]))
    _say_trained(result, options["data"])


def _write_run_folder(options: dict[str, Any], result, engine, device_type: str) -> None:
    """The run folder (mosaic.report.run_folder): train's options, the plan, and the
    prediction for the engine that ran beside the run."""
    from mosaic.hardware import make_cluster
    from mosaic.report.run_folder import write_run_folder
    from mosaic.zoo import get_model

    preset, db = str(options["preset"]), options["profile_db"]
    graph = get_model(options["model"]).graph(preset, global_batch=options["batch"])
    gpus = result.plan.num_gpus
    perf = load_perf_model(str(options["perf_model"]), make_cluster(gpus, str(options["hardware"])),
                           preset, Path(db) if db else None, accumulation=engine.accumulation,
                           engine=predicted_engine_kind(engine, gpus, device_type))
    write_run_folder(Path(options["out"]), config={**options, "plan": result.plan.to_dict()},
                     result=result, graph=graph, perf=perf)


def _training_plan(model: str, preset: str, batch: int | None, gpus: int, hardware,
                   planner: str | None, perf_model: str, profile_db: Path | None, autotune: int,
                   engine, d, skip: tuple[str, ...] = (), choose_layout: bool = False):
    """The plan `mosaic train` trains when no --plan is given, and the engine to train it
    with: the fastest measured of the best predicted (--autotune K; every rank measures,
    measure_plans is collective) with the engine settings it was measured with (with bf16
    weights, the update a weight at a time may win), else the planner's, made on rank 0 and
    shared, with `engine` as given, but for the bf16 update's layout where `choose_layout`
    (the model's choice: predicted_update_layout)."""
    from mosaic.api import plan_on_rank0
    from mosaic.autotune import autotune_recorded
    from mosaic.hardware import make_cluster
    from mosaic.zoo import get_model

    graph = engine.holding(get_model(model).graph(preset, global_batch=batch))
    cluster = make_cluster(gpus, hardware)
    def perf_for(engine):  # accumulating, a plan is searched for one micro-step's batch
        return load_perf_model(perf_model, cluster, preset, profile_db,
                               accumulation=engine.accumulation,
                               engine=predicted_engine_kind(engine, gpus, d.device.type))

    perf = perf_for(engine)
    if not autotune:
        plan = plan_on_rank0(graph, gpus, d.device, hardware=hardware,
                             planner=planner or "mosaic", perf_model=perf)
        if choose_layout:  # every rank decides alike: the same plan, DB and model
            engine, why = predicted_update_layout(plan, graph, perf, engine)
            if why and d.rank == 0:
                typer.echo(why)
            if why:  # the run's prediction is for the layout it runs
                plan = plan.with_prediction(perf_for(engine).iteration_time_s(plan, graph),
                                            plan.perf_model)
        return plan, engine
    tuned, tuned_db = autotune_recorded(get_model(model), preset, graph, cluster, perf,
                                        autotune, engine, cpu=d.device.type == "cpu", skip=skip)
    if d.rank == 0:
        _say_autotuned(tuned, tuned_db)
    return tuned.plan, dataclasses.replace(engine, **tuned.engine_settings)


def predicted_engine_kind(engine, gpus: int, device_type: str) -> str:
    """The engine kind `mosaic train` plans and predicts for: the one it runs (compile scope,
    bf16 weights and their update layout change the measured surfaces and terms it reads).
    On a CPU, which has no CUDA graphs and compiles nothing by default, the GPU engine these
    settings give there, so a CPU and a GPU make the same plan."""
    from mosaic.perf.engine_term import engine_kind

    record = dataclasses.asdict(engine)
    if device_type != "cuda":
        record.update(graphs=True, compile=record["compile"] or "default")
    return engine_kind(record, gpus)


PER_WEIGHT_MARGIN = 0.015
"""Update a weight at a time by default only where predicted this much of a step faster. On
the H200 the model's difference between the layouts missed the measured one by 0.0-1.7% of a
step (four plans of three models); with this margin it chose the faster layout on each:
Qwen3-VL `small` b8 (2.0% predicted, 2.5% measured) and Unified-IO 2 `paper` b4 (4.1%, 3.4%)
a weight at a time, CLIP `paper` b32 (1.1% slower predicted, 1.0-2.8% measured) flat."""


FLAT_TUNING_HOST_SHARE = 0.5
"""The flat bf16 update is one Inductor kernel a module that writes the module's bf16 weights,
main weights and moments; Inductor autotunes it on its first call and first copies what it
writes to pinned host memory. On the 128 GiB host of the H200 machine that copy failed for
Qwen3-VL `paper`'s LLM (70 GiB with bf16 moments) and worked for Unified-IO 2 `paper`'s (46
GiB with fp32 moments): a module whose flat update writes more than this share of the host's
memory is updated a weight at a time (a weight's kernel writes at most one weight's bytes)."""


def _flat_update_too_large(graph) -> str | None:
    """The module whose flat update's autotuning copy would not fit the host, with a line
    saying so; None when every module's fits."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for spec in graph.modules:
        written = spec.stored_bf16_params * (  # not the gradient
            BF16_WEIGHT_STATE_BYTES - BF16_GRAD_BYTES
            - MAIN_WEIGHT_BYTES * (not spec.fp32_main_weights)
            + (BF16_MOMENT_BYTES if spec.bf16_moments else FP32_MOMENT_BYTES))
        if written > FLAT_TUNING_HOST_SHARE * host:
            return (f"bf16 update: a weight at a time: the flat update of module {spec.name!r} "
                    f"writes {written / 2**30:.0f} GiB, which Inductor's autotuning copies to "
                    f"host memory first ({host / 2**30:.0f} GiB here)")
    return None


def predicted_update_layout(plan, graph, perf, engine):
    """`engine` with the bf16 update a weight at a time where a module's flat update is too
    large to autotune (FLAT_TUNING_HOST_SHARE) or `perf` (a profiled model with the modules'
    measured updates) predicts it PER_WEIGHT_MARGIN of a step faster than the flat one, on
    one GPU without accumulation (where the layouts were measured); else as given. Also a
    line saying so, or None."""
    if too_large := _flat_update_too_large(graph):
        return dataclasses.replace(engine, bf16_flat_grads=False), too_large
    saving = per_weight_saving_s(plan, graph, perf) if engine.accumulation == 1 else None
    if saving is None:
        return engine, None
    step = perf.iteration_time_s(plan, graph)
    return dataclasses.replace(engine, bf16_flat_grads=False), (
        f"bf16 update: a weight at a time, predicted {saving * 1e3:.2f} ms a step faster than "
        f"the flat one ({saving / step:.1%}) from each module's measured update; "
        "--bf16-flat-grads keeps the flat one")


def per_weight_saving_s(plan, graph, perf) -> float | None:
    """Seconds a step that updating bf16 weights a weight at a time is predicted to save over
    the flat update, where `perf` (a profiled model with the modules' measured updates)
    predicts at least PER_WEIGHT_MARGIN of the step on one GPU; else None."""
    extra_of = getattr(perf, "per_weight_extra_s", None)
    if extra_of is None or plan.num_gpus != 1:
        return None
    extra = extra_of(plan, graph)
    return -extra if extra <= -PER_WEIGHT_MARGIN * perf.iteration_time_s(plan, graph) else None


def _guard_estimate(plan, model: str, preset: str, batch: int | None, engine,
                    hardware: str) -> float:
    """Seconds the trained step's non-finite guard reads the gradients for, by the model
    (perf.base.guard_pass_s): what `_predicted` adds to the plan's predicted (bench) step."""
    from mosaic.hardware import make_cluster
    from mosaic.perf.base import guard_pass_s
    from mosaic.zoo import get_model

    graph = engine.holding(get_model(model).graph(preset, global_batch=batch))
    return guard_pass_s(plan, graph, make_cluster(plan.num_gpus, hardware).gpu)


def _say_trained(result, data) -> None:
    summary = result.summary
    typer.echo(
        f"{summary['model']} ({summary['preset']}) plan={summary['planner']}{_weights(summary)} "
        f"gpus={summary['num_gpus']}: loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
        f"step {summary['step_time_median_s'] * 1e3:.1f} ms median "
        f"(p90 {summary['step_time_p90_s'] * 1e3:.1f}{_predicted(summary)}), "
        f"{summary['samples_per_s']:.1f} samples/s{_mfu_note(summary)}, "
        f"SM quotas: {_quota_state(result.plan, summary['pool'])}"
    )
    if compiled := _compile_line(summary.get("compile") or {}):
        typer.echo(compiled)
    from mosaic.engine.steps import GuardChoice  # its bound says when the host bounds a step

    share = summary.get("host_launch_share")
    bound = GuardChoice.HOST_BOUND
    if share is not None and share >= bound and summary["device"].startswith("cuda"):
        remedy = ("a larger --batch gives it more work per launch" if summary.get("graphs", True)
                  else "CUDA graphs (drop --no-graphs) replay a module's kernels in one launch")
        typer.echo(f"host-bound: launching a step took {share:.0%} of it on the host, so the GPU "
                   f"waited; {remedy}")
    if data != DataName.synthetic:
        typer.echo(_eval_line(summary.get("eval"), result.plan.num_gpus))


def _mfu_note(summary: dict) -> str:
    """', MFU N% of 989 TF/s' on a GPU (against the datasheet's dense bf16 peak)."""
    mfu = summary.get("mfu")
    if mfu is None:
        return ""
    from mosaic.hardware import gpu_spec

    peak = gpu_spec(summary["config"]["hardware"]).datasheet_bf16_flops
    return f", MFU {mfu:.1%} of {peak / 1e12:.0f} TF/s"


def _predicted(summary: dict) -> str:
    """The model's step beside the measured one, so every run shows how far to trust a plan:
    the plan's predicted step (a bench step's) plus the non-finite guard's read of the
    gradients, which a trained step adds (perf.base.guard_pass_s). Without it the model
    predicted Qwen3-VL `paper` b2 with bf16 weights and moments at 104.2 ms on the H200,
    measured 108.4 (2026-12-04); the guard reads 18.5 GB of gradients there: 4.3 ms. Not on
    a CPU: the model predicts the GPU's step."""
    predicted = summary.get("predicted_iteration_s")
    if predicted:
        predicted += summary.get("predicted_guard_s") or 0.0
    on_gpu = str(summary.get("device", "")).startswith("cuda")
    return f"; model {predicted * 1e3:.1f}" if predicted and on_gpu else ""


def _weights(summary: dict) -> str:
    """How the weights were kept, where not the fp32 default (autotune may choose the bf16
    update's layout: the plan's name alone does not say it)."""
    if not summary.get("bf16_weights"):
        return ""
    how = ["bf16 weights"] + ([] if summary.get("bf16_flat_grads", True)
                              else ["updated a weight at a time"])
    how += ["bf16 moments"] if summary.get("bf16_moments") else []
    how += [] if summary.get("fp32_main_weights", True) else ["no fp32 main weights"]
    return f" ({', '.join(how)})"


def _compile_line(report: dict) -> str | None:
    """Start-up a user pays once (Inductor's cache serves the next run), and the modules that
    fell back to eager with why; None when nothing was compiled."""
    if not report.get("compiled"):
        return None
    eager = report.get("eager") or {}
    return (f"compile: {len(report['compiled'])} module(s) by Inductor, "
            f"{report.get('total_compile_s', 0.0):.1f} s"
            + (f"; eager: {', '.join(f'{m} ({why})' for m, why in eager.items())}" if eager else ""))


def _eval_line(evaluation: dict | None, num_gpus: int) -> str:
    if evaluation is None:  # no rank held every module (mosaic.engine.trainer._evaluate)
        return (f"zero-shot accuracy: not measured (the plan spreads the modules over "
                f"{num_gpus} GPUs; train on one GPU, or with --planner megatron, to measure it)")
    return (f"zero-shot accuracy {evaluation['zero_shot_accuracy']:.3f} on "
            f"{evaluation['test_images']} held-out images (chance {evaluation['chance']:.2f})")


def _optional_zoo_model(value: str | None) -> str | None:
    return None if value is None else _zoo_model(value)


def _with_job(ctx, config: Path | None, overrides: list[str]) -> dict:
    """`train`'s parameters: the command line's, then the job's for those left at default."""
    from mosaic.job_config import FIELDS, JobConfigError, load_job

    field = {param: key for key, (param, _) in FIELDS.items()}
    params = {**ctx.params, "config": None, "set_": None, "ctx": ctx}
    choices = {"preset": PresetName, "hardware": HardwareName, "perf_model": PerfModelName,
               "data": DataName, "lr_decay": LRDecay}
    for name, value in load_job(config, overrides).items():
        source = ctx.get_parameter_source(name)  # typer may vendor click: compare by name
        if source is not None and source.name != "DEFAULT":
            continue  # given on the command line: it wins
        try:
            if name in choices:
                value = choices[name](value)
            elif name == "model":
                _zoo_model(value)
            elif name == "planner":
                _planner_names(value)
        except (ValueError, MosaicError) as exc:
            valid = f"; one of {', '.join(c.value for c in choices[name])}" if name in choices else ""
            raise JobConfigError(f"{field[name]} = {value!r}: {exc}{valid}") from None
        params[name] = value
    return params


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
    profile_db: ProfileDbOption = None,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind", case_sensitive=False)] = HardwareName.h200,
    rounds: Annotated[int, typer.Option(help="interleaved rounds")] = 6,
    steps_per_round: Annotated[int, typer.Option(help="timed steps per plan per round")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed steps per plan first")] = 5,
    in_flight_steps: Annotated[int, typer.Option(
        min=0, help="per round, also time this many steps of each contender back to back, "
        "read once at the end, as a training loop that logs every N steps (0: none)")] = 10,
    graphs: Annotated[bool, typer.Option(help="per-module CUDA graphs")] = True,
    compile_mode: Annotated[str, typer.Option("--compile", help="Inductor per module before capture: auto (default on a GPU, none on CPU) | default | max-autotune-gemm (GEMMs tuned) | max-autotune-no-cudagraphs | none")] = "auto",
    compile_scope: CompileScopeOption = CompileScopeName.module,
    grad_sync: GradSyncOption = GradSyncName.flat,
    reduce_dtype: Annotated[str, typer.Option(help="gradient all-reduce precision: fp32 | bf16")] = "fp32",
    grads_in_graph: Annotated[bool, typer.Option(help="with graphs: each backward graph adds its "
                                                 "module's gradients itself (not under DDP)")] = True,
    accumulation: Annotated[int, typer.Option(help="gradient-accumulation micro-steps per step")] = 1,
    user_programs: Annotated[str, typer.Option(help="the user's own programs to measure too: torch-eager,torch-compile[,torch-compile-max-autotune[-gemm]] on DDP; torch-eager-fsdp,torch-compile-fsdp on FSDP2, for several GPUs (empty: none)")] = "torch-eager,torch-compile",
    user_rounds: Annotated[str, typer.Option(help="interleaved: user programs share the plans' timed rounds; apart: their own rounds after the plans'; alone: set up and timed in a group of their own before the plans' (never sharing the GPU's memory with them), the reference every plan is checked against")] = "interleaved",
    plans_at_once: Annotated[int | None, typer.Option(
        "--plans-at-once", min=1, help="measure the plans in groups of N, each set up from the "
        "same seed, timed and released before the next (user programs with the first, whose "
        "reference loss and gradients check every group): for "
        "plans whose CUDA graphs do not fit on the GPU together; no interleaving across groups "
        "(default: all at once)")] = None,
    engine_variants: Annotated[list[str] | None, typer.Option(
        "--engine-variant", help="also measure every data-parallel plan with these gradient-sync "
        "settings, in the same rounds (repeatable), e.g. grad_sync=bucketed or "
        "bucket_view=false,reduce_dtype=bf16, or every plan with grads_in_graph=false, "
        "optimizer_overlap=true or bf16_weights=true (bf16 GEMM weights, fp32 main weights in "
        "the optimizer; with reduce_dtype=bf16 where a plan is data-parallel; "
        "bf16_weights=true,bf16_flat_grads=false updates them a weight at a time, no gradient "
        "copy; bf16_moments=true keeps their moments in bf16, fp32_main_weights=false drops "
        "their fp32 copies; with update_under_forward=true too, the update runs under the next "
        "step's forward, each block waiting for its own weights; update_group=K with "
        "bf16_flat_grads=false,fp32_main_weights=false updates same-shaped weights K at a "
        "time in one launch, fp8_first_moment=true there keeps AdamW's first moment in 8 "
        "bits); labelled PLAN@SETTINGS")] = None,
    plans_dir: Annotated[Path | None, typer.Option("--plans", help="measure the plan JSONs in this "
                                                   "directory (from `mosaic plan --out`) instead of planning")] = None,
    autotune: Annotated[int, typer.Option("--autotune", min=0, help="also measure the K best "
                                          "predicted plans and the baselines briefly and add the "
                                          "fastest as plan `autotune` (0: off)")] = 0,
    autotune_skip: Annotated[str, typer.Option("--autotune-skip", help="comma-separated "
                                               "planners whose plans autotune leaves out (one "
                                               "that failed on the GPU)")] = "",
    cpu_smoke: Annotated[bool, typer.Option("--cpu-smoke", help="run on CPU with tiny settings "
                                            "(1 round, 1 step, no CUDA graphs): checks that it "
                                            "runs, measures nothing")] = False,
    out: Annotated[Path | None, typer.Option(help="directory for results JSON and timelines",
                                             callback=_out_dir)] = None,
    torch_trace: Annotated[Path | None, typer.Option(
        "--torch-trace", help="also run 3 timed steps of each plan and user program under "
        "torch.profiler: DIR/LABEL/trace-rank<r>.json.gz and its kernel time by class "
        "(`mosaic kernel-time`)", callback=_out_dir_of("--torch-trace"))] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Plan MODEL with every planner and train each plan, and the user's own program (eager and
    torch.compile), in one run: measured vs predicted, gradients checked equal first."""
    if cpu_smoke:
        rounds, steps_per_round, warmup, graphs = 1, 1, 1, False
        in_flight_steps = min(in_flight_steps, 2)
    elif not _has_cuda():  # refuse now, not after planning and building
        _fail("mosaic bench measures on CUDA GPUs and this machine has none; run it on a GPU "
              "machine, or pass --cpu-smoke to check on CPU that it runs")

    skip = _autotune_skip(autotune_skip, autotune)
    from mosaic.bench import run_bench
    from mosaic.engine.measure import BenchConfig, parse_variant
    from mosaic.engine.session import EngineConfig
    from mosaic.hardware import make_cluster
    from mosaic.report.bench_report import (
        print_bench_table,
        write_bench_json,
        write_bench_timelines,
    )
    from mosaic.zoo import get_model

    cluster = make_cluster(gpus, hardware)
    zoo_model = get_model(model)
    graph = zoo_model.graph(preset, global_batch=batch)
    names = [n.strip() for n in planners.split(",") if n.strip()]
    users = tuple(n.strip() for n in user_programs.split(",") if n.strip() not in ("", "none"))
    config = BenchConfig(rounds=rounds, steps_per_round=steps_per_round, warmup_steps=warmup,
                         in_flight_steps=in_flight_steps,
                         engine=EngineConfig(graphs=graphs, compile=_compile_mode(compile_mode),
                                             compile_scope=str(compile_scope),
                                             grad_sync=str(grad_sync), reduce_dtype=reduce_dtype,
                                             grads_in_graph=grads_in_graph,
                                             accumulation=accumulation),
                         user_programs=users, user_rounds=user_rounds,
                         plans_at_once=plans_at_once,
                         torch_trace_dir=str(torch_trace) if torch_trace else None)
    _log_progress()
    run = run_bench(zoo_model, graph, cluster, config, preset=str(preset), planners=names,
                    perf_model=str(perf_model), profile_db=profile_db,
                    plans=(lambda: load_plans(plans_dir, names, graph, cluster))
                    if plans_dir is not None else None,
                    variants=[parse_variant(v) for v in engine_variants or []],
                    autotune=autotune, autotune_skip=skip)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if run.autotune is not None:
        _say_autotuned(run.autotune, run.autotune_db)
    report = run.report
    out = out or Path("runs") / f"bench-{graph.name}-{preset}-{gpus}"
    write_bench_json(report, out)
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        print_bench_table(report)
    if torch_trace is not None:
        from mosaic.report.kernel_time import summarise_trace_dir

        for directory in sorted(d for d in torch_trace.iterdir() if d.is_dir()):
            summarise_trace_dir(directory)
    if run.interrupted is not None:
        _fail(f"bench {run.interrupted}; written to {out / 'bench.json'}", EXIT_INTERRUPTED)
    if run.refused is not None:
        _fail(f"bench refused {run.refused}; every contender's differences are written to "
              f"{out / 'bench.json'}")
    write_bench_timelines(report, run.measurements, out)


def _log_progress() -> None:
    """The bench's phase lines (engine/measure.py) on stderr: a start-up of minutes says where
    it is, and a run killed by a time limit shows the phase it died in."""
    logger = logging.getLogger("mosaic")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("mosaic %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _autotune_skip(names: str, autotune: int) -> tuple[str, ...]:
    """--autotune-skip as planner names, checked before any set-up."""
    skip = tuple(n.strip() for n in names.split(",") if n.strip())
    if not skip:
        return skip
    if not autotune:
        raise OptionError("--autotune-skip leaves planners out of --autotune's candidates: add "
                          "--autotune K, or drop it")
    from mosaic.autotune import AutotuneError, autotune_planners

    try:
        autotune_planners(skip)
    except AutotuneError as exc:
        raise OptionError(str(exc)) from exc
    return skip


def _say_autotuned(result, db: Path | None) -> None:
    in_flight = any(m.in_flight_s is not None for m in result.measurements)
    basis = "in flight" if in_flight else "a step"
    typer.echo(f"autotune: chose {result.label!r} of {len(result.measurements)} measured plans "
               f"({result.ranked_s * 1e3:.2f} ms {basis} vs best baseline "
               f"{result.best_baseline_s * 1e3:.2f} ms); start-up {result.startup_s:.1f} s",
               err=True)
    if db is not None:
        typer.echo(f"autotune: measurements recorded in {db} (plan with --profile-db {db}; "
                   f"refit: mosaic model-error --fit-engine-term DIR --db {db})", err=True)


def _compile_mode(name: str) -> str | None:
    """`auto`: Inductor on a GPU (fusion pays there), none on a CPU (compile time dominates)."""
    import torch

    if name == "auto":
        return "default" if torch.cuda.is_available() else None
    return None if name == "none" else name


@app.command()
def profile(
    models_: Annotated[list[str] | None, typer.Argument(
        metavar="[MODEL...]", help="zoo models to profile (none with --collectives)",
        callback=_zoo_models)] = None,
    preset: Annotated[PresetName, typer.Option(help="size of the zoo models")] = PresetName.small,
    hardware: Annotated[HardwareName, typer.Option(help="the GPU this runs on",
                                                   case_sensitive=False)] = HardwareName.h200,
    db: Annotated[Path, typer.Option(help="ProfileDB to write (SQLite; replaced when done)",
                                     callback=_out_file("--db"))] = Path("runs/profile.sqlite"),
    budget_s: Annotated[float, typer.Option("--budget", min=1.0, help="wall-clock seconds for profiling")] = 220.0,
    kernels: Annotated[KernelsName, typer.Option(
        help="eager modules, or each module behind Inductor as the engine runs it")] = KernelsName.eager,
    surfaces_only: Annotated[bool, typer.Option(
        "--surfaces-only", help="skip the bandwidth signatures, busy fractions and "
        "colocations")] = False,
    busy_only: Annotated[bool, typer.Option(
        "--busy-only", help="with --update: measure only each module's busy fraction (two "
        "copies side by side against one alone, at the grid's middle, preset and largest "
        "batches), which bounds what colocating it can save; modules without a --kernels "
        "surface in --db are skipped, pairs --db holds are kept (with --remeasure: measured "
        "again)")] = False,
    update: Annotated[bool, typer.Option(
        "--update", help="add to the existing --db (keeping its modules, comm curves and "
        "fits) instead of replacing it; modules it already holds are skipped, and what a "
        "stopped run measured stays, so running again resumes")] = False,
    remeasure: Annotated[bool, typer.Option(
        "--remeasure", help="with --update: measure the named models' modules again even where "
        "--db holds them (a change their cost facts do not show, such as other attention "
        "kernels); each module's old points are replaced once its new surface is complete")] = False,
    main_weights_only: Annotated[bool, typer.Option(
        "--main-weights-only", help="with --update: measure only each module's bf16 weight "
        "update, a weight at a time and over one flat gradient buffer, with fp32 and with bf16 "
        "moments (priced per module where a plan updates a weight at a time, "
        "--no-bf16-flat-grads, or keeps bf16 moments, --bf16-moments)")] = False,
    collectives: Annotated[bool, typer.Option(
        "--collectives", help="instead of modules: all-reduce, reduce-scatter, all-gather, "
        "broadcast and p2p from 4 KiB to 1 GiB between the GPUs of this torchrun world "
        "(`torchrun --nproc-per-node N -m mosaic profile --collectives`), added to --db")] = False,
) -> None:
    """Measure scaling surfaces and colocations on this GPU into a ProfileDB (needs CUDA);
    `mosaic profile-recipe` prints the commands that rebuild the shipped one."""
    from mosaic.files import atomic_path
    from mosaic.profile.profiler import ProfilerConfig, profile_models

    if collectives:
        _profile_collectives(models_, db, hardware)
        return
    if not models_:
        _fail("name the zoo models to profile (e.g. `mosaic profile clip imagebind`), or pass "
              "--collectives under torchrun")

    if main_weights_only:
        _profile_main_weights(models_, str(preset), db, hardware, update)
        return
    if busy_only and (surfaces_only or not update):
        _fail("--busy-only adds busy fractions to the surfaces of an existing --db: pass "
              "--update, and not --surfaces-only (which skips them)")
    if remeasure and not update:
        _fail("--remeasure replaces modules' surfaces in an existing --db: add --update (without "
              "it the DB is made anew and every module is measured anyway)")
    if update and not db.is_file():
        _fail(f"--update adds to an existing --db, and {db} does not exist; drop --update to "
              "create it")
    if not _has_cuda():  # refuse now, before the profiler builds anything
        _fail("mosaic profile measures on a CUDA GPU and this machine has none; run it on the "
              "GPU to profile, or plan here with the shipped profile (--perf-model profiled)")
    db.parent.mkdir(parents=True, exist_ok=True)
    no_colocations = {"antagonist": False, "max_pairs": 0, "max_triples": 0}
    skip = ({**no_colocations, "busy_batches": ()} if surfaces_only
            else {**no_colocations, "surfaces": False} if busy_only else {})
    config = ProfilerConfig(hardware=str(hardware), preset=str(preset), budget_s=budget_s,
                            kernels=str(kernels), **skip)
    if update:  # each module's points commit as one transaction: a stopped run keeps them
        reports = profile_models(models_, str(db), config, update=True, remeasure=remeasure)
    else:
        with atomic_path(db) as tmp:  # the old DB stays until the new one is complete
            reports = profile_models(models_, str(tmp), config)
    for r in reports:
        typer.echo(f"{r.model}: {r.points} of {r.full_grid} grid points, {r.busy} busy "
                   f"fractions, {r.colocations} colocations, {r.wall_s:.1f} s{'; ' + '; '.join(r.notes) if r.notes else ''}")
    _store_surface_fits(db, str(hardware))
    if any(r.colocations for r in reports):  # else a model would refit on every load
        from mosaic.perf.accuracy import stale_surface_advice, store_interference_fits

        used = store_interference_fits(db, str(hardware), str(kernels))
        typer.echo(f"interference fitted on {used} {kernels} colocations (held-out error: "
                   f"mosaic model-error --kernels {kernels} --db {db})")
        for line in stale_surface_advice(db, str(hardware), str(kernels)):
            typer.echo(line)
    typer.echo(f"wrote {db}")


def _store_surface_fits(db: Path, hardware: str) -> None:
    """Store every surface's fitted law in the DB, so each machine predicts from the same
    parameters (least squares differs across numpy/scipy builds) and no load fits them."""
    from mosaic.hardware import make_cluster
    from mosaic.perf.profiled import surface_fits
    from mosaic.profile.db import ProfileDB

    with ProfileDB.open(db, readonly=False) as opened:
        record = surface_fits(opened, make_cluster(1, hardware))
        opened.add_fit(record)
    typer.echo(f"surfaces: {record.n_points} fits stored")


def _profile_collectives(models: list[str], db: Path, hardware) -> None:
    from mosaic.profile import collectives

    if models:
        _fail(f"--collectives measures the GPUs' links, not modules: drop {' '.join(models)}")
    if not _has_cuda():
        _fail("mosaic profile --collectives measures NCCL between CUDA GPUs and this machine has "
              "none; run it under torchrun on the GPU machine")
    code = collectives.main(["--db", str(db), "--hardware", str(hardware)])
    if code:
        raise typer.Exit(code)


def _profile_main_weights(models: list[str], preset: str, db: Path, hardware: str,
                          update: bool) -> None:
    from mosaic.hardware import gpu_spec
    from mosaic.profile.db import ProfileDB
    from mosaic.profile.main_weights import profile_main_weights

    if not update or not db.is_file():
        _fail("--main-weights-only adds to an existing --db: pass --update and the DB's path "
              "(`mosaic profile` makes one first)")
    if not _has_cuda():
        _fail("mosaic profile measures on a CUDA GPU and this machine has none")
    with ProfileDB.open(db, hardware=gpu_spec(str(hardware)).name, readonly=False) as profile_db:
        points = profile_main_weights(profile_db, models, preset, log=typer.echo)
    typer.echo(f"bf16 updates of {len(points)} modules stored in {db}")


@app.command("profile-recipe")
def profile_recipe(
    db: Annotated[Path | None, typer.Option(help="ProfileDB to describe (default: the shipped "
                                            "one for --hardware)")] = None,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind of the shipped DB",
                                                   case_sensitive=False)] = HardwareName.h200,
    out: Annotated[str, typer.Option(help="the DB the commands write")] = "runs/profile.sqlite",
    results: Annotated[Path, typer.Option(help="bench results the engine terms were fitted "
                                          "on")] = Path("benchmarks/results"),
) -> None:
    """The commands that rebuild a ProfileDB from nothing (surfaces and colocations per
    kernels and preset, collectives per GPU count, engine terms), read from what it holds;
    on your own GPUs they make the same kind of DB for them."""
    from mosaic.profile.db import default_db_path
    from mosaic.profile.recipe import format_recipe, rebuild_recipe

    path = db or default_db_path(str(hardware))
    if not path.is_file():
        _fail(f"--db {path} does not exist")
    typer.echo(format_recipe(rebuild_recipe(path, out, results)))


@app.command("kernel-time")
def kernel_time_command(
    trace: Annotated[Path, typer.Argument(help="torch.profiler Chrome trace (.json or .json.gz; "
                                          "`mosaic train --torch-trace DIR` writes one per rank)")],
    steps: Annotated[int | None, typer.Option(min=1, help="steps the trace covers, for times "
                                              "per step (default: its ProfilerStep marks)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Where a traced step's GPU time goes: span, busy and idle time per GPU, and the kernels by
    class (GEMMs, attention, optimizer, copies, fused Triton, elementwise, collectives)."""
    from mosaic.report.kernel_time import format_kernel_time, kernel_time, load_trace

    try:
        summary = kernel_time(load_trace(trace), steps)
    except (OSError, ValueError) as exc:
        _fail(f"cannot read the trace {trace}: {exc}")
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    elif not summary["devices"]:
        typer.echo(f"{trace}: no GPU kernels (a CPU run, or a trace without CUDA activity)")
    else:
        typer.echo(format_kernel_time(summary))


@app.command("model-error")
def model_error(
    db: Annotated[Path | None, typer.Option(help="ProfileDB (default: the shipped one)")] = None,
    hardware: Annotated[HardwareName, typer.Option(help="GPU kind of the shipped DB",
                                                   case_sensitive=False)] = HardwareName.h200,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    iterations: Annotated[Path | None, typer.Option(
        "--iterations", help="instead: whole-iteration error of the `mosaic bench` results "
        "JSON under this directory, gated (<=10% each, median <=5%); a report, exit 0")] = None,
    as_recorded: Annotated[bool, typer.Option(
        "--as-recorded", help="with --iterations: judge the predictions the results recorded, "
        "not today's model (--db or the shipped profile) on the same plans")] = False,
    stages: Annotated[bool, typer.Option(
        "--stages", help="with --iterations: stage by stage, today's model against each "
        "plan's traced step (modules alone vs their surfaces, colocations, and the saving "
        "predicted vs measured)")] = False,
    fit_engine_term: Annotated[list[Path] | None, typer.Option(
        "--fit-engine-term", help="instead: refit the per-step engine term on the bench results "
        "JSON under DIR (repeatable) plus --db's recorded iterations, and store it in --db")] = None,
    engine_kinds: Annotated[list[str] | None, typer.Option(
        "--engine-kind", help="with --fit-engine-term: store only these engine kinds' terms "
        "(repeatable; e.g. graphs+compile-default+grads-in-graph), leaving the others' as "
        "they are")] = None,
    kernels: Annotated[str, typer.Option(
        help="the colocations to judge the interference fit on: those measured with these "
        "kernels (eager, compile-default, ...)")] = "eager",
) -> None:
    """Prediction error on held-out measured points: aware vs unaware vs linear interference."""
    if fit_engine_term is not None:
        _refit_engine_term(fit_engine_term, db, as_json, engine_kinds)
        return
    from mosaic.perf.accuracy import model_error as compute
    from mosaic.perf.accuracy import print_model_error
    from mosaic.profile.db import default_db_path

    if iterations is not None:
        from mosaic.perf.accuracy import iteration_error, print_iteration_error
        from mosaic.perf.repredict import Repredictor

        if stages:
            _stage_error(iterations, Repredictor(db), as_json)
            return
        report = iteration_error(iterations, repredict=None if as_recorded else Repredictor(db))
        if as_json:
            typer.echo(json.dumps(report, indent=2))
        else:
            print_iteration_error(report)
        return
    result = compute(db or default_db_path(hardware), kernels=kernels)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_model_error(result)


def _stage_error(results: Path, repredict: Any, as_json: bool) -> None:
    from mosaic.perf.traced import print_stage_error, stage_error

    report = stage_error(results, repredict)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_stage_error(report)


def _refit_engine_term(results: list[Path], db: Path | None, as_json: bool,
                       kinds: list[str] | None) -> None:
    """One engine term per engine kind, stored in --db; its held-out error printed."""
    from mosaic.perf.engine_term import refit
    from mosaic.perf.repredict import Repredictor

    if db is None:  # never the shipped DB by default: a refit replaces what others rely on
        raise OptionError("--fit-engine-term stores the fit in a ProfileDB: pass --db PATH "
                          "(e.g. src/mosaic/profile/data/h200.sqlite)")
    terms = refit(db, results, Repredictor(db), kinds=kinds)
    if as_json:
        typer.echo(json.dumps({k: t.to_fit().params | {"mape": t.mape, "n_points": t.n_points}
                               for k, t in terms.items()}, indent=2))
        return
    for term in terms.values():
        typer.echo(term.describe())
    typer.echo(f"stored {len(terms)} engine term(s) in {db} (fits: "
               f"{', '.join('engine_term.' + k for k in terms) or 'none: too few runs'})")


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
@app.command("cli-reference", hidden=True)
def cli_reference() -> None:
    """Print docs/cli.md: every command's options, from the commands themselves."""
    typer.echo(reference_markdown(), nl=False)


def reference_markdown() -> str:
    """The CLI reference as Markdown, built from the click commands so it cannot drift."""
    root = typer.main.get_command(app)
    lines = ["# `mosaic` command reference", "",
             "Generated by `mosaic cli-reference > docs/cli.md` (a test checks it is current).", ""]
    for name, command in sorted(root.commands.items()):
        if command.hidden:
            continue
        lines += [f"## `mosaic {name}`", "", (command.help or "").strip(), "",
                  "| argument / option | type | default | help |", "|---|---|---|---|"]
        lines += [_reference_row(param) for param in command.params if param.name != "help"]
        lines.append("")
    return "\n".join(lines)


def _reference_row(param) -> str:
    names = (" / ".join(param.opts) if param.param_type_name == "option"
             else (param.metavar or param.name.upper()))
    kind = _reference_type(param.type_descriptor.annotation)
    default = "" if param.required or param.default is None else f"`{param.default}`"
    helptext = " ".join((param.help or "").split()).replace("|", "\\|")
    return f"| `{names}` | {kind} | {default} | {helptext} |"


def _reference_type(annotation) -> str:
    import enum
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and typing.get_origin(annotation) is not list:
        annotation = args[0]  # X | None: the X
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(str(e.value) for e in annotation)
    return getattr(annotation, "__name__", str(annotation))


_click_errors = importlib.import_module(typer.BadParameter.__module__)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors -- ours (MosaicError) and click's usage errors (bad
    choice, missing argument) -- become one line on stderr and exit status 2; bugs keep their
    traceback. Not standalone mode, so click's errors reach us instead of its usage box.
    Under torchrun every rank raises the same user error (arguments, a plan rank 0 read), so
    only rank 0 prints it; an error of one rank alone (a lost peer: `per_rank`) prints on any."""
    from mosaic.errors import is_user_error

    argv = _bare_resume(sys.argv[1:] if argv is None else list(argv))
    rank0 = os.environ.get("RANK", "0").strip() in ("0", "")
    try:
        code = app(args=argv, prog_name="mosaic", standalone_mode=False)
    except ValueError as exc:
        if not is_user_error(exc):
            raise
        if rank0 or getattr(exc, "per_rank", False):
            _exit_one_line(str(exc), 2)
        sys.exit(2)
    except _click_errors.ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare `mosaic`: the help, as before
            exc.show()
            sys.exit(exc.exit_code)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        if not rank0:
            sys.exit(exc.exit_code)
        _exit_one_line(exc.format_message() + hint, exc.exit_code)
    except typer.Abort:  # Ctrl-D at a prompt, as typer raises it
        _exit_one_line("aborted", 1)
    sys.exit(code if isinstance(code, int) else 0)


def _bare_resume(argv: list[str]) -> list[str]:
    """`--resume` takes an optional value (`--resume auto`), which click cannot express: a
    bare `--resume` (last, or before another option) gets its implicit value "yes"."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("yes")
    return out


def _exit_one_line(message: str, code: int) -> None:
    typer.echo(f"mosaic: error: {' '.join(message.split())}", err=True)
    sys.exit(code)
