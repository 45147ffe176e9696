"""Tensor parallelism across processes (gloo): a TP placement of the qwen3-vl `tiny` LLM trains
exactly like one process on the global batch (same losses, same weights after SGD steps).

Two processes: the LLM on (0, 1) with tensor_parallel=2 (one replica, split in two), the
encoders data-parallel on both; four processes: the LLM on (0, 1, 2, 3) with tensor_parallel=2
(2 replicas x 2 shards), encoders on other GPU sets, so that activations travel from
data-parallel producers to every GPU of each TP group and their gradients come back once.
A case of two plans trains the first for STEPS - 1 steps with a checkpoint, then resumes it
under the second: a TP checkpoint loads under plain data parallelism.
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
from torch.distributed.tensor import DTensor

from mosaic.engine.checkpoint import CheckpointConfig
from mosaic.engine.session import Dist, EngineConfig, build_modules, end_distributed, make_batch
from mosaic.engine.tensor_parallel import full_tensor, local_tensor
from mosaic.engine.trainer import OPTIMIZERS, TrainConfig, train
from mosaic.plan import Placement, Plan, Stage
from mosaic.zoo import get_model
from tests.helpers import start_workers

# One xdist worker runs every start_workers test (tests/helpers.py), in turn: one forkserver,
# and never two multi-process runs at once on the 2 cores of CI.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("start_workers")]

MODEL, PRESET, STEPS, LR = "qwen3-vl", "tiny", 3, 0.5
"""SGD with a large rate, so that a wrong gradient (scale, shard, route) shows in the weights."""


def _plan(num_gpus: int, where: dict[str, tuple[int, ...]], llm: tuple[int, ...],
          tensor_parallel: int) -> dict:
    first = Stage(sharing="temporal", placements=tuple(
        Placement(module=m, gpus=g) for m, g in where.items()))
    last = Stage(placements=(Placement(module="llm", gpus=llm, tensor_parallel=tensor_parallel),))
    return Plan(model=MODEL, planner="manual", num_gpus=num_gpus, stages=(first, last)).to_dict()


CASES = {
    2: {"tp2": [_plan(2, {"vision": (0, 1), "text": (1, 0)}, (0, 1), 2)],
        "tp2-resumed-as-dp2": [_plan(2, {"vision": (0,), "text": (1,)}, (1, 0), 2),
                               _plan(2, {"vision": (0, 1), "text": (1,)}, (0, 1), 1)]},
    4: {"tp2-dp2": [_plan(4, {"vision": (0, 1, 2, 3), "text": (3,)}, (0, 1, 2, 3), 2)],
        "tp2-dp2-reversed": [_plan(4, {"vision": (2, 3), "text": (0, 1)}, (2, 3, 0, 1), 2)]},
}


def _worker(rank: int, world: int, port: int, cases: dict, out_dir: str,
            device: str = "cpu", clip_grad_norm: float | None = None,
            compile_scope: str | None = None) -> None:
    """`compile_scope`: compile every module (Inductor, default mode) by that scope."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="env://")
    for name, plans in cases.items():
        where = Path(out_dir) / name
        where.mkdir(parents=True, exist_ok=True)
        for part, plan in enumerate(plans):
            last = part == len(plans) - 1
            config = TrainConfig(device=device, model=MODEL, preset=PRESET, lr=LR,
                                 steps=STEPS if last else STEPS - 1, resume=part > 0,
                                 checkpoint=CheckpointConfig(directory=str(where / "ck")),
                                 optimizer="sgd", plan=Plan.from_dict(plan), warmup_steps=0,
                                 engine=EngineConfig(amp=False, compile=compile_scope and "default",
                                                     compile_scope=compile_scope or "module"),
                                 progress=False,
                                 metrics_path=str(where / f"metrics{part}.jsonl"),
                                 clip_grad_norm=clip_grad_norm)
            result = train(config)
        # full_tensor gathers a TP shard: a collective, in state_dict order on every rank.
        state = {f"{m}.{k}": full_tensor(v).detach().cpu().contiguous()
                 for m, module in sorted(result.modules.items())
                 for k, v in module.state_dict().items()}
        save_file(state, str(where / f"rank{rank}.safetensors"))
        q_proj = result.modules["llm"].backbone.layers[0].self_attn.q_proj.weight
        (where / f"rank{rank}.json").write_text(json.dumps(
            {"sharded": isinstance(q_proj, DTensor), "local_rows": local_tensor(q_proj).shape[0]}))
        (where / f"compile{rank}.json").write_text(json.dumps(result.summary["compile"]))
    end_distributed(Dist(rank=rank, world_size=world, device=torch.device(device),
                         owns_group=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(clip_grad_norm: float | None = None,
              norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole model and the global batch: losses per step and final weights
    (with `clip_grad_norm`, torch's clip_grad_norm_ before each update, its norms in `norms`)."""
    model = get_model(MODEL)
    graph = model.graph(PRESET)
    modules = build_modules(model, PRESET, graph.names, seed=0)
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = OPTIMIZERS["sgd"](params, lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model.loss(modules, make_batch(model, PRESET, graph.global_batch, 0, step))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)))
        optimizer.step()
        losses.append(loss.item())
    state = {f"{m}.{k}": v.detach().clone() for m, mod in modules.items()
             for k, v in mod.state_dict().items()}
    return losses, state


@pytest.fixture(scope="module")
def expected() -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference()


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_trains_like_one_process(tmp_path, expected, world):
    check_against_one_process(tmp_path, expected, world, "cpu", rel=1e-5, rtol=1e-4, atol=1e-5)


def test_tensor_parallel_compiled_by_blocks_trains_like_one_process(tmp_path, expected):
    """Inductor (on the CPU) over the TP shards: each decoder layer compiled after
    `parallelize_module` made its weights DTensors, as torchtitan compiles after TP."""
    check_against_one_process(tmp_path, expected, 2, "cpu", rel=1e-5, rtol=1e-4, atol=1e-5,
                              cases={"tp2": CASES[2]["tp2"]}, compile_scope="blocks")
    for rank in range(2):
        report = json.loads((tmp_path / "tp2" / f"compile{rank}.json").read_text())
        assert report["compiled"]["llm"]["blocks"] > 1 and not report["eager"], report
        assert "llm" in report["compile_s"], report  # the compiled view ran


CLIP = 0.5
"""Below the tiny LLM's gradient norm at each of the STEPS (asserted): clipping acts."""


def test_tensor_parallel_clips_the_global_norm_like_one_process(tmp_path):
    """--clip-grad-norm over a TP group: each shard of a split weight counts once in the
    global norm, the weights every GPU of the group holds whole (norms, adapters) once over
    their copies, so the plan clips as one process does, norms included."""
    norms: list[float] = []
    expected = reference(CLIP, norms)
    assert min(norms) > CLIP
    check_against_one_process(tmp_path, expected, 2, "cpu", rel=1e-5, rtol=1e-4, atol=1e-5,
                              cases={"tp2": CASES[2]["tp2"]}, clip_grad_norm=CLIP, norms=norms)


def check_against_one_process(tmp_path: Path, expected, world: int, device: str, *,
                              rel: float, rtol: float, atol: float, cases: dict | None = None,
                              clip_grad_norm: float | None = None,
                              norms: list[float] | None = None,
                              compile_scope: str | None = None) -> None:
    """Train every case of CASES[world] (or `cases`) on `world` processes; losses and weights
    (and with `clip_grad_norm` the logged norms) must match one process on the CPU."""
    cases = cases or CASES[world]
    start_workers(_worker, (world, _free_port(), cases, str(tmp_path), device, clip_grad_norm,
                            compile_scope), nprocs=world, device=device)
    losses, state = expected
    for name, plans in cases.items():
        rows = [json.loads(r) for part in range(len(plans))
                for r in (tmp_path / name / f"metrics{part}.jsonl").read_text().splitlines()]
        assert [r["loss"] for r in rows] == pytest.approx(losses, rel=rel)
        if clip_grad_norm is not None:
            assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)
        placed = {p["module"]: p["gpus"] for s in plans[-1]["stages"] for p in s["placements"]}
        for rank in range(world):
            shard = json.loads((tmp_path / name / f"rank{rank}.json").read_text())
            full_rows = state["llm.backbone.layers.0.self_attn.q_proj.weight"].shape[0]
            t = plans[-1]["stages"][-1]["placements"][0]["tensor_parallel"]
            assert shard == {"sharded": t > 1, "local_rows": full_rows // t}  # really split
            got = load_file(str(tmp_path / name / f"rank{rank}.safetensors"))
            assert {k.split(".")[0] for k in got} == {m for m, g in placed.items() if rank in g}
            for key, value in got.items():
                torch.testing.assert_close(value, state[key], rtol=rtol, atol=atol,
                                           msg=lambda m, k=f"{name} rank {rank} {key}": f"{k}: {m}")
