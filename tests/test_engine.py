"""Engine on CPU, one process: the runner trains, and equals a plain training loop.

A toy model (tiny hand-made modules, zoo calling convention) keeps these fast and independent
of the zoo; the zoo's tiny presets are run too when present. `test_engine_dist.py` reuses
the toy model and the reference loop.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterable
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mosaic.engine.comm import CommError, PlanComm, pieces, sample_range
from mosaic.engine.runner import EngineError, PlanRunner, RunnerConfig
from mosaic.engine.session import EngineConfig, RankSession, batch_loader
from mosaic.engine.timer import Timer
from mosaic.engine.trainer import (
    OPTIMIZERS,
    TrainConfig,
    TrainError,
    build_modules,
    make_batch,
    train,
    train_from_cli,
)
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.plan import Placement, Plan, Stage

# --- a toy model with the zoo's calling convention ------------------------------------------------


class Vision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Text(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 16), nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids).mean(1))


class Adapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Contrastive(nn.Module):
    """Symmetric InfoNCE over the batch it is given, with a learnt temperature."""

    needs_global_batch = True

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        v, t = F.normalize(self.proj(v), dim=-1), F.normalize(t, dim=-1)
        logits = self.logit_scale.exp() * v @ t.T
        labels = torch.arange(len(v), device=v.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class Sink(nn.Module):
    """A per-sample-mean loss (the LLM kind): own labels first, then predecessor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 5)

    def forward(self, labels: torch.Tensor, a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(torch.cat([a, t], dim=-1)), labels)


TOYS = {
    "toyclip": ({"vision": Vision, "text": Text, "head": Contrastive},
                (("vision", "head"), ("text", "head"))),
    "toyvlm": ({"vision": Vision, "adapter": Adapter, "text": Text, "llm": Sink},
               (("vision", "adapter"), ("adapter", "llm"), ("text", "llm"))),
}


class WholeBatchToy:
    """The zoo-model protocol (build_modules, make_inputs, graph) over TOYS, without
    `make_rows`: every rank makes the whole global batch and keeps its rows."""

    def __init__(self, name: str, global_batch: int = 12) -> None:
        self.name = name
        self.factories, self.edges = TOYS[name]
        self.global_batch = global_batch
        self.requested: list[dict] = []
        """The rows each make_rows call asked for (ToyModel), to check per-rank loading."""

    def build_modules(self, preset: str, device="cpu", dtype=torch.float32, *,
                      names: Iterable[str] | None = None, seed: int = 0) -> dict[str, nn.Module]:
        wanted = set(self.factories if names is None else names)
        out = {}
        for name, factory in self.factories.items():
            if name in wanted:
                torch.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                out[name] = factory().to(device=device, dtype=dtype)
        return out

    def make_inputs(self, preset: str, batch_size: int, generator: torch.Generator,
                    device="cpu") -> dict[str, tuple[torch.Tensor, ...]]:
        data = {"vision": (torch.randn(batch_size, 12, generator=generator),),
                "text": (torch.randint(0, 20, (batch_size, 5), generator=generator),),
                "llm": (torch.randint(0, 5, (batch_size,), generator=generator),)}
        return {k: tuple(t.to(device) for t in v) for k, v in data.items() if k in self.factories}

    def graph(self, preset: str, global_batch: int | None = None) -> MMGraph:
        kinds = {"head": "head", "llm": "llm"}
        specs = tuple(
            ModuleSpec(name=n, kind=kinds.get(n, "encoder"), input_shape=(12,), num_params=1000,
                       flops_per_sample=1e6, activation_bytes_per_sample=1e3,
                       output_bytes_per_sample=32.0)
            for n in self.factories)
        return MMGraph(name=self.name, modules=specs, edges=self.edges,
                       global_batch=global_batch or self.global_batch, preset=preset)


