"""Checkpoint and resume a plan's training: DCP shards, atomic publication, any plan on load.

    save_checkpoint(DIR, step, runner.modules, optimizer, plan=plan, extra={...})   # every rank
    step, plan_dict, extra = load_checkpoint(DIR, runner.modules, optimizer)      # every rank

Layout of DIR:

    step-000120/                 one checkpoint; 120 = optimizer steps done = next step's index
        .metadata, __R_0.distcp  torch.distributed.checkpoint (DCP): weights and optimizer tensors
        rank-00000.json          one per rank: its torch RNG states, optimizer hyperparameters
        checkpoint.json          written LAST, by rank 0: step, plan, extra, every file's size
    latest                       "step-000120": the checkpoint a resume takes
    step-000140.tmp-<token>/     a save in progress, or one that crashed: never read

Why FQN keys. Every tensor is keyed by its module-qualified name ("model.vision.fc1.weight",
"optim.state.vision.fc1.weight.exp_avg"), never by rank or by position in an optimizer, so a
checkpoint loads under another plan: modules on other ranks, another world size, one process.
Each rank writes what it holds; DCP writes a replicated tensor (a data-parallel module) once.
Every rank may read any file on load: on several hosts DIR must be on a shared filesystem.

Why nothing is pickled by us. DCP stores non-tensor values with torch.save and reads them back
with `torch.load(weights_only=False)`, which runs arbitrary code from the file. So only tensors
go to DCP; RNG states and hyperparameters (lr, betas, ...) go to JSON. DCP's own `.metadata`
index is a pickle we cannot avoid: it is read with an unpickler that admits DCP's metadata
classes only.

Atomicity. Ranks write into a fresh `.tmp-<token>` folder; once all have written, rank 0
writes checkpoint.json, renames the folder into place and replaces `latest` (write + os.replace).
Each is one atomic filesystem operation, so a crash anywhere leaves the previous checkpoint
complete and named by `latest`. Old checkpoints are deleted only after that.

Collectives. save_checkpoint and load_checkpoint are collective over the default process group
(when one is initialised): every rank calls them, with the same step or path, at the same point.
A failure on one rank is raised on every rank rather than leaving the others waiting.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pickle
import re
import secrets
import shutil
import threading
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mosaic.errors import MosaicError
from mosaic.plan import Plan

FORMAT_VERSION = 1
MARKER = "checkpoint.json"
"""Written last: a step folder without it is incomplete and never loaded."""
LATEST = "latest"
_METADATA = ".metadata"  # DCP's index file name
_STEP_DIR = re.compile(r"step-(\d+)")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Flat optimizer keys ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"): one optimizer per
rank over different modules per rank only reshards when every value is keyed by FQN."""


class CheckpointError(MosaicError):
    """A checkpoint that cannot be written or read; the message names the path and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where and how often a training loop checkpoints (`mosaic train --checkpoint-*`)."""

    directory: str
    every_steps: int = 0
    """Save after every this many optimizer steps; 0: never on a schedule."""
    keep_last: int | None = 3
    """Complete checkpoints kept (the newest by step); None keeps all."""
    background: bool = False
    """Write the tensors in a background thread (`begin_checkpoint`): the step waits only for
    their copy into host memory; the checkpoint counts once published, after every rank wrote.
    At most one in flight: the next save, and the end of training, wait for it."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise CheckpointError(f"every_steps={self.every_steps} must be >= 0 (0: off)")
        if self.keep_last is not None and self.keep_last < 1:
            raise CheckpointError(f"keep_last={self.keep_last} must be >= 1 (or None: keep all)")

    def due(self, steps_done: int) -> bool:
        """Whether to save after `steps_done` optimizer steps."""
        return self.every_steps > 0 and steps_done > 0 and steps_done % self.every_steps == 0


class Resumed(NamedTuple):
    """What load_checkpoint restored besides the tensors."""

    step: int
    """Optimizer steps done when saved: the index of the next step to run."""
    plan: dict[str, Any] | None
    """The saving run's plan (Plan.to_dict), or None."""
    extra: dict[str, Any]
    """The JSON object the saving run passed as `extra`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    """A complete checkpoint's record (checkpoint.json), read without loading any tensor."""

    path: Path
    step: int
    world_size: int
    plan: dict[str, Any] | None
    extra: dict[str, Any]
    files: dict[str, int]
    """File name -> size in bytes, as written."""


