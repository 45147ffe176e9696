"""`mosaic bench` logic on CPU: timings are meaningless here, the bookkeeping is not."""

import json
from dataclasses import replace

import pytest
import torch

from mosaic.engine.measure import BenchConfig, BenchError, bench_report, measure_plans
from mosaic.graph import MMGraph
from mosaic.hardware import H200
from mosaic.plan import Placement, Plan, Stage, gpu_memory_bytes
from mosaic.zoo import get_model
from tests.helpers import bench_plans, bench_two_ranks, drop_text_grads_of_mosaic


def test_bench_measures_every_plan_and_reports_ratios(tmp_path):
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=2, steps_per_round=2, warmup_steps=1, nvml_seconds=0,
                         user_programs=("torch-eager",))
    measurements, checks = measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)
    assert [m.label for m in measurements] == ["megatron", "mosaic", "torch-eager"]
    assert all(len(m.step_times_s) == 4 for m in measurements)
    # On a CPU the host computes as it launches: launching is nearly the whole step.
    assert all(len(m.launch_times_s) == 4 and 0.5 < m.summary()["host_launch_share"] <= 1.01
               for m in measurements)
    assert all(len(m.in_flight_step_times_s) == 2 for m in measurements)  # one a round
    assert {e["module"] for e in measurements[1].timeline} == set(graph.names)
    assert checks["gradients"]["reference"] == "torch-eager"
    seconds = [p["s"] for p in checks["phases"]]  # the start-up's phases, in order
    assert seconds == sorted(seconds) and checks["phases"][-1]["phase"].startswith("one traced")
    assert set(measurements[0].grad_error) == set(graph.names)
    assert max(measurements[1].grad_error.values()) < 1e-4  # fp32 on CPU: same math
    report = bench_report(graph, measurements, H200, "tiny", 1)
    json.dumps(report)  # serialisable
    assert MMGraph.from_dict(report["graph"]) == graph  # the module facts the plans ran on
    row = report["results"][1]
    assert {"planner", "measured_iteration_s", "spread_s", "predicted_iteration_s", "mfu"} <= row.keys()
    assert row["predicted_memory_bytes"] == max(gpu_memory_bytes(measurements[1].plan, graph)
                                                .values()) > 0
    assert report["results"][2]["predicted_memory_bytes"] is None  # a user program: no plan
    assert row["mfu_in_flight"] == pytest.approx(
        row["mfu"] * row["measured_iteration_s"] / row["in_flight_median_s"])
    assert row["speedup_in_flight_vs"]["torch-eager"] == pytest.approx(
        report["results"][2]["in_flight_median_s"] / row["in_flight_median_s"])
    assert report["mosaic_speedup_vs_best_baseline"] == pytest.approx(
        measurements[0].median_s / measurements[1].median_s)


def test_user_programs_that_cannot_fit_are_left_out_naming_what_would_run():
    """8 B parameters (128 GB of fp32 training states): DDP's replicas fit no H200, FSDP2's
    shards fit on two; on one GPU neither, and the reason says what would."""
    from mosaic.engine.measure import user_program_bytes, user_programs_that_fit
    from tests.helpers import encoders_and_head, spec

    graph = MMGraph(name="big", modules=(spec("llm", params_m=8000.0, layers=32),),
                    edges=(), global_batch=2)
    users = ("torch-compile", "torch-compile-fsdp")
    kept, left_out = user_programs_that_fit(graph, users, 2, H200)
    assert kept == ("torch-compile-fsdp",)
    fsdp = user_program_bytes(graph, "torch-compile-fsdp", 2) / 2**30
    assert "whole on every GPU (DDP)" in left_out["torch-compile"]
    assert f"torch-compile-fsdp (FSDP2 shards them: about {fsdp:.1f} GiB)" in left_out["torch-compile"]
    kept, left_out = user_programs_that_fit(graph, users, 1, H200)
    assert kept == () and "more GPUs" in left_out["torch-compile-fsdp"]
    small = encoders_and_head()
    assert user_programs_that_fit(small, users, 2, H200) == (users, {})


def test_the_plans_are_measured_without_a_user_program_that_cannot_fit(monkeypatch):
    from mosaic.engine import measure

    real = measure.user_program_bytes
    monkeypatch.setattr(measure, "user_program_bytes", lambda graph, label, world, k=1: (
        2.0**50 if label == "torch-compile" else real(graph, label, world, k)))
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=1, nvml_seconds=0,
                         in_flight_steps=0, user_programs=("torch-eager", "torch-compile"))
    measurements, checks = measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)
    assert [m.label for m in measurements] == ["megatron", "mosaic", "torch-eager"]
    assert "needs about 1048576.0 GiB" in checks["user_programs_left_out"]["torch-compile"]


def test_an_fsdp2_user_program_on_one_process_is_refused_before_anything_compiles(monkeypatch):
    from mosaic.engine import measure

    monkeypatch.setattr(measure, "_setup", lambda *args, **kwargs: pytest.fail("set up"))
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=1, nvml_seconds=0, user_programs=("torch-compile-fsdp",))
    with pytest.raises(BenchError, match=r"\['torch-compile-fsdp'\] shard the training states.*"
                                         r"torchrun --standalone --nproc-per-node N"):
        measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)