class ToyModel(WholeBatchToy):
    """WholeBatchToy plus `make_rows`: each sample from its own seed, so a rank makes only
    the rows it processes (the trainer's per-rank loading, as the zoo's)."""

    def make_rows(self, preset: str, ranges, *, step: int, seed: int,
                  global_batch: int) -> dict[str, tuple[torch.Tensor, ...]]:
        ranges = ranges or {n: (0, global_batch) for n in self.factories}
        self.requested.append({"step": step, **{m: list(r) for m, r in ranges.items()}})
        out = {}
        for name, (start, stop) in ranges.items():
            if name in ("vision", "text", "llm"):
                samples = [self._sample(name, seed, step, i) for i in range(start, stop)]
                out[name] = (torch.stack(samples),)
        return out

    @staticmethod
    def _sample(name: str, seed: int, step: int, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(
            ((seed * 1_000_003 + step) * 10_007 + index) * 101 + zlib.crc32(name.encode()) % 101)
        if name == "vision":
            return torch.randn(12, generator=g)
        if name == "text":
            return torch.randint(0, 20, (5,), generator=g)
        return torch.randint(0, 5, (), generator=g)


def reference_state(model, preset: str, steps: int, lr: float, seed: int = 0,
                    global_batch: int | None = None, optimizer: str = "sgd",
                    clip_grad_norm: float | None = None,
                    norms: list[float] | None = None,
                    weight_decay: float = 0.0) -> dict[str, torch.Tensor]:
    """Plain single-process training on the global batch, all modules in one optimizer, no
    plan. SGD by default: Adam is invariant to a constant gradient scale, so it would hide
    a wrong loss or all-reduce scaling. `clip_grad_norm`: torch's clip_grad_norm_ before
    each update, the norms it returned appended to `norms`."""
    graph = model.graph(preset, global_batch)
    modules = build_modules(model, preset, graph.names, seed)
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = OPTIMIZERS[optimizer](params, lr=lr, weight_decay=weight_decay)
    for step in range(steps):
        data = make_batch(model, preset, graph.global_batch, seed, step)
        outputs: dict[str, torch.Tensor] = {}
        for name in graph.topo_order():
            preds = [outputs[p] for p in graph.predecessors(name)]
            outputs[name] = modules[name](*data.get(name, ()), *preds)
        loss = sum(outputs[s] for s in graph.sinks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
    return state_of(modules)


def state_of(modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{m}.{k}": v.detach().to("cpu", copy=True).contiguous()
            for m, mod in modules.items() for k, v in mod.state_dict().items()}


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                       rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Float32 tolerance: only the summation order differs from the reference."""
    assert got.keys() <= want.keys()
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], rtol=rtol, atol=atol,
                                   msg=lambda m, k=key: f"{k}: {m}")


def one_gpu_plans(graph: MMGraph) -> dict[str, Plan]:
    """Temporal, free, partition and cap plans of a graph on one GPU (one stage per level)."""
    plans = {}
    for sharing in ("temporal", "free", "partition", "cap"):
        stages = []
        for level in graph.levels():
            share = {"partition": 0.9 / len(level), "cap": 0.5}.get(sharing, 1.0)
            stages.append(Stage(sharing=sharing, placements=tuple(
                Placement(module=m, gpus=(0,), sm_share=share, priority=int(i == 0 and sharing == "free"))
                for i, m in enumerate(level))))
        plans[sharing] = Plan(model=graph.name, planner=f"manual-{sharing}", num_gpus=1,
                              stages=tuple(stages))
    return plans


# --- sample layout ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,src,dst", [
    (12, (0,), (0,)), (12, (0, 1), (1,)), (12, (0, 1, 2, 3), (2, 3)), (12, (0, 1, 2, 3), (3, 1, 0)),
    (12, (1, 0), (0, 1)), (24, (0, 1, 2), (0, 1, 2, 3)), (6, (2,), (0, 1, 2)),
])
def test_pieces_tile_both_layouts(n, src, dst):
    got = pieces(n, src, dst)
    for rank in dst:  # each consumer gets exactly its interval, in order
        mine = [p for p in got if p.dst == rank]
        start, stop = sample_range(n, dst, rank)
        assert mine[0].start == start and mine[-1].stop == stop
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:], strict=False))
    for rank in src:  # each producer sample goes to exactly one consumer
        start, stop = sample_range(n, src, rank)
        covered = sorted(i for p in got if p.src == rank for i in range(p.start, p.stop))
        assert covered == list(range(start, stop))


# --- single-process training ---------------------------------------------------------------------------

def test_loss_falls_over_20_steps(tmp_path):
    model = ToyModel("toyclip")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    metrics = tmp_path / "m.jsonl"
    result = train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=20, lr=1e-2,
                               metrics_path=str(metrics), engine=EngineConfig(timeline=True)),
                   model=model)
    losses = [s["loss"] for s in result.steps]
    assert losses[-1] < 0.8 * losses[0]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in lines] == list(range(20))
    assert {"loss", "step_time_s", "samples_per_s", "warmup"} <= lines[0].keys()
    summary = result.summary
    assert summary["final_loss"] == losses[-1] and summary["step_time_median_s"] > 0
    assert summary["pool"]["backend"] == "cpu"
    json.dumps(result.to_dict())
    phases = {(e["module"], e["phase"]) for e in result.timeline}
    assert phases == {(m, p) for m in ("vision", "text", "head") for p in ("fwd", "bwd")}
    assert all(0 <= e["start_s"] <= e["end_s"] for e in result.timeline)


@pytest.mark.parametrize("toy", ["toyclip", "toyvlm"])
@pytest.mark.parametrize("sharing", ["temporal", "free", "partition", "cap"])
@pytest.mark.parametrize("kind", [ToyModel, WholeBatchToy])
def test_one_gpu_equals_reference_loop(toy, sharing, kind):
    model = kind(toy)
    plan = one_gpu_plans(model.graph("tiny"))[sharing]
    for optimizer in ("sgd", "adamw"):
        result = train(TrainConfig(device="cpu", model=toy, plan=plan, steps=3, warmup_steps=0, lr=1e-2,
                                   optimizer=optimizer), model=model)
        want = reference_state(model, "tiny", 3, 1e-2, optimizer=optimizer)
        assert_state_close(state_of(result.modules), want)


def test_weight_decay_trains_as_adamw_with_it():
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    result = train(TrainConfig(device="cpu", model="toyvlm", plan=plan, steps=3, warmup_steps=0,
                               lr=1e-1, weight_decay=0.5), model=model)
    want = reference_state(model, "tiny", 3, 1e-1, optimizer="adamw", weight_decay=0.5)
    assert_state_close(state_of(result.modules), want)
    plain = reference_state(model, "tiny", 3, 1e-1, optimizer="adamw")
    assert any(not torch.allclose(want[k], plain[k]) for k in want)  # it decays


CLIP = 0.05
"""Below the toy models' gradient norms at every step of these runs (asserted): it clips."""


@pytest.mark.parametrize("toy", ["toyclip", "toyvlm"])
@pytest.mark.parametrize("sharing", ["temporal", "free"])
def test_clipped_gradients_train_as_torchs_clip_grad_norm(toy, sharing, tmp_path):
    """--clip-grad-norm scales every module's gradients by one global factor, as
    clip_grad_norm_ over all parameters does (SGD: a wrong factor shows), and each step's
    metrics line holds the norm before clipping."""
    model = ToyModel(toy)
    plan = one_gpu_plans(model.graph("tiny"))[sharing]
    metrics = tmp_path / "metrics.jsonl"
    result = train(TrainConfig(device="cpu", model=toy, plan=plan, steps=3, warmup_steps=0,
                               lr=1e-1, optimizer="sgd", clip_grad_norm=CLIP,
                               metrics_path=str(metrics)), model=model)
    norms: list[float] = []
    want = reference_state(model, "tiny", 3, 1e-1, clip_grad_norm=CLIP, norms=norms)
    assert min(norms) > CLIP
    assert_state_close(state_of(result.modules), want)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["grad_norm"] for row in rows] == pytest.approx(norms, rel=1e-4)
    assert (result.summary["clip_grad_norm"], result.summary["nan_guard"]) == (CLIP, "clip norms")


def test_clipped_adamw_divides_the_gradients_it_reads_as_torchs_clip_grad_norm():
    """A fused optimizer is told the clipping factor (its grad_scale) and applies it in its
    own pass: AdamW, whose update depends on each step's factor (the norms differ between
    steps), trains as torch's AdamW after clip_grad_norm_, and not as unclipped AdamW."""
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    result = train(TrainConfig(device="cpu", model="toyvlm", plan=plan, steps=3, warmup_steps=0,
                               lr=1e-2, optimizer="adamw", clip_grad_norm=CLIP), model=model)
    norms: list[float] = []
    want = reference_state(model, "tiny", 3, 1e-2, optimizer="adamw", clip_grad_norm=CLIP,
                           norms=norms)
    assert min(norms) > CLIP
    assert_state_close(state_of(result.modules), want)
    unclipped = reference_state(model, "tiny", 3, 1e-2, optimizer="adamw")
    assert any(not torch.allclose(want[k], unclipped[k], rtol=1e-4, atol=1e-5) for k in want)


def test_clipped_accumulated_micro_steps_train_as_the_whole_batch_clipped():
    """Clipping reads the gradients once every micro-step has added into them."""
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["temporal"]
    result = train(TrainConfig(device="cpu", model="toyvlm", plan=plan, steps=3, warmup_steps=0,
                               lr=1e-1, optimizer="sgd", clip_grad_norm=CLIP,
                               engine=EngineConfig(accumulation=2)), model=model)
    norms: list[float] = []
    want = reference_state(model, "tiny", 3, 1e-1, clip_grad_norm=CLIP, norms=norms)
    assert_state_close(state_of(result.modules), want)
    assert [s["grad_norm"] for s in result.steps] == pytest.approx(norms, rel=1e-4)


def test_clipping_refuses_a_nonpositive_bound():
    plan = one_gpu_plans(ToyModel("toyclip").graph("tiny"))["temporal"]
    with pytest.raises(TrainError, match="clip_grad_norm=0.0 must be > 0"):
        TrainConfig(device="cpu", model="toyclip", plan=plan, clip_grad_norm=0.0)


@pytest.mark.parametrize("sharing", ["temporal", "free"])
def test_micro_batch_overlap_equals_reference_loop(sharing):
    """Two micro-batches with gradient accumulation make the same update as the whole batch."""
    model = ToyModel("toyvlm")
    plan = replace(one_gpu_plans(model.graph("tiny"))[sharing], micro_batches=2)
    result = train(TrainConfig(device="cpu", model="toyvlm", plan=plan, steps=3, warmup_steps=0,
                               lr=1e-2, optimizer="sgd"), model=model)
    assert_state_close(state_of(result.modules), reference_state(model, "tiny", 3, 1e-2))


def test_micro_batches_refuse_a_contrastive_head():
    model = ToyModel("toyclip")
    plan = replace(one_gpu_plans(model.graph("tiny"))["free"], micro_batches=2)
    with pytest.raises(EngineError, match="whole batch"):
        train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=1, warmup_steps=0),
              model=model)


