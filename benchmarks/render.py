"""Render the tables of BENCHMARKS.md from the raw JSON under benchmarks/results/.

    python benchmarks/render.py            # rewrite every marked block of BENCHMARKS.md
    python benchmarks/render.py --check    # exit 1 when BENCHMARKS.md differs from its data

A block is `<!-- render:NAME -->` ... `<!-- /render:NAME -->`, where NAME is a registered
renderer, optionally with an argument after a colon: a path under results/, e.g.
`<!-- render:bench:h200-small -->`. Everything between the two markers belongs to the
renderer; the prose around them is the author's. Renderers read only JSON and format it with
fixed rules, so the output is deterministic and a figure cannot drift from its data.

Renderers: one-gpu-bench[:DIR], green-probe[:FILE], gemm-probe:FILE, bench:DIR_OR_FILE, iteration-error[:DIR],
scaling-sim[:DIR], variants:DIR, targets-1gpu, profile-recipe[:DB],
step-fit:FILE,FILE[,...], kernel-time:FILE[,...], train-in-flight:DIR, train-summaries:DIR,
guard-host-cost:FILE, autotune-choices:FILE, gate-misses[:DIR], main-weights-profile:DB,
checkpoint-background:DIR, busy-fractions:FILE, memory-peaks:DIR[,DIR...],
moments-digits:FILE, moments-drift:FILE, update-bits:FILE[,...], update-streams:FILE[,...].
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "BENCHMARKS.md"
DOCS = (DOC, ROOT / "README.md")
"""What `render.py` renders and checks unless told one --doc: the README's summary too."""
if importlib.util.find_spec("mosaic") is None:  # run as a plain script, without PYTHONPATH=src
    sys.path.insert(0, str(ROOT / "src"))

BASELINES = ("megatron", "distmm", "spindle")
"""In-engine baselines (the BASELINES of `mosaic bench`; not imported: that would load torch)."""
USER_BASELINES = ("torch-eager", "torch-compile", "torch-compile-max-autotune",
                  "torch-compile-max-autotune-gemm", "torch-eager-fsdp", "torch-compile-fsdp")
"""The user's own training program, measured beside the plans; never predicted."""
FSDP_USER = "torch-compile-fsdp"
"""The user's torch.compile program on FSDP2: their baseline where DDP's replicas do not fit."""
ONE_GPU_MODELS = ("clip", "imagebind", "qwen3-vl", "unified-io-2", "ofasys")
"""bench_h200.sh's models, in its order (the zoo's): one results file bench_MODEL.json each."""
PEAK_TFLOPS = 989.0
"""H200 dense bf16 datasheet peak: the usual MFU denominator (the engine records MFU against
the 790 TF/s a matmul reached, GPUSpec.peak_bf16_flops)."""
MINUS = "\u2212"  # the Markdown tables print a true minus sign, as the hand-written ones did

Renderer = Callable[[Path, "str | None"], str]
RENDERERS: dict[str, Renderer] = {}


class RenderError(ValueError):
    """A marker or renderer problem in the document; the message says where."""


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        RENDERERS[name] = fn
        return fn
    return register


# --- formatting -------------------------------------------------------------------------------

def table(header: list[str], rows: Iterable[list[str]]) -> str:
    """A GitHub Markdown table; a `|` inside a cell is escaped so it cannot split the cell."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.2f}"


def pct(fraction: float | None, signed: bool = True) -> str:
    if fraction is None:
        return "–"
    return (f"{fraction * 100:+.1f}%" if signed else f"{fraction * 100:.1f}%").replace("-", MINUS)


def span(values: Iterable[float], fmt: str) -> str:
    """"a–b" over the values as printed ("a" when they print the same)."""
    values = list(values)
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def load(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# --- bench results ----------------------------------------------------------------------------

def by_planner(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["planner"]: r for r in report["results"]}


def user_baseline(report: dict[str, Any]) -> dict[str, Any] | None:
    """The user's torch.compile program (on DDP; else on FSDP2, where only that one ran),
    unless it was compiled by blocks (bench runs before the user program was always compiled
    whole): its CUDA graphs then split at every layer, which no user compiling per module
    gets, so it is no baseline."""
    compiled = report.get("checks", {}).get("compile", {}).get("compiled", {})
    if any(name.startswith("torch-compile/") and how.get("scope") == "blocks"
           for name, how in compiled.items()):
        return None
    rows = by_planner(report)
    return rows.get("torch-compile") or rows.get(FSDP_USER)


def _user_speedup(report: dict[str, Any], row: dict[str, Any] | None) -> str:
    """Against the user's torch.compile program, naming FSDP2 when that is the one."""
    user = user_baseline(report)
    fsdp = user is not None and user["planner"] == FSDP_USER
    return _speedup(user, row) + (" (vs FSDP2)" if fsdp and row is not None else "")


def best_baseline(report: dict[str, Any]) -> dict[str, Any] | None:
    """The fastest in-engine baseline row (on one GPU the three are nearly one plan)."""
    rows = [r for name, r in by_planner(report).items() if name in BASELINES]
    return min(rows, key=lambda r: r["measured_iteration_s"]) if rows else None


def _stage_key(plan: dict[str, Any]) -> Any:
    return (plan.get("micro_batches", 1),
            [(s["sharing"], [(p["module"], p["gpus"], p["sm_share"]) for p in s["placements"]])
             for s in plan["stages"]])


def _placement(p: dict[str, Any], sharing: str, num_sms: int | None) -> str:
    if sharing not in ("partition", "cap") or p["sm_share"] >= 1:
        return p["module"]
    sms = f"{round(p['sm_share'] * num_sms)}" if num_sms else f"{p['sm_share']:.0%}"
    return f"{p['module']} {'≤' if sharing == 'cap' else ''}{sms}"


def plan_text(row: dict[str, Any], report: dict[str, Any]) -> str:
    """The plan in one line: stages in order, `a ‖ b (free)` for modules sharing the GPU;
    a plan identical to a baseline's is named as that baseline's."""
    plan, rows = row["plan"], by_planner(report)
    for name in BASELINES:
        if name in rows and _stage_key(rows[name]["plan"]) == _stage_key(plan):
            return f"{name}'s plan (no colocation)"
    stages = []
    for s in plan["stages"]:
        names = [_placement(p, s["sharing"], report.get("num_sms")) for p in s["placements"]]
        joined = ", ".join(names) if s["sharing"] == "temporal" else " ‖ ".join(names)
        stages.append(names[0] if len(names) == 1 else f"{joined} ({s['sharing']})")
    return " → ".join(stages)


def _tflop_per_gpu_s(report: dict[str, Any], row: dict[str, Any]) -> float:
    return report["model_tflop_per_iteration"] / (report["gpus"] * row["measured_iteration_s"])


def recorded_peak_tflops(report: dict[str, Any], row: dict[str, Any]) -> float:
    """The peak the recorded "mfu" was computed against (it is not stored on its own)."""
    return _tflop_per_gpu_s(report, row) / row["mfu"]


def mfu(report: dict[str, Any], row: dict[str, Any] | None,
        peak_tflops: float = PEAK_TFLOPS) -> float | None:
    return None if row is None else _tflop_per_gpu_s(report, row) / peak_tflops


def with_spread(row: dict[str, Any]) -> str:
    return f"{ms(row['measured_iteration_s'])} ({ms(row['p10_s'])}–{ms(row['p90_s'])})"


# --- (a) mosaic vs the baselines on one GPU ---------------------------------------------------

def _one_gpu_row(report: dict[str, Any]) -> list[str]:
    base, mosaic = best_baseline(report), by_planner(report)["mosaic"]
    speedup = base["measured_iteration_s"] / mosaic["measured_iteration_s"]
    shown = f"{speedup:.3f}x"
    return [report["model"], str(report["global_batch"]), with_spread(base), with_spread(mosaic),
            f"**{shown}**" if speedup > 1 else shown, plan_text(mosaic, report),
            f"{ms(mosaic['predicted_iteration_s'])} ({pct(mosaic.get('prediction_error'))})",
            f"{base['mfu'] * 100:.1f} → {mosaic['mfu'] * 100:.1f}%"]


@renderer("one-gpu-bench")
def one_gpu_bench(results: Path, arg: str | None) -> str:
    """Best of the Megatron/DistMM/Spindle plans vs mosaic's, one row per zoo model."""
    directory = results / (arg or "h200-small")
    files = [directory / f"bench_{m}.json" for m in ONE_GPU_MODELS]
    reports = [load(f) for f in files if f.exists()]
    if not reports:
        raise RenderError(f"one-gpu-bench: no bench_MODEL.json under {directory}")
    presets = ", ".join(sorted({r["preset"] for r in reports}))
    peaks = {round(recorded_peak_tflops(r, by_planner(r)["mosaic"])) for r in reports}
    peak = f"of {peaks.pop()} TF/s" if len(peaks) == 1 else "of the recorded peaks"
    header = [f"model (preset {presets})", "batch", "best baseline, ms (p10–p90)",
              "mosaic, ms (p10–p90)", "**speedup**", "mosaic plan", "predicted, ms (error)",
              f"MFU base → mosaic ({peak})"]
    return table(header, map(_one_gpu_row, reports))


# --- (b) the green-context probe --------------------------------------------------------------

def _partition_row(x: dict[str, Any]) -> list[str]:
    keys = list(x["requested"])

    def sizes(field: str) -> str:
        return "/".join(str(x[field][k]) for k in keys)

    shared = sum(x["shared_sms"].values())
    result = (f"contexts of {sizes('num_context')} SMs; `%smid` seen {sizes('num_seen')}, "
              f"{shared} shared, {'ran' if x['ran_concurrently'] else 'did NOT run'} concurrently")
    if sizes("num_context") != sizes("requested"):  # why a context got more than it asked for
        units = x["describe"]["unit_sms"]
        result += f" (the split's last unit has {units[-1]} SMs and joins the last partition)"
    return [f"{len(keys)} partitions, {sizes('requested')} SMs requested", result]