def test_user_programs_accumulate_as_many_micro_steps_as_the_plans(monkeypatch):
    """`--accumulation 2` on an LLM-sink model: the user program runs two micro-steps too, each
    loss halved and only the second synchronised, and its loss and gradients match the
    plans' (fp32 on CPU: the same math)."""
    from mosaic.engine.user_program import UserProgram

    micro_steps = []
    real = UserProgram._micro_step
    monkeypatch.setattr(UserProgram, "_micro_step", lambda self, data, scale, sync: (
        micro_steps.append((scale, sync)) or real(self, data, scale, sync)))
    model = get_model("qwen3-vl")
    graph = model.graph("tiny")
    plan = Plan(model="qwen3-vl", planner="megatron", num_gpus=1, stages=(
        Stage(placements=(Placement(module="vision", gpus=(0,)), Placement(module="text", gpus=(0,)))),
        Stage(placements=(Placement(module="llm", gpus=(0,)),))))
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=1, nvml_seconds=0,
                         in_flight_steps=0, user_programs=("torch-eager",),
                         engine=replace(BenchConfig().engine, accumulation=2))
    measurements, checks = measure_plans(model, "tiny", graph, {"megatron": plan}, H200, config)
    assert [m.label for m in measurements] == ["megatron", "torch-eager"]
    assert checks["gradients"]["reference"] == "torch-eager"
    assert max(measurements[0].grad_error.values()) < 1e-4
    assert micro_steps and micro_steps == [(2, False), (2, True)] * (len(micro_steps) // 2)


def test_the_bench_table_says_which_user_programs_were_left_out_and_why(capsys):
    from mosaic.report.bench_report import print_bench_table

    why = ("needs about 147.0 GiB per GPU (every module's training states whole on every GPU "
           "(DDP), and activations at 1 samples) but 125.1 GiB is usable on h200; it would run "
           "with torch-compile-fsdp (FSDP2 shards them: about 92.3 GiB)")  # one line, unwrapped
    print_bench_table({"model": "qwen3-vl", "preset": "paper", "global_batch": 2, "gpus": 2,
                       "hardware": "h200", "results": [], "date": "2026-12-05", "torch": "2.11",
                       "checks": {"user_programs_left_out": {"torch-compile": why}}})
    assert f"torch-compile: not measured: it {why}" in capsys.readouterr().out


def test_plans_measured_in_groups_are_each_set_up_from_the_same_weights_and_released(monkeypatch):
    """`--plans-at-once 1` (Unified-IO 2 `paper`: four plans' CUDA graph pools did not fit on
    the H200 together): each plan is built afresh from the seed, checked, timed and closed
    before the next; the user programs go with the first group, whose reference judges all."""
    import mosaic.engine.measure as measure

    model = get_model("clip")
    graph = model.graph("tiny")
    plans = bench_plans(graph)
    plans = {"megatron": plans["megatron"], "distmm": replace(plans["megatron"], planner="distmm"),
             "mosaic": plans["mosaic"]}
    closed, built = [], []
    close, setup = measure._close, measure._setup

    def counting_setup(*args, **kwargs):
        s = setup(*args, **kwargs)
        built.append((list(s.contenders), [p.detach().clone() for p in s.params]))
        return s

    monkeypatch.setattr(measure, "_setup", counting_setup)
    monkeypatch.setattr(measure, "_close", lambda cs: (closed.append(list(cs)), close(cs)))
    config = BenchConfig(rounds=1, steps_per_round=2, warmup_steps=0, nvml_seconds=0,
                         user_programs=("torch-eager",), plans_at_once=1)
    measurements, checks = measure_plans(model, "tiny", graph, plans, H200, config)
    assert [m.label for m in measurements] == ["megatron", "distmm", "mosaic", "torch-eager"]
    assert measurements[1].same_plan_as == "megatron"  # identical plans still measured once
    assert [labels for labels, _ in built] == [["megatron"], ["mosaic"]]  # user programs: later
    assert closed == [["megatron", "torch-eager"], ["mosaic"]]
    for a, b in zip(built[0][1], built[1][1], strict=True):  # each group starts from the seed
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert checks["plan_groups"] == [["megatron"], ["mosaic"]]
    assert [g["reference"] for g in checks["gradient_groups"]] == ["torch-eager"] * 2
    assert checks["peak_memory_bytes"] == [None, None]  # CPU: no GPU memory to count
    assert all(m.graph_memory_bytes is None and m.graph_reserved_bytes is None
               and m.graph_pool_bytes is None
               for m in measurements)
    assert all(m.step_times_s and m.grad_error for m in measurements)
    assert any(p["phase"].startswith("group 2 of 2 (mosaic)") for p in checks["phases"])
    with pytest.raises(BenchError, match="plans_at_once"):
        BenchConfig(plans_at_once=0)


def test_identical_plans_are_measured_once_and_reported_for_every_label():
    model = get_model("clip")
    graph = model.graph("tiny")
    plans = bench_plans(graph)
    plans = {"megatron": plans["megatron"], "distmm": replace(plans["megatron"], planner="distmm"),
             "mosaic": plans["mosaic"]}
    config = BenchConfig(rounds=1, steps_per_round=2, warmup_steps=0, nvml_seconds=0,
                         user_programs=())
    measurements, _ = measure_plans(model, "tiny", graph, plans, H200, config)
    rows = {m.label: m for m in measurements}
    assert list(rows) == ["megatron", "distmm", "mosaic"]
    assert rows["distmm"].same_plan_as == "megatron" and rows["mosaic"].same_plan_as is None
    assert rows["distmm"].step_times_s == rows["megatron"].step_times_s
    assert rows["distmm"].plan.planner == "distmm"
    report = bench_report(graph, measurements, H200, "tiny", 1)
    assert report["results"][1]["same_plan_as"] == "megatron"


def test_user_programs_can_be_timed_in_their_own_rounds_after_the_plans(monkeypatch):
    from mosaic.engine import measure

    model = get_model("clip")
    graph = model.graph("tiny")
    order: list[str] = []
    one_step = measure._one_step
    monkeypatch.setattr(measure, "_one_step",
                        lambda s, c: order.append(c.label) or one_step(s, c))
    config = BenchConfig(rounds=2, steps_per_round=1, warmup_steps=1, nvml_seconds=0,
                         user_programs=("torch-eager",), user_rounds="apart",
                         check_gradients=False)
    measurements, _ = measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)
    assert all(len(m.step_times_s) == 2 for m in measurements)
    timed = order[:9]  # warmup and rounds; the NVML and timeline steps come later
    assert timed[:6].count("torch-eager") == 0 and set(timed[6:9]) == {"torch-eager"}
    with pytest.raises(BenchError, match="user_rounds"):
        BenchConfig(user_rounds="sometimes")