def test_gradient_accumulation_equals_reference_loop():
    """Two accumulation micro-steps, each loading only its own rows, make the whole batch's
    update (SGD: a wrong loss scale would show)."""
    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["temporal"]
    result = train(TrainConfig(device="cpu", model="toyvlm", plan=plan, steps=3, warmup_steps=0,
                               lr=1e-2, optimizer="sgd", engine=EngineConfig(accumulation=2)),
                   model=model)
    assert_state_close(state_of(result.modules), reference_state(model, "tiny", 3, 1e-2))
    assert model.requested[0] == {"step": 0, "vision": [0, 6], "text": [0, 6], "llm": [0, 6],
                                  "adapter": [0, 6]}


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_each_rank_loads_only_its_rows(rank):
    """Rank `rank` of a 3-GPU plan (DP 3 -> 1 -> DP 3 with two micro-steps) asks the model for
    its own rows only, and gets what slicing the whole global batch gives."""
    model = ToyModel("toyvlm", global_batch=12)
    graph = model.graph("tiny")
    plan = Plan(model="toyvlm", planner="manual", num_gpus=3, stages=(
        Stage(sharing="temporal", placements=(Placement(module="vision", gpus=(2, 0, 1)),
                                              Placement(module="text", gpus=(1,)))),
        Stage(sharing="temporal", placements=(Placement(module="adapter", gpus=(0, 1, 2)),)),
        Stage(sharing="temporal", placements=(Placement(module="llm", gpus=(0, 1, 2)),))))
    comm = PlanComm(rank=rank, world_size=3, device=torch.device("cpu"), groups={})
    local = [m for m in graph.names if rank in plan.placement(m).gpus]
    modules = build_modules(model, "tiny", local, 0)
    half = replace(graph, global_batch=6)  # the graph of one of two accumulation micro-steps
    runner = PlanRunner(plan=plan, graph=half, modules=modules, comm=comm)
    session = RankSession(plan=plan, graph=graph, runner=runner, comm=comm, pool=None,
                          config=EngineConfig(accumulation=2))
    got = session.load_local_batch(batch_loader(model, "tiny", 12, 0, 5))
    vision = {2: [0, 2], 0: [2, 4], 1: [4, 6]}[rank]  # placement order, not rank order
    llm = [2 * rank, 2 * rank + 2]
    want_rows = [{"vision": vision, "llm": llm, **({"text": [0, 6]} if rank == 1 else {})},
                 {"vision": [v + 6 for v in vision], "llm": [v + 6 for v in llm],
                  **({"text": [6, 12]} if rank == 1 else {})}]
    asked = [{k: v for k, v in r.items() if k not in ("step", "adapter")} for r in model.requested]
    assert asked == want_rows
    want = session.local_batch(make_batch(model, "tiny", 12, 0, 5))  # slice the whole batch
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    for g, w in zip(got, want, strict=True):
        for m in w:
            assert all(torch.equal(a, b) for a, b in zip(g[m], w[m], strict=True))


