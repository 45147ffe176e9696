"""Whole-iteration accuracy gate over `mosaic bench` results JSON (synthetic files, then the
repo's own benchmarks/results/)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mosaic.cli import app
from mosaic.perf.accuracy import gate_summary, iteration_error
from mosaic.perf.results import BenchResultsError, superseded, without_superseded_rows

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def plan_row(planner, measured_ms, predicted_ms=None, **extra):
    """One results row as bench_report writes it (the fields the gate and tables read)."""
    measured, predicted = measured_ms / 1e3, predicted_ms / 1e3 if predicted_ms else None
    row = {"planner": planner, "measured_iteration_s": measured, "median_s": measured,
           "p10_s": measured * 0.99, "p90_s": measured * 1.01, "predicted_iteration_s": predicted,
           "mfu": 0.1, "plan": {"planner": planner, "num_gpus": 1, "stages": []}, **extra}
    if predicted:
        row["prediction_error"] = predicted / measured - 1
    return row


def write_bench(path, rows, model="toy", gpus=1, batch=16, preset="small", tflop=1.0):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "preset": preset, "global_batch": batch,
                                "gpus": gpus, "num_sms": 132, "model_tflop_per_iteration": tflop,
                                "results": rows}))
    return path


def with_errors(path, *errors, **kw):
    """A results file whose plan rows have these prediction errors (fractions)."""
    rows = [plan_row(f"p{i}", 10.0, 10.0 * (1 + e)) for i, e in enumerate(errors)]
    return write_bench(path, rows, **kw)


def test_rows_and_aggregates(tmp_path):
    with_errors(tmp_path / "a" / "bench_a.json", 0.02, -0.04, model="a", gpus=2, batch=8)
    with_errors(tmp_path / "bench_b.json", -0.08, model="b")
    r = iteration_error(tmp_path)
    assert r["files"] == ["a/bench_a.json", "bench_b.json"]  # sorted, relative: deterministic
    first = r["rows"][0]
    expected = {"file": "a/bench_a.json", "model": "a", "preset": "small", "gpus": 2,
                "global_batch": 8, "planner": "p0"}
    assert {k: first[k] for k in expected} == expected
    assert first["measured_s"] == pytest.approx(0.010)
    assert first["predicted_s"] == pytest.approx(0.0102)
    assert [row["error"] for row in r["rows"]] == pytest.approx([0.02, -0.04, -0.08])
    assert r["count"] == 3 and r["median_abs_error"] == pytest.approx(0.04)
    assert r["max_abs_error"] == pytest.approx(0.08) and r["share_within_max_error"] == 1.0
    assert r["passed"] and gate_summary(r).startswith("PASS")


def test_one_row_over_10_percent_fails(tmp_path):
    with_errors(tmp_path / "bench.json", 0.01, -0.12, 0.02)
    r = iteration_error(tmp_path)
    assert not r["passed"] and r["over_max_error"] == 1
    assert r["worst"]["planner"] == "p1" and r["share_within_max_error"] == pytest.approx(2 / 3)
    assert gate_summary(r).startswith("FAIL")


def test_the_gate_is_also_given_per_gpu_count(tmp_path):
    """A miss on two GPUs alone says which machine its rerun needs."""
    with_errors(tmp_path / "bench_1.json", 0.01, -0.02)
    with_errors(tmp_path / "bench_2.json", 0.03, -0.30, gpus=2)
    r = iteration_error(tmp_path)
    assert not r["passed"]
    assert {n: (g["count"], g["passed"]) for n, g in r["by_gpus"].items()} == {
        1: (2, True), 2: (2, False)}
    assert gate_summary(r).endswith("by GPU count: 1 GPU PASS (2 rows, median 1.5%, max 2.0%), "
                                    "2 GPUs FAIL (2 rows, median 16.5%, max 30.0%)")


def test_median_over_5_percent_fails_though_every_row_is_within_10(tmp_path):
    with_errors(tmp_path / "bench.json", 0.06, -0.07, 0.02)
    r = iteration_error(tmp_path)
    assert r["max_abs_error"] <= 0.10 and r["median_abs_error"] == pytest.approx(0.06)
    assert not r["passed"]


def test_user_baselines_are_listed_but_not_gated(tmp_path):
    no_key = plan_row("torch-compile", 20.0)
    del no_key["predicted_iteration_s"]  # a user baseline may leave the key out entirely
    rows = [plan_row("mosaic", 10.0, 10.1), plan_row("torch-eager", 30.0), no_key]
    write_bench(tmp_path / "bench.json", rows)
    r = iteration_error(tmp_path)
    assert [row["planner"] for row in r["rows"]] == ["mosaic", "torch-eager", "torch-compile"]
    assert [row["error"] is None for row in r["rows"]] == [False, True, True]
    assert r["count"] == 1 and r["not_predicted"] == 2 and r["passed"]


def test_nothing_predicted_cannot_pass(tmp_path):
    write_bench(tmp_path / "bench.json", [plan_row("torch-eager", 30.0)])
    r = iteration_error(tmp_path)
    assert r["count"] == 0 and not r["passed"] and gate_summary(r).startswith("FAIL")


def test_other_json_is_skipped(tmp_path):
    with_errors(tmp_path / "run" / "bench.json", 0.01)
    (tmp_path / "run" / "mosaic.trace.json").write_text("[]")
    (tmp_path / "probe.json").write_text(json.dumps({"env": {}, "matmul": {}}))
    (tmp_path / "plan.json").write_text(json.dumps({"results": [{"planner": "x"}]}))
    (tmp_path / "broken.json").write_text("{not json")
    assert iteration_error(tmp_path)["files"] == ["run/bench.json"]


def test_files_can_be_given_one_by_one(tmp_path):
    a = with_errors(tmp_path / "a.json", 0.01)
    b = with_errors(tmp_path / "b.json", 0.03)
    assert iteration_error([b, a])["files"] == [str(b), str(a)]


def supersede(directory, entries):
    (Path(directory) / "superseded.json").write_text(json.dumps(entries))


def test_a_superseded_run_is_listed_but_not_gated(tmp_path):
    with_errors(tmp_path / "old" / "bench.json", 0.30, 0.01)
    with_errors(tmp_path / "old" / "kept.json", 0.02)
    with_errors(tmp_path / "rerun" / "bench.json", 0.03)
    supersede(tmp_path / "old", {"bench.json": {"by": "../rerun/bench.json", "why": "old engine"}})
    r = iteration_error(tmp_path)
    assert [bool(row["superseded"]) for row in r["rows"]] == [True, True, False, False]
    assert r["rows"][0]["superseded"]["why"] == "old engine"
    assert r["count"] == 2 and r["superseded"] == 2 and r["passed"]
    assert "2 rows of superseded runs" in gate_summary(r)


def test_a_star_entry_supersedes_every_run_of_its_directory(tmp_path):
    with_errors(tmp_path / "old" / "a.json", 0.5)
    with_errors(tmp_path / "old" / "b.json", -0.5)
    with_errors(tmp_path / "new" / "a.json", 0.01)
    supersede(tmp_path / "old", {"*": {"by": "../new", "why": "foreach AdamW"}})
    r = iteration_error(tmp_path)
    assert r["count"] == 1 and r["superseded"] == 2 and r["passed"]


def test_an_entry_with_labels_supersedes_those_contenders_alone(tmp_path):
    """A variant whose code changed is measured again; the run's other contenders stand."""
    with_errors(tmp_path / "old" / "bench.json", 0.30, 0.01)
    with_errors(tmp_path / "rerun" / "bench.json", 0.03)
    supersede(tmp_path / "old", {"bench.json": {"by": "../rerun/bench.json", "why": "kernel",
                                                "labels": ["p0"]}})
    r = iteration_error(tmp_path)
    assert [bool(row["superseded"]) for row in r["rows"]] == [True, False, False]
    assert r["count"] == 2 and r["superseded"] == 1 and r["passed"]
    old = tmp_path / "old" / "bench.json"
    assert superseded(old) is None and superseded(old, "p1") is None
    assert superseded(old, "p0")["why"] == "kernel"
    kept = without_superseded_rows(json.loads(old.read_text()), old)
    assert [row["planner"] for row in kept["results"]] == ["p1"]


