"""Checkpoint and resume (mosaic.engine.checkpoint).

- A resumed run continues the exact loss curve: train N steps with a checkpoint at K, load it
  into freshly built (differently seeded) modules and optimizer, train K..N, compare losses,
  weights and optimizer state bitwise (float32, CPU, deterministic algorithms).
- Resharding: 2 gloo processes save with every module replicated on both ranks, then load
  under other plans (modules split over the ranks; all on one rank, the other holding none;
  one process). The loaded tensors equal the saved ones bitwise.
- Atomicity: a save that fails or is killed mid-way leaves `latest` on the previous step.
- Errors: a missing, empty, incomplete or corrupt checkpoint raises CheckpointError naming
  the path and the fix; a hostile DCP index is refused, not unpickled.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import mosaic.engine.checkpoint as ck
from mosaic.engine.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    checkpoint_info,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from mosaic.engine.comm import PlanComm
from mosaic.engine.runner import PlanRunner
from mosaic.engine.session import host_all_reduce
from mosaic.engine.trainer import build_modules, make_batch, make_optimizer
from mosaic.plan import Placement, Plan, Stage
from tests.helpers import start_workers
from tests.test_engine import ToyModel, one_gpu_plans

STEPS, SAVE_AT, LR = 6, 3, 0.05
"""A large rate, so that any state not restored shows in the next losses."""


@pytest.fixture(autouse=True)
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


# --- helpers: one rank's share of a plan, trained with the engine ---------------------------
def make_job(model, plan: Plan, optimizer: str = "adamw", seed: int = 0):
    """This rank's runner and optimizer (None when the plan gives it no module)."""
    comm = PlanComm.create(plan)
    local = [p.module for s in plan.stages for p in s.placements if comm.rank in p.gpus]
    modules = build_modules(model, "tiny", local, seed)
    runner = PlanRunner(plan=plan, graph=model.graph("tiny"), modules=modules, comm=comm)
    params = runner.parameters()
    return runner, (make_optimizer(optimizer, params, LR) if params else None)


def train_steps(model, runner: PlanRunner, optimizer, steps: range, after_step=None) -> list[float]:
    """Global loss of each step; `after_step(steps_done)` runs after each optimizer step."""
    losses = []
    for step in steps:
        data = runner.local_batch(make_batch(model, "tiny", runner.graph.global_batch, 0, step))
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        out = runner.step(data)
        if optimizer is not None:
            optimizer.step()
        losses.extend(host_all_reduce([out.loss.item()], "sum"))
        if after_step is not None:
            after_step(step + 1)
    return losses