ZOO_MODELS = ["clip", "imagebind", "qwen3-vl", "ofasys"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_tiny_trains_and_equals_reference(name):
    zoo = pytest.importorskip("mosaic.zoo")
    if name not in zoo.MODELS:
        pytest.skip(f"zoo has no {name!r} yet")
    model = zoo.get_model(name)
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    result = train(TrainConfig(device="cpu", model=name, plan=plan, steps=3, warmup_steps=0, lr=1e-3,
                               optimizer="sgd"), model=model)
    assert all(math.isfinite(s["loss"]) for s in result.steps)
    assert_state_close(state_of(result.modules), reference_state(model, "tiny", 3, 1e-3))


# --- errors fail before the first step, and write nothing ---------------------------------------------

def test_plan_for_more_gpus_than_processes_fails_before_building(tmp_path):
    model = ToyModel("toyclip")
    plan = Plan(model="toyclip", planner="manual", num_gpus=2, stages=(
        Stage(placements=(Placement(module="vision", gpus=(0,)), Placement(module="text", gpus=(1,)))),
        Stage(placements=(Placement(module="head", gpus=(0, 1)),))))
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(CommError, match="torchrun --nproc-per-node 2"):
        train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=3, metrics_path=str(metrics)), model=model)
    assert not metrics.exists()


