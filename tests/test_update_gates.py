"""The update under the next step's forward (engine/update_gates.py): its groups, its slots,
its arithmetic against MainWeightsAdamW's, and where it is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from mosaic.bench import BenchConfig, measure_plans
from mosaic.engine.compile import CompiledModule, CompileReport, repeated_block_lists
from mosaic.engine.gate_slot import GateSlot
from mosaic.engine.update_gates import UpdateGates
from mosaic.hardware import H200
from mosaic.zoo import get_model
from tests.helpers import bench_plans


def _imagebind_tiny():
    from mosaic.engine.session import build_modules

    model = get_model("imagebind")
    graph = model.graph("tiny")
    return graph, build_modules(model, "tiny", graph.names, 0, torch.device("cpu"))


def test_the_gates_hold_every_parameter_once_in_forward_order():
    graph, modules = _imagebind_tiny()
    order = list(graph.names)
    gates = UpdateGates(order, modules, torch.device("cpu"))
    grouped = [id(p) for _, params in gates.groups for p in params]
    assert sorted(grouped) == sorted(id(p) for m in modules.values() for p in m.parameters())
    blocks = {m: [b for _, bl in repeated_block_lists(modules[m]) for b in bl] for m in order}
    assert sum(map(len, blocks.values())) == len(gates.block_events) > 0
    assert set(gates.module_events) == set(order)
    # Each module's own parameters come before its blocks', and its blocks in their order.
    expected = []
    for m in order:
        inside = {id(p) for b in blocks[m] for p in b.parameters()}
        expected += [id(p) for p in modules[m].parameters() if id(p) not in inside]
        expected += [id(p) for b in blocks[m] for p in b.parameters()]
    assert grouped == expected


def test_a_slot_waits_only_inside_a_gated_forward():
    block = nn.Linear(4, 4)
    slot = GateSlot(block, block)
    x = torch.ones(2, 4)
    torch.testing.assert_close(slot(x), block(x))
    assert slot.key == id(block) and list(slot.parameters()) == list(block.parameters())


def test_a_module_compiled_by_blocks_calls_each_block_through_a_slot():
    _, modules = _imagebind_tiny()
    name, module = next((m, mod) for m, mod in modules.items() if repeated_block_lists(mod))
    compiled = CompiledModule(name, module, "default", CompileReport(), scope="blocks")
    (path, blocks), *_ = repeated_block_lists(module)
    view = compiled._compiled.get_submodule(path)
    assert all(isinstance(slot, GateSlot) for slot in view)
    assert [slot.key for slot in view] == [id(b) for b in blocks]


def gated_against_plain(device: str, graphs: bool, steps: int = 3, defer: bool = False,
                        planner: str = "mosaic", flat: bool = True, delay_cycles: int = 0,
                        compiled: bool = False, delay_within: bool = False, update_sms: int = 0,
                        model_name: str = "imagebind", preset: str = "tiny"):
    """Parameters after `steps` steps of a plan of ImageBind `tiny` with bf16 weights,
    updated by MainWeightsAdamW after the backward and by GatedMainWeightsAdamW (with `defer`,
    under the next step's forward once the gradients stay put; `delay_cycles`: the update
    stream sleeps that long before each update, so a forward that did not wait for it would
    read the weights before it; `delay_within`: it sleeps after each module's own update
    instead, before the module's blocks', so only each block's own wait keeps the forward from
    reading them early, and gradients the forward may overwrite would be read late);
    `update_sms`: the update's stream a green context of that many SMs)."""
    from mosaic.engine.compile import compile_modules
    from mosaic.engine.main_weights import MainWeightsAdamW, cast_weights_bf16
    from mosaic.engine.session import (
        EngineConfig,
        RankSession,
        build_modules,
        end_distributed,
        make_batch,
        start_distributed,
    )
    from mosaic.engine.update_gates import GatedMainWeightsAdamW

    model = get_model(model_name)
    graph = model.graph(preset)
    plan = bench_plans(graph)[planner] if "align" in graph.names else _one_by_one(graph)
    d = start_distributed(device)
    states, deferred = {}, 0
    try:
        for kind in ("plain", "gated"):
            modules = build_modules(model, preset, graph.names, 0, d.device)
            cast_weights_bf16(modules.values(), min_elements=1)  # tiny's weights are small
            engine = EngineConfig(graphs=graphs, bf16_weights=True, bf16_flat_grads=flat,
                                  update_under_forward=kind == "gated",
                                  update_sms=update_sms if kind == "gated" else 0)
            views = (compile_modules(modules, "default", scope="blocks")[0] if compiled
                     else None)
            session = RankSession.create(plan, graph, modules, d, H200, engine, views=views)
            optimizer = (MainWeightsAdamW(session.parameters(), 1e-3) if kind == "plain" else
                         GatedMainWeightsAdamW(session.parameters(), 1e-3, gates=session.gates))
            data = session.local_batch(make_batch(model, preset, graph.global_batch, 0, 0))
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                session.step(data)
                if kind == "gated" and delay_cycles and not delay_within:
                    _sleep_before_update(session.gates.stream, delay_cycles)
                if kind == "gated" and delay_cycles and delay_within and step == 0:
                    _sleep_after_module_updates(session.gates, delay_cycles)
                optimizer.step()
                if graphs and step == 0:
                    session.capture_graphs()
                if kind == "gated" and defer and session.runner.grads_stay_put:
                    optimizer.defer = True
                    deferred += 1
            if kind == "gated":
                optimizer.settle()
            states[kind] = {f"{m}.{n}": p.detach().float().cpu().clone()
                            for m, mod in modules.items() for n, p in mod.named_parameters()}
            session.close()
    finally:
        end_distributed(d)
    return states, deferred