def test_engine_variants_are_parsed_checked_and_labelled():
    from mosaic.engine.measure import engine_variant, parse_variant, variant_label
    from mosaic.engine.session import EngineConfig

    settings = parse_variant("grad_sync=bucketed, bucket_view=false")
    assert settings == {"grad_sync": "bucketed", "bucket_view": False}
    assert variant_label("megatron", settings) == "megatron@grad_sync=bucketed,bucket_view=false"
    assert engine_variant(EngineConfig(), settings).grad_sync == "bucketed"
    with pytest.raises(BenchError, match="compile"):
        engine_variant(EngineConfig(), {"compile": "default"})
    with pytest.raises(BenchError, match="bf16"):  # the engine's own check, named
        engine_variant(EngineConfig(), {"grad_sync": "bucketed", "reduce_dtype": "bf16"})
    with pytest.raises(BenchError, match="FIELD=VALUE"):
        parse_variant("bucketed")


def test_a_variant_plans_timeline_files_have_portable_names(tmp_path):
    from mosaic.report.bench_report import write_bench_timelines

    model = get_model("clip")
    graph = model.graph("tiny")
    plans = {"megatron@bucket_view=true": bench_plans(graph)["megatron"]}
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=())
    engines = {"megatron@bucket_view=true": replace(config.engine, bucket_view=True)}
    measurements, _ = measure_plans(model, "tiny", graph, plans, H200, config, engines)
    write_bench_timelines({"model": "clip", "preset": "tiny"}, measurements, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "megatron_bucket_view_true.png", "megatron_bucket_view_true.trace.json"]


def test_torch_trace_writes_each_contenders_timed_steps_under_its_portable_name(tmp_path):
    from mosaic.report.kernel_time import load_trace, summarise_trace_dir

    model = get_model("clip")
    graph = model.graph("tiny")
    plans = {"megatron@bucket_view=true": bench_plans(graph)["megatron"]}
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=("torch-eager",), torch_trace_dir=str(tmp_path))
    engines = {"megatron@bucket_view=true": replace(config.engine, bucket_view=True)}
    measurements, _ = measure_plans(model, "tiny", graph, plans, H200, config, engines)
    for m, stem in zip(measurements, ["megatron_bucket_view_true", "torch-eager"], strict=True):
        assert m.summary()["torch_trace"] == str(tmp_path / stem)
        trace = load_trace(tmp_path / stem / "trace-rank0.json.gz")
        marks = {e["name"] for e in trace["traceEvents"]
                 if e.get("name", "").startswith("ProfilerStep#")}
        assert len(marks) == 3 and any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
        assert summarise_trace_dir(tmp_path / stem) == [tmp_path / stem / "kernel-time-rank0.json"]
        summary = json.loads((tmp_path / stem / "kernel-time-rank0.json").read_text())
        assert summary == {"steps": 3, "devices": {}}  # a CPU run launches no GPU kernels