# --- public API ------------------------------------------------------------------------------
def save_checkpoint(directory: str | os.PathLike, step: int, modules: Mapping[str, nn.Module],
                    optimizer: torch.optim.Optimizer | None, *,
                    plan: Plan | Mapping[str, Any] | None = None,
                    extra: Mapping[str, Any] | None = None,
                    keep_last: int | None = 3) -> Path:
    """Save this rank's modules and optimizer as checkpoint `step` of `directory` and make it
    `latest`; collective. `extra` (rank 0's) must be JSON. Returns the checkpoint folder."""
    return begin_checkpoint(directory, step, modules, optimizer, plan=plan, extra=extra,
                            keep_last=keep_last, background=False).wait()


def begin_checkpoint(directory: str | os.PathLike, step: int, modules: Mapping[str, nn.Module],
                     optimizer: torch.optim.Optimizer | None, *,
                     plan: Plan | Mapping[str, Any] | None = None,
                     extra: Mapping[str, Any] | None = None, keep_last: int | None = 3,
                     background: bool = True, timeout_s: float | None = None
                     ) -> PendingCheckpoint:
    """`save_checkpoint`, with the tensors written in a background thread when `background`:
    returns once they are copied to host memory (training may then change them). Rank 0
    publishes the checkpoint as soon as DCP reports every rank's files written; `wait()` on
    every rank (collective) before the next checkpoint and at the end raises what failed.
    `timeout_s` bounds the background write's collectives (a dead rank), as --timeout-s does
    training's (None: torch's default)."""
    if step < 0:
        raise CheckpointError(f"step={step} must be >= 0 (optimizer steps done)")
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last} must be >= 1 (or None: keep all)")
    root, (rank, world) = Path(directory), _rank_world()
    name = _step_name(step)
    tmp = root / f"{name}.tmp-{_shared_token()}"
    record, tensors, failure = None, {}, None
    try:
        state = _state_to_save(modules, optimizer)
        tensors = state.tensors()
        if rank == 0:  # checked before any file is written: a bad `extra` costs nothing
            record = _record(step, world, plan, extra)
        tmp.mkdir(parents=True, exist_ok=True)
        _write_json(tmp / _rank_file(rank), {"rank": rank, "world_size": world,
                                             "rng": _rng_state(), "values": state.values()})
    except Exception as exc:  # the other ranks must hear of it, not wait in dcp.save
        failure = _as_checkpoint_error(exc, f"cannot write checkpoint files under {tmp}")
    _raise_if_any_failed(failure, f"saving {root / name}")
    pending = PendingCheckpoint(root=root, tmp=tmp, name=name, record=record,
                                keep_last=keep_last)
    pending.start(_dcp_async_save(tensors, tmp, timeout_s) if background
                  else _written(tensors, tmp))
    return pending


@dataclass(kw_only=True, slots=True)
class PendingCheckpoint:
    """A checkpoint whose tensors are being written. Rank 0 publishes it (marker, rename,
    `latest`, prune) from the writer's completion, so a checkpoint counts as soon as every
    rank's files are written, whichever step training is at; until then `latest` names the
    previous one, and a crash loses only this save."""

    root: Path
    tmp: Path
    name: str
    record: dict[str, Any] | None
    keep_last: int | None
    _written: Future | None = None
    _published: threading.Event = field(default_factory=threading.Event)
    _publish_error: Exception | None = None

    def start(self, written: Future) -> None:
        self._written = written
        written.add_done_callback(self._publish_if_written)

    def _publish_if_written(self, written: Future) -> None:
        try:
            if self.record is not None and written.exception() is None:
                _publish(self.root, self.tmp, self.name, self.record, self.keep_last)
        except Exception as exc:
            self._publish_error = _as_checkpoint_error(
                exc, f"cannot publish checkpoint {self.tmp} as {self.root / self.name}")
        finally:
            self._published.set()

    def wait(self) -> Path:
        """Collective: wait until this rank's files are written and, on rank 0, the checkpoint
        published; raise on every rank if any rank failed. The checkpoint folder."""
        failure: Exception | None = None
        try:
            self._written.result()
        except (CheckpointException, OSError) as exc:  # DCP raises on every rank if one failed
            failure = _write_failed(self.tmp, exc)
            failure.__cause__ = exc
        except Exception as exc:
            failure = exc
        self._published.wait()
        _raise_if_any_failed(failure or self._publish_error, f"saving {self.root / self.name}")
        return self.root / self.name