def _one_by_one(graph):
    """Megatron's one-GPU plan: every module in a temporal stage of its own, in graph order."""
    from mosaic.plan import Placement, Plan, Stage

    stages = tuple(Stage(placements=(Placement(module=m, gpus=(0,)),)) for m in graph.topo_order())
    return Plan(model=graph.name, planner="megatron", num_gpus=1, stages=stages,
                predicted_iteration_s=0.01)


def _sleep_after_module_updates(gates, cycles: int) -> None:
    record = gates.record
    module_events = {id(event) for event in gates.module_events.values()}

    def record_then_sleep(event) -> None:
        record(event)
        if id(event) in module_events:
            torch.cuda._sleep(cycles)

    gates.record = record_then_sleep


def _sleep_before_update(stream, cycles: int) -> None:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)


@pytest.mark.parametrize("model_name", ["imagebind", "unified-io-2"])
def test_the_gated_update_computes_what_main_weights_adamw_does(model_name):
    states, _ = gated_against_plain("cpu", graphs=False, model_name=model_name)
    for name, want in states["plain"].items():
        torch.testing.assert_close(states["gated"][name], want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("settings", "message"), [
    ({}, "set bf16_weights=True too"),
    ({"bf16_weights": True, "accumulation": 2}, "accumulation=2"),
    ({"bf16_weights": True, "optimizer_overlap": True}, "choose one"),
])
def test_update_under_forward_is_refused_where_it_cannot_run(settings, message):
    from mosaic.engine.session import EngineConfig, SessionError

    with pytest.raises(SessionError, match=message):
        EngineConfig(update_under_forward=True, **settings)


def test_update_under_forward_is_a_bench_variant_and_refused_by_the_trainer():
    from mosaic.engine.measure import parse_variant, variant_applies
    from mosaic.engine.session import EngineConfig
    from mosaic.engine.trainer import TrainConfig, TrainError

    graph = get_model("clip").graph("tiny")
    settings = parse_variant("bf16_weights=true,update_under_forward=true")
    assert settings == {"bf16_weights": True, "update_under_forward": True}
    assert variant_applies(bench_plans(graph)["megatron"], settings)
    plans = bench_plans(graph)
    label = "mosaic@bf16_weights=true,update_under_forward=true"
    plans[label] = plans["mosaic"]
    config = BenchConfig(rounds=1, steps_per_round=2, warmup_steps=0, nvml_seconds=0,
                         user_programs=(), engine=EngineConfig(amp=True))  # as on a GPU
    engines = {label: replace(config.engine, **settings)}
    measurements, _ = measure_plans(get_model("clip"), "tiny", graph, plans, H200, config, engines)
    row = {m.label: m for m in measurements}[label]
    assert row.engine_variant == settings and row.median_s > 0
    with pytest.raises(TrainError, match="update_under_forward"):
        TrainConfig(model="clip", preset="tiny", plan=plans["mosaic"],
                    engine=EngineConfig(bf16_weights=True, update_under_forward=True))



def _gated_optimizer():
    from mosaic.engine.main_weights import cast_weights_bf16
    from mosaic.engine.update_gates import GatedMainWeightsAdamW

    blocks = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    cast_weights_bf16([blocks], min_elements=1)
    gates = UpdateGates(["m"], {"m": blocks}, torch.device("cpu"))
    return GatedMainWeightsAdamW(list(blocks.parameters()), 1e-3, gates=gates)