def test_a_plan_under_another_engine_is_measured_apart_from_itself():
    from mosaic.engine.session import EngineConfig
    from mosaic.perf.engine_term import engine_kind, row_engine

    model = get_model("clip")
    graph = model.graph("tiny")
    plans = bench_plans(graph)
    plans["megatron@bucket_view=true"] = plans["megatron"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=())
    engines = {"megatron@bucket_view=true": replace(config.engine, bucket_view=True)}
    measurements, _ = measure_plans(model, "tiny", graph, plans, H200, config, engines)
    rows = {m.label: m for m in measurements}
    assert rows["megatron@bucket_view=true"].same_plan_as is None  # not a twin: other engine
    assert rows["megatron@bucket_view=true"].engine_variant == {"bucket_view": True}
    report = {"engine": {"graphs": True, "compile": "default", "grad_sync": "ddp"}}
    row = {"engine_variant": {"grad_sync": "bucketed"}}
    assert engine_kind(row_engine(report, row)) == "graphs+compile-default+bucketed"
    assert isinstance(EngineConfig().bucket_view, bool)


def test_bench_refuses_multi_gpu_plans_in_one_process():
    model = get_model("clip")
    graph = model.graph("tiny")
    plan = Plan(model="clip", planner="megatron", num_gpus=2, stages=(
        Stage(placements=tuple(Placement(module=m, gpus=(0, 1)) for m in graph.names[:-1])),
        Stage(placements=(Placement(module="align", gpus=(0, 1)),))))
    with pytest.raises(BenchError, match="torchrun"):
        measure_plans(model, "tiny", graph, {"megatron": plan}, H200, BenchConfig())


def test_plan_groups_under_torchrun_join_a_new_process_group_each(tmp_path):
    """`--plans-at-once 1` on two gloo processes: every group starts and ends its own world."""
    report, _ = bench_two_ranks("clip", tmp_path, "--plans-at-once", "1", "--planners",
                                "megatron,mosaic", "--user-programs", "torch-eager")
    assert [r["planner"] for r in report["results"]] == ["megatron", "mosaic", "torch-eager"]
    assert report["checks"]["plan_groups"] == [["megatron"], ["mosaic"]]


@pytest.mark.slow
def test_bench_runs_multi_gpu_plans_under_torchrun(tmp_path):
    """Two gloo processes stand in for two GPUs: every planner's 2-GPU plan is measured, and
    the data-parallel ones once more on DDP, on DDP bucket views and summed during the
    backward (an A/B in one run against the default flat buffers; every row's gradients
    equal the reference's)."""
    report, _ = bench_two_ranks("clip", tmp_path, "--steps-per-round", "2",
                                "--user-programs", "torch-eager",
                                "--engine-variant", "grad_sync=ddp",
                                "--engine-variant", "grad_sync=ddp,bucket_view=true",
                                "--engine-variant", "grad_sync=overlapped")
    assert report["gpus"] == 2
    labels = {r["planner"] for r in report["results"]}
    variants = {label for label in labels if "@" in label}
    assert labels - variants == {"megatron", "distmm", "spindle", "mosaic", "torch-eager"}
    assert {"megatron@grad_sync=ddp", "megatron@grad_sync=ddp,bucket_view=true",
            "megatron@grad_sync=overlapped"} <= variants
    rows = {r["planner"]: r for r in report["results"]}
    assert rows["megatron@grad_sync=ddp"]["engine_variant"] == {"grad_sync": "ddp"}
    assert rows["megatron"]["engine_variant"] is None
    assert report["checks"]["gradients"]["tolerance"] <= 1e-3
    assert all(max(r["grad_error"].values()) < 1e-4 for r in report["results"])
    assert all(r["measured_iteration_s"] > 0 and r["num_steps"] == 1 for r in report["results"])


def test_a_plan_that_drops_a_modules_gradients_is_refused(monkeypatch):
    """The gradient check catches what the loss check cannot: a plan whose text encoder never
    receives its gradient still computes the same loss."""
    drop_text_grads_of_mosaic(monkeypatch)
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=("torch-eager",))
    with pytest.raises(BenchError, match="'mosaic'.*gradient of module 'text'"):
        measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)


def test_a_broken_plan_measured_in_a_later_group_is_refused_against_the_first_groups_reference(
        monkeypatch):
    """Alone in its group (`--plans-at-once 1`), a plan would agree with itself: it is judged
    against the first group's reference, kept on the host."""
    model = get_model("clip")
    graph = model.graph("tiny")
    drop_text_grads_of_mosaic(monkeypatch)
    plans = bench_plans(graph)
    for user_programs in (("torch-eager",), ()):  # the reference: torch-eager, else megatron
        config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                             user_programs=user_programs, plans_at_once=1)
        with pytest.raises(BenchError, match="'mosaic'.*gradient of module 'text'"):
            measure_plans(model, "tiny", graph, {"megatron": plans["megatron"],
                                                 "mosaic": plans["mosaic"]}, H200, config)


def _clip_plan(planner: str, sharded: bool) -> Plan:
    encoders = Stage(placements=tuple(Placement(module=m, gpus=(0, 1), shard=sharded)
                                      for m in ("vision", "text")))
    head = Stage(placements=(Placement(module="align", gpus=(0, 1)),))
    return Plan(model="clip", planner=planner, num_gpus=2, stages=(encoders, head))