def load_checkpoint(path: str | os.PathLike, modules: Mapping[str, nn.Module],
                    optimizer: torch.optim.Optimizer | None, *,
                    restore_rng: bool = True) -> Resumed:
    """Load `path` (a checkpoint folder, or a directory: its latest) into this rank's modules
    and optimizer, whatever plan saved it; collective. Call after building both, before the
    first step; `modules` are the plain modules (not DDP wrappers: their names would differ).
    Hyperparameters (lr, betas, ...) come from the checkpoint. Restores this rank's RNG states
    when the saving run had the same world size (warns otherwise)."""
    rank, world = _rank_world()
    failure = None
    try:
        info = checkpoint_info(path)
        state = _LiveState.of(modules, optimizer)  # creates a fresh optimizer's state
        request, saved_optimizer = _prepare_load(info, state)
    except Exception as exc:
        failure = _as_checkpoint_error(exc, f"cannot read checkpoint {path}")
    _raise_if_any_failed(failure, f"loading {path}")
    _dcp_load(request, info.path)
    state.apply(modules, optimizer, clear_optimizer=not saved_optimizer)
    if restore_rng and info.world_size == world:
        _set_rng_state(_read_json(info.path / _rank_file(rank))["rng"])
    elif restore_rng and rank == 0:
        warnings.warn(f"{info.path} was saved by {info.world_size} process(es), this run has "
                      f"{world}: random number generator states are per process, so they are not "
                      "restored (weights, optimizer state and step are)", stacklevel=2)
    return Resumed(step=info.step, plan=info.plan, extra=info.extra)


def load_newest_loadable(directory: str | os.PathLike, modules: Mapping[str, nn.Module],
                         optimizer: torch.optim.Optimizer | None, *, restore_rng: bool = True,
                         ) -> tuple[Resumed, list[str]]:
    """`load_checkpoint` of the newest complete checkpoint under `directory` that loads, older
    ones tried in turn when a newer one is corrupt (a shard truncated or zeroed after it was
    published, an unreadable index); collective. Returns what was restored and one line per
    checkpoint passed over. Raises the oldest one's error when none loads. Each load either
    completes or leaves nothing applied, and the next one overwrites every tensor, so a
    partial read of a corrupt checkpoint cannot leak into the run."""
    candidates = _shared_from_rank0(lambda: [str(p) for p in _newest_first(Path(directory))])
    if not candidates:
        raise CheckpointError(f"no checkpoint in {directory} (no complete step-NNNNNN folder)")
    passed_over: list[str] = []
    for i, path in enumerate(candidates):
        try:
            return load_checkpoint(path, modules, optimizer, restore_rng=restore_rng), passed_over
        except CheckpointError as exc:
            if i == len(candidates) - 1:
                raise
            passed_over.append(f"{path} cannot be loaded ({exc})")
    raise AssertionError("unreachable")


def _newest_first(root: Path) -> list[Path]:
    """The checkpoint `latest` names (as latest_checkpoint finds it), then the complete ones
    older than it, newest first."""
    latest = latest_checkpoint(root)
    if latest is None:
        return []
    older = [(step, path) for step, path in _complete_checkpoints(root) if path != latest
             and step < int(_STEP_DIR.fullmatch(latest.name)[1])]
    return [latest] + [path for _, path in reversed(older)]


