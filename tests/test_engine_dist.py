"""Engine across processes (gloo): any plan trains exactly like one process on the global batch.

Two and four processes stand in for GPUs. Each worker trains every case for K=3 steps and
saves its modules as safetensors; the test compares every replica of every module with the
single-process reference loop of test_engine.py. Cases cover the baselines' shapes (hand-made,
plus the real planners' plans where they import), DP-degree mismatches between producer and
consumer (2 -> 1, 4 -> 2, 4 -> 3 -> 2, reversed GPU orders), contrastive heads sharded over
2 and 4 ranks, and the error paths (all ranks must raise before the first step, none hang).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mosaic.engine.session import Dist, EngineConfig, end_distributed
from mosaic.engine.trainer import TrainConfig, train
from mosaic.plan import Placement, Plan, Stage
from tests.helpers import start_workers
from tests.test_engine import ToyModel, assert_state_close, reference_state, state_of

# One xdist worker runs every start_workers test (tests/helpers.py), in turn: one forkserver,
# and never two multi-process runs at once on the 2 cores of CI.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("start_workers")]

STEPS, LR = 3, 0.1
"""SGD (see reference_state) with a large rate, so any gradient error shows in the weights."""


def _plan(model: str, num_gpus: int, *stages: tuple[str, dict[str, tuple[int, ...]]],
          shares: dict[str, float] | None = None, name: str = "manual") -> dict:
    shares = shares or {}
    return Plan(model=model, planner=name, num_gpus=num_gpus, stages=tuple(
        Stage(sharing=sharing, placements=tuple(
            Placement(module=m, gpus=g, sm_share=shares.get(m, 1.0)) for m, g in where.items()))
        for sharing, where in stages)).to_dict()


def cases_2() -> dict[str, tuple[str, dict]]:
    both = (0, 1)
    return {
        "megatron": ("toyclip", _plan("toyclip", 2, ("temporal", {"vision": both}),
                                      ("temporal", {"text": both}), ("temporal", {"head": both}))),
        "distmm": ("toyclip", _plan("toyclip", 2, ("temporal", {"vision": (0,), "text": (1,)}),
                                    ("temporal", {"head": both}))),
        "spindle": ("toyvlm", _plan("toyvlm", 2, ("temporal", {"vision": both}),
                                    ("temporal", {"adapter": (0,), "text": (1,)}),
                                    ("temporal", {"llm": both}))),
        "mosaic-dp2-to-dp1": ("toyclip", _plan("toyclip", 2, ("free", {"vision": both, "text": both}),
                                               ("temporal", {"head": (1,)}))),
        "vlm-mismatch": ("toyvlm", _plan("toyvlm", 2, ("partition", {"vision": both, "text": (0,)}),
                                         ("temporal", {"adapter": (1,)}),
                                         ("cap", {"llm": (1, 0)}),
                                         shares={"vision": 0.5, "text": 0.4, "llm": 0.5})),
    }


def cases_4() -> dict[str, tuple[str, dict]]:
    every = (0, 1, 2, 3)
    return {
        "dp4-to-dp2": ("toyclip", _plan("toyclip", 4, ("free", {"vision": every, "text": (2, 3)}),
                                        ("temporal", {"head": (3, 1)}))),
        "dp4-dp3-dp2": ("toyvlm", _plan("toyvlm", 4, ("temporal", {"vision": every, "text": (3,)}),
                                        ("temporal", {"adapter": (0, 2, 3)}),
                                        ("temporal", {"llm": (1, 2)}))),
        "head-dp4": ("toyclip", _plan("toyclip", 4, ("temporal", {"vision": (0, 1), "text": (2, 3)}),
                                      ("temporal", {"head": every}))),
    }


def planner_cases(world: int) -> dict[str, tuple[str, dict]]:
    """The real planners' plans of the toy models, where the planners import."""
    try:
        from mosaic.hardware import make_cluster
        from mosaic.perf import make_perf_model
        from mosaic.planners import get_planner
    except ImportError:
        return {}
    cluster = make_cluster(world)
    out = {}
    for toy in ("toyclip", "toyvlm"):
        graph = ToyModel(toy).graph("tiny")
        for name in ("megatron", "distmm", "spindle", "mosaic"):
            plan = get_planner(name)(graph, cluster, make_perf_model("analytic", cluster))
            out[f"planner-{name}-{toy}"] = (toy, plan.to_dict())
    return out