def test_invalid_plan_fails_with_one_line(tmp_path):
    model = ToyModel("toyclip")
    plan = Plan(model="toyclip", planner="manual", num_gpus=1, stages=(
        Stage(placements=(Placement(module="vision", gpus=(0,)),)),
        Stage(placements=(Placement(module="head", gpus=(0,)),))))
    with pytest.raises(TrainError, match=r"\['text'\] are not placed") as info:
        train(TrainConfig(device="cpu", model="toyclip", plan=plan, steps=3), model=model)
    assert "\n" not in str(info.value)
    bad_share = Plan(model="toyclip", planner="manual", num_gpus=1, stages=(
        Stage(sharing="partition", placements=(Placement(module="vision", gpus=(0,), sm_share=1.5),
                                               Placement(module="text", gpus=(0,), sm_share=0.5))),
        Stage(placements=(Placement(module="head", gpus=(0,)),))))
    with pytest.raises(TrainError, match="quota beyond the GPU"):
        train(TrainConfig(device="cpu", model="toyclip", plan=bad_share, steps=3), model=model)


def test_plan_file_errors_and_config_errors(tmp_path):
    with pytest.raises(TrainError, match="cannot read plan file"):
        train(TrainConfig(device="cpu", model="toyclip", plan_path=str(tmp_path / "missing.json")),
              model=ToyModel("toyclip"))
    with pytest.raises(TrainError, match="exactly one of"):
        TrainConfig(device="cpu", model="toyclip")
    with pytest.raises(TrainError, match="warmup_steps"):
        TrainConfig(device="cpu", model="toyclip", plan_path="p.json", steps=2, warmup_steps=2)
    with pytest.raises(TrainError, match="torchrun --standalone --nproc-per-node 2"):
        train_from_cli("clip", plan_path="p.json", gpus=2)