def _qwen_plan(planner: str, sharded: bool) -> Plan:
    encoders = Stage(placements=tuple(Placement(module=m, gpus=(0, 1)) for m in ("vision", "text")))
    llm = Stage(placements=(Placement(module="llm", gpus=(0, 1), tensor_parallel=2 if sharded else 1),))
    return Plan(model="qwen3-vl", planner=planner, num_gpus=2, stages=(encoders, llm))


@pytest.mark.slow
@pytest.mark.parametrize(("model", "make_plan"), [("clip", _clip_plan), ("qwen3-vl", _qwen_plan)],
                         ids=["fsdp", "tensor-parallel"])
def test_bench_measures_a_sharded_plan_beside_a_plain_one(tmp_path, model, make_plan):
    """A plan that shards its modules (FSDP2, or TP) trains its own copy of them, so the plain
    plan keeps whole parameters; both pass the gradient check at the same weights (2 gloo
    ranks)."""
    plans = tmp_path / "plans"
    plans.mkdir()
    make_plan("megatron", False).save(plans / "megatron.json")
    make_plan("mosaic", True).save(plans / "mosaic.json")
    report, _ = bench_two_ranks(model, tmp_path / "out", "--planners", "megatron,mosaic",
                                "--plans", str(plans), "--steps-per-round", "2",
                                "--user-programs", "none")
    rows = {r["planner"]: r for r in report["results"]}
    assert set(rows) == {"megatron", "mosaic"}
    placed = [p for s in rows["mosaic"]["plan"]["stages"] for p in s["placements"]]
    assert any(p["shard"] or p["tensor_parallel"] > 1 for p in placed)
    assert max(rows["mosaic"]["grad_error"].values()) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(("users", "rounds", "reference"),
                         [("torch-eager,torch-compile-fsdp", "interleaved", "torch-eager"),
                          ("torch-eager-fsdp", "alone", "torch-eager-fsdp")],
                         ids=["compiled-beside-ddp", "alone"])
def test_the_users_fsdp2_program_trains_its_own_copy_beside_the_plans(tmp_path, users, rounds,
                                                                      reference):
    """The FSDP2 user program shards its own copy of the modules: the plans' shared modules
    stay whole (their gradients still match after it is set up). Compiled as the bench
    compiles (its first call compiles the backward on a throwaway forward, which must leave
    FSDP2's gradients alone; ~30 s of Inductor on two cores). `--user-rounds alone`: the
    user program is measured in a group of its own first (no plan's modules built beside it)
    and is the reference the plans' group is judged against. 2 gloo ranks."""
    fsdp = users.split(",")[-1]
    compiled = ["--compile", "default"] if fsdp == "torch-compile-fsdp" else []
    report, _ = bench_two_ranks("clip", tmp_path, "--planners", "megatron", "--steps-per-round",
                                "2", "--user-programs", users, "--user-rounds", rounds, *compiled)
    rows = {r["planner"]: r for r in report["results"]}
    assert set(rows) == {"megatron", *users.split(",")}
    assert report["checks"]["gradients"]["reference"] == reference
    assert report["checks"].get("plan_groups") == ([[], ["megatron"]] if rounds == "alone"
                                                   else None)
    if rounds == "alone":  # the plans' group is judged against the user program's gradients
        assert [g["reference"] for g in report["checks"]["gradient_groups"]] == [reference] * 2
    assert all(max(r["grad_error"].values()) < 1e-4 for r in rows.values())
    assert rows[fsdp]["measured_iteration_s"] > 0
    if compiled:
        assert {f"{fsdp}/{m}" for m in ("vision", "text", "align")} <= set(
            report["checks"]["compile"]["compiled"])


def test_the_fsdp2_program_gathering_bf16_weights_is_of_the_bf16_kernel_class():
    from types import SimpleNamespace

    from mosaic.engine import measure

    def contender(param_dtype):
        return SimpleNamespace(session=None, program=SimpleNamespace(param_dtype=param_dtype))

    assert measure._kernel_class(contender(torch.bfloat16)) == "bf16 weights"
    assert measure._kernel_class(contender(None)) == "fp32 weights"


def test_a_plan_sharding_a_module_under_autocast_is_of_the_bf16_kernel_class():
    """Its sharded module is gathered in bf16 (fsdp.gather_dtype), so it computes as a
    bf16-weights plan does; without autocast, or sharding nothing, it stays fp32."""
    from types import SimpleNamespace

    from mosaic.engine import measure
    from mosaic.plan import Placement, Plan, Stage

    def contender(shard: bool, amp: bool):
        plan = Plan(model="m", planner="p", num_gpus=2, stages=(Stage(placements=(
            Placement(module="llm", gpus=(0, 1), shard=shard),)),))
        session = SimpleNamespace(plan=plan, config=SimpleNamespace(bf16_weights=False),
                                  runner=SimpleNamespace(amp=amp))
        return SimpleNamespace(session=session, program=None)

    assert measure._kernel_class(contender(shard=True, amp=True)) == "bf16 weights"
    assert measure._kernel_class(contender(shard=True, amp=False)) == "fp32 weights"
    assert measure._kernel_class(contender(shard=False, amp=True)) == "fp32 weights"


