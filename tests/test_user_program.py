"""The user-program baseline (one autograd graph, DDP over the world) computes the reference.

Every test compares with `ZooModel.loss(modules, whole batch)` (or a toy model's equivalent)
backpropagated in one process: the loss shares must sum to its loss and every parameter's
gradient must equal its gradient, in one process and across two (gloo, torchrun).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from mosaic.engine import user_program
from mosaic.engine.user_program import UserProgram, UserProgramError
from mosaic.graph import MMGraph
from mosaic.zoo import get_model
from tests.helpers import failure_lines, spec
from tests.test_engine import Contrastive

CPU = torch.device("cpu")
DRIVER = Path(__file__).with_name("user_program_driver.py")


def reference(modules: dict[str, nn.Module], loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    """The one-process loss and every parameter's gradient (grads left cleared)."""
    loss = loss_fn()
    loss.backward()
    grads = {f"{m}.{n}": p.grad.clone() for m, mod in modules.items()
             for n, p in mod.named_parameters()}
    clear_grads(modules)
    return loss.item(), grads


def clear_grads(modules: dict[str, nn.Module]) -> None:
    for mod in modules.values():
        for p in mod.parameters():
            p.grad = None


def assert_grads(modules: dict[str, nn.Module], expected: dict[str, torch.Tensor],
                 rtol: float = 1e-5, atol: float = 1e-7) -> None:
    for m, mod in modules.items():
        for n, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, expected[f"{m}.{n}"], rtol=rtol, atol=atol,
                                       msg=lambda text, key=f"{m}.{n}": f"{key}: {text}")


def zoo(name: str):
    model = get_model(name)
    graph = model.graph("tiny")
    modules = model.build_modules("tiny")
    batch = model.make_inputs("tiny", graph.global_batch, torch.Generator().manual_seed(0))
    return model, graph, modules, batch


# --- a toy model (fast to compile): two encoders and a contrastive head ---------------------------
class Encoder(nn.Module):
    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_dim, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def toy(batch: int = 8):
    graph = MMGraph(name="toy", modules=(spec("vision"), spec("text"), spec("head", kind="head")),
                    edges=(("vision", "head"), ("text", "head")), global_batch=batch)
    torch.manual_seed(0)
    modules = {"vision": Encoder(12), "text": Encoder(6), "head": Contrastive()}
    data = {"vision": (torch.randn(batch, 12),), "text": (torch.randn(batch, 6),), "head": ()}
    return graph, modules, data


def toy_loss(modules, data) -> torch.Tensor:
    return modules["head"](modules["vision"](*data["vision"]), modules["text"](*data["text"]))


# --- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["clip", "ofasys"])
def test_one_process_equals_reference(name):
    model, graph, modules, batch = zoo(name)
    ref_loss, ref_grads = reference(modules, lambda: model.loss(modules, batch))
    before = {id(p) for mod in modules.values() for p in mod.parameters()}
    program = UserProgram(graph=graph, modules=modules, compile_mode=None, device=CPU)
    assert not program.amp  # bf16 autocast is for CUDA only, unless asked
    loss = program.step(program.local_batch(batch))
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    assert_grads(modules, ref_grads)
    # The shared modules themselves are trained: no copies, every parameter once.
    assert {id(p) for p in program.parameters()} == before
    assert len(program.parameters()) == len(before)
    assert all(program.program.graph_modules[m] is modules[m] for m in graph.names)
    assert program.compile_seconds == 0.0


def test_compile_fn_is_called_per_module_and_leaves_modules_alone():
    graph, modules, data = toy()
    ref_loss, ref_grads = reference(modules, lambda: toy_loss(modules, data))
    calls = []

    def fake_compile(name: str, module: nn.Module, mode: str):
        calls.append((name, module, mode))
        return lambda *args: module(*args)

    program = UserProgram(graph=graph, modules=modules, compile_mode="reduce-overhead",
                          device=CPU, compile_fn=fake_compile)
    assert [(n, mode) for n, _, mode in calls] == [(m, "reduce-overhead") for m in graph.names]
    assert all(module is modules[n] for n, module, _ in calls)
    for _ in range(3):  # steps 1-2 count as compiling in a CUDA-graph mode, 3 is the steady one
        clear_grads(modules)
        loss = program.step(program.local_batch(data))
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    assert_grads(modules, ref_grads)
    assert program.compile_seconds >= 0.0
    assert all("forward" not in vars(mod) for mod in modules.values())  # not wrapped in place