def test_runner_rejects_graphs_on_cpu_and_missing_modules():
    from mosaic.engine.comm import PlanComm

    model = ToyModel("toyclip")
    graph = model.graph("tiny")
    plan = one_gpu_plans(graph)["temporal"]
    comm = PlanComm.create(plan)
    with pytest.raises(EngineError, match="graphs=True needs a CUDA device"):
        PlanRunner(plan=plan, graph=graph, modules=model.build_modules("tiny"), comm=comm,
                   config=RunnerConfig(graphs=True))
    with pytest.raises(EngineError, match=r"\['head'\] are placed on rank 0 but not built"):
        PlanRunner(plan=plan, graph=graph, modules=model.build_modules("tiny", names=["vision", "text"]),
                   comm=comm)


def test_cpu_timer_measures_host_time():
    timer = Timer("cpu")
    start = timer.mark()
    sum(range(10000))
    assert timer.seconds(start, timer.mark()) > 0


def test_a_resumed_run_continues_the_exact_loss_curve(tmp_path):
    """Stop after 3 of 6 steps (a crash after the checkpoint), resume: the last 3 losses and
    the final weights equal the uninterrupted run's, bit for bit (CPU, SGD)."""
    from mosaic.engine.checkpoint import CheckpointConfig

    model = ToyModel("toyvlm")
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    common = dict(device="cpu", model="toyvlm", plan=plan, warmup_steps=0, lr=1e-2,
                  optimizer="sgd", progress=False)
    whole = train(TrainConfig(steps=6, **common), model=model)
    ckpt = CheckpointConfig(directory=str(tmp_path / "ckpt"), every_steps=3)
    train(TrainConfig(steps=3, checkpoint=ckpt, **common), model=model)
    resumed = train(TrainConfig(steps=6, checkpoint=ckpt, resume=True, **common), model=model)
    assert [s["step"] for s in resumed.steps] == [3, 4, 5]
    assert [s["loss"] for s in resumed.steps] == [s["loss"] for s in whole.steps[3:]]
    want, got = state_of(whole.modules), state_of(resumed.modules)
    assert all(torch.equal(want[k], got[k]) for k in want)
    with pytest.raises(TrainError, match="raise --steps"):
        train(TrainConfig(steps=6, checkpoint=ckpt, resume=True, **common), model=model)