def flat_state(modules: dict[str, nn.Module], optimizer) -> dict[str, torch.Tensor]:
    """Weights and optimizer tensors by FQN (DCP's flat keys), copied."""
    if not modules:
        return {}
    model, optim = get_state_dict(nn.ModuleDict(modules), optimizer or [],
                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    both = {**{f"model.{k}": v for k, v in model.items()},
            **{f"optim.{k}": v for k, v in optim.items()}}
    return {k: v.detach().clone() for k, v in both.items() if isinstance(v, torch.Tensor)}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got, "nothing to compare"
    for key, value in got.items():
        assert torch.equal(value, want[key]), key


def get_model(name: str):
    if name.startswith("toy"):
        return ToyModel(name)
    zoo = pytest.importorskip("mosaic.zoo")
    return zoo.get_model(name)


def _plan(model: str, num_gpus: int, *stages: dict[str, tuple[int, ...]]) -> Plan:
    return Plan(model=model, planner="manual", num_gpus=num_gpus, stages=tuple(
        Stage(placements=tuple(Placement(module=m, gpus=g) for m, g in s.items())) for s in stages))


# --- one process: exact resume --------------------------------------------------------------
@pytest.mark.parametrize("name,optimizer",
                         [("toyvlm", "adamw"), ("toyvlm", "sgd"), ("clip", "adamw")])
def test_resume_continues_the_exact_loss_curve(tmp_path, name, optimizer):
    model = get_model(name)
    plan = one_gpu_plans(model.graph("tiny"))["free"]
    runner, opt = make_job(model, plan, optimizer)
    torch.manual_seed(7)  # after the build: zoo and toy builds seed the global RNG
    saved = {}

    def checkpoint(done: int) -> None:
        if done == SAVE_AT:
            save_checkpoint(tmp_path, done, runner.modules, opt, plan=plan, extra={"lr": LR})
            saved["state"], saved["rand"] = flat_state(runner.modules, opt), torch.rand(4)

    losses = train_steps(model, runner, opt, range(STEPS), checkpoint)
    runner2, opt2 = make_job(model, plan, optimizer, seed=1)
    torch.manual_seed(8)  # another RNG state and other weights: the load must replace both
    step, plan_dict, extra = load_checkpoint(tmp_path, runner2.modules, opt2)
    assert (step, Plan.from_dict(plan_dict), extra) == (SAVE_AT, plan, {"lr": LR})
    assert torch.equal(torch.rand(4), saved["rand"])
    assert_bitwise(flat_state(runner2.modules, opt2), saved["state"])
    assert train_steps(model, runner2, opt2, range(SAVE_AT, STEPS)) == losses[SAVE_AT:]
    assert_bitwise(flat_state(runner2.modules, opt2), flat_state(runner.modules, opt))


def _as_fresh(opt: torch.optim.Optimizer) -> bool:
    """No optimizer state, or only the zeros AdamW starts from (MainWeightsAdamW makes its
    state up front, in the layout its captured step reads)."""
    return all(not torch.is_tensor(v) or not torch.count_nonzero(v)
               for state in opt.state.values() for v in state.values())


def test_save_before_the_first_step_changes_nothing(tmp_path):
    """DCP creates a fresh AdamW's state with a zero step (step=1); the save must undo it, and
    a resume from it must start from a fresh state, like the run that saved it."""
    model = ToyModel("toyclip")
    plan = one_gpu_plans(model.graph("tiny"))["temporal"]
    runner, opt = make_job(model, plan)
    save_checkpoint(tmp_path, 0, runner.modules, opt)
    assert _as_fresh(opt)
    losses = train_steps(model, runner, opt, range(3))
    untouched_runner, untouched_opt = make_job(model, plan)
    assert train_steps(model, untouched_runner, untouched_opt, range(3)) == losses
    resumed_runner, resumed_opt = make_job(model, plan, seed=1)
    assert load_checkpoint(tmp_path, resumed_runner.modules, resumed_opt).step == 0
    assert _as_fresh(resumed_opt)
    assert train_steps(model, resumed_runner, resumed_opt, range(3)) == losses


def test_weights_only_load_and_a_rank_without_modules(tmp_path):
    modules, opt = _linear_job()
    save_checkpoint(tmp_path / "a", 1, modules, opt)
    fresh = {"enc": nn.Linear(4, 3)}
    load_checkpoint(tmp_path / "a", fresh, None)
    assert torch.equal(fresh["enc"].weight, modules["enc"].weight)
    save_checkpoint(tmp_path / "b", 2, {}, None, extra={"idle": True})
    assert load_checkpoint(tmp_path / "b", {}, None) == (2, None, {"idle": True})


# --- several processes: save under one plan, load under others ------------------------------
REPLICATED = _plan("toyclip", 2, {"vision": (0, 1), "text": (0, 1)}, {"head": (0, 1)})
SPLIT = _plan("toyclip", 2, {"vision": (0,), "text": (1,)}, {"head": (1,)})
ONE_RANK = _plan("toyclip", 2, {"vision": (1,), "text": (1,)}, {"head": (1,)})  # rank 0 idle


def _worker(rank: int, world: int, out: str) -> None:
    """A: train REPLICATED, save at SAVE_AT. B: resume under REPLICATED. C: resume under SPLIT,
    save at STEPS. D: load C's checkpoint under ONE_RANK. E: a save failing on rank 1 only.
    Writes losses, states and errors to `out`; the test compares them."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    store = dist.FileStore(os.path.join(out, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    out_dir, model = Path(out), ToyModel("toyclip")
    first, second = out_dir / "first", out_dir / "second"

    def dump(tag: str, runner, opt, losses=None) -> None:
        save_file(flat_state(runner.modules, opt), str(out_dir / f"{tag}-rank{rank}.safetensors"))
        if losses is not None and rank == 0:
            (out_dir / f"{tag}-losses.json").write_text(json.dumps(losses))

    runner, opt = make_job(model, REPLICATED)
    torch.manual_seed(100 + rank)  # after the build, which seeds: a resume restores each rank's

    def checkpoint(done: int) -> None:
        if done == SAVE_AT:
            save_checkpoint(first, done, runner.modules, opt, plan=REPLICATED)
            dump("A-saved", runner, opt)
            save_file({"rand": torch.rand(4)}, str(out_dir / f"A-rand-rank{rank}.safetensors"))

    dump("A", runner, opt, train_steps(model, runner, opt, range(STEPS), checkpoint))
    runner, opt = make_job(model, REPLICATED, seed=1)
    torch.manual_seed(999)
    assert load_checkpoint(first, runner.modules, opt).step == SAVE_AT
    save_file({"rand": torch.rand(4)}, str(out_dir / f"B-rand-rank{rank}.safetensors"))
    dump("B", runner, opt, train_steps(model, runner, opt, range(SAVE_AT, STEPS)))
    runner, opt = make_job(model, SPLIT, seed=1)
    load_checkpoint(first, runner.modules, opt)
    dump("C-loaded", runner, opt)
    dump("C", runner, opt, train_steps(model, runner, opt, range(SAVE_AT, STEPS)))
    save_checkpoint(second, STEPS, runner.modules, opt, plan=SPLIT)
    runner, opt = make_job(model, ONE_RANK, seed=1)
    assert load_checkpoint(second, runner.modules, opt).step == STEPS
    dump("D-loaded", runner, opt)
    if rank == 1:  # E: one rank's disk is full: both ranks raise, neither waits for the other
        ck._write_json = _raise_oserror
    try:
        save_checkpoint(second, STEPS + 1, runner.modules, opt)
    except CheckpointError as exc:
        (out_dir / f"E-error-rank{rank}.txt").write_text(str(exc))
    dist.destroy_process_group()


def _states(out: Path, tag: str, world: int = 2) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"{tag}-rank{r}.safetensors")) for r in range(world)]


def _modules_in(state: dict[str, torch.Tensor]) -> set[str]:
    return {k.split(".")[1] for k in state if k.startswith("model.")}


def _union(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: v for state in states for k, v in state.items()}


@pytest.mark.slow
@pytest.mark.xdist_group("start_workers")  # see tests/test_engine_dist.py
def test_two_processes_save_and_load_under_other_plans(tmp_path):
    start_workers(_worker, (2, str(tmp_path)), nprocs=2)
    losses = {tag: json.loads((tmp_path / f"{tag}-losses.json").read_text()) for tag in "ABC"}
    saved = _union(_states(tmp_path, "A-saved"))
    # Same plan: exact, rank by rank, RNG included (and the ranks' RNG streams differ).
    assert losses["B"] == losses["A"][SAVE_AT:]
    for a, b in zip(_states(tmp_path, "A"), _states(tmp_path, "B"), strict=True):
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
    rands = [[load_file(str(tmp_path / f"{t}-rand-rank{r}.safetensors"))["rand"] for r in (0, 1)]
             for t in "AB"]
    assert all(torch.equal(a, b) for a, b in zip(*rands, strict=True))
    assert not torch.equal(*rands[0])
    # Other plans: every module where the plan puts it, bitwise what was saved.
    split = _states(tmp_path, "C-loaded")
    assert _modules_in(split[0]) == {"vision"} and _modules_in(split[1]) == {"text", "head"}
    assert_bitwise(_union(split), saved)
    torch.testing.assert_close(losses["C"], losses["A"][SAVE_AT:], rtol=1e-5, atol=1e-6)
    idle, holder = _states(tmp_path, "D-loaded")
    assert not idle and _modules_in(holder) == {"vision", "text", "head"}
    assert_bitwise(holder, _union(_states(tmp_path, "C")))
    errors = [(tmp_path / f"E-error-rank{r}.txt").read_text() for r in (0, 1)]
    assert "failed on rank(s) [1]" in errors[0] and "No space left" in errors[1]
    assert latest_checkpoint(tmp_path / "second") == tmp_path / "second" / "step-000006"
    # One process, no process group: the 2-rank checkpoint, all modules here.
    model = ToyModel("toyclip")
    runner, opt = make_job(model, one_gpu_plans(model.graph("tiny"))["temporal"], seed=1)
    with pytest.warns(UserWarning, match="saved by 2 process"):
        assert load_checkpoint(tmp_path / "first", runner.modules, opt).step == SAVE_AT
    assert_bitwise(flat_state(runner.modules, opt), saved)
    resumed = train_steps(model, runner, opt, range(SAVE_AT, STEPS))
    torch.testing.assert_close(resumed, losses["A"][SAVE_AT:], rtol=1e-5, atol=1e-6)


# --- atomicity --------------------------------------------------------------------------------
def _linear_job(seed: int = 0):
    torch.manual_seed(seed)
    modules = {"enc": nn.Linear(4, 3)}
    return modules, torch.optim.AdamW(modules["enc"].parameters(), lr=0.1)


def _step(modules, opt) -> None:
    opt.zero_grad()
    modules["enc"](torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()


def _raise_oserror(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("where", ["dcp-finish", "_rename_into_place", "_point_latest"])
def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, where):
    """Fails writing DCP's index, after every file but before the rename, or after the
    rename but before `latest` moves: step 1 stays the checkpoint to resume from."""
    modules, opt = _linear_job()
    _step(modules, opt)
    save_checkpoint(tmp_path, 1, modules, opt)
    want = flat_state(modules, opt)
    _step(modules, opt)
    with monkeypatch.context() as patch:
        if where == "dcp-finish":
            patch.setattr(FileSystemWriter, "finish", _raise_oserror)
        else:
            patch.setattr(ck, where, _raise_oserror)
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_checkpoint(tmp_path, 2, modules, opt)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    fresh, fresh_opt = _linear_job(seed=1)
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 1
    assert_bitwise(flat_state(fresh, fresh_opt), want)
    save_checkpoint(tmp_path, 3, modules, opt, keep_last=1)  # cleans the crashed save up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000003"]


def _save_and_die(root: Path, where: str, modules, opt) -> None:
    setattr(ck, where, lambda *args, **kwargs: os._exit(3))  # no clean-up, like a kill
    save_checkpoint(root, 2, modules, opt)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["_write_json", "_rename_into_place", "_point_latest"])
def test_killed_save_leaves_the_previous_checkpoint(tmp_path, where):
    """A forked process dies writing its files, before the rename, or before `latest` moves."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs fork (a child with the parent's modules, no re-import)")
    modules, opt = _linear_job()
    _step(modules, opt)
    save_checkpoint(tmp_path, 1, modules, opt)
    want = flat_state(modules, opt)
    _step(modules, opt)
    child = multiprocessing.get_context("fork").Process(
        target=_save_and_die, args=(tmp_path, where, modules, opt))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 3
    if where == "_point_latest":  # complete and in place, but `latest` never moved to it
        assert (tmp_path / "step-000002" / "checkpoint.json").is_file()
    else:
        assert any(".tmp-" in p.name for p in tmp_path.iterdir())
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    fresh, fresh_opt = _linear_job(seed=1)
    assert load_checkpoint(tmp_path, fresh, fresh_opt).step == 1
    assert_bitwise(flat_state(fresh, fresh_opt), want)


