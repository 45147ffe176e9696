"""Bad command lines: exit 2, one line on stderr naming the field, no traceback, no output.

In process, through `mosaic.cli.main` -- the entry point a shell runs, which turns our errors
and click's usage errors into one line -- so the suite stays fast; a subprocess only where the
imports of a fresh interpreter are the point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from mosaic.cli import main
from mosaic.errors import MosaicError, is_user_error


@dataclass
class Run:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys, tmp_path, monkeypatch):
    """Run `mosaic ARGS...` in process from an empty directory; returns code, stdout, stderr."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> Run:
        with pytest.raises(SystemExit) as info:
            main(list(args))
        captured = capsys.readouterr()
        return Run(info.value.code or 0, captured.out, captured.err)

    return run


def refused(run: Run, *needles: str) -> str:
    """Exit 2, nothing on stdout, exactly one `mosaic: error:` line holding every needle."""
    assert run.code == 2, run
    assert run.out == "", run.out
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("mosaic: error: ") and "Traceback" not in run.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def nothing_written(directory: Path) -> None:
    assert list(directory.iterdir()) == [], list(directory.iterdir())


# --- fixed choices -----------------------------------------------------------------------
@pytest.mark.parametrize(("args", "needles"), [
    (["plan", "clip", "--perf-model", "bogus"], ["--perf-model", "bogus", "analytic"]),
    (["plan", "clip", "--preset", "huge"], ["--preset", "huge", "tiny"]),
    (["plan", "clip", "--hardware", "a100"], ["--hardware", "a100", "h200"]),
    (["simulate", "clip", "--plan", "p.json", "--perf-model", "bogus"], ["--perf-model"]),
    (["models", "--preset", "huge"], ["--preset"]),
    (["train", "clip", "--preset", "huge"], ["--preset"]),
    (["bench", "clip", "--hardware", "a100"], ["--hardware"]),
    (["profile", "clip", "--preset", "huge"], ["--preset"]),
    (["model-error", "--hardware", "a100"], ["--hardware"]),
])
def test_a_value_outside_the_choices_is_refused(cli, tmp_path, args, needles):
    refused(cli(*args), *needles)
    nothing_written(tmp_path)


def test_help_lists_the_choices(cli):
    run = cli("plan", "--help")
    assert run.code == 0
    for choice in ("paper", "small", "tiny", "h200", "h100", "auto", "profiled", "analytic"):
        assert choice in run.out, choice


def test_hardware_is_case_insensitive(cli, tmp_path):
    run = cli("plan", "clip", "--preset", "tiny", "--gpus", "1", "--hardware", "H200",
              "--perf-model", "analytic", "--planners", "megatron", "--out", "o", "--json")
    assert run.code == 0, run.err
    assert json.loads(run.out)["hardware"] == "h200"


@pytest.mark.parametrize("args", [
    ["plan", "clip", "--planners", "megatron,bogus"],
    ["plan", "clip", "--planners", ","],
    ["bench", "clip", "--planners", "bogus"],
    ["train", "clip", "--planner", "bogus"],
])
def test_unknown_planners_are_refused_before_any_work(cli, tmp_path, args):
    refused(cli(*args), "--planner", "bogus" if "bogus" in args[-1] else "none given", "megatron")
    nothing_written(tmp_path)


@pytest.mark.parametrize("args", [["plan", "gpt-17"], ["simulate", "gpt-17", "--plan", "p.json"],
                                  ["train", "gpt-17"], ["bench", "gpt-17"],
                                  ["profile", "clip", "gpt-17"]])
def test_unknown_models_name_the_valid_ones(cli, args):
    refused(cli(*args), "gpt-17", "valid models: clip, imagebind")


def test_a_missing_graph_file_is_refused(cli):
    refused(cli("plan", "missing.json"), "missing.json", "no such graph file")


def test_click_usage_errors_are_one_line_too(cli):
    refused(cli("plan"), "Missing argument", "mosaic plan --help")
    refused(cli("plan", "clip", "--no-such-option"), "--no-such-option")


# --- GPU counts and numbers ----------------------------------------------------------------
@pytest.mark.parametrize(("args", "needles"), [
    (["plan", "clip", "--gpus", "0"], ["--gpus 0", "at least 1"]),
    (["plan", "clip", "--gpus", "100000"], ["--gpus 100000", "4096"]),
    (["plan", "clip", "--preset", "tiny", "--gpus", "32"],
     ["--gpus 32", "more than 24 GPUs", "global batch of 8", "--gpus 24 or fewer", "--batch 11"]),
    # Qwen3-VL's LLM splits 8 ways by TP: a replica of each module takes up to 10 GPUs
    (["plan", "qwen3-vl", "--gpus", "24"], ["--gpus 24", "more than 20 GPUs", "takes 10 GPUs",
                                            "--batch 3"]),
    (["plan", "clip", "--gpus", "12"], ["--gpus 12", "whole number"]),
    (["plan", "clip", "--batch", "0"], ["--batch"]),
    (["train", "clip", "--preset", "tiny", "--no-bf16-flat-grads"],
     ["--no-bf16-flat-grads", "add --bf16-weights"]),
    (["train", "clip", "--preset", "tiny", "--bf16-moments"], ["--bf16-moments", "add --bf16-weights"]),
    (["plan", "clip", "--bf16-moments"], ["--bf16-moments", "add --bf16-weights"]),
    (["plan", "clip", "--no-bf16-flat-grads"], ["--no-bf16-flat-grads", "add --bf16-weights"]),
    (["train", "clip", "--preset", "tiny", "--no-fp32-main-weights"],
     ["--no-fp32-main-weights", "add --bf16-weights"]),
    (["plan", "clip", "--no-fp32-main-weights"], ["--no-fp32-main-weights", "add --bf16-weights"]),
    (["bench-planner", "--modules", "0"], ["--modules"]),
    (["bench-planner", "--gpus", "0"], ["--gpus"]),
    (["bench-planner", "--gpus", "12"], ["--gpus 12", "whole number"]),
    (["bench-planner", "--seeds", "0"], ["--seeds"]),
    (["bench-planner", "--sm-steps", "abc"], ["--sm-steps", "'abc'", "hw"]),
    (["bench-planner", "--sm-steps", "0.25,2"], ["--sm-steps", "'2'", "(0, 1]"]),
])
def test_impossible_numbers_are_refused(cli, tmp_path, args, needles):
    refused(cli(*args), *needles)
    nothing_written(tmp_path)


# --- output paths --------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["plan", "clip"], ["train", "clip"], ["bench", "clip"],
                                     ["simulate", "clip", "--plan", "p.json"]])
def test_out_under_a_file_is_refused(cli, tmp_path, command):
    (tmp_path / "a_file").write_text("x")
    refused(cli(*command, "--out", "a_file/sub"), "--out a_file/sub", "a_file, which is a file")
    refused(cli(*command, "--out", "a_file"), "--out a_file", "is a file")
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_file_outputs_are_checked_too(cli, tmp_path):
    (tmp_path / "d").mkdir()
    refused(cli("profile", "clip", "--db", "d"), "--db d", "is a directory")
    refused(cli("bench-planner", "--plot", "d"), "--plot d", "is a directory")
    (tmp_path / "f").write_text("x")
    refused(cli("train", "clip", "--metrics", "f/m.jsonl"), "--metrics", "which is a file")


def _refuses_files(directory: Path) -> bool:
    try:
        tempfile.NamedTemporaryFile(dir=directory).close()
    except OSError:
        return True
    return False


def test_an_unwritable_out_is_refused(cli, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)  # root ignores modes, but sysfs refuses new files even to root
    where = next((d for d in (locked, Path("/sys")) if d.is_dir() and _refuses_files(d)), None)
    if where is None:
        pytest.skip("no directory here refuses this user a new file")
    target = where / "mosaic-test-out"
    refused(cli("plan", "clip", "--out", str(target)), "--out", "cannot write")
    assert not target.exists()


# --- commands that need a GPU ----------------------------------------------------------------
def _skip_with_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")


def test_bench_without_cuda_is_refused_at_once(cli, tmp_path):
    _skip_with_cuda()
    refused(cli("bench", "clip"), "CUDA", "--cpu-smoke")
    nothing_written(tmp_path)


def test_profile_without_cuda_is_refused_at_once(cli, tmp_path):
    _skip_with_cuda()
    refused(cli("profile", "clip", "--db", "p.sqlite"), "CUDA")
    nothing_written(tmp_path)


def test_profile_names_models_or_collectives_and_not_both(cli, tmp_path):
    refused(cli("profile", "--db", "p.sqlite"), "name the zoo models", "--collectives")
    refused(cli("profile", "clip", "--collectives", "--db", "p.sqlite"), "--collectives",
            "drop clip")
    _skip_with_cuda()
    refused(cli("profile", "--collectives", "--db", "p.sqlite"), "CUDA", "torchrun")
    nothing_written(tmp_path)


def test_remeasure_without_update_is_refused(cli, tmp_path):
    refused(cli("profile", "clip", "--remeasure", "--db", "p.sqlite"), "--remeasure", "--update")
    nothing_written(tmp_path)


def test_busy_only_without_update_is_refused(cli, tmp_path):
    refused(cli("profile", "clip", "--busy-only", "--db", "p.sqlite"), "--busy-only", "--update")
    refused(cli("profile", "clip", "--busy-only", "--surfaces-only", "--update", "--db",
                "p.sqlite"), "--busy-only", "--surfaces-only")
    nothing_written(tmp_path)


def test_main_weights_only_needs_an_existing_db_to_add_to(cli, tmp_path):
    refused(cli("profile", "clip", "--main-weights-only", "--db", "p.sqlite"),
            "--main-weights-only", "--update")
    refused(cli("profile", "clip", "--main-weights-only", "--update", "--db", "p.sqlite"),
            "--update", "makes one first")
    nothing_written(tmp_path)


# --- error classes ---------------------------------------------------------------------------
def test_every_user_error_class_is_a_mosaic_error():
    from mosaic.cli import OptionError
    from mosaic.files import OutputError
    from mosaic.graph import GraphError
    from mosaic.hardware import HardwareError
    from mosaic.perf.base import PerfModelError
    from mosaic.perf.interference import InterferenceError
    from mosaic.perf.results import BenchResultsError
    from mosaic.plan import PlanError
    from mosaic.profile.db import ProfileDBError
    from mosaic.profile.graph_timing import ProfilerError

    for cls in (GraphError, PlanError, HardwareError, ProfileDBError, ProfilerError,
                PerfModelError, InterferenceError, BenchResultsError, OutputError, OptionError):
        assert issubclass(cls, MosaicError), cls
        assert is_user_error(cls("x"))


def test_user_errors_are_mosaic_errors_and_not_any_value_error():
    assert not is_user_error(ValueError("a bug, not the user's"))
    assert not is_user_error(KeyError("x"))


def test_an_unknown_perf_model_name_is_a_mosaic_error():
    from mosaic.hardware import make_cluster
    from mosaic.perf import make_perf_model

    with pytest.raises(MosaicError, match="unknown perf model 'bogus'; choose one of"):
        make_perf_model("bogus", make_cluster(1))


def test_mosaic_debug_shows_the_traceback(cli, monkeypatch):
    from mosaic.graph import GraphError

    monkeypatch.setenv("MOSAIC_DEBUG", "1")
    with pytest.raises(GraphError, match="unknown model"):
        main(["plan", "gpt-17"])


# --- a fresh interpreter: what an early error imports ----------------------------------------
def test_an_unknown_model_fails_before_the_heavy_imports(tmp_path):
    code = ("import sys\nfrom mosaic.cli import main\n"
            "try:\n    main(['plan', 'gpt-17'])\nexcept SystemExit as e:\n    code = e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'scipy', 'matplotlib', 'networkx') "
            "if m in sys.modules]\nprint(code, heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.stdout.strip() == "2 []", result.stdout + result.stderr


def test_a_profile_of_ones_own_gpus_is_used_for_planning(cli, tmp_path):
    """`mosaic profile --db PATH` then `mosaic plan --profile-db PATH`: the plan's prediction
    comes from that DB (its name is in the footer); a missing one is refused in one line."""
    import shutil

    from mosaic.profile.db import default_db_path

    shutil.copy(default_db_path("h200"), tmp_path / "mine.sqlite")
    run = cli("plan", "clip", "--gpus", "2", "--preset", "small", "--profile-db", "mine.sqlite",
              "--json", "--out", "p")
    assert run.code == 0, run.err
    assert "profiled (mine.sqlite:" in json.loads(run.out)["perf_model"]
    refused(cli("plan", "clip", "--profile-db", "missing.sqlite"), "missing.sqlite", "does not exist")
    refused(cli("plan", "clip", "--profile-db", "mine.sqlite", "--perf-model", "analytic"),
            "--profile-db", "--perf-model analytic")
