"""The profiler (GPU): zoo models -> ProfileDB, within a wall-clock budget.

Per model, in order (later steps are cut first when the budget runs short):
1. Scaling surface of every *distinct* module (symmetry pruning: modules whose cost facts are
   equal share a signature and are measured once, across models too; a per-GPU batch b on k
   SMs is one measurement whatever DP degree or GPU set produced it). Points: a coarse grid,
   then bisection where neighbours' interpolation misses a midpoint by > tol (sampling.py).
   Each point: fwd+bwd as a CUDA graph captured on a stream with exactly k SMs (a green
   context; the whole GPU on a plain stream), median over event-timed replays.
2. Bandwidth signature of each distinct module: its time on a 64-SM partition alone and next to
   a device-copy antagonist on the other SMs (the slowdown is its memory sensitivity); its
   bandwidth demand is the analytic byte count over the measured time (interference.py).
3. Busy fraction of each distinct module at a few per-GPU batches: two copies of it side by
   side on the whole GPU against one alone (db.BusyPoint). It bounds what colocating it with
   other modules can save (interference.py).
4. Colocations of independent modules (pairs, a triple): partition, cap, free and free with a
   high-priority stream, at two per-GPU batches; per-module times alone and together.
5. Communication curves: measured with NCCL when several GPUs exist, else analytic.
Then, once per run, the engine's optimizer step over several parameter counts (optimizer.py).
"""

from __future__ import annotations

import itertools
import json
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import GPUSpec, gpu_spec
from mosaic.profile.db import (
    KERNELS,
    BusyPoint,
    ColocPoint,
    ColocWork,
    CommPoint,
    ModulePoint,
    ProfileDB,
    SignaturePoint,
    compile_of_kernels,
    module_signature,
    profile_meta_key,
)
from mosaic.profile.graph_timing import (
    Antagonist,
    GraphBench,
    ProfilerError,
    StreamBank,
    Timing,
    TimingConfig,
    free_device_memory,
    memory_state,
    time_group,
)
from mosaic.profile.optimizer import profile_optimizer
from mosaic.profile.sampling import batch_grid, coarse_points, refine
from mosaic.tensor_parallel import bytes_per_gpu

MODES = ("partition", "cap", "free", "free-prio")
BATCH_PICKS = ("min", "mid", "preset", "max")
ANTAGONIST_SPLIT = 64
"""The module gets this many SMs in its bandwidth-signature run; the antagonist the rest."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfilerConfig:
    hardware: str = "h200"
    preset: str = "small"
    tol: float = 0.05
    """Refine where neighbours' interpolation misses a midpoint by more than this."""
    refine_budget: int = 8
    """Points per distinct module beyond the coarse grid."""
    coloc_batches: tuple[str, ...] = ("mid", "max")
    busy_batches: tuple[str, ...] = ("mid", "preset", "max")
    """Per-GPU batches (of the grid: BATCH_PICKS) at which each distinct module's busy
    fraction is measured; () measures none."""
    surfaces: bool = True
    """False: measure only the other steps asked for, against the DB's surfaces (with
    --update), and not the optimizer step either."""
    max_pairs: int = 3
    max_triples: int = 1
    modes: tuple[str, ...] = MODES
    antagonist: bool = True
    budget_s: float = 220.0
    """Wall-clock budget for everything; each model gets an equal share of what is left."""
    amp: bool = True
    """bf16 autocast over fp32 weights, as the engine trains."""
    kernels: str = "eager"
    """`compile-<mode>`: each module behind Inductor first, as the engine runs it by default
    (engine/compile.py, same workarounds and fallback), then captured as before."""
    max_batch_factor: int = 4
    """The batch grid reaches this many times the preset's global batch (per GPU), where the
    module still fits in memory: benchmarks run up to 4x the preset batch."""
    timing: TimingConfig = field(default_factory=TimingConfig)

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ProfilerError(f"modes {bad}: choose from {MODES}")
        bad = [b for b in (*self.coloc_batches, *self.busy_batches) if b not in BATCH_PICKS]
        if bad:
            raise ProfilerError(f"batch picks {bad}: choose from {BATCH_PICKS}")
        if not 0 < self.tol < 1:
            raise ProfilerError(f"tol={self.tol}: use a fraction such as 0.05")
        if self.kernels not in KERNELS:
            raise ProfilerError(f"kernels={self.kernels!r}: choose one of {KERNELS}")