def _shared_from_rank0(make: Any) -> Any:
    """Rank 0's value of make() on every rank (so that all ranks try the same folders)."""
    if not _distributed():
        return make()
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint `directory/latest` names if complete, else the complete one with the
    highest step (a crash can leave `latest` missing or naming a replaced folder); None if
    there is none. Folders being written (.tmp-*) and incomplete ones are never returned."""
    root = Path(directory)
    if not root.is_dir():
        return None
    try:
        named = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    if _STEP_DIR.fullmatch(named) and (root / named / MARKER).is_file():
        return root / named
    found = _complete_checkpoints(root)
    return found[-1][1] if found else None


def checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    """The record of `path` (a checkpoint folder, or a directory: its latest), after checking
    that every file it lists is there at its size. Raises CheckpointError otherwise."""
    folder = _resolve(Path(path))
    fix = (f"delete {folder} to resume from the previous checkpoint of {folder.parent}, or "
           "point at another step-* folder")
    try:
        record = json.loads((folder / MARKER).read_text())
        info = CheckpointInfo(path=folder, step=int(record["step"]),
                              world_size=int(record["world_size"]), plan=record["plan"],
                              extra=dict(record["extra"]), files=dict(record["files"]))
        version = record["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{folder / MARKER} is unreadable or malformed ({exc}); {fix}") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{folder} has checkpoint format {version}; this mosaic reads "
                              f"format {FORMAT_VERSION}")
    for name, size in info.files.items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"{file} is missing or truncated (expected {size} bytes); {fix}")
    return info


# --- this rank's state, flat: "model.<fqn>" and "optim.<flat key>" -> value ------------------
@dataclass(slots=True)
class _LiveState:
    """get_state_dict's two dicts. Their tensors ARE the module's and optimizer's tensors
    (no copy), so DCP loads in place; set_state_dict then takes the non-tensor values."""

    model: dict[str, Any]
    optim: dict[str, Any]

    @classmethod
    def of(cls, modules: Mapping[str, nn.Module],
           optimizer: torch.optim.Optimizer | None) -> _LiveState:
        root = nn.ModuleDict(dict(modules))
        if not root.state_dict():  # a rank holding no module: DCP refuses an empty model
            if optimizer is not None and optimizer.param_groups[0]["params"]:
                raise CheckpointError("the optimizer has parameters but no module holds them")
            return cls({}, {})
        if optimizer is None:
            return cls(dict(get_model_state_dict(root)), {})
        model, optim = get_state_dict(root, optimizer, options=_OPTIONS)
        return cls(dict(model), dict(optim))

    def flat(self) -> dict[str, Any]:
        return {**{f"model.{k}": v for k, v in self.model.items()},
                **{f"optim.{k}": v for k, v in self.optim.items()}}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.flat().items() if isinstance(v, torch.Tensor)}

    def values(self) -> dict[str, Any]:
        return {k: v for k, v in self.flat().items() if not isinstance(v, torch.Tensor)}

    def drop_optimizer_state(self) -> None:
        self.optim = {k: v for k, v in self.optim.items() if not k.startswith("state.")}

    def set_value(self, key: str, value: Any) -> None:
        prefix, name = key.split(".", 1)
        part = self.model if prefix == "model" else self.optim
        old = part[name]
        part[name] = tuple(value) if isinstance(old, tuple) else value  # JSON has no tuples

    def apply(self, modules: Mapping[str, nn.Module], optimizer: torch.optim.Optimizer | None,
              clear_optimizer: bool) -> None:
        if not self.model:  # a rank holding no module
            return
        root = nn.ModuleDict(dict(modules))
        if optimizer is None:
            set_model_state_dict(root, self.model)
            return
        set_state_dict(root, optimizer, model_state_dict=self.model, optim_state_dict=self.optim,
                       options=_OPTIONS)
        if clear_optimizer:  # saved before its first step: it must stay without state
            optimizer.state.clear()


def _state_to_save(modules: Mapping[str, nn.Module],
                   optimizer: torch.optim.Optimizer | None) -> _LiveState:
    """get_state_dict creates a fresh optimizer's state with a zero step (AdamW: step=1).
    Undone here, and not saved: the run must not notice the save, and a resume from it must
    start from no state, as the uninterrupted run does."""
    fresh = optimizer is not None and not optimizer.state
    state = _LiveState.of(modules, optimizer)
    if fresh:
        optimizer.state.clear()
        state.drop_optimizer_state()
    return state


_HOW_IT_RUNS = ("fused", "foreach", "capturable", "differentiable")
"""Optimizer options that say how the update runs here (fused on this device, or not), not
what it computes: kept as the live optimizer has them. A checkpoint saved where AdamW could
not be fused (sharded states on a CPU) would otherwise unfuse it where it can be."""


def _prepare_load(info: CheckpointInfo, state: _LiveState) -> tuple[dict[str, torch.Tensor], bool]:
    """The tensors to read from DCP, after checking that the checkpoint has every one at its
    shape; sets the non-tensor values. Also returns whether the optimizer state was saved."""
    saved = _read_metadata(info.path).state_dict_metadata
    values: dict[str, Any] = {}
    for rank in range(info.world_size):  # replicas wrote equal values: any copy will do
        values.update(_read_json(info.path / _rank_file(rank))["values"])
    saved_optimizer = any(k.startswith("optim.state.") for k in [*saved, *values])
    # Without a saved optimizer state the live (zero) one is kept for set_state_dict, which
    # needs every key, and cleared after it.
    skip = () if saved_optimizer else ("optim.state.",)
    tensors = {k: v for k, v in state.tensors().items() if not k.startswith(skip)}
    wanted = [k for k in state.values()
              if not k.startswith(skip) and k.rsplit(".", 1)[-1] not in _HOW_IT_RUNS]
    missing = sorted([k for k in tensors if k not in saved]
                     + [k for k in wanted if k not in values])
    if missing:
        raise CheckpointError(_missing_message(info.path, missing, saved))
    for key, tensor in tensors.items():
        shape = tuple(getattr(saved[key], "size", ()))
        if shape != tuple(tensor.shape):
            raise CheckpointError(f"{info.path}: {key} has shape {list(shape)} there but "
                                  f"{list(tensor.shape)} here; load it into the model it was "
                                  "saved from (same preset)")
        dtype = getattr(getattr(saved[key], "properties", None), "dtype", tensor.dtype)
        if dtype != tensor.dtype:  # DCP would cast: bf16 weights would lose their fp32 mains
            raise CheckpointError(f"{info.path}: {key} is {dtype} there but {tensor.dtype} "
                                  f"here; {_precision_fix(key)}")
    for key in wanted:
        state.set_value(key, values[key])
    return tensors, saved_optimizer


def _precision_fix(key: str) -> str:
    """What to resume with where a saved tensor's dtype differs from the live one's: AdamW's
    moments follow --bf16-moments, everything else the weights' precision."""
    if key.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq"):
        return ("resume with the moments' precision it was saved with (engine bf16_moments, "
                "`mosaic train --bf16-moments` on or off)")
    return "resume with the weights' precision it was saved with (engine bf16_weights)"


def _missing_message(folder: Path, missing: list[str], saved: Mapping[str, Any]) -> str:
    held = sorted({k.split(".")[1] for k in saved if k.startswith("model.")})
    modules = sorted({k.split(".")[1] for k in missing if k.startswith("model.")})
    if modules:
        return (f"{folder} has no weights for {missing[0]} and {len(missing) - 1} more (modules "
                f"{modules}; it holds modules {held}); load it into the model it was saved from")
    if any(k.endswith(".main") for k in missing):
        if _holds_bf16_weights(saved):
            return (f"{folder} has no fp32 main weights ({missing[0]}): it was saved by a run "
                    "that kept none (engine fp32_main_weights off); resume with "
                    "`mosaic train --no-fp32-main-weights` (its bf16 weights are all it holds)")
        return (f"{folder} has no fp32 main weights ({missing[0]}): it was saved with fp32 "
                "weights; resume with the weights' precision it was saved with (engine "
                "bf16_weights)")
    return (f"{folder} has no optimizer value {missing[0]} (and {len(missing) - 1} more): it was "
            "saved without an optimizer or with another optimizer type; use the same optimizer, "
            "or pass optimizer=None to load the weights only")


def _holds_bf16_weights(saved: Mapping[str, Any]) -> bool:
    return any(getattr(getattr(v, "properties", None), "dtype", None) == torch.bfloat16
               for k, v in saved.items() if k.startswith("model."))


# --- RNG -------------------------------------------------------------------------------------
def _rng_state() -> dict[str, list[int]]:
    state = {"torch_cpu": torch.get_rng_state().tolist()}
    # Only when CUDA is in use: get_rng_state would create a context on a CPU-only run.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def _set_rng_state(state: Mapping[str, list[int]]) -> None:
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["torch_cuda"], dtype=torch.uint8))