@pytest.mark.parametrize("stay_put", [True, False])
def test_a_deferred_contender_is_timed_from_the_end_of_its_step_before(monkeypatch, stay_put):
    """Its update runs past its step's end, so each timed window starts where the step before
    ended (after one untimed step), and the update is waited for once the steps are done.
    Where gradients do not stay put it is not deferred, and the bench says so."""
    from types import SimpleNamespace

    from mosaic.engine import measure

    optimizer = _gated_optimizer()
    settled, calls = [], []
    monkeypatch.setattr(optimizer, "settle", lambda: settled.append(optimizer.defer))

    def one_step(s, c, since=None):
        calls.append((since, optimizer.defer))
        c.last_end = len(calls)
        return 0.01, 0.001

    monkeypatch.setattr(measure, "_one_step", one_step)
    runner = SimpleNamespace(grads_stay_put=stay_put)
    c = SimpleNamespace(label="gated", optimizer=optimizer, session=SimpleNamespace(runner=runner),
                        last_end=None)
    if not stay_put:
        with pytest.warns(UserWarning, match="waits for itself"):
            times = measure._timed_steps(SimpleNamespace(optimizer=None), c, 3)
        assert calls == [(None, False)] * 3 and settled == [] and len(times) == 3
        return
    times = measure._timed_steps(SimpleNamespace(optimizer=None), c, 3)
    assert len(times) == 3
    assert calls == [(None, True), (1, True), (2, True), (3, True)]
    assert settled == [False] and optimizer.defer is False


@pytest.mark.parametrize("loss", [1.0, float("nan")])
def test_steps_in_flight_are_read_once_and_their_window_holds_the_last_update(monkeypatch, loss):
    """The in-flight window: steps and updates launched back to back between two marks, the
    deferred update waited for before the end mark (the window holds all of it), the summed
    losses read once after; a non-finite loss in any step is refused."""
    from types import SimpleNamespace

    from mosaic.engine import measure

    optimizer = _gated_optimizer()
    events = []
    monkeypatch.setattr(optimizer, "settle", lambda: events.append(("settle", optimizer.defer)))
    monkeypatch.setattr(optimizer, "step", lambda: events.append("update"))

    class Timer:
        def mark(self):
            events.append("mark")

        def seconds(self, start, end):
            return 0.05

    def step():
        events.append("step")
        return torch.tensor(loss if len(events) > 3 else 1.0)

    s = SimpleNamespace(optimizer=None, timer=Timer(), contenders={}, params=[],
                        device=torch.device("cpu"))
    c = SimpleNamespace(label="gated", optimizer=optimizer, step=step,
                        session=SimpleNamespace(runner=SimpleNamespace(grads_stay_put=True)))
    if loss != loss:
        with pytest.raises(measure.BenchError, match="'gated': loss became non-finite"):
            measure._in_flight_step(s, c, 5)
        return
    assert measure._in_flight_step(s, c, 5) == pytest.approx(0.01)
    assert events == (["mark"] + ["step", "update"] * 5
                      + [("settle", True), "mark", ("settle", False)])


def test_the_update_streams_sms_are_a_whole_number_for_the_gated_update_only():
    from mosaic.engine.measure import BenchError, parse_variant
    from mosaic.engine.session import EngineConfig, SessionError

    assert parse_variant("update_under_forward=true,update_sms=48") == {
        "update_under_forward": True, "update_sms": 48}
    with pytest.raises(BenchError, match="update_sms is a whole number"):
        parse_variant("update_sms=half")
    with pytest.raises(SessionError, match="set that too"):
        EngineConfig(bf16_weights=True, update_sms=48)
    with pytest.raises(SessionError, match="must be >= 0"):
        EngineConfig(bf16_weights=True, update_under_forward=True, update_sms=-8)


@pytest.mark.parametrize(("mode", "outlive", "stays"), [
    ("own", False, False), ("own", True, True), ("copy", True, True), (None, True, False)])
def test_gradients_stay_put_only_where_no_forward_graph_reuses_them(mode, outlive, stays):
    """A deferred update reads the gradients while the next forward runs: graph-owned
    gradients ("own") qualify only from a backward graph whose memory pool the forward graph
    does not share (graphed.py); flat copies ("copy") always; autograd's (None) never."""
    from dataclasses import replace as replaced
    from types import SimpleNamespace

    from mosaic.engine.session import (
        EngineConfig,
        RankSession,
        build_modules,
        end_distributed,
        start_distributed,
    )

    model = get_model("imagebind")
    graph = model.graph("tiny")
    d = start_distributed("cpu")
    try:
        modules = build_modules(model, "tiny", graph.names, 0, d.device)
        session = RankSession.create(bench_plans(graph)["megatron"], graph, modules, d, H200,
                                     EngineConfig())
        runner = session.runner
        runner.graphed = True  # as after capture on a GPU
        runner._homes = {m: replaced(h, graph_mode=mode) for m, h in runner._homes.items()}
        runner._in_graph = {m: [SimpleNamespace(grads_outlive_forward=outlive)]
                            for m in runner.local} if mode else {}
        assert runner.grads_stay_put is stays
        session.close()
    finally:
        end_distributed(d)