def test_gradients_are_compared_a_parameter_and_a_chunk_at_a_time_as_one_norm_would(monkeypatch):
    """The reference's flat gradient is written a parameter at a time on the host; a
    contender's gradients are compared with it a parameter, and within one a chunk, at a time
    (memory); the numbers are those of one whole norm, a missing gradient counting as zeros."""
    from torch import nn

    from mosaic.engine import measure

    monkeypatch.setattr(measure, "COMPARE_CHUNK", 7)
    params = [nn.Parameter(torch.ones(4, 5)), nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(9))]
    params[0].grad, params[2].grad = torch.full((4, 5), 2.0), torch.full((9,), 3.0)
    flat = measure._flat_grad(params, torch.device("cpu"))
    assert flat.tolist() == [2.0] * 20 + [0.0] * 4 + [3.0] * 9
    generator = torch.Generator().manual_seed(0)
    ref = torch.randn(flat.numel(), generator=generator)
    norm, distance = measure._module_norm_and_distance(ref, params, torch.device("cpu"))
    assert norm == pytest.approx(float(ref.norm()), rel=1e-6)
    assert distance == pytest.approx(float((flat - ref).norm()), rel=1e-6)


def test_running_out_of_gpu_memory_names_the_phase_and_the_fix(monkeypatch):
    from mosaic.engine import measure

    def out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 13.04 GiB")

    monkeypatch.setattr(measure, "_timed_rounds", out_of_memory)
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=())
    with pytest.raises(BenchError, match=r"out of GPU memory \(it tried to allocate 13.04 GiB\) "
                                         r"after 'gradients checked.*2 plan\(s\).*--planners "
                                         r"mosaic") as caught:
        measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    alone = {"megatron": bench_plans(graph)["megatron"]}
    with pytest.raises(BenchError, match=r"1 plan\(s\).*measured alone already: a smaller "
                                         r"--batch, or --accumulation N") as caught:
        measure_plans(model, "tiny", graph, alone, H200, config)
    assert "--plans-at-once" not in str(caught.value)


def overlapped_against_one_optimizer(device: str, graphs: bool, steps: int = 3,
                                     bf16_weights: bool = False, planner: str = "mosaic"):
    """Parameters after `steps` steps of the same plan, stepped by one AdamW after the
    backward and by an OverlappedOptimizer (per module, on the modules' streams on CUDA);
    with `bf16_weights`, MainWeightsAdamW over the modules' bf16 weights."""
    from mosaic.engine.main_weights import MainWeightsAdamW, cast_weights_bf16
    from mosaic.engine.session import (
        EngineConfig,
        OverlappedOptimizer,
        RankSession,
        build_modules,
        end_distributed,
        make_batch,
        make_optimizer,
        start_distributed,
    )

    model = get_model("imagebind")
    graph = model.graph("tiny")
    plan = bench_plans(graph)[planner]
    d = start_distributed(device)
    states, ready = {}, {}
    try:
        for kind in ("one", "overlapped"):
            modules = build_modules(model, "tiny", graph.names, 0, d.device)
            if bf16_weights:
                cast_weights_bf16(modules.values(), min_elements=1)  # tiny's weights are small
            engine = EngineConfig(graphs=graphs, amp=True if bf16_weights else None,
                                  bf16_weights=bf16_weights)
            session = RankSession.create(plan, graph, modules, d, H200, engine)

            def make(params):
                return (MainWeightsAdamW(params, 1e-3) if bf16_weights
                        else make_optimizer("adamw", params, 1e-3))

            optimizer = (make(session.parameters()) if kind == "one"
                         else OverlappedOptimizer(session, make))
            data = session.local_batch(make_batch(model, "tiny", graph.global_batch, 0, 0))
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                out = session.step(data)
                optimizer.step()
                if graphs and step == 0:
                    session.capture_graphs()
            ready[kind] = set(out.grads_ready)
            states[kind] = {f"{m}.{n}": p.detach().float().cpu().clone()
                            for m, mod in modules.items() for n, p in mod.named_parameters()}
            session.close()
    finally:
        end_distributed(d)
    return states, ready, graph


@pytest.mark.parametrize("bf16_weights", [False, True])
def test_the_overlapped_optimizer_updates_as_one_optimizer_does(bf16_weights):
    states, ready, _ = overlapped_against_one_optimizer("cpu", graphs=False,
                                                        bf16_weights=bf16_weights)
    assert ready["overlapped"] == set()  # no streams on the CPU: every module steps after the join
    for name, want in states["one"].items():
        torch.testing.assert_close(states["overlapped"][name], want, rtol=0, atol=0, msg=name)


def test_optimizer_overlap_is_a_variant_of_every_plan_and_refused_by_the_trainer():
    from mosaic.engine.measure import parse_variant, variant_applies
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, TrainError

    graph = get_model("clip").graph("tiny")
    settings = parse_variant("optimizer_overlap=true")
    assert settings == {"optimizer_overlap": True}
    assert variant_applies(bench_plans(graph)["megatron"], settings)  # one GPU: no gradient sync
    plans = bench_plans(graph)
    plans["mosaic@optimizer_overlap=true"] = plans["mosaic"]
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=())
    engines = {"mosaic@optimizer_overlap=true": replace(config.engine, optimizer_overlap=True)}
    measurements, _ = measure_plans(get_model("clip"), "tiny", graph, plans, H200, config, engines)
    row = {m.label: m for m in measurements}["mosaic@optimizer_overlap=true"]
    assert row.engine_variant == {"optimizer_overlap": True} and row.median_s > 0
    with pytest.raises(TrainError, match="optimizer_overlap"):
        TrainConfig(model="clip", preset="tiny", plan=plans["mosaic"],
                    engine=EngineConfig(optimizer_overlap=True))


def test_the_user_program_with_tuned_kernels_is_asked_for_not_run_by_default():
    from mosaic.engine.measure import USER_PROGRAMS

    assert BenchConfig().user_programs == ("torch-eager", "torch-compile")
    assert USER_PROGRAMS["torch-compile-max-autotune"] == "max-autotune"
    assert USER_PROGRAMS["torch-compile-max-autotune-gemm"] == "reduce-overhead-max-autotune-gemm"
    BenchConfig(user_programs=("torch-compile-max-autotune", "torch-compile-max-autotune-gemm"))


def test_a_bench_stopped_by_sigterm_keeps_the_groups_it_measured(monkeypatch):
    """A time limit (`timeout`, torchrun) sends SIGTERM: the plans measured by then, the
    phase reached and the compile report come back; the signal handler is put back."""
    import os
    import signal

    from mosaic.engine import measure

    timed = measure._timed_rounds
    calls = []

    def second_group_stopped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return timed(*args, **kwargs)

    monkeypatch.setattr(measure, "_timed_rounds", second_group_stopped)
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=1, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=("torch-eager",), plans_at_once=1)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(measure.BenchInterrupted, match="SIGTERM") as caught:
        measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)
    stop = caught.value
    assert [m.label for m in stop.measurements] == ["megatron", "torch-eager"]
    assert stop.phase.startswith("group 2 of 2 (mosaic): gradients checked")
    assert stop.checks["plan_groups"] == [["megatron"], ["mosaic"]]
    assert stop.checks["phases"][-1]["phase"] == stop.phase and "compile" in stop.checks
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_bench_stopped_after_its_timed_rounds_keeps_their_times(monkeypatch):
    """SIGTERM while the traced steps are taken, after the timed rounds (Qwen3-VL `small` on
    the H200 lost three measured rounds so): the rounds' step times come back."""
    import os
    import signal

    from mosaic.engine import measure

    def stopped_while_tracing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(measure, "_timeline", stopped_while_tracing)
    model = get_model("clip")
    graph = model.graph("tiny")
    config = BenchConfig(rounds=2, steps_per_round=1, warmup_steps=0, nvml_seconds=0,
                         user_programs=("torch-eager",))
    with pytest.raises(measure.BenchInterrupted) as caught:
        measure_plans(model, "tiny", graph, bench_plans(graph), H200, config)
    stop = caught.value
    assert stop.phase == "2 timed round(s) done"
    assert {m.label for m in stop.measurements} == {"megatron", "mosaic", "torch-eager"}
    assert all(len(m.step_times_s) == 2 and m.timeline == [] for m in stop.measurements)
    assert stop.checks["gradients"]["tolerance"] > 0 and stop.checks["peak_memory_bytes"]