@pytest.mark.slow
@pytest.mark.xdist_group("inductor")  # see tests/test_compile.py
def test_torch_compile_default_on_cpu_equals_eager():
    """Inductor on CPU (gcc): about 25 s on a cold cache for the toy model."""
    graph, modules, data = toy()
    ref_loss, ref_grads = reference(modules, lambda: toy_loss(modules, data))
    program = UserProgram(graph=graph, modules=modules, compile_mode="default", device=CPU)
    for _ in range(2):
        clear_grads(modules)
        loss = program.step(program.local_batch(data))
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
        assert_grads(modules, ref_grads, rtol=1e-4, atol=1e-6)
    assert program.compile_seconds > 0.0
    assert all(type(mod) in (Encoder, Contrastive) for mod in modules.values())


# --- errors: every one before the first step, naming the fix ---------------------------------------
class VectorSink(nn.Module):
    def forward(self, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (v * t).sum(-1)


def test_errors_name_the_fix(monkeypatch):
    graph, modules, data = toy()
    with pytest.raises(UserProgramError, match="pass every module"):
        UserProgram(graph=graph, modules={"vision": modules["vision"]}, compile_mode=None,
                    device=CPU)
    with pytest.raises(UserProgramError, match="use None"):
        UserProgram(graph=graph, modules=modules, compile_mode="fast", device=CPU)
    program = UserProgram(graph=graph, modules={**modules, "head": VectorSink()},
                          compile_mode=None, device=CPU)
    with pytest.raises(UserProgramError, match="scalar loss"):
        program.step(program.local_batch(data))
    two_sinks = MMGraph(name="toy", modules=(spec("vision"), spec("text")), edges=(),
                        global_batch=8)
    with pytest.raises(UserProgramError, match="exactly one"):
        UserProgram(graph=two_sinks, modules=modules, compile_mode=None, device=CPU)
    chain = MMGraph(name="toy", modules=(spec("vision"), spec("head"), spec("text")),
                    edges=(("vision", "head"), ("head", "text")), global_batch=8)
    with pytest.raises(UserProgramError, match="only the sink"):
        UserProgram(graph=chain, modules=modules, compile_mode=None, device=CPU)
    with pytest.raises(UserProgramError, match="torchrun --nproc-per-node"):
        UserProgram(graph=graph, modules=modules, compile_mode=None, device=CPU,
                    shard_states=True)
    with pytest.raises(UserProgramError, match="need the whole batch in one step"):
        UserProgram(graph=graph, modules=modules, compile_mode=None, device=CPU, accumulation=2)
    monkeypatch.setattr(user_program, "world", lambda: (0, 3))
    with pytest.raises(UserProgramError, match="multiple of 3"):
        UserProgram(graph=graph, modules=modules, compile_mode=None, device=CPU)
    monkeypatch.setattr(user_program, "world", lambda: (0, 2))
    with pytest.raises(UserProgramError, match="compile_mode='default'"):
        UserProgram(graph=graph, modules=modules, compile_mode="reduce-overhead", device=CPU,
                    shard_states=True)


# --- two processes (gloo) -------------------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """A contrastive head (clip: gathered batch) and a per-sample-mean LLM sink (qwen3-vl):
    loss shares sum to the one-process loss, and every rank's gradients equal the one-process
    gradients at scale 1 (module docstring). About 30 s: torchrun, imports, two models."""
    names = ["clip", "qwen3-vl"]
    run_driver(tmp_path, names)
    for name in names:
        check_ranks(tmp_path / name, *zoo_light(name))


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode", [None, "default"], ids=["eager", "compiled"])
def test_two_processes_sharding_with_fsdp2_equal_one(tmp_path, compile_mode):
    """The FSDP2 program (shard_states=True): each module's layers, the module and the whole
    program sharded over both ranks, gradients averaged as DDP's, the contrastive head's
    temperature (a scalar FSDP2 leaves whole) averaged by hand. Compiled: clip alone, whose
    Inductor compile runs ~30 s on two CPU cores."""
    names = ["clip", "qwen3-vl"] if compile_mode is None else ["clip"]
    flags = ["--shard-states"] + ([] if compile_mode is None else ["--compile", compile_mode])
    run_driver(tmp_path, names, flags)
    for name in names:
        check_ranks(tmp_path / name, *zoo_light(name))
        compiled = load_file(str(tmp_path / name / "rank0.safetensors"))["compile_seconds"]
        assert (compiled.item() > 0) == (compile_mode is not None)


@pytest.mark.slow
def test_four_processes_hybrid_sharding_two_copies_equal_one(tmp_path):
    """HSDP as torchtitan runs it across nodes: four processes, two copies of the states
    sharded over two processes each (the mesh copies x 2), the copies' gradients all-reduced."""
    run_driver(tmp_path, ["qwen3-vl"], ["--shard-states", "--shard-degree", "2"], ranks=4)
    states = check_ranks(tmp_path / "qwen3-vl", *zoo_light("qwen3-vl"), ranks=4)
    assert all(s["mesh_dims"].item() == 2 for s in states)


def test_the_fsdp2_program_keeps_a_copy_a_node_where_the_world_spans_nodes(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert user_program.node_shard_degree(16) == 8
    assert user_program.node_shard_degree(8) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert user_program.node_shard_degree(8) == 0  # uneven nodes: shard over the world
    with pytest.raises(UserProgramError, match="shard_degree=3 must be >= 2 and divide the 8"):
        user_program.program_mesh("cpu", 8, 3)


@pytest.mark.slow
def test_ddp_on_gloo_keeps_fp32_sums_when_bf16_is_asked(tmp_path):
    """reduce_dtype=bf16: torch's bf16 hook needs NCCL, so on gloo DDP says so and sums in
    fp32, exactly (over NCCL: tests/gpu/test_sharding_gpu.py)."""
    run_driver(tmp_path, ["clip"], ["--reduce-dtype", "bf16"])
    check_ranks(tmp_path / "clip", *zoo_light("clip"))


def test_the_fsdp2_program_shards_layers_then_modules_then_itself_in_the_precisions_asked(
        monkeypatch):
    """torchtitan's order of units (each module's layers, the module, then the program as the
    root), each with the weights' and gradients' dtypes asked for; the bf16 reduce-scatters
    themselves run in the NCCL GPU test (tests/gpu/test_sharding_gpu.py)."""
    from mosaic.engine import fsdp

    model, graph, modules, _ = zoo("clip")
    units = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda unit, *, mesh, mp_policy, ignored_params: (
        units.append((unit, mp_policy.param_dtype, mp_policy.reduce_dtype, ignored_params))))
    monkeypatch.setattr(user_program, "world", lambda: (0, 2))
    monkeypatch.setattr(user_program.DeviceMesh, "from_group", lambda group, device_type: None)
    program = UserProgram(graph=graph, modules=modules, compile_mode=None, device=CPU, amp=True,
                          shard_states=True, reduce_dtype=torch.bfloat16)
    expected = [u for m in graph.names for u in (*fsdp.layer_units(modules[m]), modules[m])]
    assert [u for u, *_ in units] == [*expected, program.program]
    assert len(expected) > len(graph.names)  # the transformers' layers are units of their own
    assert {(weights, grads) for _, weights, grads, _ in units} == {(torch.bfloat16, torch.bfloat16)}
    temperature = modules["align"].logit_scale
    assert program.whole_params == [temperature] and all(temperature in i for *_, i in units)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_processes_accumulating_micro_batches_equal_one(tmp_path, sharding):
    """accumulation=2: each rank's 4 samples as two micro-steps of 2, each loss halved, the
    gradients synchronised on the second only (DDP's no_sync, FSDP2's setting): the same loss
    and gradients as one process over the whole batch (a per-sample-mean LLM sink)."""
    flags = ["--accumulation", "2"] + (["--shard-states"] if sharding == "fsdp" else [])
    run_driver(tmp_path, ["qwen3-vl"], flags)
    check_ranks(tmp_path / "qwen3-vl", *zoo_light("qwen3-vl"))


def run_driver(out: Path, names: list[str], flags: list[str] | None = None,
               ranks: int = 2) -> None:
    paths = [str(DRIVER.parents[1] / "src"), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), str(DRIVER), *(flags or []), str(out), *names]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, failure_lines(result.stderr)


def check_ranks(where: Path, model, modules: dict[str, nn.Module], batch,
                ranks: int = 2) -> list[dict[str, torch.Tensor]]:
    """Every rank's gradients are the one-process gradients, the losses sum to its loss;
    returns what the ranks saved."""
    ref_loss, ref_grads = reference(modules, lambda: model.loss(modules, batch))
    states = [load_file(str(where / f"rank{r}.safetensors")) for r in range(ranks)]
    for step in range(2):
        total = sum(s[f"loss.{step}"].item() for s in states)
        assert total == pytest.approx(ref_loss, rel=1e-5), (model.name, step)
    for state in states:
        for key, expected in ref_grads.items():
            torch.testing.assert_close(state[f"grad.{key}"], expected, rtol=1e-4, atol=1e-6,
                                       msg=lambda text, k=key: f"{model.name} {k}: {text}")
    return states


def zoo_light(name: str):
    """`zoo` without counting the graph's costs (the reference needs only modules and data)."""
    model = get_model(name)
    modules = model.build_modules("tiny")
    batch = model.make_inputs("tiny", model.preset("tiny").global_batch,
                              torch.Generator().manual_seed(0))
    return model, modules, batch
