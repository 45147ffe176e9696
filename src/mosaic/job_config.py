"""Job configs for `mosaic train --config job.toml [--set train.lr=1e-4 ...]`.

A TOML file (tomllib; `.yaml` / `.yml` through pyyaml) of sections mapping onto the options of
`mosaic train`:

    model = "clip"
    [train]   steps, lr, seed, batch, preset, data
    [plan]    planner, gpus, file, hardware, perf_model, profile_db
    [engine]  graphs, compile, compile_scope, grad_sync, reduce_dtype, grads_in_graph,
              accumulation, bf16_weights, bf16_flat_grads, bf16_moments, fp32_main_weights
    [checkpoint] dir, every, resume
    [run]     out, overwrite, metrics, tensorboard, torch_trace

`--set section.key=value` overrides one field (the value is read as a TOML literal, else as a
string). Every field is typed and checked; an error names the field. Options given on the
command line win over the file.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mosaic.errors import MosaicError


class JobConfigError(MosaicError):
    """A job config that cannot be used; the message names the file, the field and the fix."""


class ResumeMode:
    """`checkpoint.resume`: true (a checkpoint must exist), false, or "auto" (if one exists)."""


# dotted field -> (option / parameter name of `mosaic train`, type)
FIELDS: dict[str, tuple[str, type]] = {
    "model": ("model", str),
    "train.steps": ("steps", int), "train.lr": ("lr", float), "train.seed": ("seed", int),
    "train.batch": ("batch", int), "train.preset": ("preset", str), "train.data": ("data", str),
    "train.clip_grad_norm": ("clip_grad_norm", float),
    "train.lr_warmup_steps": ("lr_warmup_steps", int), "train.lr_decay": ("lr_decay", str),
    "train.min_lr": ("min_lr", float), "train.weight_decay": ("weight_decay", float),
    "plan.planner": ("planner", str), "plan.gpus": ("gpus", int), "plan.file": ("plan_file", Path),
    "plan.hardware": ("hardware", str), "plan.perf_model": ("perf_model", str),
    "plan.profile_db": ("profile_db", Path),
    "engine.graphs": ("graphs", bool), "engine.compile": ("compile_mode", str),
    "engine.compile_scope": ("compile_scope", str),
    "engine.grad_sync": ("grad_sync", str), "engine.reduce_dtype": ("reduce_dtype", str),
    "engine.grads_in_graph": ("grads_in_graph", bool), "engine.accumulation": ("accumulation", int),
    "engine.bf16_weights": ("bf16_weights", bool),
    "engine.bf16_flat_grads": ("bf16_flat_grads", bool),
    "engine.bf16_moments": ("bf16_moments", bool),
    "engine.fp32_main_weights": ("fp32_main_weights", bool),
    "checkpoint.dir": ("checkpoint_dir", Path), "checkpoint.every": ("checkpoint_every", int),
    "checkpoint.resume": ("resume", ResumeMode),
    "checkpoint.background": ("checkpoint_background", bool),
    "run.out": ("out", Path), "run.overwrite": ("overwrite", bool), "run.metrics": ("metrics", Path),
    "run.tensorboard": ("tensorboard", Path), "run.torch_trace": ("torch_trace", Path),
}


def load_job(path: Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """{parameter name: typed value} from the file (if any) then the `--set` overrides."""
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        for key, value in _flatten(_read(Path(path))).items():
            flat[key], where[key] = value, str(path)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise JobConfigError(f"--set {item!r}: use --set section.key=value, e.g. "
                                 "--set train.lr=1e-4")
        flat[key.strip()], where[key.strip()] = _literal(raw.strip()), f"--set {item}"
    return {FIELDS[key][0]: _typed(key, value, where[key]) for key, value in flat.items()
            if _known(key, where[key])}


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise JobConfigError(f"--config {path}: not valid {path.suffix.lstrip('.') or 'TOML'}: "
                             f"{' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise JobConfigError(f"--config {path}: the top level must be a table of sections")
    return data


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _literal(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _known(key: str, where: str) -> bool:
    if key not in FIELDS:
        raise JobConfigError(f"{where}: unknown field {key!r}; fields: {', '.join(FIELDS)}")
    return True


def _typed(key: str, value: Any, where: str) -> Any:
    kind = FIELDS[key][1]
    if kind is ResumeMode:
        if isinstance(value, bool) or value == "auto":
            return value
        raise JobConfigError(f"{where}: {key} = {value!r} must be true, false or \"auto\"")
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, int | float) and not isinstance(value, bool),
          str: isinstance(value, str), Path: isinstance(value, str)}[kind]
    if not ok:
        names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
                 Path: "a path (string)"}
        raise JobConfigError(f"{where}: {key} = {value!r} must be {names[kind]}")
    return kind(value)