@pytest.mark.parametrize("entries, needle", [
    ({"bench.json": {"by": "../nowhere.json", "why": "x"}}, "does not exist"),
    ({"bench.json": {"why": "no rerun named"}}, 'needs "by"'),
    ({"bench.json": {"by": ".", "why": "x", "labels": []}}, "non-empty list"),
    ("{broken", "not readable JSON"),
])
def test_a_bad_superseded_file_names_the_fix(tmp_path, entries, needle):
    with_errors(tmp_path / "bench.json", 0.01)
    if isinstance(entries, str):
        (tmp_path / "superseded.json").write_text(entries)
    else:
        supersede(tmp_path, entries)
    with pytest.raises(BenchResultsError, match=needle):
        iteration_error(tmp_path)


@pytest.mark.parametrize("make, needle", [
    (lambda d: d / "missing", "does not exist"),
    (lambda d: d, "no `mosaic bench` results"),
    (lambda d: (d / "x.json").write_text("{}") and d / "x.json", "not a `mosaic bench` results"),
])
def test_bad_input_is_a_user_error(tmp_path, make, needle):
    with pytest.raises(BenchResultsError, match=needle):
        iteration_error(make(tmp_path))


def test_cli_prints_the_verdict_and_exits_0_on_fail(tmp_path):
    with_errors(tmp_path / "bench.json", 0.01, -0.2)
    recorded = ["model-error", "--iterations", str(tmp_path), "--as-recorded"]
    out = CliRunner().invoke(app, recorded)
    assert out.exit_code == 0, out.output
    assert "FAIL" in out.output and "-20.0%" in out.output
    out = CliRunner().invoke(app, [*recorded, "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["passed"] is False


def test_todays_model_predicts_the_measured_plans_again():
    """The default: each plan predicted by today's shipped model for the engine it ran on, so
    a result measured after the engine term was fitted is an out-of-sample check."""
    from mosaic.perf.repredict import Repredictor

    held_out = RESULTS / "compiled-profile-h200x2"
    r = iteration_error(held_out, repredict=Repredictor())
    assert r["predictions"] == "today's model" and r["count"] == 4 and r["not_predicted"] == 1
    assert r["max_abs_error"] <= 0.10
    out = CliRunner().invoke(app, ["model-error", "--iterations", str(held_out), "--json"])
    assert json.loads(out.output)["rows"] == json.loads(json.dumps(r["rows"]))


def test_repo_results_agree_with_the_recorded_errors():
    """The gate on the real tree: every row's error is the one bench_report recorded."""
    r = iteration_error(RESULTS)
    assert "h200-small/bench_clip.json" in r["files"] and r["count"] >= 38
    for row in r["rows"]:
        if row["error"] is None:  # a user program: nothing was predicted
            continue
        report = json.loads((RESULTS / row["file"]).read_text())
        recorded = {x["planner"]: x for x in report["results"]}
        assert row["error"] == pytest.approx(recorded[row["planner"]]["prediction_error"])
    assert r["passed"] == (r["max_abs_error"] <= 0.10 and r["median_abs_error"] <= 0.05)


def test_a_result_is_repredicted_with_the_module_facts_it_ran_on():
    """A zoo change (new kernels, recounted costs) changes module facts, and with them which
    profiled surface applies: a result that recorded its graph keeps its own facts."""
    from dataclasses import replace as replaced

    from mosaic.graph import MMGraph
    from mosaic.perf.results import graph_of
    from mosaic.zoo import get_model

    today = get_model("clip").graph("small")
    then = MMGraph(name=today.name, global_batch=today.global_batch, edges=today.edges,
                   modules=tuple(replaced(m, num_kernels=m.num_kernels + 7)
                                 for m in today.modules))
    report = {"model": "clip", "preset": "small", "global_batch": today.global_batch}
    assert graph_of(report) == today  # older results recorded none: today's zoo
    assert graph_of({**report, "graph": then.to_dict()}) == then
