"""Sharded states (FSDP2) in the engine, on CPU with gloo: a plan with sharded placements trains
exactly like the same plan unsharded and like one process on the global batch, and its
checkpoints load under sharded and unsharded plans alike.

Two processes stand in for two GPUs. SGD with a large rate (as test_engine_dist.py), so a
wrong gradient scale shows in the weights. The toy modules hold nn.ModuleLists, so FSDP2
shards per layer as it does on the zoo's transformers (engine/fsdp.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from mosaic.engine.checkpoint import CheckpointConfig
from mosaic.engine.fsdp import layer_units
from mosaic.engine.session import EngineConfig
from mosaic.engine.trainer import TrainConfig, train
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.plan import Placement, Plan, Stage
from tests.helpers import start_workers
from tests.test_engine import ToyModel, WholeBatchToy, reference_state
from tests.test_engine_dist import _free_ports

# One xdist worker runs every start_workers test (tests/helpers.py), in turn: one forkserver,
# and never two multi-process runs at once on the 2 cores of CI.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("start_workers")]

STEPS, LR = 3, 0.1
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
"""Float32 on CPU: sharded and unsharded differ only in the order of a sum over two ranks."""


# --- a toy model whose modules have layers (nn.ModuleList) ------------------------------------
class DeepVision(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 16), nn.Linear(16, 16), nn.Linear(16, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Words(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(1)


class DeepSink(nn.Module):
    """Per-sample-mean loss over two layers and a head left outside them (the root's unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 5)

    def forward(self, labels: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x = torch.cat([v, t], dim=-1)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return F.cross_entropy(self.head(x), labels)


DEEP = {"vision": DeepVision, "text": Words, "llm": DeepSink}
DEEP_EDGES = (("vision", "llm"), ("text", "llm"))


class DeepToy(WholeBatchToy):
    """The trainer's model protocol over DEEP (as tests.test_engine's toys over theirs), with
    layers in the graph: FSDP shards per layer."""

    def __init__(self) -> None:
        self.name = "toydeep"
        self.factories, self.edges = DEEP, DEEP_EDGES
        self.global_batch = 12
        self.requested: list[dict] = []

    def graph(self, preset: str, global_batch: int | None = None) -> MMGraph:
        specs = tuple(ModuleSpec(name=n, kind="llm" if n == "llm" else "encoder",
                                 input_shape=(12,), num_params=1000, num_layers=3,
                                 flops_per_sample=1e6, activation_bytes_per_sample=1e3,
                                 output_bytes_per_sample=32.0)
                      for n in DEEP)
        return MMGraph(name=self.name, modules=specs, edges=DEEP_EDGES,
                       global_batch=global_batch or self.global_batch, preset=preset)


def make_model(name: str):
    if name == "toydeep":
        return DeepToy()
    if name.startswith("toy"):
        return ToyModel(name)
    from mosaic.zoo import get_model

    return get_model(name)


# --- plans: each case sharded, and the same plan unsharded -------------------------------------
def _plan(model: str, *stages: dict[str, tuple[tuple[int, ...], bool]],
          sharing: str = "temporal") -> dict:
    return Plan(model=model, planner="manual", num_gpus=2, stages=tuple(
        Stage(sharing=sharing, placements=tuple(
            Placement(module=m, gpus=g, shard=s) for m, (g, s) in where.items()))
        for where in stages)).to_dict()


BOTH = (0, 1)
SHARDED_CASES = {
    # every sharded module on both GPUs; text alone on GPU 0 feeds the sharded LLM
    "deep-all": ("toydeep", _plan("toydeep", {"vision": (BOTH, True), "text": ((0,), False)},
                                  {"llm": ((1, 0), True)})),
    # a sharded producer feeding an unsharded consumer on one GPU, and DP 2 -> 1
    "deep-vision-only": ("toydeep", _plan("toydeep", {"vision": (BOTH, True), "text": (BOTH, False)},
                                          {"llm": ((1,), False)})),
    # concurrent streams on a GPU (free sharing): a sharded and an unsharded encoder at once
    "deep-free": ("toydeep", _plan("toydeep", {"vision": (BOTH, True), "text": (BOTH, False)},
                                   {"llm": (BOTH, True)}, sharing="free")),
    # a contrastive head (its gradient divided by the DP degree) sharded, a root-only encoder
    "clip-head": ("toyclip", _plan("toyclip", {"vision": (BOTH, True), "text": (BOTH, False)},
                                   {"head": (BOTH, True)})),
}


def unsharded(plan: dict) -> dict:
    return Plan.from_dict({**plan, "stages": [
        {**s, "placements": [{**p, "shard": False} for p in s["placements"]]}
        for s in plan["stages"]]}).to_dict()


# --- workers -----------------------------------------------------------------------------------
def full_state(modules: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every tensor whole (a sharded one gathered: collective over its module's GPUs)."""
    out = {}
    for name, module in sorted(modules.items()):
        for key, value in module.state_dict().items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[f"{name}.{key}"] = value.detach().to("cpu", copy=True)
    return out


def _train(case: dict, out: Path, rank: int, device: str) -> None:
    """Train one case; save this rank's whole weights and the loss curve (or its error)."""
    model = make_model(case["model"])
    checkpoint = (CheckpointConfig(directory=case["checkpoint"], every_steps=case["steps"],
                                   background=case.get("background", False))
                  if "checkpoint" in case else None)
    engine = EngineConfig(amp=case.get("amp", False), graphs=case.get("graphs", False),
                          compile=case.get("compile"),
                          compile_scope=case.get("compile_scope", "module"),
                          accumulation=case.get("accumulation", 1),
                          reduce_dtype=case.get("reduce_dtype", "fp32"))
    config = TrainConfig(model=case["model"], preset=case.get("preset", "tiny"),
                         plan=Plan.from_dict(case["plan"]), steps=case["steps"],
                         warmup_steps=int(engine.graphs), lr=case.get("lr", LR),
                         optimizer=case.get("optimizer", "sgd"), device=device, progress=False,
                         engine=engine, checkpoint=checkpoint, resume=case.get("resume", False),
                         skip_nonfinite=case.get("skip_nonfinite", False),
                         clip_grad_norm=case.get("clip_grad_norm"))
    os.environ.pop("MOSAIC_FAULT", None)
    if "fault" in case:
        os.environ["MOSAIC_FAULT"] = case["fault"]
    micro_steps: list[dict[str, bool]] = []
    unwatch = _watch_micro_steps(micro_steps)
    gathered: set[str] = set()
    watch = nn.modules.module.register_module_forward_hook(  # before FSDP frees the unit
        lambda module, args, output: gathered.update(
            str(p.dtype) for p in module.parameters(recurse=False))
        if isinstance(module, FSDPModule) else None)
    try:
        result = train(config, model=model)
    except ValueError as exc:
        (out / f"error{rank}.json").write_text(json.dumps({"error": str(exc)}))
        return
    finally:
        os.environ.pop("MOSAIC_FAULT", None)
        watch.remove()
        unwatch()
    (out / f"gathered{rank}.json").write_text(json.dumps(sorted(gathered)))
    (out / f"micro_steps{rank}.json").write_text(json.dumps(micro_steps))
    torch.save(full_state(result.modules), out / f"rank{rank}.pt")
    sharded = sorted(m for m, module in result.modules.items()
                     if any(isinstance(p, DTensor) for p in module.parameters()))
    (out / f"sharded{rank}.json").write_text(json.dumps(sharded))
    meshes = {}  # per sharded module, its first matrix: mesh dimensions, local and whole size
    for m, module in sorted(result.modules.items()):
        for p in module.parameters():
            if isinstance(p, DTensor) and p.dim() == 2:
                meshes.setdefault(m, [p.device_mesh.ndim, p.to_local().numel(), p.numel()])
    (out / f"meshes{rank}.json").write_text(json.dumps(meshes))
    (out / f"compile{rank}.json").write_text(json.dumps(result.summary["compile"]))
    (out / f"losses{rank}.json").write_text(json.dumps([s["loss"] for s in result.steps]))
    (out / f"grad_norms{rank}.json").write_text(json.dumps([s.get("grad_norm")
                                                            for s in result.steps]))


def _watch_micro_steps(record: list[dict[str, bool]]):
    """After each micro-step but an accumulated step's last, whether each sharded module's
    sharded gradients hold its sum already (reduce-scattered). Returns the undo."""
    from mosaic.engine.runner import PlanRunner

    original = PlanRunner.step

    def step(self, data, *, fraction=1.0, sync=True):
        out = original(self, data, fraction=fraction, sync=sync)
        if not sync:
            record.append({m: all(p.grad is not None and bool(p.grad.to_local().abs().sum() > 0)
                                  for p in self.modules[m].parameters() if isinstance(p, DTensor))
                           for m in sorted(self.sharded)})
        return out

    PlanRunner.step = step
    return lambda: setattr(PlanRunner, "step", original)


def _worker(rank: int, port: int, cases: dict, out_dir: str, device: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    # Ours, not train()'s: it leaves a group it did not start alone, so the gathers after it run
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method="env://", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method="env://")
    for name, case in cases.items():  # in order: a resume follows its save
        where = Path(out_dir) / name
        where.mkdir(parents=True, exist_ok=True)
        _train(case, where, rank, device)
    dist.destroy_process_group()


def run_cases(cases: dict, tmp_path: Path, device: str = "cpu", world: int = 2) -> None:
    """Every case on `world` processes (gloo on CPU, NCCL on as many GPUs)."""
    start_workers(_worker, (_free_ports()[0], cases, str(tmp_path), device, world), nprocs=world,
                  device=device)


def load_run(tmp_path: Path, name: str, world: int = 2) -> tuple[list[dict], list[list[float]]]:
    where = tmp_path / name
    errors = [json.loads(p.read_text())["error"] for p in sorted(where.glob("error*.json"))]
    assert not errors, f"{name}: {errors}"
    states = [torch.load(where / f"rank{r}.pt") for r in range(world)]
    losses = [json.loads((where / f"losses{r}.json").read_text()) for r in range(world)]
    return states, losses


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tolerance) -> None:
    assert got.keys() <= want.keys(), sorted(set(got) - set(want))
    for key, value in got.items():
        torch.testing.assert_close(value, want[key], **(tolerance or TIGHT),
                                   msg=lambda m, k=key: f"{k}: {m}")


# --- tests ---------------------------------------------------------------------------------
def test_layer_units_are_the_layers_and_skip_tied_weights():
    sink = DeepSink()
    assert layer_units(sink) == list(sink.blocks)
    assert layer_units(Words()) == []  # no layers: the module is its one unit
    tied = DeepSink()
    tied.blocks[1].weight = tied.blocks[0].weight  # tied across two layers: neither is a unit
    assert layer_units(tied) == []


def test_sharded_plans_train_like_unsharded_and_like_one_process(tmp_path):
    cases = {}
    for name, (model, plan) in SHARDED_CASES.items():
        cases[name] = {"model": model, "plan": plan, "steps": STEPS}
        cases[f"{name}-unsharded"] = {"model": model, "plan": unsharded(plan), "steps": STEPS}
    # gradient accumulation: FSDP2 reduce-scatters on every micro-step (sharded gradients only)
    model, plan = SHARDED_CASES["deep-all"]
    cases["deep-all-accumulate"] = {"model": model, "plan": plan, "steps": STEPS, "accumulation": 2}
    # bf16 reduce-scatter (FSDP's reduce_dtype) against DDP's bf16 all-reduce hook
    for label, p in (("deep-all-bf16", plan), ("deep-all-bf16-unsharded", unsharded(plan))):
        cases[label] = {"model": model, "plan": p, "steps": STEPS, "reduce_dtype": "bf16"}
    run_cases(cases, tmp_path)
    for name, (model, plan) in SHARDED_CASES.items():
        reference = reference_state(make_model(model), "tiny", STEPS, LR)
        states, losses = load_run(tmp_path, name)
        plain_states, plain_losses = load_run(tmp_path, f"{name}-unsharded")
        assert losses[0] == losses[1]  # every rank reports the summed loss
        for rank in range(2):  # FSDP really holds the shards of exactly the sharded placements
            held = json.loads((tmp_path / name / f"sharded{rank}.json").read_text())
            assert held == sorted(p["module"] for s in plan["stages"] for p in s["placements"]
                                  if p["shard"] and rank in p["gpus"])
        torch.testing.assert_close(losses[0], plain_losses[0], **TIGHT)
        for rank in range(2):
            assert states[rank].keys() == plain_states[rank].keys()
            assert_same(states[rank], plain_states[rank])
            assert_same(states[rank], reference, rtol=1e-4, atol=1e-5)  # as test_engine_dist
    states, _ = load_run(tmp_path, "deep-all-bf16")
    plain_states, _ = load_run(tmp_path, "deep-all-bf16-unsharded")
    for rank in range(2):  # bf16 rounding of the gradients on the wire, in either order
        assert_same(states[rank], plain_states[rank], rtol=1e-3, atol=5e-4)
    states, losses = load_run(tmp_path, "deep-all-accumulate")
    torch.testing.assert_close(losses[0], load_run(tmp_path, "deep-all")[1][0], **TIGHT)
    for rank in range(2):
        micro_steps = json.loads((tmp_path / "deep-all-accumulate" / f"micro_steps{rank}.json")
                                 .read_text())
        assert micro_steps == [{"llm": True, "vision": True}] * STEPS
        assert_same(states[rank], reference_state(DeepToy(), "tiny", STEPS, LR),
                    rtol=1e-4, atol=1e-5)


def test_hybrid_sharding_over_copies_trains_like_one_process(tmp_path):
    """HSDP (Placement.shard_degree): four processes, each sharded module's states spread
    over two GPUs and kept twice, the copies' gradients all-reduced; and a producer sharded
    over all four beside it. Same weights as one process on the global batch; its AdamW
    checkpoint resumes under plain FSDP over all four, as the straight run continues."""
    four = (0, 1, 2, 3)

    def plan(degree: int) -> dict:
        return Plan(model="toydeep", planner="manual", num_gpus=4, stages=(
            Stage(placements=(Placement(module="vision", gpus=four, shard=True, shard_degree=degree),
                              Placement(module="text", gpus=four, shard=True))),
            Stage(placements=(Placement(module="llm", gpus=(2, 3, 0, 1), shard=True,
                                        shard_degree=degree),)))).to_dict()

    ckpt, adamw = str(tmp_path / "ckpt"), {"model": "toydeep", "optimizer": "adamw"}
    run_cases({"hsdp": {"model": "toydeep", "plan": plan(2), "steps": STEPS},
               "straight": {**adamw, "plan": plan(2), "steps": 4},
               "first-half": {**adamw, "plan": plan(2), "steps": 2, "checkpoint": ckpt},
               "resumed-fsdp": {**adamw, "plan": plan(0), "steps": 4, "checkpoint": ckpt,
                                "resume": True}}, tmp_path, world=4)
    straight, straight_losses = load_run(tmp_path, "straight", world=4)
    resumed, resumed_losses = load_run(tmp_path, "resumed-fsdp", world=4)
    torch.testing.assert_close(resumed_losses[0], straight_losses[0][2:], **TIGHT)
    for rank in range(4):
        assert_same(resumed[rank], straight[rank])
    states, losses = load_run(tmp_path, "hsdp", world=4)
    reference = reference_state(DeepToy(), "tiny", STEPS, LR)
    for rank in range(4):
        assert losses[rank] == losses[0]
        assert_same(states[rank], reference, rtol=1e-4, atol=1e-5)
        meshes = json.loads((tmp_path / "hsdp" / f"meshes{rank}.json").read_text())
        ndim, local, whole = meshes["llm"]
        assert ndim == 2 and local * 2 == whole  # half of it on each of a copy's two GPUs
        assert meshes["vision"][0] == 2 and meshes["text"][0] == 1


@pytest.mark.parametrize("scope", ["blocks", "module"])
def test_sharded_modules_compile_after_sharding_and_train_like_one_process(tmp_path, scope):
    """Inductor (on the CPU) over modules FSDP2 has sharded: by blocks each layer unit is a
    compiled graph of its own with FSDP's hooks between them (torchtitan's recipe); whole,
    Dynamo runs the units' hooks outside its graphs. Same weights as one eager process, and
    the compile report lists the sharded modules as compiled, not eager."""
    compiled = ("deep-all", "clip-head")
    run_cases({name: {"model": SHARDED_CASES[name][0], "plan": SHARDED_CASES[name][1],
                      "steps": STEPS, "compile": "default", "compile_scope": scope}
               for name in compiled}, tmp_path)
    for name in compiled:
        model, plan = SHARDED_CASES[name]
        states, _ = load_run(tmp_path, name)
        reference = reference_state(make_model(model), "tiny", STEPS, LR)
        sharded = {p["module"] for s in plan["stages"] for p in s["placements"] if p["shard"]}
        for rank in range(2):
            assert_same(states[rank], reference, rtol=1e-4, atol=1e-5)
            report = json.loads((tmp_path / name / f"compile{rank}.json").read_text())
            held = set(json.loads((tmp_path / name / f"sharded{rank}.json").read_text()))
            assert held == sharded and not report["eager"], report
            assert sharded <= set(report["compiled"]) & set(report["compile_s"]), report
            if scope == "blocks" and model == "toydeep":  # its layer units, a graph each
                assert report["compiled"]["vision"]["blocks"] == 3, report


def test_sharded_modules_compute_with_weights_gathered_in_bf16_under_autocast(tmp_path):
    """Under bf16 autocast FSDP2 gathers the weights in bf16 (fsdp.gather_dtype), as the
    memory and cost model count them; the loss follows the unsharded plan's within bf16's
    rounding. Without autocast they are gathered as stored (fp32)."""
    model, plan = SHARDED_CASES["deep-all"]
    run_cases({"amp": {"model": model, "plan": plan, "steps": STEPS, "amp": True},
               "amp-unsharded": {"model": model, "plan": unsharded(plan), "steps": STEPS,
                                 "amp": True},
               "fp32": {"model": model, "plan": plan, "steps": 1}}, tmp_path)
    _, losses = load_run(tmp_path, "amp")
    _, plain_losses = load_run(tmp_path, "amp-unsharded")
    torch.testing.assert_close(losses[0], plain_losses[0], rtol=2e-2, atol=2e-2)
    for rank in range(2):
        for case, dtype in (("amp", "torch.bfloat16"), ("fp32", "torch.float32")):
            seen = json.loads((tmp_path / case / f"gathered{rank}.json").read_text())
            assert seen == [dtype], (case, seen)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sharded_plans_clip_the_global_norm_as_one_process_does(tmp_path, optimizer):
    """--clip-grad-norm with FSDP shards: each rank's shard of a gradient counts once in the
    global norm, the parameters FSDP leaves whole (replicated) once over their copies, so
    sharded plans clip as one process clipping all its parameters does, norms included.
    SGD's gradients are divided in place; fused AdamW over DTensors is told the factor."""
    clip = 0.05
    cases = {name: {"model": model, "plan": plan, "steps": STEPS, "clip_grad_norm": clip,
                    "optimizer": optimizer}
             for name, (model, plan) in SHARDED_CASES.items()}
    run_cases(cases, tmp_path)
    for name, (model, _) in SHARDED_CASES.items():
        norms: list[float] = []
        reference = reference_state(make_model(model), "tiny", STEPS, LR, clip_grad_norm=clip,
                                    norms=norms, optimizer=optimizer)
        assert min(norms) > clip, name
        states, _ = load_run(tmp_path, name)
        for rank in range(2):
            assert_same(states[rank], reference, rtol=1e-4, atol=1e-5)
            logged = json.loads((tmp_path / name / f"grad_norms{rank}.json").read_text())
            assert logged == pytest.approx(norms, rel=1e-4), name


def test_sharded_checkpoints_resume_under_sharded_and_unsharded_plans(tmp_path):
    """AdamW, so the optimizer state (DTensor shards) is saved and loaded too."""
    _, plan = SHARDED_CASES["deep-all"]
    base = {"model": "toydeep", "optimizer": "adamw"}
    cases = {"straight": {**base, "plan": plan, "steps": 4}}
    for target, resumed_plan in (("sharded", plan), ("unsharded", unsharded(plan))):
        ckpt = str(tmp_path / f"ckpt-{target}")  # a resumed run saves its last step there too
        cases[f"first-half-{target}"] = {**base, "plan": plan, "steps": 2, "checkpoint": ckpt}
        cases[f"resumed-{target}"] = {**base, "plan": resumed_plan, "steps": 4,
                                      "checkpoint": ckpt, "resume": True}
    run_cases(cases, tmp_path)
    straight, straight_losses = load_run(tmp_path, "straight")
    for name in ("resumed-sharded", "resumed-unsharded"):
        states, losses = load_run(tmp_path, name)
        torch.testing.assert_close(losses[0], straight_losses[0][2:], **TIGHT)
        for rank in range(2):
            assert_same(states[rank], straight[rank])


def test_sharded_states_saved_in_the_background_resume_exactly(tmp_path):
    """FSDP2's DTensor shards staged to host memory and written by the background thread
    over its own gloo group: the resumed run continues the straight run's curve."""
    _, plan = SHARDED_CASES["deep-all"]
    base = {"model": "toydeep", "optimizer": "adamw", "plan": plan}
    ckpt = str(tmp_path / "ckpt")
    run_cases({"straight": {**base, "steps": 4},
               "first-half": {**base, "steps": 2, "checkpoint": ckpt, "background": True},
               "resumed": {**base, "steps": 4, "checkpoint": ckpt, "resume": True,
                           "background": True}}, tmp_path)
    straight, straight_losses = load_run(tmp_path, "straight")
    states, losses = load_run(tmp_path, "resumed")
    torch.testing.assert_close(losses[0], straight_losses[0][2:], **TIGHT)
    for rank in range(2):
        assert_same(states[rank], straight[rank])


def test_a_nan_step_is_skipped_on_every_rank_over_sharded_adamw_states(tmp_path):
    """Rank 0's shard of one gradient turns NaN at step 2: the health summed over ranks tells
    the fused AdamW on both ranks to skip (a 0-d `found_inf` beside DTensor states), so the
    weights end as a clean 2-step run's."""
    _, plan = SHARDED_CASES["deep-all"]
    base = {"model": "toydeep", "optimizer": "adamw", "plan": plan, "skip_nonfinite": True}
    run_cases({"clean": {**base, "steps": 2},
               "nan": {**base, "steps": 3, "fault": "nan:rank=0:step=2"}}, tmp_path)
    clean, _ = load_run(tmp_path, "clean")
    skipped, _ = load_run(tmp_path, "nan")
    for rank in range(2):
        assert_same(skipped[rank], clean[rank])


def zoo_plan(model: str, sharded: set[str]) -> dict:
    """Encoders in stage 0, the consumer in stage 1, every module on both processes."""
    from mosaic.zoo import get_model

    graph = get_model(model).graph("tiny")
    return Plan(model=model, planner="manual", num_gpus=2, stages=tuple(
        Stage(placements=tuple(Placement(module=m, gpus=BOTH, shard=m in sharded) for m in level))
        for level in graph.levels())).to_dict()


ZOO_CASES = {"qwen3-vl": {"vision", "llm"}, "clip": {"vision", "align"}}
"""Real transformers layers (per-layer units), and CLIP's head with its scalar temperature,
which FSDP leaves whole and the runner all-reduces."""


def test_zoo_modules_sharded_train_like_unsharded(tmp_path):
    """Eager, and Qwen3-VL's transformers layers compiled by blocks after sharding too (a
    zoo module's class cannot be built without arguments, as copy.copy of an FSDP2 unit
    would: compile._shallow)."""
    cases = {}
    for model, sharded in ZOO_CASES.items():
        for label, shard in (("sharded", sharded), ("unsharded", set())):
            cases[f"{model}-{label}"] = {"model": model, "plan": zoo_plan(model, shard),
                                         "steps": 2, "lr": 1e-2}
    cases["qwen3-vl-sharded-compiled"] = {**cases["qwen3-vl-sharded"], "compile": "default",
                                          "compile_scope": "blocks"}
    run_cases(cases, tmp_path)
    states, losses = load_run(tmp_path, "qwen3-vl-sharded-compiled")
    plain_states, plain_losses = load_run(tmp_path, "qwen3-vl-unsharded")
    torch.testing.assert_close(losses[0], plain_losses[0], rtol=1e-4, atol=1e-5)
    for rank in range(2):
        assert_same(states[rank], plain_states[rank], rtol=1e-4, atol=1e-5)
    report = json.loads((tmp_path / "qwen3-vl-sharded-compiled" / "compile0.json").read_text())
    assert report["compiled"]["llm"]["blocks"] > 1 and not report["eager"], report
    for model, sharded in ZOO_CASES.items():
        states, losses = load_run(tmp_path, f"{model}-sharded")
        plain_states, plain_losses = load_run(tmp_path, f"{model}-unsharded")
        assert json.loads((tmp_path / f"{model}-sharded" / "sharded0.json").read_text()) == sorted(sharded)
        torch.testing.assert_close(losses[0], plain_losses[0], rtol=1e-5, atol=1e-6)
        for rank in range(2):
            assert_same(states[rank], plain_states[rank], rtol=1e-4, atol=1e-6)


def test_sharded_modules_on_subgroups_of_four_processes(tmp_path):
    """FSDP on process groups of part of the world: vision sharded over ranks 2-3 only (ranks
    0-1 never see it), the LLM over all four; then a checkpoint of that plan resumed by one
    where nothing is sharded."""
    plan = Plan(model="toydeep", planner="manual", num_gpus=4, stages=(
        Stage(placements=(Placement(module="vision", gpus=(3, 2), shard=True),
                          Placement(module="text", gpus=(0, 1)))),
        Stage(placements=(Placement(module="llm", gpus=(0, 1, 2, 3), shard=True),)))).to_dict()
    ckpt = str(tmp_path / "ckpt")
    cases = {"subgroups": {"model": "toydeep", "plan": plan, "steps": STEPS},
             "first-half": {"model": "toydeep", "plan": plan, "steps": 1, "checkpoint": ckpt},
             "resumed": {"model": "toydeep", "plan": unsharded(plan), "steps": STEPS,
                         "checkpoint": ckpt, "resume": True}}
    run_cases(cases, tmp_path, world=4)
    reference = reference_state(DeepToy(), "tiny", STEPS, LR)
    for name in ("subgroups", "resumed"):
        states, _ = load_run(tmp_path, name, world=4)
        for rank in range(4):
            assert_same(states[rank], reference, rtol=1e-4, atol=1e-5)
    held = [json.loads((tmp_path / "subgroups" / f"sharded{r}.json").read_text()) for r in range(4)]
    assert held == [["llm"], ["llm"], ["llm", "vision"], ["llm", "vision"]]