@dataclass(slots=True)
class ModelReport:
    model: str
    num_modules: int = 0
    num_distinct: int = 0
    points: int = 0
    full_grid: int = 0
    colocations: int = 0
    signatures: int = 0
    busy: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


# --- one model -----------------------------------------------------------------------------------
class ModelProfiler:
    """Profiles one zoo model into the DB; `measured` carries signatures across models."""

    def __init__(self, name: str, cfg: ProfilerConfig, db: ProfileDB, bank: StreamBank,
                 measured: set[str], device: str = "cuda") -> None:
        from mosaic.zoo import get_model

        self.zoo = get_model(name)
        self.cfg, self.db, self.bank, self.measured = cfg, db, bank, measured
        self.device = device
        self.graph: MMGraph = self.zoo.graph(cfg.preset)
        self.batches = batch_grid(self.graph.global_batch, self._max_batch(cfg))
        self.compile_report: Any = None
        """engine.compile.CompileReport when the modules are compiled."""
        self.modules = self._build(cfg, device)
        self.shapes = self.zoo.in_shapes(cfg.preset)
        self.report = ModelReport(model=name, num_modules=len(self.graph.modules))
        kept, self.without_surface = busy_only_split(self.graph, cfg, measured)
        self.sigs = {m.name: db.add_module(name, cfg.preset, m, cfg.kernels) for m in kept}
        self._inputs: dict[int, dict[str, tuple[torch.Tensor, ...]]] = {}
        self._benches: dict[tuple[str, int], GraphBench] = {}

    def _max_batch(self, cfg: ProfilerConfig) -> int:
        """The largest power-of-two per-GPU batch (up to max_batch_factor x the preset's) at
        which every module of the model fits in memory on its own."""
        budget = 0.8 * gpu_spec(cfg.hardware).memory_bytes
        limit = max(cfg.max_batch_factor, 1) * self.graph.global_batch
        while limit > self.graph.global_batch and any(
                bytes_per_gpu(m, limit) > budget for m in self.graph.modules):
            limit //= 2
        return max(limit, self.graph.global_batch)

    def _build(self, cfg: ProfilerConfig, device: str) -> dict[str, Any]:
        modules = self.zoo.build_modules(cfg.preset, device)
        if cfg.kernels == "eager":
            return modules
        from mosaic.engine.compile import compile_modules

        mode, scope = compile_of_kernels(cfg.kernels)
        compiled, self.compile_report = compile_modules(modules, mode, scope=scope)
        return compiled

    # inputs and benches -----------------------------------------------------------------------
    def bench(self, name: str, b: int) -> GraphBench:
        if (name, b) not in self._benches:
            if b not in self._inputs:
                gen = torch.Generator().manual_seed(b)
                self._inputs[b] = self.zoo.make_inputs(self.cfg.preset, b, gen)
            own = [t.to(self.device) for t in self._inputs[b][name]]
            upstream = [torch.randn(b, *shape, device=self.device, requires_grad=True)
                        for shape in self.shapes[name]]
            self._benches[(name, b)] = GraphBench(self.modules[name], own + upstream, self.cfg.amp)
        return self._benches[(name, b)]

    def measure(self, name: str, b: int, stream: torch.cuda.Stream) -> Timing:
        graph = self.bench(name, b).capture(stream)
        t = time_group([(graph.replay, stream)], self.cfg.timing)
        del graph
        return t

    def _drop_benches(self) -> None:
        for (name, b), bench in sorted(self._benches.items()):
            if bench.capture_errors:
                how = "timed eagerly" if bench.eager else f"captured in {bench.mode} mode"
                self._note(f"{name}: capture failed at batch {b} ({bench.capture_errors[0]}); {how}")
        self._benches.clear()
        if torch.cuda.is_available():
            free_device_memory()  # the next module starts from an empty cache

    def _note(self, note: str) -> None:
        key = note.split(" at batch")[0]
        if not any(n.startswith(key) for n in self.report.notes):
            self.report.notes.append(note)

    def release(self) -> None:
        report = self.compile_report
        if report is not None:
            for name, why in report.eager.items():
                self._note(f"{name}: compile failed, profiled eagerly ({why})")
            self._note(f"compile: {sum(report.compile_s.values()):.0f} s over "
                       f"{len(report.compile_s)} modules (first shapes)")
        self._drop_benches()
        self._inputs.clear()
        self.modules.clear()
        if report is not None:
            # Dynamo's caches keep the compiled modules' frames, and with them their weights,
            # alive after the model is done: the next model would start on a fuller GPU.
            torch._dynamo.reset()
        if torch.cuda.is_available():
            free_device_memory()

    # 1. surfaces ------------------------------------------------------------------------------
    def surfaces(self, refine_until: float) -> None:
        sms = self.bank.sm_values
        self.report.full_grid = len(self.graph.modules) * len(self.batches) * len(sms)
        distinct = {sig: name for name, sig in reversed(list(self.sigs.items()))}
        self.report.num_distinct = len(distinct)
        for sig, name in distinct.items():
            if sig in self.measured:
                self.report.notes.append(f"{name}: surface already measured (same cost facts)")
                continue
            self._surface(sig, name, refine_until)
            self.measured.add(sig)
            self._drop_benches()

    def _surface(self, sig: str, name: str, refine_until: float) -> None:
        sms = self.bank.sm_values
        measured: dict[tuple[int, int], float] = {}
        timings: dict[tuple[int, int], Timing] = {}

        def run(b: int, k: int) -> float:
            timings[(b, k)] = self.measure(name, b, self.bank.stream(k)[1])
            return timings[(b, k)].median_s

        for b, k in coarse_points(self.batches, sms, anchor=self.graph.global_batch):
            measured[(b, k)] = run(b, k)
        coarse = set(measured)
        if time.perf_counter() < refine_until:
            refine(run, measured, self.batches, sms, tol=self.cfg.tol,
                   budget=self.cfg.refine_budget)
        else:
            self.report.notes.append(f"{name}: refinement skipped (budget)")
        # A point timed eagerly (its capture failed) holds launch overhead a graph does not:
        # it would bend the surface of the graphs the engine runs, so it is not stored.
        eager = {(b, k) for b, k in timings if self.bench(name, b).eager}
        if eager:
            self.report.notes.append(f"{name}: {len(eager)} point(s) timed eagerly (capture "
                                     "failed), not stored")
        self.db.replace_points(sig, [ModulePoint(signature=sig, per_gpu_batch=b, num_sms=k,
                                                 time_s=t.median_s, spread=t.spread,
                                                 repeats=t.repeats,
                                                 phase="coarse" if (b, k) in coarse else "refine")
                                     for (b, k), t in sorted(timings.items())
                                     if (b, k) not in eager])
        self.report.points += len(timings) - len(eager)

    # 2. bandwidth signatures --------------------------------------------------------------------
    def signatures(self, antagonist: Antagonist, copy_s: float) -> None:
        b = self.batches[len(self.batches) // 2]
        (s_mod, s_ant), got = antagonist_streams(self.bank)
        done = {row.signature for row in self.db.signatures()}
        for name, sig in self.sigs.items():
            if sig in done:
                continue
            done.add(sig)
            graph = self.bench(name, b).capture(s_mod)
            alone = time_group([(graph.replay, s_mod)], self.cfg.timing).median_s
            antagonist.copies = math.ceil(1.5 * alone / copy_s) + 2
            both = time_group([(graph.replay, s_mod)], self.cfg.timing,
                              background=(antagonist, s_ant)).median_s
            spec = self.graph.module(name)
            self.db.add_signature(SignaturePoint(
                signature=sig, per_gpu_batch=b, num_sms=got[0], antagonist_sms=got[1],
                alone_s=alone, with_antagonist_s=both,
                bytes_per_s=spec.step_traffic_bytes(b) / alone,
                method="device-copy antagonist on the other SMs; bytes = analytic count"))
            self.report.signatures += 1
            del graph
        self._drop_benches()

    # 3. busy fractions ----------------------------------------------------------------------
    def busy(self, deadline: float) -> None:
        """Each distinct module's busy fraction at the busy batches; a module's points are
        stored as soon as it is done, so a stopped run keeps them, and one the DB holds
        already is skipped, so running again resumes."""
        batches = self.picked_batches(self.cfg.busy_batches)
        if not batches:
            return
        held = {(p.signature, p.per_gpu_batch) for p in self.db.busy()}
        full = self.bank.full_sms
        _, streams, _ = self.bank.group("free", [full, full], [0, 0])
        distinct = {sig: name for name, sig in reversed(list(self.sigs.items()))}
        for sig, name in distinct.items():
            if time.perf_counter() > deadline:
                self.report.notes.append(f"busy fractions: {name} and later skipped (budget)")
                break
            points = [p for b in batches if (sig, b) not in held
                      and (p := self.measure_busy(name, sig, b, streams))]
            self.db.add_busy(points)
            self.report.busy += len(points)
            self._drop_benches()

    def measure_busy(self, name: str, sig: str, b: int,
                     streams: Sequence[torch.cuda.Stream]) -> BusyPoint | None:
        """Two CUDA graphs of the module (own memory pools, the same weights) on two free
        streams, together, against one of them alone just before. None if it cannot be
        captured (an eager pair would time Python launches)."""
        bench = self.bench(name, b)
        graphs = [bench.capture(s) for s in streams]
        if bench.eager:
            self._note(f"{name}: busy fraction not measured at batch {b} (capture failed)")
            return None
        alone = time_group([(graphs[0].replay, streams[0])], self.cfg.timing)
        pair = time_group([(g.replay, s) for g, s in zip(graphs, streams, strict=True)],
                          self.cfg.timing)
        return BusyPoint(signature=sig, per_gpu_batch=b, alone_s=alone.median_s,
                         pair_s=pair.median_s, spread=pair.spread, repeats=pair.repeats)

    # 4. colocations -----------------------------------------------------------------------------
    def groups(self) -> list[list[str]]:
        """Independent modules to colocate: pairs and triples of the widest graph level,
        heaviest first."""
        level = max(self.graph.levels(), key=len)
        ranked = sorted(level, key=lambda n: -self.graph.module(n).flops_per_sample)
        pairs = list(itertools.combinations(ranked, 2))[: self.cfg.max_pairs]
        triples = list(itertools.combinations(ranked, 3))[: self.cfg.max_triples]
        return [list(g) for g in pairs + triples]

    def picked_batches(self, picks: Sequence[str]) -> list[int]:
        """The grid's batches named by BATCH_PICKS (the preset's own: its global batch)."""
        named = {"min": self.batches[0], "mid": self.batches[len(self.batches) // 2],
                 "preset": self.graph.global_batch, "max": self.batches[-1]}
        return sorted({named[p] for p in picks})

    def colocations(self, deadline: float) -> None:
        batches = self.picked_batches(self.cfg.coloc_batches)
        plan = [(g, b, mode) for b in batches for g in self.groups() for mode in self.cfg.modes]
        for i, (members, b, mode) in enumerate(plan):
            if time.perf_counter() > deadline:
                self.report.notes.append(f"colocations: {len(plan) - i} of {len(plan)} skipped (budget)")
                break
            point = self.colocate(members, b, mode)
            if point is None:
                self._note(f"colocations with {members} at batch {b}: skipped (a member runs eagerly)")
                continue
            self.db.add_colocation(point)
            self.report.colocations += 1
        self._drop_benches()

    def _shares(self, members: Sequence[str], b: int) -> list[int]:
        """SMs per member in proportion to its whole-GPU time, multiples of 8, >= 16, sum 128."""
        g = self.bank.gpu.sm_granularity
        weight = [self._full_time(m, b) for m in members]
        if None in weight:  # some module unmeasured at this batch: FLOPs instead, for all
            weight = [self.graph.module(m).flops_per_sample for m in members]
        units = (self.bank.full_sms // g) - 2 * len(members)
        extra = [int(units * w / sum(weight)) for w in weight]
        return [g * (2 + e) for e in extra]

    def _full_time(self, name: str, b: int) -> float | None:
        """Measured whole-GPU time of the module at batch b (measured under any model)."""
        return next((p.time_s for p in self.db.points(self.sigs[name])
                     if p.per_gpu_batch == b and p.num_sms == self.bank.full_sms), None)

    def colocate(self, members: Sequence[str], b: int, mode: str) -> ColocPoint | None:
        shares = self._shares(members, b)
        heaviest = max(range(len(members)), key=lambda i: shares[i])
        full = self.bank.full_sms
        if mode == "partition":
            sizes, prio = shares, [0] * len(members)
        elif mode == "cap":  # the heaviest runs uncapped, the others capped at their share
            sizes = [full if i == heaviest else s for i, s in enumerate(shares)]
            prio = [0] * len(members)
        else:
            sizes = [full] * len(members)
            prio = [int(mode == "free-prio" and i == heaviest) for i in range(len(members))]
        base = "free" if mode.startswith("free") else mode
        _, streams, got = self.bank.group(base, sizes, prio)
        graphs = [self.bench(m, b).capture(s) for m, s in zip(members, streams, strict=True)]
        if any(self.bench(m, b).eager for m in members):
            return None  # eager launches from one thread would time Python, not sharing
        alone = [time_group([(g.replay, s)], self.cfg.timing).median_s
                 for g, s in zip(graphs, streams, strict=True)]
        together = time_group([(g.replay, s) for g, s in zip(graphs, streams, strict=True)],
                              self.cfg.timing)
        works = tuple(ColocWork(module=m, signature=self.sigs[m], per_gpu_batch=b, num_sms=k,
                                priority=p, alone_s=a, time_s=t)
                      for m, k, p, a, t in zip(members, got, prio, alone, together.members_s,
                                               strict=True))
        return ColocPoint(model=self.zoo.name, preset=self.cfg.preset, sharing=base, works=works,
                          group_time_s=together.median_s, spread=together.spread,
                          repeats=together.repeats)


def antagonist_streams(bank: StreamBank) -> tuple[tuple[Any, Any], list[int]]:
    """(module stream, antagonist stream) on two disjoint partitions, and their SM counts."""
    rest = bank.full_sms - ANTAGONIST_SPLIT
    _, streams, got = bank.group(
        "partition", [ANTAGONIST_SPLIT, rest - rest % bank.gpu.sm_granularity], [0, 0])
    return (streams[0], streams[1]), got


# --- communication -----------------------------------------------------------------------------
COMM_BYTES = tuple(float(4**i) for i in range(5, 17))
"""1 KiB .. 4 GiB, x4 steps."""


# --- the whole run -------------------------------------------------------------------------------
def _versions(gpu_name: str) -> dict[str, str]:
    import datetime
    import os
    import subprocess

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "gpu_name": gpu_name,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    try:
        import pynvml

        pynvml.nvmlInit()
        out["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # versions are informative only
        out["driver"] = "unknown"
    out["git_sha"] = os.environ.get("MOSAIC_GIT_SHA", "unknown")  # the GPU copy may lack .git
    try:
        git = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        if git.returncode == 0 and len(git.stdout.strip()) == 40:
            out["git_sha"] = git.stdout.strip()
    except OSError:
        pass
    return out


def _check_device(gpu: GPUSpec) -> None:
    if not torch.cuda.is_available():
        raise ProfilerError("profiling needs a CUDA GPU; on CPU use a shipped DB (--db) instead")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms != gpu.num_sms:
        raise ProfilerError(f"this GPU has {sms} SMs but hardware {gpu.name!r} has {gpu.num_sms}; "
                            "pass the matching --hardware")


def profile_models(models: Sequence[str], db_path: str, cfg: ProfilerConfig,
                   log: Callable[[str], None] = print, *, update: bool = False,
                   remeasure: bool = False) -> list[ModelReport]:
    """Profile `models` at cfg.preset into a new DB at `db_path` (`update`: add them to the
    DB there, keeping its other modules, comm curves and fits; `remeasure`: measure their
    modules again even where it holds them); one report per model."""
    gpu = gpu_spec(cfg.hardware)
    _check_device(gpu)
    start = time.perf_counter()
    config = {**asdict(cfg), "models": list(models)}
    versions = _versions(torch.cuda.get_device_name(0))
    if update:
        db = ProfileDB.open(db_path, hardware=gpu.name, readonly=False)
        key = profile_meta_key(cfg.kernels, cfg.preset,
                               colocations=cfg.max_pairs + cfg.max_triples > 0,
                               busy_only=not cfg.surfaces)
        config.update(recorded_part(db.meta.get(key), models, cfg.budget_s))
        db.set_meta(key, json.dumps({**config, **versions}, sort_keys=True, default=str))
    else:
        db = ProfileDB.create(db_path, hardware=gpu.name, num_sms=gpu.num_sms, config=config,
                              versions=versions, overwrite=True)
    bank = StreamBank(gpu)
    cfg = replace(cfg, timing=replace(cfg.timing, clock=bank.clock))
    log(f"streams: {len(bank.sm_values)} SM counts {bank.sm_values}, clock={bank.clock}")
    antagonist = Antagonist()
    (_, ant_stream), _ = antagonist_streams(bank)
    copy_s = time_group([(antagonist, ant_stream)], cfg.timing).median_s
    # Signatures with points already: kept, not re-measured (--update resumes a stopped run).
    measured: set[str] = {p.signature for p in db.points()} if update else set()
    if remeasure and cfg.surfaces:
        measured -= model_signatures(models, cfg.preset, cfg.kernels)
    elif remeasure:  # the busy fractions are what is measured again; the surfaces stay
        db.drop_busy(model_signatures(models, cfg.preset, cfg.kernels))
    if measured:
        log(f"kept: {len(measured)} module surfaces already in {db_path}")
    reports = []
    try:
        for i, name in enumerate(models):
            try:
                reports.append(_profile_one(name, cfg, db, bank, measured, antagonist, copy_s,
                                            start, len(models) - i, log))
            except Exception as exc:  # keep the other models' profiles; say what broke
                log(f"[{name}] FAILED: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                reports.append(ModelReport(model=name, notes=[f"failed: {exc}"]))
            else:
                continue
            # Out of the except block, so the traceback no longer holds the model's tensors.
            torch._dynamo.reset()
            _quiet_free()
        if cfg.surfaces:
            fit = profile_optimizer(db)
            log(f"optimizer step (fused AdamW): {fit.fixed_s * 1e3:.3f} ms + "
                f"{fit.s_per_param * 1e12:.2f} ps per parameter")
        if not update:
            db.add_comm(_comm(cfg.hardware, log))
            db.set_meta("profile_wall_s", f"{time.perf_counter() - start:.1f}")
    finally:
        bank.close()
        db.close()
    return reports


def recorded_part(previous: str | None, models: Sequence[str], budget_s: float
                  ) -> dict[str, Any]:
    """What an updating run records for its part of the DB (the recipe's command for it):
    the models of the runs before it (same meta key) and this run's, and the budget one run
    would need for all of them: the runs' budgets summed where this run adds models, the
    larger where it measures the same ones again (a resumed run)."""
    try:
        before = json.loads(previous or "{}")
        models_before = list(before.get("models", []))
        budget_before = float(before.get("budget_s", 0.0))
    except (ValueError, TypeError, AttributeError):
        models_before, budget_before = [], 0.0
    added = [m for m in models if m not in models_before]
    budget = budget_before + budget_s if added and models_before else max(budget_before, budget_s)
    return {"models": models_before + added, "budget_s": budget}


def _quiet_free() -> None:
    """free_device_memory() after a failure, whose CUDA error may surface once more here."""
    try:
        free_device_memory()
    except RuntimeError:
        torch.cuda.empty_cache()


def busy_only_split(graph: MMGraph, cfg: ProfilerConfig, surfaced: set[str]
                    ) -> tuple[list[ModuleSpec], list[str]]:
    """The modules a run profiles, and (a busy-only run) the names of those it skips: a busy
    fraction bounds a surface of the same kernels, so a module without one has nothing to
    bound, and registering it would claim a surface the DB does not hold."""
    if cfg.surfaces:
        return list(graph.modules), []
    kept = [m for m in graph.modules if module_signature(m, cfg.kernels) in surfaced]
    return kept, [m.name for m in graph.modules if m not in kept]


def model_signatures(models: Sequence[str], preset: str, kernels: str) -> set[str]:
    """The module signatures the zoo models have at `preset` with `kernels`."""
    from mosaic.zoo import get_model

    return {module_signature(m, kernels) for name in models
            for m in get_model(name).graph(preset).modules}


def _profile_one(name: str, cfg: ProfilerConfig, db: ProfileDB, bank: StreamBank,
                 measured: set[str], antagonist: Antagonist, copy_s: float, start: float,
                 models_left: int, log: Callable[[str], None]) -> ModelReport:
    t0 = time.perf_counter()
    deadline = t0 + (cfg.budget_s - (t0 - start)) / models_left
    prof = ModelProfiler(name, cfg, db, bank, measured)
    log(f"[{name}] {len(prof.graph.modules)} modules, batches {prof.batches}, "
        f"SMs {bank.sm_values}")
    if prof.without_surface:
        prof.report.notes.append(
            f"busy fractions skipped for {', '.join(prof.without_surface)}: no {cfg.kernels} "
            f"`{cfg.preset}` surface in the DB (measure it first: mosaic profile {name} --preset "
            f"{cfg.preset} --kernels {cfg.kernels} --surfaces-only --update)")
    if cfg.surfaces:
        prof.surfaces(refine_until=t0 + 0.45 * (deadline - t0))
        log(f"[{name}] surfaces: {prof.report.points} points in "
            f"{time.perf_counter() - t0:.1f}s ({memory_state()})")
    if cfg.antagonist:
        prof.signatures(antagonist, copy_s)
    prof.busy(deadline)
    prof.colocations(deadline)
    prof.release()
    prof.report.wall_s = time.perf_counter() - t0
    log(f"[{name}] done in {prof.report.wall_s:.1f}s: {prof.report.busy} busy fractions, "
        f"{prof.report.colocations} colocations; " + "; ".join(prof.report.notes))
    return prof.report


def _comm(hardware: str, log: Callable[[str], None]) -> list[CommPoint]:
    """NCCL measurements when several GPUs exist. No analytic rows: the DB holds measurements,
    and the performance model falls back to its own link model where a curve is missing."""
    pts: list[CommPoint] = []
    world = torch.cuda.device_count()
    if world > 1:
        try:
            pts += measure_comm(world)
        except Exception as exc:  # a failed NCCL run must not lose the whole profile
            log(f"NCCL measurement failed ({type(exc).__name__}: {exc}); analytic curves only")
    return pts


def measure_comm(world: int, max_bytes: float = float(256 << 20)) -> list[CommPoint]:
    """NCCL all-reduce over the first n GPUs (n = 2, 4, .. world) and p2p 0 -> 1, one process
    per GPU; NVLink multicast stays off (NCCL_NVLS_ENABLE=0)."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        mp.spawn(_comm_worker, args=(world, 29500 + os.getpid() % 1000, out, max_bytes),
                 nprocs=world, join=True)
        with open(out) as f:
            rows = json.load(f)
    return [CommPoint(source="measured", **r) for r in rows]


def _comm_worker(rank: int, world: int, port: int, out: str, max_bytes: float) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    sizes = [n for n in (2, 4, 8, 16) if n <= world]
    groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank makes every group
    for x in (b for b in COMM_BYTES if b <= max_bytes):
        buf = torch.ones(int(x) // 2, dtype=torch.bfloat16, device="cuda")
        for n in sizes:
            if rank < n:
                rows.append({"kind": "allreduce", "num_gpus": n, "num_bytes": x,
                             "time_s": _timed(lambda b=buf, g=groups[n]: dist.all_reduce(b, group=g))})
        if rank < 2:
            op = dist.send if rank == 0 else dist.recv
            rows.append({"kind": "p2p", "num_gpus": 2, "num_bytes": x,
                         "time_s": _timed(lambda b=buf, o=op: o(b, 1 - rank))})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _timed(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up (NCCL connects lazily)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats
