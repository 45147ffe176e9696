"""Property-based tests (hypothesis): malformed plans, graphs, profile DBs and command lines
raise a MosaicError (the CLI: exit 2 with one line), never another exception, never a hang.

Each input is either arbitrary (random JSON, random bytes) or a valid one with one field
broken (deleted, retyped, replaced by random JSON), which reaches deeper than random input.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mosaic.errors import MosaicError
from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.plan import Plan
from mosaic.zoo import get_model

FAST = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)

GRAPH = get_model("clip").graph("tiny")
CLUSTER = make_cluster(2)


def _valid_plan() -> dict:
    both = [0, 1]
    return {"format_version": 1, "model": "clip", "planner": "manual", "num_gpus": 2,
            "stages": [{"sharing": "temporal", "placements": [
                {"module": m.name, "gpus": both, "sm_share": 1.0}]} for m in GRAPH.modules]}


def _paths(obj, prefix=()):
    """Every (path, value) inside a JSON object, containers included."""
    yield prefix, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        yield from _paths(value, (*prefix, key))


@st.composite
def broken(draw, valid: dict):
    """`valid` with one field (anywhere) deleted or replaced by random JSON."""
    doc = json.loads(json.dumps(valid))
    paths = [p for p, _ in _paths(doc) if p]
    path = draw(st.sampled_from(paths))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return doc


def _only_mosaic_errors(call) -> None:
    try:
        call()
    except MosaicError as exc:
        assert "\n" not in str(exc).strip() or len(str(exc)) < 2000, str(exc)


# --- plans ---------------------------------------------------------------------------------
@FAST
@given(st.one_of(json_values, broken(_valid_plan())))
def test_a_malformed_plan_raises_a_plan_error(doc):
    def load_and_validate():
        Plan.from_dict(doc).validate(GRAPH, CLUSTER)

    _only_mosaic_errors(load_and_validate)


@FAST
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_a_malformed_plan_file_raises_a_plan_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_bytes(data)
    _only_mosaic_errors(lambda: Plan.load(path).validate(GRAPH, CLUSTER))


# --- graphs --------------------------------------------------------------------------------
@FAST
@given(st.one_of(json_values, broken(GRAPH.to_dict())))
def test_a_malformed_graph_raises_a_graph_error(doc):
    from mosaic.graph import validate_graph

    _only_mosaic_errors(lambda: validate_graph(MMGraph.from_json(json.dumps(doc))))


@FAST
@given(st.text(max_size=200))
def test_graph_text_that_is_not_json_raises_a_graph_error(text):
    _only_mosaic_errors(lambda: MMGraph.from_json(text))


# --- profile DBs ---------------------------------------------------------------------------
SHIPPED = Path(__file__).parents[1] / "src" / "mosaic" / "profile" / "data" / "h200.sqlite"


def _open_db(path: Path) -> None:
    from mosaic.profile.db import ProfileDB

    ProfileDB.open(path, hardware="h200").close()


@FAST
@given(st.binary(max_size=4096))
def test_random_bytes_are_not_a_profile_db(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("db") / "p.sqlite"
    path.write_bytes(data)
    _only_mosaic_errors(lambda: _open_db(path))


@FAST
@given(st.floats(0.0, 0.999))
def test_a_truncated_profile_db_raises_a_profile_db_error(tmp_path_factory, fraction):
    data = SHIPPED.read_bytes()
    path = tmp_path_factory.mktemp("db") / "p.sqlite"
    path.write_bytes(data[:int(len(data) * fraction)])
    _only_mosaic_errors(lambda: _open_db(path))


@FAST
@given(json_values)
def test_a_wrong_schema_version_raises_a_profile_db_error(tmp_path_factory, version):
    path = tmp_path_factory.mktemp("db") / "p.sqlite"
    shutil.copy(SHIPPED, path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                     (json.dumps(version),))
    _only_mosaic_errors(lambda: _open_db(path))


@pytest.mark.parametrize("schema", ["CREATE TABLE meta (key TEXT)",
                                    "CREATE TABLE meta (a, b, c)",
                                    "CREATE TABLE other (x)"])
def test_a_db_of_another_schema_raises_a_profile_db_error(tmp_path, schema):
    path = tmp_path / "p.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute(schema)
        if "(a, b, c)" in schema:
            conn.execute("INSERT INTO meta VALUES (1, 2, 3)")
    _only_mosaic_errors(lambda: _open_db(path))


# --- command lines -------------------------------------------------------------------------
class _WouldRun(Exception):
    """The command line parsed and the command was about to do real work."""


COMMANDS = ["models", "plan", "simulate", "train"]
OPTIONS = ["--gpus", "--preset", "--batch", "--planners", "--planner", "--plan", "--steps",
           "--hardware", "--perf-model", "--out", "--json", "--lr", "--seed", "--metrics",
           "--checkpoint-dir", "--checkpoint-every", "--resume", "--timeout-s",
           "--skip-nonfinite", "--accumulation", "--grad-sync", "--compile", "--help-me"]
VALUES = ["clip", "tiny", "paper", "h200", "megatron", "mosaic", "0", "-1", "2", "8", "1e9",
          "nan", "auto", "x.json", "", "=", "--", "a/b"]
tokens = st.sampled_from(OPTIONS + VALUES) | st.text(max_size=6)


@FAST
@given(st.sampled_from(COMMANDS), st.lists(tokens, max_size=6))
def test_a_malformed_command_line_exits_2_with_one_line(monkeypatch, tmp_path, capsys, command,
                                                        args):
    from mosaic import cli
    from mosaic.engine import session

    def would_run(*args, **kwargs):
        raise _WouldRun

    monkeypatch.chdir(tmp_path)  # `plan` makes runs/... in the working directory
    monkeypatch.setattr(cli, "load_perf_model", would_run)
    monkeypatch.setattr(session, "start_distributed", would_run)
    capsys.readouterr()
    try:
        cli.main([command, *args])
    except _WouldRun:
        return
    except SystemExit as exc:
        err = capsys.readouterr().err
        if exc.code in (0, None):
            return
        assert exc.code == 2, (exc.code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mosaic: error: "), err