def _matmul_row(m: dict[str, Any]) -> list[str]:
    quotas = sorted((v for k, v in m.items() if k.startswith("sm")), key=lambda v: v["num_sms"])
    enforced = "quota enforced" if m["describe"]["enforced"] else "quota NOT enforced"
    sms = " / ".join(str(v["num_sms"]) for v in quotas)
    times = " / ".join(f"{v['ms']:.2f}" for v in quotas)
    return [f"8192³ bf16 matmul on {sms} SMs", f"{times} ms ({enforced}); whole GPU without a "
            f"context {m['whole_gpu']['ms']:.2f} ms"]


def _setup_rows(s: dict[str, Any]) -> list[list[str]]:
    counts = sorted(int(k.split("_")[1]) for k in s if k.startswith("partitions_"))
    runs = [s[f"partitions_{n}"] for n in counts]
    # memory of the last (steady) creation: the first may also load driver state
    per_context = [r[-1]["mem_mib"] / n for n, r in zip(counts, runs, strict=True)]
    times = " / ".join(span([x["setup_s"] * 1e3 for x in r], ".1f") for r in runs)
    left = s["busy_work_left_after_create_s"] * 1e3
    return [
        [f"pool creation, {' / '.join(map(str, counts))} partitions",
         f"{times} ms once at start-up; {span(per_context, '.0f')} MiB device memory per context"],
        ["stream lookup from the pool (in a step)", f"{s['lookup_us']:.2f} µs"],
        ["creating one context + stream inside a step",
         f"{s['create_in_step_idle_s'] * 1e3:.1f} ms on an idle GPU, "
         f"**{s['create_in_step_busy_s'] * 1e3:.1f} ms behind queued work** (creation waits for "
         f"the queue: {left:.2f} ms of it was left after)"],
    ]


@renderer("green-probe")
def green_probe(results: Path, arg: str | None) -> str:
    """benchmarks/green_probe.py's JSON: partitions, quota vs matmul time, setup cost."""
    r = load(results / (arg or "green_probe_h200.json"))
    rows: list[list[str]] = []
    sections = (("disjoint", lambda d: [_partition_row(d[k]) for k in ("three_way", "two_way")]),
                ("matmul", lambda m: [_matmul_row(m)]), ("setup", _setup_rows))
    for name, make in sections:
        # a section the probe recorded as failed is shown as failed, not silently dropped
        rows += [[name, "FAILED (see the JSON)"]] if "error" in r[name] else make(r[name])
    return table(["check", "result"], rows)


def _error_name(message: str) -> str:
    """A CUDA/cuBLAS status name from an error message, else its first words."""
    found = re.search(r"\b(CU(?:BLAS|DA)_(?:STATUS_|ERROR_)?[A-Z_]+)", message)
    return found.group(1) if found else message.replace("`", "")[:60]


@renderer("gemm-probe")
def gemm_probe(results: Path, arg: str | None) -> str:
    """benchmarks/green_gemm_probe.py's JSON lines: each pool's streams, the SM units each
    got, and whether both bf16 GEMMs ran there (else the error's first words)."""
    if not arg:
        raise RenderError("gemm-probe needs a probe.jsonl under results/")
    rows = []
    for line in (results / arg).read_text().splitlines():
        r = json.loads(line)
        if "crashed" in r:
            rows.append([r["case"], "–", "–", "–", "–", "–", f"process ended ({r['crashed']})"])
            continue
        gemms = {r[k] for k in ("n256", "n392")}
        units = f"[{r['sm_range'][0]}, {r['sm_range'][1]})" if r["sm_range"] else "–"
        leftover = " (leftover alone)" if r["sm_range"] and r["sm_range"][0] == len(
            r["unit_sms"]) - 1 else ""
        share = f"{r['share']:.3f}" if r.get("share") is not None else "–"
        rows.append([r["case"], r["module"], r["mode"], share, str(r["num_sms"] or "all"),
                     units + leftover,
                     "ok" if gemms == {"ok"} else _error_name(next(g for g in gemms if g != "ok"))])
    return table(["pool", "stream", "mode", "planned share", "SMs", "units", "both GEMMs"], rows)


# --- (c) any bench results: one row per results file ------------------------------------------

def _result_files(results: Path, dir_or_files: str | Path | Iterable[str | Path]) -> list[Path]:
    """What counts as a bench result is perf/results.py's rule, so the gate and tables agree."""
    from mosaic.perf.results import bench_result_files

    if isinstance(dir_or_files, str | Path):
        dir_or_files = [dir_or_files]
    return [path for _, path in bench_result_files([results / p for p in dir_or_files])]


def _ratio(reference: dict[str, Any] | None, row: dict[str, Any] | None) -> float | None:
    """How many times faster `row` ran than `reference`."""
    if reference is None or row is None:
        return None
    return reference["measured_iteration_s"] / row["measured_iteration_s"]


def _speedup(base: dict[str, Any] | None, row: dict[str, Any] | None) -> str:
    ratio = _ratio(base, row)
    return "–" if ratio is None else f"{ratio:.3f}x"


def _engine_text(report: dict[str, Any]) -> str:
    """Gradient sync (several GPUs) and where gradients are left (bench JSON `engine`)."""
    engine = report.get("engine", {})
    sync = (f"{engine['grad_sync']}, {engine.get('reduce_dtype', 'fp32')}" if "grad_sync" in engine
            else "bucketed, fp32")
    parts = [sync] if report["gpus"] > 1 else []
    if engine.get("grads_in_graph") and engine.get("graphs"):
        parts.append("grads in graph")
    if engine.get("accumulation", 1) > 1:
        parts.append(f"{engine['accumulation']} micro-steps of {report['global_batch'] // engine['accumulation']}")
    if report.get("checks", {}).get("plan_groups"):  # --plans-at-once: not interleaved
        parts.append(f"plans in {len(report['checks']['plan_groups'])} groups")
    return "; ".join(parts) or "–"


def _plan_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of plans as benched, without `--engine-variant` repeats (their own table)."""
    return [r for r in report["results"] if not r.get("engine_variant")]


def _bench_row(report: dict[str, Any], planners: list[str]) -> list[str]:
    rows = by_planner(report)
    mosaic = rows.get("mosaic")
    errors = [r["prediction_error"] for r in rows.values() if r.get("prediction_error") is not None]
    worst = max(errors, key=abs) if errors else None
    error = pct(mosaic.get("prediction_error")) if mosaic else "–"
    return [report["model"], report["preset"], str(report["gpus"]), str(report["global_batch"]),
            _engine_text(report),
            *[_planner_ms(report, rows, p) for p in planners],
            _speedup(best_baseline(report), mosaic), _user_speedup(report, mosaic),
            pct(mfu(report, mosaic), signed=False), f"{error} (worst {pct(worst)})"]


def _left_out(report: dict[str, Any]) -> dict[str, str]:
    """User programs the bench did not build because they cannot fit, and why."""
    return report.get("checks", {}).get("user_programs_left_out", {})


def _planner_ms(report: dict[str, Any], rows: dict[str, dict[str, Any]], planner: str) -> str:
    if planner not in rows:
        return "does not fit" if planner in _left_out(report) else "–"
    unfair = planner == "torch-compile" and user_baseline(report) is None
    return ms(rows[planner]["measured_iteration_s"]) + (" (compiled by blocks)" if unfair else "")


def bench_table(dir_or_files: str | Path | Iterable[str | Path], results: Path = RESULTS) -> str:
    """Every bench results JSON under the directory (or the files), one row each: every
    planner's median ms (user baselines last), mosaic's speedups, MFU and prediction error."""
    reports = [load(f) for f in _result_files(results, dir_or_files)]
    seen = list(dict.fromkeys([*(r["planner"] for rep in reports for r in _plan_rows(rep)),
                               *(label for rep in reports for label in _left_out(rep))]))
    users = [p for p in USER_BASELINES if p in seen]
    planners = [p for p in seen if p not in USER_BASELINES] + users
    rows = [_bench_row(rep, planners) for rep in reports]
    header = ["model", "preset", "GPUs", "batch", "engine",
              *[f"{p}, ms" for p in planners],
              "mosaic vs best baseline", "mosaic vs torch-compile",
              f"mosaic MFU (of {PEAK_TFLOPS:.0f} TF/s)",
              "mosaic prediction error as recorded (worst plan)"]
    if "torch-compile" not in seen and FSDP_USER not in seen:  # a column of dashes says nothing
        drop = header.index("mosaic vs torch-compile")
        header, rows = header[:drop] + header[drop + 1:], [r[:drop] + r[drop + 1:] for r in rows]
    return table(header, rows)


@renderer("bench")
def bench(results: Path, arg: str | None) -> str:
    if not arg:
        raise RenderError("bench needs a directory or file under results/: render:bench:DIR")
    return bench_table(arg, results)


def variants_table(dir_or_files: str | Path | Iterable[str | Path], results: Path = RESULTS) -> str:
    """Every `--engine-variant` row: the plan, the settings changed, its median against the
    same plan under the run's own engine settings (same process and rounds)."""
    rows = []
    for path in _result_files(results, dir_or_files):
        report = load(path)
        plans = by_planner(report)
        for r in report["results"]:
            settings = r.get("engine_variant")
            if not settings:
                continue
            base_label = r["planner"].split("@", 1)[0]
            base = plans.get(base_label)
            rows.append([path.name, report["model"], report["preset"], str(report["gpus"]),
                         str(report["global_batch"]), _engine_text(report), base_label,
                         ", ".join(f"{k}={str(v).lower()}" for k, v in settings.items()),
                         ms(base["measured_iteration_s"]) if base else "–",
                         ms(r["measured_iteration_s"]), _speedup(r, base),
                         _user_speedup(report, r), _variant_mfu(report, r)])
    return table(["file", "model", "preset", "GPUs", "batch", "run's engine", "plan",
                  "variant", "run's engine, ms", "variant, ms", "run's engine vs variant",
                  "variant vs torch-compile", f"variant MFU (of {PEAK_TFLOPS:.0f} TF/s)"], rows)