# --- DCP -------------------------------------------------------------------------------------
def _dcp_save(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    try:
        with _single_process_is_intended():
            dcp.save(tensors, storage_writer=_writer(folder), no_dist=not _distributed())
    except (CheckpointException, OSError) as exc:  # DCP raises on every rank if one failed
        raise _write_failed(folder, exc) from exc


def _writer(folder: Path) -> FileSystemWriter:
    return FileSystemWriter(folder, single_file_per_rank=True, sync_files=True)


def _write_failed(folder: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"writing checkpoint tensors to {folder} failed: {exc}")


def _written(tensors: dict[str, torch.Tensor], folder: Path) -> Future:
    """`_dcp_save` now, as a completed future (the synchronous path of begin_checkpoint)."""
    done: Future = Future()
    try:
        _dcp_save(tensors, folder)
        done.set_result(None)
    except Exception as exc:
        done.set_exception(exc)
    return done


def _dcp_async_save(tensors: dict[str, torch.Tensor], folder: Path,
                    timeout_s: float | None = None) -> Future:
    """DCP's async_save: the writer stages (copies) the tensors into host memory before this
    returns, then a thread writes them. Its collectives run on a process group of their own,
    never the one training uses at the same time."""
    kwargs: dict[str, Any] = {"storage_writer": _writer(folder)}
    if _distributed():
        kwargs["process_group"] = _background_group(timeout_s)
    else:
        if "no_dist" in inspect.signature(dcp.async_save).parameters:
            kwargs["no_dist"] = True
        # The writing thread warns as _single_process_is_intended says, after its `with` has
        # put the filters back.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with _single_process_is_intended():
        response = dcp.async_save(tensors, **kwargs)
    return getattr(response, "upload_completion", response)  # torch >= 2.9 may wrap it


_BACKGROUND_GROUP: list[tuple[Any, Any]] = []
"""(the world it belongs to, a gloo group for background saves): made collectively at a
world's first background save, again when the world is a new one."""


def _background_group(timeout_s: float | None) -> Any:
    world = dist.group.WORLD
    if not _BACKGROUND_GROUP or _BACKGROUND_GROUP[0][0] is not world:
        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        _BACKGROUND_GROUP[:] = [(world, dist.new_group(backend="gloo", **timeout))]
    return _BACKGROUND_GROUP[0][1]


def _dcp_load(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    try:
        with _single_process_is_intended():
            dcp.load(tensors, storage_reader=_SafeReader(folder), no_dist=not _distributed())
    except (CheckpointException, Exception) as exc:  # Exception: corrupt data, one process
        raise CheckpointError(f"reading checkpoint tensors from {folder} failed ({exc}); it is "
                              f"corrupt: delete it to resume from the previous checkpoint of "
                              f"{folder.parent}") from exc


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    # DCP warns on every no-process-group call, even with no_dist=True: one process is a
    # supported mode here, not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's index holds dataclasses of torch.distributed.checkpoint.metadata, torch.Size,
    dtypes, layouts and paths; anything else (os.system, ...) is refused."""

    _NAMED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
              ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
              ("collections", "OrderedDict"),
              *((where, path) for where in ("pathlib", "pathlib._local")  # 3.13: _local
                for path in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"))}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.distributed.checkpoint.metadata":
            obj = getattr(torch.distributed.checkpoint.metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def _read_metadata(folder: Path) -> Metadata:
    try:
        with open(folder / _METADATA, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
        raise CheckpointError(
            f"{folder / _METADATA} is unreadable ({exc}); delete {folder} to resume from the "
            f"previous checkpoint of {folder.parent}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{folder / _METADATA} is not a DCP index; delete {folder}")
    return metadata


class _SafeReader(FileSystemReader):
    """FileSystemReader whose index is read by _MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --- files -----------------------------------------------------------------------------------
def _record(step: int, world: int, plan: Any, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    plan_dict = plan.to_dict() if isinstance(plan, Plan) else (dict(plan) if plan else None)
    record = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
              "plan": plan_dict, "extra": dict(extra or {}), "torch": torch.__version__}
    try:
        json.dumps(record)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint plan/extra must be JSON (numbers, strings, lists, "
                              f"dicts): {exc}") from None
    return record


def _publish(root: Path, tmp: Path, name: str, record: dict[str, Any],
             keep_last: int | None) -> None:
    """Rank 0, once every rank has written: complete, rename, point, prune, in this order."""
    record["files"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    _write_json(tmp / MARKER, record)
    _fsync_dir(tmp)
    final = root / name
    retired = _retire(final) if final.exists() else None  # a re-save of this step
    _rename_into_place(tmp, final)
    _point_latest(root, name)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
    _prune(root, keep_last, keep=final)


def _retire(folder: Path) -> Path:
    old = folder.with_name(f"{folder.name}.old-{secrets.token_hex(4)}")
    os.rename(folder, old)
    return old


def _rename_into_place(tmp: Path, final: Path) -> None:
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST}.tmp-{secrets.token_hex(4)}"
    _write_text(tmp, name + "\n")
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _prune(root: Path, keep_last: int | None, keep: Path) -> None:
    """Delete all but the `keep_last` highest-step complete checkpoints (never `keep`), and
    leftovers of crashed saves. The marker goes first: a crash mid-delete leaves a folder
    that is incomplete, never one that looks complete with files missing."""
    complete = [path for _, path in _complete_checkpoints(root)]
    doomed = [] if keep_last is None else [p for p in complete[:-keep_last] if p != keep]
    leftovers = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(
        r"step-\d+(\.tmp-\w+|\.old-\w+)?", p.name) and p not in complete and p != keep]
    for path in doomed + leftovers:
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    for pointer in root.glob(f"{LATEST}.tmp-*"):  # a crash between write and os.replace
        pointer.unlink(missing_ok=True)


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every folder named step-N holding a marker, by step."""
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match[1]), path))
    return sorted(found)


def _resolve(path: Path) -> Path:
    """A complete checkpoint folder: `path` itself, or the latest one under it."""
    if (path / MARKER).is_file():
        return path
    fix = "drop --resume, or point --checkpoint-dir at the directory a run saved into"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist; {fix}")
    if _STEP_DIR.fullmatch(path.name.split(".")[0]) and latest_checkpoint(path) is None:
        raise CheckpointError(f"{path} is incomplete (no {MARKER}: its save was interrupted); "
                              f"resume from {path.parent} to take its latest complete checkpoint")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no checkpoint in {path} (no complete step-NNNNNN folder); {fix}")
    return found


def _step_name(step: int) -> str:
    return f"step-{step:06d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _write_json(path: Path, obj: Any) -> None:
    try:
        text = json.dumps(obj)
    except (TypeError, ValueError) as exc:  # e.g. an optimizer hyperparameter of an odd type
        raise CheckpointError(f"cannot store {path.name} as JSON: {exc}") from None
    _write_text(path, text)


def _write_text(path: Path, text: str) -> None:
    # fsync: after a power loss the marker must not exist without the bytes it vouches for.
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); delete {path.parent} to resume "
                              f"from the previous checkpoint of {path.parent.parent}") from None


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable. Not every platform or filesystem can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- process group ---------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _collective_device() -> torch.device:
    """NCCL moves only CUDA tensors; gloo, CPU ones."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shared_token() -> str:
    """A fresh name part, rank 0's, on every rank: all ranks write into one new folder.
    From `secrets`, not torch: drawing from torch's generator would change the run."""
    token = torch.tensor([secrets.randbits(48)], dtype=torch.int64)
    if _distributed():
        token = token.to(_collective_device())
        dist.broadcast(token, src=0)
    return f"{int(token.item()):012x}"


def _raise_if_any_failed(failure: BaseException | None, what: str) -> None:
    """Collective: a rank that failed raises its own error, every other rank a CheckpointError
    naming it, so that no rank waits in the next collective until the timeout."""
    rank, world = _rank_world()
    failed = [rank] if failure is not None else []
    if world > 1:
        flags = torch.zeros(world, dtype=torch.int32, device=_collective_device())
        flags[rank] = int(failure is not None)
        dist.all_reduce(flags)
        failed = [r for r, flag in enumerate(flags.tolist()) if flag]
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(f"{what} failed on rank(s) {failed}; their error says why")


def _as_checkpoint_error(exc: Exception, context: str) -> Exception:
    """OSError (disk full, permissions) is the user's to fix; anything else is a bug and keeps
    its type and traceback."""
    if isinstance(exc, OSError):
        error = CheckpointError(f"{context}: {exc.strerror or exc} ({exc.filename or ''})")
        error.__cause__ = exc
        return error
    return exc