def test_keep_last_and_the_latest_pointer(tmp_path):
    modules, opt = _linear_job()
    for step in range(1, 6):
        _step(modules, opt)
        save_checkpoint(tmp_path, step, modules, opt, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000005"]
    assert (tmp_path / "latest").read_text().strip() == "step-000005"
    (tmp_path / "latest").unlink()  # no pointer: the highest complete step
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000005"
    (tmp_path / "latest").write_text("step-000009\n")  # names a folder that is gone
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000005"
    save_checkpoint(tmp_path, 5, modules, opt, keep_last=None)  # a re-save replaces the step
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000005"
    assert checkpoint_info(tmp_path).step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000005"]


def test_checkpoint_config():
    config = CheckpointConfig(directory="runs/x", every_steps=10)
    assert [s for s in range(31) if config.due(s)] == [10, 20, 30]
    assert not CheckpointConfig(directory="runs/x").due(10)
    with pytest.raises(CheckpointError, match="every_steps=-1"):
        CheckpointConfig(directory="runs/x", every_steps=-1)
    with pytest.raises(CheckpointError, match="keep_last=0"):
        CheckpointConfig(directory="runs/x", keep_last=0)


# --- errors ---------------------------------------------------------------------------------
def _truncate(folder: Path) -> None:
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])