def _variant_mfu(report: dict[str, Any], row: dict[str, Any]) -> str:
    in_flight = in_flight_mfu(report, row)
    return pct(mfu(report, row), signed=False) + (
        "" if in_flight is None else f" (in flight {pct(in_flight, signed=False)})")


@renderer("variants")
def variants(results: Path, arg: str | None) -> str:
    if not arg:
        raise RenderError("variants needs a directory or file under results/: "
                          "render:variants:DIR")
    return variants_table(arg, results)


# --- (c') where the one-GPU engine-speed targets stand ------------------------------------------

SPEEDUP_VS_USER = 1.10
"""Target: mosaic's plan at least this much faster than the user's torch.compile program."""
SPEEDUP_VS_BASELINE = 1.05
"""Target: mosaic's plan at least this much faster than the best in-engine baseline."""
PLAN_WITHIN = 0.02
"""Target at 4x the preset batch: the planner's plan within 2% of the best plan measured."""
MFU_TARGET = 0.35
"""Target at `paper`: mosaic's MFU against the datasheet peak, on these models."""
MFU_TARGET_MODELS = ("unified-io-2", "ofasys")


def _mfu_cell(report: dict[str, Any], mosaic: dict[str, Any] | None) -> str:
    """MFU of the steps read one at a time, and, where the run measured it, of the steps run
    in flight (as a training loop runs them); each against the target where there is one."""
    value = mfu(report, mosaic)
    targeted = report["preset"] == "paper" and report["model"] in MFU_TARGET_MODELS
    if value is None:
        return pct(value, signed=False)
    cell = _mfu_value(value, targeted)
    in_flight = in_flight_mfu(report, mosaic)
    if in_flight is not None:
        cell += f" (in flight {_mfu_value(in_flight, targeted)})"
    return cell


def in_flight_mfu(report: dict[str, Any], row: dict[str, Any]) -> float | None:
    """MFU of a row's steps run in flight (the bench's window), None where not measured."""
    if not row.get("in_flight_median_s"):
        return None
    return mfu(report, row) * row["measured_iteration_s"] / row["in_flight_median_s"]


def _mfu_value(value: float, targeted: bool) -> str:
    if not targeted:
        return pct(value, signed=False)
    return f"{100 * value:.2f}% {'✓' if value >= MFU_TARGET else '✗'}"


def _compiled_one_gpu(report: dict[str, Any]) -> bool:
    """A one-GPU run of the compiled engine."""
    engine = report.get("engine") or {}
    return report["gpus"] == 1 and engine.get("compile") not in (None, "none")


Runs = dict[tuple[str, str, int], tuple[Path, dict[str, Any]]]


def _latest_runs(results: Path) -> dict[str | None, Runs]:
    """(model, preset, batch) -> the newest compiled one-GPU result with the user's
    torch.compile program beside it, else the newest without, preferring one that took the
    batch in one step over one that accumulated micro-steps (an experiment on accumulation,
    not the row's configuration); never a superseded one, one
    stopped before it measured every contender (`complete` false), nor one without mosaic's
    plan (a variant measured on a baseline's plan alone). Under None every such run; under
    BF16_MOSAIC, BF16_MOMENTS_MOSAIC, NO_MAIN_MOSAIC and AUTOTUNE only the runs that measured
    that label, for
    a column or row the newest run may lack (one pass over the files for all)."""
    from mosaic.perf.results import superseded, without_superseded_rows

    def rank(report: dict[str, Any]) -> tuple[bool, bool, str]:
        one_step = report.get("engine", {}).get("accumulation", 1) == 1
        return user_baseline(report) is not None, one_step, report["date"]

    latest: dict[str | None, Runs] = {None: {}, AUTOTUNE: {}, **{k: {} for k in _LAYOUTS_OF}}
    for path in _result_files(results, "."):
        report = without_superseded_rows(load(path), path)
        if not _compiled_one_gpu(report) or superseded(path) or not report.get("complete", True):
            continue
        plans = by_planner(report)
        if "mosaic" not in plans:
            continue
        key = (report["model"], report["preset"], report["global_batch"])
        for having, runs in latest.items():
            if (having is None or _labelled(report, having) is not None) and (
                    key not in runs or rank(report) > rank(runs[key][1])):
                runs[key] = (path, report)
    return latest


def _verdict(value: float | None, target: float) -> str:
    return "–" if value is None else f"{value:.3f}x {'✓' if value >= target else '✗'}"


def _target_row(report: dict[str, Any], path: Path, results: Path, times: int,
                columns: dict[str, tuple[Path, dict[str, Any]] | None]) -> list[str]:
    """`columns`: per label of the last two columns, the newest run that measured it, where
    that is not `report` (a later run without bf16 weights keeps an earlier one's cell)."""
    rows = by_planner(report)
    mosaic, base, user = rows.get("mosaic"), best_baseline(report), user_baseline(report)
    plans = [r for name, r in rows.items() if name not in USER_BASELINES and not r.get("engine_variant")]
    best_plan = min(r["measured_iteration_s"] for r in plans)
    behind = mosaic["measured_iteration_s"] / best_plan - 1 if mosaic else None
    within = ("–" if behind is None or times != 4 else
              f"{pct(behind, signed=False)} {'✓' if behind <= PLAN_WITHIN else '✗'}")
    return [str(path.relative_to(results)), report["date"][:10],
            ms(mosaic["measured_iteration_s"]) if mosaic else "–",
            f"{ms(base['measured_iteration_s'])} ({base['planner']})" if base else "–",
            ms(user["measured_iteration_s"]) if user else "not run",
            _verdict(_ratio(base, mosaic), SPEEDUP_VS_BASELINE) + _same_plan(mosaic, base),
            _verdict(_ratio(user, mosaic), SPEEDUP_VS_USER),
            within, _mfu_cell(report, mosaic),
            _other_run_cell(_bf16_weights_cell, BF16_MOSAIC, report, columns, results),
            _other_run_cell(_autotune_cell, AUTOTUNE, report, columns, results)]


def _other_run_cell(cell, label: str, report: dict[str, Any],
                    columns: dict[str, tuple[Path, dict[str, Any]] | None], results: Path) -> str:
    """`cell` of `label` from `report`, else from the newest run that measured it, named."""
    if _labelled(report, label) is not None or columns.get(label) is None:
        return cell(report, _labelled(report, label))
    path, other = columns[label]
    return f"{cell(other, _labelled(other, label))} ({path.relative_to(results)})"