ERROR_CASES = {
    "error-world-size": ("toyclip", _plan("toyclip", 4, ("temporal", {"vision": (0, 1, 2, 3), "text": (0,)}),
                                          ("temporal", {"head": (1,)}))),
    "error-invalid-plan": ("toyclip", _plan("toyclip", 2, ("temporal", {"vision": (0, 1)}),
                                            ("temporal", {"head": (0, 1)}))),
    "error-missing-plan-file": ("toyclip", None),  # read on rank 0, its error sent to all
}


def _worker(rank: int, world: int, ports: tuple[int, int], cases: dict, out_dir: str,
            device: str = "cpu", graphs: bool = False, grad_sync: str = "ddp",
            clip_grad_norm: float | None = None) -> None:
    """One process of `world`: trains every case, saves its modules (or its error)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if grad_sync == "overlapped":  # toy modules: many buckets, summed in the backward
        from mosaic.engine import bucket_reduce

        bucket_reduce.BUCKET_BYTES = 256
    for index, (name, (toy, plan)) in enumerate(cases.items()):
        if index == 1:  # the first case let the trainer start (and end) the group itself
            os.environ["MASTER_PORT"] = str(ports[1])
            if device == "cuda":
                torch.cuda.set_device(rank)
                dist.init_process_group("nccl", init_method="env://",
                                        device_id=torch.device("cuda", rank))
            else:
                dist.init_process_group("gloo", init_method="env://")
        where = Path(out_dir) / name
        where.mkdir(parents=True, exist_ok=True)
        source = {"plan": Plan.from_dict(plan)} if plan else {"plan_path": str(where / "none.json")}
        engine = EngineConfig(graphs=graphs, amp=False, grad_sync=grad_sync)
        config = TrainConfig(device=device, model=toy, steps=STEPS, warmup_steps=int(graphs),
                             lr=LR, optimizer="sgd", engine=engine, clip_grad_norm=clip_grad_norm,
                             metrics_path=str(where / "metrics.jsonl"), **source)
        model = ToyModel(toy)
        try:
            result = train(config, model=model)
        except ValueError as exc:
            (where / f"rank{rank}.json").write_text(json.dumps({"error": str(exc)}))
            continue
        save_file(state_of(result.modules), str(where / f"rank{rank}.safetensors"))
        (where / f"rank{rank}-rows.json").write_text(json.dumps(model.requested))
    end_distributed(Dist(rank=rank, world_size=world, device=torch.device(device),
                         owns_group=True))


def _free_ports() -> tuple[int, int]:
    socks = [socket.socket() for _ in range(2)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = tuple(s.getsockname()[1] for s in socks)
    for s in socks:
        s.close()
    return ports


def run_workers(world: int, cases: dict, tmp_path: Path, device: str = "cpu",
                graphs: bool = False, grad_sync: str = "ddp",
                clip_grad_norm: float | None = None) -> None:
    start_workers(_worker, (world, _free_ports(), cases, str(tmp_path), device, graphs, grad_sync,
                            clip_grad_norm), nprocs=world, device=device)


def check_case(tmp_path: Path, name: str, toy: str, plan: dict, world: int,
               reference: dict[str, torch.Tensor], **tolerance: float) -> None:
    placed = {p["module"]: p["gpus"] for s in plan["stages"] for p in s["placements"]}
    for rank in range(world):
        state = load_file(str(tmp_path / name / f"rank{rank}.safetensors"))
        assert {k.split(".")[0] for k in state} == {m for m, g in placed.items() if rank in g}
        assert_state_close(state, reference, **tolerance)
    rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == STEPS  # written by rank 0 only


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {toy: reference_state(ToyModel(toy), "tiny", STEPS, LR) for toy in ("toyclip", "toyvlm")}


def test_two_processes_equal_one(tmp_path, references):
    cases = {**cases_2(), **planner_cases(2), **ERROR_CASES}
    run_workers(2, cases, tmp_path)
    for name, (toy, plan) in cases.items():
        if name.startswith("error-"):
            continue
        check_case(tmp_path, name, toy, plan, 2, references[toy])
    for rank in range(2):  # each rank made only its own rows of each step's batch
        rows = json.loads((tmp_path / "megatron" / f"rank{rank}-rows.json").read_text())
        share = [6 * rank, 6 * rank + 6]
        assert rows == [{"step": s, "vision": share, "text": share, "head": [0, 12]}
                        for s in range(STEPS)]
    expected = {"error-world-size": "plan needs num_gpus=4 processes",
                "error-invalid-plan": "['text'] are not placed",
                "error-missing-plan-file": "cannot read plan file"}
    for name, text in expected.items():
        for rank in range(2):  # every rank fails, before any step: no metrics written
            assert text in json.loads((tmp_path / name / f"rank{rank}.json").read_text())["error"]
        assert not (tmp_path / name / "metrics.jsonl").exists()


@pytest.mark.parametrize("grad_sync", ["bucketed", "flat", "overlapped"])
def test_two_processes_with_hand_written_all_reduce_equal_one(tmp_path, references, grad_sync):
    """The bucketed all-reduce (kept to measure DDP against), the flat gradient buffers, and
    those buffers summed bucket by bucket during the backward (256-byte buckets here, so
    every toy module has several) train every 2-process plan as one process does."""
    cases = cases_2()
    run_workers(2, cases, tmp_path, grad_sync=grad_sync)
    for name, (toy, plan) in cases.items():
        check_case(tmp_path, name, toy, plan, 2, references[toy])


@pytest.mark.parametrize("grad_sync", ["ddp", "flat"])
def test_two_processes_clip_the_global_norm_as_one_does(tmp_path, grad_sync):
    """--clip-grad-norm over 2 processes: each module's gradients counted once in the global
    norm (data-parallel replicas hold copies; a module on one rank only there), so every plan
    trains as one process clipping all its parameters does, and every rank logs that norm."""
    clip = 0.05
    norms = {toy: [] for toy in ("toyclip", "toyvlm")}
    want = {toy: reference_state(ToyModel(toy), "tiny", STEPS, LR, clip_grad_norm=clip,
                                 norms=norms[toy]) for toy in norms}
    assert min(min(n) for n in norms.values()) > clip  # it clips at every step
    cases = cases_2()
    run_workers(2, cases, tmp_path, grad_sync=grad_sync, clip_grad_norm=clip)
    for name, (toy, plan) in cases.items():
        check_case(tmp_path, name, toy, plan, 2, want[toy])
        rows = [json.loads(r) for r in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["grad_norm"] for r in rows] == pytest.approx(norms[toy], rel=1e-4), name


def test_four_processes_equal_one(tmp_path, references):
    cases = {**cases_4(), **{k: v for k, v in planner_cases(4).items() if "toyvlm" in k}}
    run_workers(4, cases, tmp_path)
    for name, (toy, plan) in cases.items():
        check_case(tmp_path, name, toy, plan, 4, references[toy])


def test_flat_gradients_accumulate_in_place_and_repair_replaced_ones(monkeypatch):
    """After attach(), autograd adds into the buffer's views (no copy); a .grad replaced
    since (a new tensor, or None) is copied in before the one all-reduce per buffer."""
    from mosaic.engine import comm

    reduced = []
    monkeypatch.setattr(comm.dist, "all_reduce",
                        lambda t, group=None, async_op=False: reduced.append(t))
    layer = torch.nn.Linear(3, 2)
    flat = comm.FlatGrads(list(layer.parameters()))
    flat.attach()
    layer(torch.ones(4, 3)).sum().backward()
    assert layer.weight.grad.data_ptr() == flat.views[0].data_ptr()  # accumulated in place
    expected_weight = layer.weight.grad.clone()
    layer.bias.grad = torch.full((2,), 7.0)  # replaced, e.g. by a zero_grad(set_to_none) user
    flat.reduce(group=None, divide_by=2)
    assert len(reduced) == 1 and reduced[0].numel() == 8  # one buffer, every parameter
    assert torch.equal(layer.weight.grad, expected_weight / 2)
    assert torch.equal(layer.bias.grad, torch.full((2,), 3.5))
    assert layer.bias.grad.data_ptr() == flat.views[1].data_ptr()
    layer.weight.grad = None  # no gradient this step: zeros, as every replica must send
    flat.reduce(group=None)
    assert torch.equal(layer.weight.grad, torch.zeros(2, 3))


def test_flat_gradients_can_travel_in_bf16(monkeypatch):
    """reduce_dtype='bf16' under grad_sync='flat': the all-reduce sends a bf16 copy, and
    waiting for it writes the (bf16-rounded) sum back into the fp32 buffer."""
    from mosaic.engine import comm

    sent = []

    class Done:
        def wait(self):
            pass

    def fake_all_reduce(t, group=None, async_op=False):
        sent.append(t.dtype)
        t.mul_(2)  # two replicas with the same gradient
        return Done()

    monkeypatch.setattr(comm.dist, "all_reduce", fake_all_reduce)
    layer = torch.nn.Linear(3, 2)
    flat = comm.FlatGrads(list(layer.parameters()))
    flat.attach()
    layer(torch.ones(4, 3)).sum().backward()
    local = layer.weight.grad.clone()
    for work in flat.reduce(group=None, wire_dtype=torch.bfloat16):
        work.wait()
    assert sent == [torch.bfloat16] and layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, (local.to(torch.bfloat16) * 2).float())