@pytest.mark.slow
def test_mosaic_bench_killed_by_a_time_limit_writes_what_it_had(tmp_path):
    """End to end: SIGTERM to a running `mosaic bench` (as `timeout` sends it) once it has
    set its plans up; it exits 143 having written bench.json, marked incomplete."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    bench = subprocess.Popen(
        # `small` on a CPU: its first eager step takes seconds, so the signal lands inside it.
        [sys.executable, "-m", "mosaic", "bench", "clip", "--preset", "small", "--batch", "2",
         "--planners", "megatron", "--perf-model", "analytic", "--cpu-smoke",
         "--user-programs", "torch-eager", "--out", str(out)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in bench.stderr:
        if "set up" in line:
            bench.send_signal(signal.SIGTERM)
            break
    err = bench.stderr.read()
    assert bench.wait(timeout=120) == 143, err
    report = json.loads((out / "bench.json").read_text())
    assert report["complete"] is False and report["results"] == []
    assert report["interrupted"]["after_phase"] == "1 plan(s) set up"
    assert "stopped by SIGTERM" in err and "bench.json" in err


def test_graph_pools_are_the_segments_outside_the_default_pool_on_that_gpu():
    from mosaic.engine.measure import private_pool_bytes

    segments = [{"device": 0, "total_size": 100, "segment_pool_id": (0, 0)},
                {"device": 0, "total_size": 30, "segment_pool_id": (1, 2)},
                {"device": 0, "total_size": 5, "segment_pool_id": (1, 3)},
                {"device": 1, "total_size": 70, "segment_pool_id": (1, 2)}]
    assert private_pool_bytes(segments, 0) == 35
    assert private_pool_bytes(segments, 1) == 70
    assert private_pool_bytes([], 0) == 0


def test_a_contender_of_other_kernels_is_held_to_the_eager_vs_compiled_floor():
    """Against a compiled fp32 reference, torch-compile (the same kernels) differs by 0.0007
    (Qwen3-VL `small` b8, H200), bf16-weight plans (other kernels) by 0.019, as compiled
    programs from eager ones: those get the eager-vs-compiled tolerance, the rest stay tight,
    and a dropped gradient is refused either way."""
    from types import SimpleNamespace

    from mosaic.engine import measure

    s = SimpleNamespace(device=torch.device("cuda"), engine=SimpleNamespace(compile="default"))
    errors = {"megatron": {"llm": 0.0}, "torch-compile": {"llm": 0.0007},
              "megatron@bf16_weights=true": {"llm": 0.019}}
    checks = measure._gradient_tolerance(s, "megatron", errors)
    assert checks["tolerance"] == pytest.approx(0.0028)
    assert checks["tolerance_other_kernels"] == pytest.approx(4 * measure.COMPILED_NOISE_FLOOR)
    checks["other_kernels"] = ["megatron@bf16_weights=true"]
    measure._refuse_differing(errors, "megatron", checks)
    with pytest.raises(measure.BenchError, match=r"'llm' differs .* by 0.019 .*tolerance 0.0028"):
        measure._refuse_differing({"mosaic": {"llm": 0.019}}, "megatron", checks)
    with pytest.raises(measure.BenchError, match="every module: vision 1, llm 0.01"):
        measure._refuse_differing({"megatron@bf16_weights=true": {"vision": 1.0, "llm": 0.01}},
                                  "megatron", checks)
    eager = measure._gradient_tolerance(s, "torch-eager", {"torch-compile": {"llm": 0.02}})
    assert eager["tolerance_other_kernels"] == eager["tolerance"] == pytest.approx(0.08)
    # The reference's gradients come from a second step of it: its own difference is
    # run-to-run noise (atomics), a floor too (Unified-IO 2 `paper` audio: 0.006).
    rerun = measure._gradient_tolerance(s, "megatron", {**errors, "megatron": {"audio": 0.006}})
    assert rerun["rerun_difference"] == 0.006 and rerun["tolerance"] == pytest.approx(0.024)
    alone = measure._gradient_tolerance(s, "megatron", {"megatron": {"audio": 0.05}})
    assert alone["tolerance"] == pytest.approx(0.2)  # above the assumed 0.03, capped


def test_a_refused_bench_writes_the_groups_before_and_every_difference(tmp_path, monkeypatch,
                                                                       capsys):
    """`mosaic bench` refusing a plan whose gradients differ exits 2 and still writes
    bench.json: the groups measured before it, the refusal, and every contender's per-module
    differences (a refusal on the H200 once left an empty file, so noise could not be told
    from a defect)."""
    from mosaic.cli import main

    drop_text_grads_of_mosaic(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as code:
        main(["bench", "clip", "--preset", "tiny", "--planners", "megatron,mosaic",
              "--perf-model", "analytic", "--cpu-smoke", "--user-programs", "",
              "--plans-at-once", "1", "--out", str(out)])
    assert code.value.code == 2
    assert "refused 'mosaic'" in capsys.readouterr().err
    report = json.loads((out / "bench.json").read_text())
    assert report["complete"] is False
    assert report["refused"]["contender"] == "mosaic" and report["refused"]["module"] == "text"
    assert [r["planner"] for r in report["results"]] == ["megatron"]
    differences = report["checks"]["gradients"]["differences"]
    assert differences["mosaic"]["text"] == pytest.approx(1.0)


@pytest.mark.parametrize("device, bf16, asked, warm", [
    ("cuda", True, 2, 3), ("cuda", True, 5, 5), ("cuda", False, 2, 3), ("cpu", True, 2, 2)])
def test_plans_warm_up_until_their_update_is_captured(device, bf16, asked, warm):
    """A plan's optimizer (MainWeightsAdamW, fp32 or bf16 weights) captures its update only
    after steps in a row with the same gradients; timed before that, its update ran eagerly
    (autotune's two warm-up steps timed a per-weight update 2.3x slow on the H200). A CPU
    captures nothing; a user's program keeps the warm-up asked for."""
    from types import SimpleNamespace

    from mosaic.engine.main_weights import STEPS_BEFORE_CAPTURE
    from mosaic.engine.measure import _warmup_steps

    setup = SimpleNamespace(device=torch.device(device))
    contender = SimpleNamespace(session=SimpleNamespace(config=SimpleNamespace(bf16_weights=bf16)))
    assert STEPS_BEFORE_CAPTURE + 1 == 3
    assert _warmup_steps(setup, contender, BenchConfig(warmup_steps=asked)) == warm
    user_program = SimpleNamespace(session=None)
    assert _warmup_steps(setup, user_program, BenchConfig(warmup_steps=asked)) == asked