def _same_plan(mosaic: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    """Said where the planner returned the best baseline's own plan: no schedule of these
    modules beats that baseline in the model, so 1.000x is the plan space's answer, not noise."""
    if mosaic and base and mosaic.get("same_plan_as") == base["planner"]:
        return f" (the planner returned {base['planner']}'s plan)"
    return ""


AUTOTUNE = "autotune"
"""The plan `--autotune K` kept after measuring the K best predicted plans and the baselines'
at start-up, timed in the rounds beside the others."""


def _autotune_cell(report: dict[str, Any], row: dict[str, Any] | None) -> str:
    """Against the run's best baseline and the user's torch.compile program, with the target
    verdicts; which plan it kept, of how many measured, and its start-up."""
    tuned = report.get("autotune")
    if row is None or not tuned:
        return "–"
    base, user = best_baseline(report), user_baseline(report)
    versus = f", {_verdict(_ratio(user, row), SPEEDUP_VS_USER)} torch-compile" if user else ""
    return (f"{ms(row['measured_iteration_s'])} ms: "
            f"{_verdict(_ratio(base, row), SPEEDUP_VS_BASELINE)} {base['planner']}{versus}; "
            f"kept {tuned['chosen']} of {len(tuned['measurements'])} plans measured, start-up "
            f"{tuned['startup_s']:.0f} s")


BF16_MOSAIC = "mosaic@bf16_weights=true"
"""mosaic's plan again with bf16 GEMM weights and fp32 main weights (a bench variant)."""
BF16_LAYOUTS = {"bf16_weights=true": "", "bf16_weights=true,bf16_flat_grads=false":
                " (a weight at a time)"}
"""The bench variants of the bf16 weights' update layouts that `mosaic train` chooses between
(one launch per module's flat gradients, or a weight at a time), each with its note; other
variants with bf16 weights are experiments, not the configuration a user trains."""
BF16_MOMENTS_MOSAIC = "mosaic@bf16_weights=true,bf16_moments=true"
"""mosaic's plan with bf16 weights and bf16 AdamW moments (`--bf16-moments`: opt-in, another
optimizer precision, so a row of its own)."""
BF16_MOMENT_LAYOUTS = {f"{v},bf16_moments=true": note for v, note in BF16_LAYOUTS.items()}
NO_MAIN_MOSAIC = f"{BF16_MOMENTS_MOSAIC},fp32_main_weights=false"
"""mosaic's plan with bf16 weights and moments and no fp32 main weights
(`--no-fp32-main-weights`: opt-in too, a row of its own)."""
NO_MAIN_LAYOUTS = {f"{v},fp32_main_weights=false": note for v, note in BF16_MOMENT_LAYOUTS.items()}
_LAYOUTS_OF = {BF16_MOSAIC: BF16_LAYOUTS, BF16_MOMENTS_MOSAIC: BF16_MOMENT_LAYOUTS,
               NO_MAIN_MOSAIC: NO_MAIN_LAYOUTS}


def _labelled(report: dict[str, Any], label: str) -> dict[str, Any] | None:
    """The row a column `label` names: for BF16_MOSAIC (BF16_MOMENTS_MOSAIC) mosaic's plan
    with bf16 weights (and moments) in the faster of the layouts `report` measured, else the
    row of that label."""
    if label in _LAYOUTS_OF:
        return _fastest_bf16(report, "mosaic", _LAYOUTS_OF[label])
    return by_planner(report).get(label)


def _fastest_bf16(report: dict[str, Any], planner: str,
                  variants: dict[str, str] = BF16_LAYOUTS) -> dict[str, Any] | None:
    rows = by_planner(report)
    layouts = [rows[f"{planner}@{v}"] for v in variants if f"{planner}@{v}" in rows]
    return min(layouts, key=lambda r: r["measured_iteration_s"]) if layouts else None


def _layout_note(row: dict[str, Any]) -> str:
    variant = row["planner"].partition("@")[2]
    return next((layouts[variant] for layouts in _LAYOUTS_OF.values() if variant in layouts), "")


def _bf16_weights_cell(report: dict[str, Any], row: dict[str, Any] | None) -> str:
    """Against the baselines' plans with bf16 weights too where the run measured them
    (Megatron keeps bf16 weights and fp32 main weights itself), else the fp32 baselines, said
    so; and against the user's torch.compile program, which runs fp32 weights under autocast
    as a torch.compile / FSDP user does."""
    if row is None:
        return "–"
    base = _bf16_baseline(report)
    same = "@bf16_weights" in base["planner"]
    which = (f"{base['planner'].split('@')[0]} with bf16 weights" if same
             else f"{base['planner']}, fp32 weights")
    user = user_baseline(report)
    versus = f", {_ratio(user, row):.3f}x torch-compile" if user else ""
    return (f"{ms(row['measured_iteration_s'])} ms{_layout_note(row)}: "
            f"{_ratio(base, row):.3f}x {which}{versus}, "
            f"MFU {pct(mfu(report, row), signed=False)}")


@renderer("targets-1gpu")
def targets_one_gpu(results: Path, arg: str | None) -> str:
    """Every zoo model at `small` and `paper`, at its preset batch and 4x it, on one GPU: the
    newest compiled-engine result with the user's torch.compile program beside it (else the
    newest without), against the engine-speed targets; a combination never measured says so."""
    from mosaic.zoo import get_model

    having = _latest_runs(results)
    latest = having[None]
    rows = []
    for model in ONE_GPU_MODELS:
        for preset in ("small", "paper"):
            preset_batch = get_model(model).graph(preset).global_batch
            for times in (1, 4):
                key = (model, preset, times * preset_batch)
                head = [model, preset, f"{key[2]} ({times}x)"]
                if key in latest:
                    columns = {label: having[label].get(key) for label in (BF16_MOSAIC, AUTOTUNE)}
                    rows.append(head + _target_row(latest[key][1], latest[key][0], results,
                                                   times, columns))
                else:
                    rows.append(head + [_unmeasured(model, preset, key[2])] + ["–"] * 10)
    header = ["model", "preset", "batch", "result", "date", "mosaic, ms",
              "best baseline, ms", "torch-compile, ms",
              f"vs best baseline (≥{SPEEDUP_VS_BASELINE:.2f}x)",
              f"vs torch-compile (≥{SPEEDUP_VS_USER:.2f}x)",
              f"mosaic's plan behind the best plan (4x: ≤{PLAN_WITHIN:.0%})",
              f"mosaic MFU (of {PEAK_TFLOPS:.0f} TF/s; `paper` {', '.join(MFU_TARGET_MODELS)}: "
              f"≥{MFU_TARGET:.0%}; in flight: steps run back to back, where measured)",
              "mosaic with bf16 weights (`--engine-variant bf16_weights=true`), same run "
              "(else the newest run with it, named)",
              "mosaic `--autotune K`, same run (else the newest run with it, named)"]
    return table(header, rows)


@renderer("measured-summary")
def measured_summary(results: Path, arg: str | None) -> str:
    """The README's table: every row of the targets table whose run measured the user's
    torch.compile program, and mosaic's plan with bf16 weights where the run measured it too
    (against the baselines' plans with bf16 weights where there are some), and the plan
    `--autotune` kept where the run autotuned (each from the newest run that measured it,
    with that run's baselines)."""
    having = _latest_runs(results)
    latest = having[None]
    rows = []
    for model in ONE_GPU_MODELS:
        display = _DISPLAY.get(model, model)
        for preset in ("small", "paper"):
            for key in sorted(k for k in latest if k[:2] == (model, preset)):
                _, report = latest[key]
                user, plans = user_baseline(report), by_planner(report)
                if user is None or "mosaic" not in plans:
                    continue
                name = display if preset == "small" else f"{display} (preset paper)"
                rows.append(_summary_row(name, report, plans["mosaic"], best_baseline(report),
                                         user))
                for label, what in ((BF16_MOSAIC, "bf16 weights"),
                                    (BF16_MOMENTS_MOSAIC, "bf16 weights and moments"),
                                    (NO_MAIN_MOSAIC, "bf16 weights and moments, no fp32 main "
                                                     "weights")):
                    bf16_run = _run_with(label, report, having[label].get(key))
                    if bf16_run is not None:
                        bf16_row = _labelled(bf16_run, label)
                        rows.append(_summary_row(
                            f"{name}, {what}{_layout_note(bf16_row)}", bf16_run, bf16_row,
                            _bf16_baseline(bf16_run, _LAYOUTS_OF[label]),
                            user_baseline(bf16_run)))
                tuned_run = _run_with(AUTOTUNE, report, having[AUTOTUNE].get(key))
                if tuned_run is not None and tuned_run.get("autotune"):
                    rows.append(_summary_row(f"{name}, `--autotune`", tuned_run,
                                             by_planner(tuned_run)[AUTOTUNE],
                                             best_baseline(tuned_run), user_baseline(tuned_run)))
    return table(["model", "batch", "user's program, torch.compile", "best in-engine baseline",
                  "mosaic", "mosaic vs torch.compile"], rows)


def _run_with(label: str, report: dict[str, Any],
              newest: tuple[Path, dict[str, Any]] | None) -> dict[str, Any] | None:
    """`report` where it measured `label`, else the newest run that did, if that run measured
    the user's program too (the README's rows compare with it)."""
    if _labelled(report, label) is not None:
        return report
    if newest is None or user_baseline(newest[1]) is None:
        return None
    return newest[1]


_DISPLAY = {"clip": "CLIP", "imagebind": "ImageBind", "qwen3-vl": "Qwen3-VL",
            "unified-io-2": "Unified-IO 2", "ofasys": "OFASys"}


def _summary_row(name: str, report: dict[str, Any], row: dict[str, Any],
                 base: dict[str, Any] | None, user: dict[str, Any]) -> list[str]:
    value = mfu(report, row)
    mosaic = f"**{ms(row['measured_iteration_s'])} ms**"
    if report["preset"] == "paper" and value is not None:
        mosaic += f" ({pct(value, signed=False)} MFU)"
    with_bf16 = ("" if not base or "@bf16_weights" not in base["planner"] else
                 " (the same flags too)" if "fp32_main_weights=false" in base["planner"] else
                 " (bf16 weights and moments too)" if "bf16_moments=true" in base["planner"]
                 else " (bf16 weights too)")
    return [name, str(report["global_batch"]), f"{ms(user['measured_iteration_s'])} ms",
            f"{ms(base['measured_iteration_s'])} ms{with_bf16}" if base else "–", mosaic,
            f"{_ratio(user, row):.3f}x"]


def _bf16_baseline(report: dict[str, Any],
                   variants: dict[str, str] = BF16_LAYOUTS) -> dict[str, Any] | None:
    """The fastest baseline plan with bf16 weights (in one of `variants`) in `report`, else
    the fastest fp32 one."""
    same = [row for name in BASELINES
            if (row := _fastest_bf16(report, name, variants)) is not None]
    return (min(same, key=lambda r: r["measured_iteration_s"]) if same
            else best_baseline(report))


def _unmeasured(model: str, preset: str, batch: int) -> str:
    """Why a combination has no result: it does not fit on one GPU (the memory model's figures,
    from the megatron planner's refusal), else it was not measured yet."""
    from mosaic.api import plan
    from mosaic.errors import MosaicError
    from mosaic.zoo import get_model

    try:
        plan(get_model(model).graph(preset, global_batch=batch), 1, planner="megatron",
             perf_model="analytic")
    except MosaicError as error:
        fit = re.search(r"needs ([\d.]+) GiB per GPU.*?only ([\d.]+) GiB is usable", str(error))
        if fit:
            return (f"does not fit on one H200 (memory model: {fit[1]} GiB a GPU, "
                    f"{fit[2]} GiB usable){_fits_in_bf16(model, preset, batch)}")
        raise
    return "not measured"


def _fits_in_bf16(model: str, preset: str, batch: int) -> str:
    """'; with bf16 weights and moments ... N GiB: fits' where the memory model places the
    model so on one H200 (no user program to compare with: it would keep fp32 weights)."""
    from mosaic.errors import MosaicError

    try:
        need = _one_gpu_memory_bytes(model, preset, batch, True, True, False) / 2**30
    except MosaicError:
        return ""
    return (f"; with bf16 weights and moments, updated a weight at a time, {need:.1f} GiB: "
            "fits (`mosaic train --bf16-weights --bf16-moments --no-bf16-flat-grads`)")


# --- (d) the whole-iteration accuracy gate ----------------------------------------------------

ERROR_HEADER = ["file", "model", "preset", "GPUs", "batch", "planner", "predicted, ms",
                "measured, ms", "error"]


def _error_row(r: dict[str, Any]) -> list[str]:
    error = ("not predicted" if r["error"] is None
             else f"{pct(r['error'])} (superseded)" if r["superseded"] else pct(r["error"]))
    return [r["file"], r["model"], r["preset"], str(r["gpus"]), str(r["global_batch"]),
            r["planner"], ms(r["predicted_s"]), ms(r["measured_s"]), error]


def _verdict_line(result: dict[str, Any]) -> str:
    from mosaic.perf.accuracy import gate_summary

    verdict, rest = gate_summary(result).split(": ", 1)
    return f"**{verdict}**: {rest.replace('<=', '≤')}"


def iteration_error_table(dir_or_files: str | Path | Iterable[str | Path],
                          results: Path = RESULTS) -> str:
    """Every predicted plan row's error, predicted by today's shipped model on the plan each
    result measured, then the gate's verdict in bold. A str argument may list several paths,
    comma-separated."""
    from mosaic.perf.accuracy import iteration_error
    from mosaic.perf.repredict import Repredictor

    if isinstance(dir_or_files, str):
        dir_or_files = [p.strip() for p in dir_or_files.split(",") if p.strip()]
    paths = [dir_or_files] if isinstance(dir_or_files, Path) else list(dir_or_files)
    result = iteration_error([results / p for p in paths], repredict=Repredictor())
    for row in result["rows"]:  # files given one by one are named by their full path
        row["file"] = row["file"].removeprefix(f"{results}/")
    rows = [_error_row(r) for r in result["rows"]]
    return table(ERROR_HEADER, rows) + "\n\n" + _verdict_line(result)


@renderer("iteration-error")
def iteration_error_block(results: Path, arg: str | None) -> str:
    return iteration_error_table(arg or ".", results)


@renderer("gate-misses")
def gate_misses(results: Path, arg: str | None) -> str:
    """The gate over every result under results/ARG (default: all), by today's model: its
    verdict, then only the plan rows outside the 10% target, per result file."""
    from mosaic.perf.accuracy import iteration_error
    from mosaic.perf.repredict import Repredictor

    result = iteration_error(results / (arg or "."), repredict=Repredictor())
    limit = result["targets"]["max_abs_error"]
    rows = [_error_row(r) for r in result["rows"]
            if r["error"] is not None and not r["superseded"] and abs(r["error"]) > limit]
    return _verdict_line(result) + "\n\n" + table(ERROR_HEADER, rows)


@renderer("stage-error")
def stage_error_block(results: Path, arg: str | None) -> str:
    """Every traced plan's stages under results/ARG (default: all) by today's model: the
    summary line, then one row per stage (`mosaic model-error --iterations DIR --stages`)."""
    from mosaic.perf.repredict import Repredictor
    from mosaic.perf.traced import sharing_text, stage_error, summary_line

    report = stage_error(results / (arg or "."), Repredictor())
    rows = [[r["file"], r["planner"], str(r["stage"]), "+".join(r["modules"]), sharing_text(r),
             f"{r['predicted_s'] * 1e3:.2f}", f"{r['measured_s'] * 1e3:.2f}", pct(r["error"]),
             (f"{r['predicted_saving_s'] * 1e3:.2f} / {r['measured_saving_s'] * 1e3:.2f}"
              if "measured_saving_s" in r else "–")]
            for r in report["rows"]]
    return summary_line(report) + "\n\n" + table(
        ["file", "plan", "stage", "modules", "sharing", "predicted, ms", "measured, ms",
         "error", "saving over one by one, predicted / measured, ms"], rows)


@renderer("colocation-savings")
def colocation_savings_block(results: Path, arg: str | None) -> str:
    """Every one-GPU colocating plan under results/ARG (default: all): the saving today's model
    composes over its placements one by one, and what it measured over the run's megatron."""
    from mosaic.perf.repredict import Repredictor
    from mosaic.perf.traced import colocation_savings

    rows = [[r["file"], r["model"], r["preset"], str(r["global_batch"]), r["planner"],
             f"{r['predicted_saving_s'] * 1e3:.2f}", f"{r['measured_saving_s'] * 1e3:.2f}",
             f"{r['realized']:.0%}"]
            for r in colocation_savings(results / (arg or "."), Repredictor())]
    return table(["file", "model", "preset", "batch", "plan", "saving predicted, ms",
                  "saving measured, ms", "realized"], rows)


# --- the batch-independent part of a step (what bounds MFU at a small batch) ---------------

@renderer("step-fit")
def step_fit(results: Path, arg: str | None) -> str:
    """mosaic's step time at several batches of one model (comma-separated results files),
    fitted as fixed + per-sample time by least squares: the fixed part is what a larger
    batch amortises, and it caps the MFU of the smallest batch."""
    import numpy as np

    files = [f.strip() for f in (arg or "").split(",") if f.strip()]
    if len(files) < 2:
        raise RenderError("step-fit needs two or more results files: render:step-fit:A,B[,C]")
    reports = [load(results / f) for f in files]
    points = sorted((r["global_batch"], by_planner(r)["mosaic"]["measured_iteration_s"],
                     r["model_tflop_per_iteration"] / r["global_batch"], f)
                    for r, f in zip(reports, files, strict=True))
    batch = np.array([p[0] for p in points], dtype=float)
    step = np.array([p[1] for p in points])
    (fixed, per_sample), *_ = np.linalg.lstsq(np.vstack([np.ones_like(batch), batch]).T, step,
                                              rcond=None)
    rows = [[f, str(b), ms(t), ms(fixed + per_sample * b),
             pct(fixed / (fixed + per_sample * b), signed=False),
             pct(tf * b / t / PEAK_TFLOPS, signed=False)] for b, t, tf, f in points]
    marginal = points[0][2] / per_sample / PEAK_TFLOPS
    return (table(["result", "batch", "mosaic, ms", "fit, ms", "fixed part of the step",
                   f"MFU (of {PEAK_TFLOPS:.0f} TF/s)"], rows)
            + f"\n\nFit: **{ms(fixed)} ms fixed + {ms(per_sample)} ms per sample**; the "
            f"per-sample part runs at {pct(marginal, signed=False)} of the peak.")


# --- where a traced step's GPU time goes (mosaic kernel-time) --------------------------------

KERNEL_CLASSES = ("gemm", "attention", "optimizer", "copy/cast", "triton (fused)",
                  "elementwise/reduce", "collective", "other")


@renderer("kernel-time")
def kernel_time(results: Path, arg: str | None) -> str:
    """One row per `kernel-time-rank<r>.json` (comma-separated, under results/): per traced
    step the span, busy and idle GPU time, and kernel time by class."""
    files = [f.strip() for f in (arg or "").split(",") if f.strip()]
    if not files:
        raise RenderError("kernel-time needs kernel-time JSON files: render:kernel-time:A[,B]")
    rows = []
    for f in files:
        for gpu, d in sorted(load(results / f)["devices"].items()):
            classes = d["classes"]
            rows.append([f, gpu, f"{d['span_ms']:.2f}", f"{d['busy_ms']:.2f}",
                         f"{d['idle_ms']:.2f}", f"{d['kernel_ms']:.2f}"]
                        + [f"{classes[c]['ms']:.2f} ({classes[c]['share_of_kernel_time']:.0%})"
                           if c in classes else "–" for c in KERNEL_CLASSES])
    return table(["trace", "GPU", "span, ms", "busy, ms", "idle, ms", "kernel time, ms",
                  *(f"{c}, ms" for c in KERNEL_CLASSES)], rows)


# --- the trainer's steps in flight (benchmarks/train_in_flight.py) ----------------------------

def _row_drawing(report: dict[str, Any]) -> str:
    if report.get("rows_on_device"):
        return "the GPU"
    if "row_processes" in report:
        return f"{report['row_processes']} processes"
    threads = report.get("row_threads", 1)
    return f"{threads} thread{'s' if threads != 1 else ''}"


def _host_rows(report: dict[str, Any]) -> str:
    value = report.get("host_rows_ms_one_thread")
    return "not measured" if value is None else f"{value:.1f}"


@renderer("train-in-flight")
def train_in_flight(results: Path, arg: str | None) -> str:
    """Every train_in_flight.py JSON under results/ARG, one row each: `mosaic train`'s median
    step reading each step before the next and in flight, MFU, what drawing the rows costs."""
    if not arg:
        raise RenderError("train-in-flight needs a directory under results/")
    rows = []
    for path in sorted((results / arg).rglob("*.json")):
        report = load(path)
        if "median_step_s" not in report:
            continue
        medians = report["median_step_s"]
        others = (report.get("in_flight_row_variants_s", {})
                  | report.get("in_flight_guard_variants_s", {}))
        if "in_flight_bf16_weights_median_s" in report:
            others["bf16 weights"] = report["in_flight_bf16_weights_median_s"]
        variants = "; ".join(f"{k} {v * 1e3:.2f} ms" for k, v in others.items()) or "–"
        if "mfu_bf16_weights" in report:
            variants += (f" ({medians['in flight'] / others['bf16 weights']:.3f}x, MFU "
                         f"{report['mfu_bf16_weights']:.1%})")
        rows.append([str(path.relative_to(results / arg)), report["model"], report["preset"],
                     str(report["batch"]), report["compile_scope"], str(len(report["runs"]) // 2),
                     _row_drawing(report), _host_rows(report),
                     f"{medians['read each step'] * 1e3:.2f}", f"{medians['in flight'] * 1e3:.2f}",
                     f"{report['speedup_in_flight']:.3f}x", f"{report['mfu']['in flight']:.1%}",
                     variants])
    return table(["file", "model", "preset", "batch", "compile scope", "rounds",
                  "rows drawn by", "one step's rows on one thread, ms", "read each step, ms",
                  "in flight, ms", "in flight vs read each", "MFU in flight (of 989 TF/s)",
                  "in flight, other row drawing, NaN guard or bf16 weights"], rows)


@renderer("train-summaries")
def train_summaries(results: Path, arg: str | None) -> str:
    """Every `mosaic train` summary JSON under results/ARG, one row each: the plan, the bf16
    update's layout, the trained steps' median and p90, the model's step (the run's
    `predicted_iteration_s`) and the NaN guard that ran last."""
    if not arg:
        raise RenderError("train-summaries needs a directory under results/")
    rows = []
    for path in sorted((results / arg).rglob("*summary.json")):
        r = load(path)
        layout = ("–" if not r.get("bf16_weights") else
                  "flat" if r.get("bf16_flat_grads", True) else "a weight at a time")
        predicted = r.get("predicted_iteration_s")
        rows.append([str(path.relative_to(results / arg)), r["model"], r["preset"],
                     str(r["global_batch"]), str(r["num_gpus"]), r["planner"],
                     "bf16" if r.get("bf16_weights") else "fp32", layout, str(r["steps"]),
                     ms(r["step_time_median_s"]), ms(r["step_time_p90_s"]),
                     ms(predicted) if predicted else "–",
                     pct(predicted / r["step_time_median_s"] - 1) if predicted else "–",
                     r.get("nan_guard", "–"), pct(r.get("host_launch_share"), signed=False)])
    return table(["file", "model", "preset", "batch", "GPUs", "plan", "weights",
                  "bf16 update", "steps", "median step, ms", "p90 step, ms", "model, ms",
                  "model vs median", "NaN guard", "host launch / step"], rows)


@renderer("memory-peaks")
def memory_peaks(results: Path, arg: str | None) -> str:
    """Every one-GPU `mosaic train` summary on a GPU under the comma-separated directories
    ARG of results/ that recorded its peak (torch's max allocated), grouped by model, preset,
    batch and precision (weights, their update's layout, moments): the highest peak against
    the memory model's estimate for the GPU (`plan.gpu_memory_bytes` of the graph with that
    precision, which on one GPU does not depend on the plan)."""
    if not arg:
        raise RenderError("memory-peaks needs directories under results/, comma-separated")
    groups: dict[tuple[str, str, int, tuple[bool, bool, bool]], list[float]] = {}
    paths = [p for d in arg.split(",") for p in sorted((results / d).rglob("*summary*.json"))]
    for path in paths:
        r = load(path)
        if (not str(r.get("device", "")).startswith("cuda") or r.get("num_gpus") != 1
                or not r.get("peak_memory_bytes") or r.get("accumulation", 1) != 1):
            continue
        precision = (bool(r.get("bf16_weights")), bool(r.get("bf16_moments")),
                     r.get("bf16_flat_grads", True) is not False)
        key = (r["model"], r["preset"], r["global_batch"], precision)
        groups.setdefault(key, []).append(float(r["peak_memory_bytes"]))
    rows = []
    for (model, preset, batch, precision), peaks in sorted(groups.items()):
        predicted = _one_gpu_memory_bytes(model, preset, batch, *precision)
        rows.append([model, preset, str(batch), _precision_label(*precision), str(len(peaks)),
                     f"{max(peaks) / 2**30:.1f}", f"{predicted / 2**30:.1f}",
                     pct(predicted / max(peaks) - 1)])
    return table(["model", "preset", "batch", "weights", "runs", "measured peak, GiB (highest)",
                  "memory model, GiB", "model vs peak"], rows)


def _precision_label(bf16_weights: bool, bf16_moments: bool, flat: bool) -> str:
    if not bf16_weights:
        return "fp32"
    return ("bf16 (flat update" if flat else "bf16 (a weight at a time") + (
        ", bf16 moments)" if bf16_moments else ")")


def _one_gpu_memory_bytes(model: str, preset: str, batch: int, bf16_weights: bool = False,
                          bf16_moments: bool = False, flat: bool = True) -> float:
    """The memory model's bytes on one GPU holding every module (megatron's plan)."""
    from mosaic.hardware import make_cluster
    from mosaic.perf.analytic import AnalyticModel
    from mosaic.plan import gpu_memory_bytes
    from mosaic.planners import plan_all
    from mosaic.zoo import get_model

    graph = get_model(model).graph(preset, global_batch=batch).with_precision(
        bf16_weights=bf16_weights, bf16_moments=bf16_moments, bf16_flat_grads=flat)
    cluster = make_cluster(1, "h200")
    (plan,) = plan_all(graph, cluster, AnalyticModel(cluster), ["megatron"])
    return gpu_memory_bytes(plan, graph)[0]


@renderer("guard-host-cost")
def guard_host_cost(results: Path, arg: str | None) -> str:
    """benchmarks/guard_host_cost.py's JSON: host ms a step of each NaN guard, per model."""
    if not arg:
        raise RenderError("guard-host-cost needs a JSON under results/")
    rows = []
    for r in load(results / arg)["rows"]:
        host = r["host_ms"]
        rows.append([r["model"], r["preset"], str(r["modules"]), str(r["gradient_tensors"]),
                     f"{r['parameters'] / 1e6:.0f} M", f"{host['norms']:.2f}",
                     f"{host['check']:.2f}"])
    return table(["model", "preset", "modules", "gradient tensors", "parameters",
                  "norms, host ms a step", "check, host ms a step"], rows)


# --- Inductor's max-autotune choices (benchmarks/autotune_choices.py) ---------------------------

@renderer("autotune-choices")
def autotune_choices(results: Path, arg: str | None) -> str:
    """Each operator Inductor tuned: its fastest kernel against ATen's (cuBLAS/cuDNN), and the
    seconds its tuning took; then the totals."""
    if not arg:
        raise RenderError("autotune-choices needs a JSON under results/")
    tuned = load(results / arg)["tuned"]
    rows = [[f"{t['op']}({t['shapes']})", t["best"], f"{t['best_ms']:.4f}",
             f"{t['aten_ms']:.4f}" if t["aten_ms"] is not None
             else f"not in the top (> {t['slowest_listed_ms']:.4f})",
             f"{t['aten_ms'] / t['best_ms']:.2f}x" if t["aten_ms"] is not None else "–",
             f"{t['tuning_s']:.1f}"] for t in tuned]
    faster = sum(t["aten_ms"] is None or t["aten_ms"] >= 1.05 * t["best_ms"] for t in tuned)
    return (table(["operator (shapes)", "fastest choice", "fastest, ms", "ATen, ms",
                   "ATen / fastest", "tuning, s"], rows)
            + f"\n\n{len(tuned)} operators tuned in {sum(t['tuning_s'] for t in tuned):.0f} s; "
            f"a generated kernel beat ATen by 5% or more on {faster}.")


# --- `mosaic train --autotune K`: the plans measured at start-up, the one trained ---------------

def _kept(tuned: dict[str, Any]) -> dict[str, Any]:
    """The candidate autotune kept: named since it ranks by steps in flight, which a plan's
    meta of before (the lowest per-step median kept) lacks."""
    if "chosen" in tuned:
        return next(m for m in tuned["chosen_from"] if m["label"] == tuned["chosen"])
    return min(tuned["chosen_from"], key=lambda m: m["measured_s"])


@renderer("train-autotune")
def train_autotune(results: Path, arg: str | None) -> str:
    """Each `*_plan.json` (a run folder's plan.json) under results/ARG with its `*_summary.json`:
    every candidate autotune measured (per step, and in flight where it ran steps so), the one
    kept, its start-up, and the trained steps."""
    if not arg:
        raise RenderError("train-autotune needs a directory under results/")
    rows = []
    for path in sorted((results / arg).glob("*_plan.json")):
        tuned = load(path)["meta"]["autotune"]
        summary = load(path.with_name(path.name.replace("_plan.json", "_summary.json")))
        kept = _kept(tuned)
        for m in tuned["chosen_from"]:
            settings = ", ".join(f"{k}={v}" for k, v in m["engine_settings"].items()) or "–"
            rows.append([summary["model"], summary["preset"], str(summary["global_batch"]),
                         m["label"] + (" (baseline)" if m["baseline"] else ""), settings,
                         f"{m['predicted_s'] * 1e3:.2f}", f"{m['measured_s'] * 1e3:.2f}",
                         f"{m['in_flight_s'] * 1e3:.2f}" if m.get("in_flight_s") else "–",
                         "kept" if m is kept else "",
                         f"{tuned['startup_s']:.1f}" if m is kept else "",
                         f"{summary['step_time_median_s'] * 1e3:.2f}" if m is kept else ""])
    return table(["model", "preset", "batch", "plan", "engine settings", "predicted, ms",
                  "measured at start-up, ms", "in flight at start-up (ranked by, where "
                  "measured), ms", "", "autotune start-up, s",
                  "trained, median step ms"], rows)


# --- the optimizer step of bf16 weights (benchmarks/main_weights_step.py) -----------------------

@renderer("main-weights-step")
def main_weights_step(results: Path, arg: str | None) -> str:
    """benchmarks/main_weights_step.py's JSON files under results/ARG: one optimizer step over
    a model's parameters, torch's fused AdamW over fp32 weights against the main-weights
    AdamW over bf16 GEMM weights (each way of compiling its update that the run measured)."""
    if not arg:
        raise RenderError("main-weights-step needs a directory under results/")
    rows = []
    for path in sorted((results / arg).glob("main_weights_step_*.json")):
        run = load(path)
        fused = run["fused_adamw_fp32"]
        for key in sorted(k for k in run if k.startswith("main_weights_bf16")):
            main = run[key]
            rows.append([path.name, run["model"], run["preset"],
                         f"{fused['tensors']} / {fused['parameters'] / 1e9:.2f} B",
                         f"{fused['gpu_ms']:.2f}",
                         main.get("kernel", "one Inductor kernel for every size"),
                         f"{main['bf16_tensors']} bf16 ({main['bf16_parameters'] / 1e9:.2f} B) "
                         f"+ {main['fp32_tensors']} fp32", f"{main['gpu_ms']:.2f}",
                         f"{fused['gpu_ms'] / main['gpu_ms']:.3f}x",
                         "yes" if main["graphs_captured"] else "no",
                         "yes" if main["weights_are_mains_rounded"] else "NO"])
    return table(["file", "model", "preset", "fused AdamW: tensors / parameters",
                  "fused AdamW fp32, GPU ms", "main-weights update", "main-weights tensors",
                  "main-weights, GPU ms", "fused / main-weights", "step captured",
                  "bf16 weights = main weights rounded"], rows)


@renderer("main-weights-ceiling")
def main_weights_ceiling(results: Path, arg: str | None) -> str:
    """benchmarks/main_weights_kernel_ceiling.py's JSON files under results/ARG: the
    main-weights update and fused AdamW over one model's weights, per tensor and flat, as
    GPU time and the bandwidth it streamed."""
    if not arg:
        raise RenderError("main-weights-ceiling needs a directory under results/")
    rows = []
    for path in sorted((results / arg).glob("main_weights_kernel_ceiling_*.json")):
        run = load(path)
        for name, row in run["rows"].items():
            rows.append([path.name, run["model"], run["preset"], name, str(row["tensors"]),
                         f"{row['parameters'] / 1e9:.3f} B", f"{row['gpu_ms']:.2f}",
                         f"{row['tb_per_s']:.2f}"])
    return table(["file", "model", "preset", "update", "launches", "parameters", "GPU ms",
                  "TB/s (28 bytes a parameter)"], rows)


@renderer("main-weights-layout")
def main_weights_layout(results: Path, arg: str | None) -> str:
    """benchmarks/main_weights_flat_or_per_weight.py's JSON files under results/ARG: per
    module, the captured main-weights update a weight at a time against one launch over the
    flat gradient buffer plus the backward's copy into it."""
    if not arg:
        raise RenderError("main-weights-layout needs a directory under results/")
    rows = []
    for path in sorted((results / arg).glob("main_weights_flat_or_per_weight_*.json")):
        run = load(path)
        for position, m in enumerate(run["modules"], start=1):
            rows.append([run["model"], run["preset"], m["module"],
                         f"{position} ({run.get('order', 'graph')})", str(m["bf16_weights"]),
                         f"{m['bf16_parameters'] / 1e6:.0f} M", f"{m['mean_elements'] / 1e6:.2f} M",
                         f"{m['per_weight_ms']:.3f}",
                         *(f"{m[k]:.3f}" if k in m else "–"
                           for k in ("per_weight_again_ms", "per_weight_kernel_per_size_ms")),
                         f"{m['flat_update_ms']:.3f}",
                         f"{m['gradient_copy_ms']:.3f}",
                         f"{m['per_weight_ms'] / m['flat_update_ms']:.2f}x", m["cheaper"]])
    return table(["model", "preset", "module", "measured (order)", "bf16 weights", "parameters",
                  "mean size", "a weight at a time, ms", "the same again, ms",
                  "a weight at a time, a kernel per size, ms", "flat, one launch, ms",
                  "gradient copy, ms",
                  "per-weight / flat update", "cheaper (flat: update + copy)"], rows)


@renderer("main-weights-profile")
def main_weights_profile(results: Path, arg: str | None) -> str:
    """The bf16 updates `mosaic profile --main-weights-only` stored in the ProfileDB at
    results/ARG: per module, a weight at a time against the flat update plus its gradient
    copy, what a per-weight plan adds (the model's term), and both layouts with bf16 moments,
    and with them and no main weights, where measured ("–": measured before they existed)."""
    from mosaic.profile.db import ProfileDB
    from mosaic.profile.main_weights import stored_updates

    if not arg or not (results / arg).is_file():
        raise RenderError("main-weights-profile needs a ProfileDB under results/")
    with ProfileDB.open(results / arg) as db:
        points = sorted(stored_updates(db).values(), key=lambda p: (p.preset, p.model))
    rows = [[p.model, p.preset, p.module, str(p.bf16_weights), f"{p.bf16_parameters / 1e6:.0f} M",
             f"{p.per_weight_s * 1e3:.3f}", f"{p.flat_update_s * 1e3:.3f}",
             f"{p.gradient_copy_s * 1e3:.3f}", f"{p.per_weight_extra_s * 1e3:+.3f}",
             *("–" if s is None else f"{s * 1e3:.3f}"
               for s in (p.per_weight_bf16_moments_s, p.flat_update_bf16_moments_s,
                         p.per_weight_no_main_s, p.flat_update_no_main_s))]
            for p in points if p.bf16_weights]
    return table(["model", "preset", "module", "bf16 weights", "parameters",
                  "a weight at a time, ms", "flat, one launch, ms", "gradient copy, ms",
                  "a weight at a time adds, ms", "bf16 moments: a weight at a time, ms",
                  "bf16 moments: flat, ms", "bf16 moments, no main weights: a weight at a "
                  "time, ms", "bf16 moments, no main weights: flat, ms"], rows)


@renderer("moments-digits")
def moments_digits(results: Path, arg: str | None) -> str:
    """benchmarks/bf16_moments_digits.py's JSON at results/ARG: per weights and moments
    setting, the final loss and zero-shot accuracy over the seeds (mean, min-max)."""
    if not arg or not (results / arg).is_file():
        raise RenderError("moments-digits needs bf16_moments_digits.py's JSON under results/")
    run = load(results / arg)

    def spread(values: list[float], digits: int) -> str:
        return (f"{sum(values) / len(values):.{digits}f} "
                f"({min(values):.{digits}f}-{max(values):.{digits}f})")

    rows = [[name, str(len(seeds)), spread([r["final_loss"] for r in seeds], 4),
             spread([100 * r["zero_shot_accuracy"] for r in seeds], 1)]
            for name, seeds in run["runs"].items()]
    return table(["setting", "seeds", f"loss, mean of the last {run['tail_steps']} steps "
                  "(min-max)", "zero-shot accuracy, % (min-max)"], rows)


@renderer("moments-drift")
def moments_drift(results: Path, arg: str | None) -> str:
    """benchmarks/fp8_moments_digits.py's JSON at results/ARG: per kind of moments and step of
    the synthetic gradient stream, how far AdamW's update direction and the second moment's
    root are from fp32 moments'."""
    if not arg or not (results / arg).is_file() or "drift" not in load(results / arg):
        raise RenderError("moments-drift needs fp8_moments_digits.py's JSON under results/")
    run = load(results / arg)
    rows = [[kind, str(point["step"]), pct(point["update_relative_l2"], signed=False),
             pct(point["root_median_relative"], signed=False),
             pct(point["roots_at_zero"], signed=False)]
            for kind, points in run["drift"].items() for point in points]
    return table(["moments", "step", "update direction vs fp32 moments' (relative L2)",
                  "root of the second moment (median relative error)", "roots read as zero"],
                 rows)


def _json_files(results: Path, arg: str | None, renderer: str, script: str) -> list[Path]:
    """The comma-separated files of a renderer's argument, each under results/."""
    paths = [results / name for name in (arg or "").split(",") if name]
    if not paths or not all(p.is_file() for p in paths):
        raise RenderError(f"{renderer} needs {script}'s JSON files under results/")
    return paths


@renderer("update-bits")
def update_bits(results: Path, arg: str | None) -> str:
    """benchmarks/rounded_update_bits.py's JSON files (comma-separated, under results/): per
    run and update, GPU time, bytes moved over it, and the kernels Inductor generated for it
    (where the run counted them)."""
    rows = []
    for path in _json_files(results, arg, "update-bits", "rounded_update_bits.py"):
        run = load(path)
        rows += [[str(path.relative_to(results)), f"2^{run['numel'].bit_length() - 1}", name,
                  f"{row['gpu_ms']:.3f}", str(row["bytes_per_param"]), f"{row['tb_per_s']:.2f}",
                  str(row.get("kernels") or "–")]
                 for name, row in run["rows"].items()]
    return table(["file", "parameters", "update", "GPU time, ms", "bytes a parameter",
                  "TB/s", "kernels generated"], rows)


@renderer("update-streams")
def update_streams(results: Path, arg: str | None) -> str:
    """benchmarks/update_streams.py's JSON files (comma-separated, under results/): per run,
    one module's update a weight at a time over N streams or grouped, beside one flat launch:
    GPU time and the flat launch's over it."""
    rows = []
    for path in _json_files(results, arg, "update-streams", "update_streams.py"):
        run = load(path)
        flat = run["rows"].get("flat, one launch", {}).get("gpu_ms")
        rows += [[str(path.relative_to(results)), f"{run['model']} `{run['preset']}` "
                  f"{run['module']}", f"{run['weights']} ({run['parameters'] / 1e9:.2f} B)", name,
                  f"{row['gpu_ms']:.3f}", f"{flat / row['gpu_ms']:.3f}x" if flat else "–"]
                 for name, row in run["rows"].items()]
    return table(["file", "module", "weights (parameters)", "update", "GPU time, ms",
                  "vs the flat launch"], rows)


# --- checkpoint saves written before the next step or in the background ------------------------

@renderer("checkpoint-background")
def checkpoint_background(results: Path, arg: str | None) -> str:
    """benchmarks/checkpoint_background.py's JSON files under results/ARG: per model, how long
    a save held training up each way, and when it was published (medians)."""
    if not arg:
        raise RenderError("checkpoint-background needs a directory under results/")
    rows = []
    for path in sorted((results / arg).glob("*.json")):
        r = load(path)
        sync, background = r["median"]["before the next step"], r["median"]["background"]
        rows.append([path.name, r["model"], r["preset"], r["device"],
                     f"{r['parameters'] / 1e6:.0f} M", f"{r['checkpoint_bytes'] / 2**30:.2f}",
                     str(r["rounds"]), f"{sync['held_s']:.2f}", f"{background['held_s']:.2f}",
                     f"{background['published_s']:.2f}",
                     f"{background['step_during_write_s']:.2f} / "
                     f"{background['step_alone_s']:.2f} (batch {r['train_batch']})"])
    return table(["file", "model", "preset", "device", "parameters", "checkpoint, GiB", "rounds",
                  "held, written before the next step, s", "held, background, s",
                  "background: published after, s",
                  "a training step while it is written / alone, s"], rows)


# --- attention with and without mask tensors (benchmarks/attention_mask_ab.py) -----------------

@renderer("attention-ab")
def attention_ab(results: Path, arg: str | None) -> str:
    """One row per module: compiled fwd+bwd with transformers' SDPA (explicit mask when
    compiled) and with the zoo's (no mask), in one process, and the output difference."""
    if not arg:
        raise RenderError("attention-ab needs a JSON under results/: render:attention-ab:FILE")
    report = load(results / arg)
    rows = []
    for r in report["rows"]:
        model, module, preset, batch = r["module"].split(":")
        times, compile_s = r["median_ms"], r["compile_s"]
        rows.append([model, module, preset, batch, f"{times['sdpa']:.2f}",
                     f"{times['mosaic_unpadded_sdpa']:.2f}", f"{r['speedup']:.3f}x",
                     f"{r['max_abs_output_difference']:.2g} of {r['output_scale']:.3g}",
                     f"{compile_s['sdpa']:.0f} / {compile_s['mosaic_unpadded_sdpa']:.0f}"])
    return table(["model", "module", "preset", "batch", "transformers SDPA (masked), ms",
                  "no mask, ms", "speedup", "max |output difference|",
                  "first step incl. compile, s (masked / no mask)"], rows)


# --- the shipped profile's rebuild recipe (mosaic profile-recipe) -----------------------------

@renderer("profile-recipe")
def profile_recipe(results: Path, arg: str | None) -> str:
    """`mosaic profile-recipe` on the shipped DB (or src/... path ARG): the commands that
    rebuild it, read from what it holds."""
    from mosaic.profile.db import default_db_path
    from mosaic.profile.recipe import format_recipe, rebuild_recipe

    db = ROOT / arg if arg else default_db_path("h200")
    text = format_recipe(rebuild_recipe(db, "runs/profile.sqlite", results))
    return "```sh\n" + text.replace(f"{ROOT}/", "") + "\n```"


@renderer("busy-fractions")
def busy_fractions(results: Path, arg: str | None) -> str:
    """A busy_fractions_h200.sh export (results/ARG): per module, the pair over twice the
    alone time at each batch measured."""
    if not arg:
        raise RenderError("busy-fractions needs its JSON file: render:busy-fractions:FILE")
    export = load(results / arg)
    points = export["points"]
    batches = sorted({p["per_gpu_batch"] for p in points})
    by_module: dict[str, dict[int, dict[str, Any]]] = {}
    for p in points:
        by_module.setdefault(" / ".join(p["modules"]), {})[p["per_gpu_batch"]] = p
    rows = [[name, *(f"{cells[b]['fraction']:.3f} ({ms(cells[b]['alone_s'])} -> "
                     f"{ms(cells[b]['pair_s'])})" if b in cells else "–" for b in batches)]
            for name, cells in sorted(by_module.items())]
    # Exports before --preset/--kernels held the compiled `small` modules only.
    what = {"eager": "eager", "compile-default-blocks": "compiled by blocks"}.get(
        export.get("kernels"), "compiled")
    return table([f"module ({what} `{export.get('preset') or 'small'}`)",
                  *(f"b{b}: busy (alone -> two side by side, ms)" for b in batches)], rows)


@renderer("update-size-hint")
def update_size_hint(results: Path, arg: str | None) -> str:
    """benchmarks/update_size_hint.py's JSON files (results/A[,B]): each case's streaming rate
    of the per-weight bf16 update by weight length, one row a case and file."""
    if not arg:
        raise RenderError("update-size-hint needs its JSON files: render:update-size-hint:A[,B]")
    reports = [(name, load(results / name)) for name in arg.split(",")]
    lengths = sorted({int(n) for _, r in reports for c in r["cases"] for n in c["lengths"]})
    rows = [[Path(name).name, case["case"], f"{case['first_length']:,}",
             str(case["dynamo_graphs"]),
             *(f"{case['lengths'][str(n)]['tb_per_s']:.2f}" if str(n) in case["lengths"] else "–"
               for n in lengths)]
            for name, report in reports for case in report["cases"]]
    return table(["file", "case", "first call's length", "Dynamo graphs",
                  *(f"{n:,} elements, TB/s" for n in lengths)], rows)


# --- simulated scaling (benchmarks/scaling_sim.py) --------------------------------------------

SCALING_PLANNERS = (*BASELINES, "mosaic")


@renderer("scaling-sim")
def scaling_sim(results: Path, arg: str | None) -> str:
    """One row per zoo model and GPU count: each planner's PREDICTED iteration time, mosaic's
    throughput and gain over the best baseline, and mosaic's search time on the CPU."""
    directory = results / (arg or "scaling-sim")
    reports = [load(directory / f"{m}.json") for m in ONE_GPU_MODELS if (directory / f"{m}.json").exists()]
    if not reports:
        raise RenderError(f"scaling-sim: no <model>.json under {directory}; run benchmarks/scaling_sim.py")
    rows = []
    for r in reports:
        by_gpus: dict[int, dict[str, dict[str, Any]]] = {}
        for row in r["rows"]:
            by_gpus.setdefault(row["gpus"], {})[row["planner"]] = row
        for gpus, plans in sorted(by_gpus.items()):
            t = {n: plans.get(n, {}).get("predicted_iteration_s") for n in SCALING_PLANNERS}
            base = [v for n, v in t.items() if n in BASELINES and v is not None]
            mosaic = plans.get("mosaic", {})
            gain = (min(base) / t["mosaic"] - 1) if base and t["mosaic"] else None
            rows.append([r["model"], str(gpus), str(mosaic.get("global_batch", "–")),
                         *[ms(t[n]) for n in SCALING_PLANNERS],
                         f"{mosaic['throughput_samples_s']:.0f}" if mosaic else "–",
                         pct(gain), f"{mosaic['search_time_s']:.2f}" if mosaic else "–"])
    first = reports[0]
    cpu = first["sweep_cpu_s"]  # the whole sweep, recorded in every file
    header = ["model", "GPUs", "batch", *[f"{n}, ms" for n in SCALING_PLANNERS],
              "mosaic, samples/s", "mosaic vs best baseline", "mosaic search, s"]
    return (f"**Simulated: predicted by the performance model, not measured.** "
            f"`{first['command']}`, {first['date']}; {first['batch_rule']}; "
            f"whole sweep {cpu:.0f} s CPU on the 2-core machine.\n\n"
            + table(header, rows))


# --- the document -----------------------------------------------------------------------------

BLOCK = re.compile(r"<!-- render:(?P<name>[\w.-]+(?::[^\s>]+)?) -->\n"
                   r"(?P<body>.*?)<!-- /render:(?P=name) -->", re.DOTALL)
OPEN = re.compile(r"<!-- render:([^\s>]+) -->")


def render_block(name: str, results: Path = RESULTS) -> str:
    kind, _, arg = name.partition(":")
    if kind not in RENDERERS:
        raise RenderError(f"unknown renderer {kind!r} in <!-- render:{name} -->; known: "
                          f"{', '.join(sorted(RENDERERS))}")
    return RENDERERS[kind](results, arg or None)


def render(text: str, results: Path = RESULTS) -> str:
    """The document with every marked block regenerated; the text outside blocks unchanged.
    Blank lines around the table keep it a table whatever Markdown renders it."""
    opened = OPEN.findall(text)
    blocks = list(BLOCK.finditer(text))
    if len(blocks) != len(opened):
        closed = {m["name"] for m in blocks}
        raise RenderError(f"unclosed marker(s): {', '.join(n for n in opened if n not in closed)} "
                          f"(each <!-- render:NAME --> ends its line; close it with "
                          f"<!-- /render:NAME -->)")
    return BLOCK.sub(lambda m: (f"<!-- render:{m['name']} -->\n\n{render_block(m['name'], results)}"
                                f"\n\n<!-- /render:{m['name']} -->"), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the document is stale")
    parser.add_argument("--doc", type=Path, action="append",
                        help="a document to render (repeatable; default: BENCHMARKS.md and "
                             "README.md)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    return max(_render_doc(doc, args.results, args.check) for doc in args.doc or DOCS)


def _render_doc(doc: Path, results: Path, check: bool) -> int:
    try:
        text = doc.read_text()
        new = render(text, results)
    except (OSError, ValueError, KeyError) as exc:  # one line, not a traceback
        print(f"render: error: {exc!r}" if isinstance(exc, KeyError) else f"render: error: {exc}",
              file=sys.stderr)
        return 2
    if check:
        if new == text:
            return 0
        sys.stderr.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                   str(doc), "rendered from results/"))
        print(f"{doc} differs from its data: run python benchmarks/render.py", file=sys.stderr)
        return 1
    if new != text:
        doc.write_text(new)
    state = "updated" if new != text else "unchanged"
    print(f"{doc}: {len(BLOCK.findall(text))} block(s), {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