def _zero_shard(folder: Path) -> None:
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(bytes(shard.stat().st_size))


def _hostile_index(folder: Path) -> None:
    """A `.metadata` that would run a shell command if unpickled; sizes updated to match."""

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {folder / 'pwned'}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    record = json.loads((folder / "checkpoint.json").read_text())
    record["files"][".metadata"] = (folder / ".metadata").stat().st_size
    (folder / "checkpoint.json").write_text(json.dumps(record))


CORRUPTIONS = {
    "truncated-shard": (_truncate, "missing or truncated"),
    "no-index": (lambda f: (f / ".metadata").unlink(), r"\.metadata is missing or truncated"),
    "no-rank-file": (lambda f: (f / "rank-00000.json").unlink(), "rank-00000.json is missing"),
    "bad-record": (lambda f: (f / "checkpoint.json").write_text("{"), "unreadable or malformed"),
    "garbage-shard": (_zero_shard, "corrupt"),
    "hostile-index": (_hostile_index, "not part of a DCP index"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_raises_a_clear_error(tmp_path, name):
    corrupt, message = CORRUPTIONS[name]
    modules, opt = _linear_job()
    _step(modules, opt)
    folder = save_checkpoint(tmp_path, 1, modules, opt)
    corrupt(folder)
    fresh, fresh_opt = _linear_job(seed=1)
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path, fresh, fresh_opt)
    assert str(folder) in str(info.value) and "delete" in str(info.value)
    assert not (folder / "pwned").exists()


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_resume_passes_over_a_corrupt_latest_checkpoint_to_the_one_before(tmp_path, name):
    """A checkpoint spoiled after it was published (a shard truncated or zeroed, its index or
    record broken): resuming takes the newest one that loads, and says which it passed over."""
    corrupt, _ = CORRUPTIONS[name]
    modules, opt = _linear_job()
    _step(modules, opt)
    save_checkpoint(tmp_path, 1, modules, opt)
    at_step_1 = flat_state(modules, opt)
    _step(modules, opt)
    corrupt(save_checkpoint(tmp_path, 2, modules, opt))
    fresh, fresh_opt = _linear_job(seed=1)
    (step, _, _), passed_over = ck.load_newest_loadable(tmp_path, fresh, fresh_opt)
    assert step == 1 and len(passed_over) == 1 and "step-000002" in passed_over[0]
    assert_bitwise(flat_state(fresh, fresh_opt), at_step_1)
    (tmp_path / "step-000001" / "checkpoint.json").write_text("{")  # now none loads
    with pytest.raises(CheckpointError, match="step-000001"):
        ck.load_newest_loadable(tmp_path, *_linear_job(seed=2))


def test_resume_respects_latest_and_never_takes_a_newer_checkpoint(tmp_path):
    """`latest` rolled back by hand to step 1: step 2 is not a candidate."""
    modules, opt = _linear_job()
    for step in (1, 2):
        _step(modules, opt)
        save_checkpoint(tmp_path, step, modules, opt)
    (tmp_path / "latest").write_text("step-000001")
    fresh, fresh_opt = _linear_job(seed=1)
    (step, _, _), passed_over = ck.load_newest_loadable(tmp_path, fresh, fresh_opt)
    assert (step, passed_over) == (1, [])


def test_missing_or_empty_directory_raises_a_clear_error(tmp_path):
    modules, opt = _linear_job()
    with pytest.raises(CheckpointError, match="does not exist; drop --resume") as info:
        load_checkpoint(tmp_path / "nowhere", modules, opt)
    assert str(tmp_path / "nowhere") in str(info.value)
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path}.*drop --resume"):
        load_checkpoint(tmp_path, modules, opt)
    crashed = tmp_path / "step-000004.tmp-abcd"  # a save that never completed
    crashed.mkdir()
    (crashed / ".metadata").write_bytes(b"")
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path, modules, opt)
    with pytest.raises(CheckpointError, match="is incomplete"):
        load_checkpoint(crashed, modules, opt)


def test_loading_into_another_model_names_what_differs(tmp_path):
    modules, opt = _linear_job()
    _step(modules, opt)
    save_checkpoint(tmp_path, 1, modules, opt)
    bigger = {"enc": nn.Linear(4, 3), "dec": nn.Linear(3, 2)}
    with pytest.raises(CheckpointError, match=r"no weights .*\['dec'\].*holds modules \['enc'\]"):
        load_checkpoint(tmp_path, bigger, None)
    with pytest.raises(CheckpointError, match=r"enc.weight has shape \[3, 4\] there but \[3, 5\]"):
        load_checkpoint(tmp_path, {"enc": nn.Linear(5, 3)}, None)
    other = {"enc": nn.Linear(4, 3)}
    with pytest.raises(CheckpointError, match="another optimizer type"):
        load_checkpoint(tmp_path, other, torch.optim.SGD(other["enc"].parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="must be JSON"):
        save_checkpoint(tmp_path, 2, modules, opt, extra={"bad": object()})
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000001"
