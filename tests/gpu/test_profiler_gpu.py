"""The profiler's GPU mechanics: a module graphed on quota'd streams gets slower with fewer SMs."""

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bank():
    from mosaic.hardware import H200
    from mosaic.profile.graph_timing import StreamBank

    bank = StreamBank(H200)
    yield bank
    bank.close()


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(2048, 2048), nn.GELU())]
    module = nn.Sequential(*layers).cuda()
    x = torch.randn(8192, 2048, device="cuda", requires_grad=True)
    return module, x


def test_fewer_sms_is_slower(bank):
    from mosaic.profile.graph_timing import GraphBench, TimingConfig, time_group

    module, x = _mlp()
    bench = GraphBench(module, [x])
    times = {}
    for k in (16, 128):
        sms = min(v for v in bank.sm_values if v >= k)
        stream = bank.stream(sms)[1]
        graph = bench.capture(stream)
        times[k] = time_group([(graph.replay, stream)], TimingConfig(clock=bank.clock)).median_s
    assert times[16] > 2.0 * times[128], times


def test_colocated_group_times_each_member(bank):
    from mosaic.profile.graph_timing import GraphBench, TimingConfig, time_group

    module_a, xa = _mlp()
    module_b, xb = _mlp()
    _, streams, got = bank.group("partition", [64, 64], [0, 0])
    assert got[0] == 64 and got[1] >= 64
    graphs = [GraphBench(m, [x]).capture(s)
              for m, x, s in zip((module_a, module_b), (xa, xb), streams, strict=True)]
    alone = time_group([(graphs[0].replay, streams[0])], TimingConfig(clock=bank.clock))
    both = time_group([(g.replay, s) for g, s in zip(graphs, streams, strict=True)], TimingConfig(clock=bank.clock))
    assert len(both.members_s) == 2 and both.median_s == pytest.approx(max(both.members_s), rel=0.2)
    # disjoint halves: together is not much slower than alone (only bandwidth is shared)
    assert both.members_s[0] < 1.6 * alone.median_s


def test_two_copies_of_a_module_that_fills_the_gpu_take_about_twice_one(bank):
    """The busy-fraction measurement: two graphs of one module (own pools) side by side on
    free streams. Large GEMMs fill the H200, so the pair takes nearly twice one alone."""
    from mosaic.profile.graph_timing import GraphBench, TimingConfig, time_group

    module, x = _mlp()
    bench = GraphBench(module, [x])
    _, streams, _ = bank.group("free", [bank.full_sms, bank.full_sms], [0, 0])
    graphs = [bench.capture(s) for s in streams]
    timing = TimingConfig(clock=bank.clock)
    alone = time_group([(graphs[0].replay, streams[0])], timing).median_s
    pair = time_group([(g.replay, s) for g, s in zip(graphs, streams, strict=True)], timing)
    assert not bench.eager
    assert 0.85 < pair.median_s / (2 * alone) < 1.2, (alone, pair)


def test_a_graph_survives_the_idle_cache_release_before_the_next_capture(bank, monkeypatch):
    """A colocation captures every member before replaying any. The cache release before a
    capture once freed the cuBLAS workspaces too, and the first graph's GEMMs point into its
    stream's: its replay faulted (compiled ImageBind `small`, 2026-12-02)."""
    import torch

    from mosaic.profile import graph_timing
    from mosaic.profile.graph_timing import GraphBench

    monkeypatch.setattr(graph_timing, "IDLE_CACHE_FRACTION", -1.0)  # release before every capture
    (module_a, xa), (module_b, xb) = _mlp(), _mlp()
    _, streams, _ = bank.group("partition", [64, 64], [0, 0])
    bench_a = GraphBench(module_a, [xa])
    graph_a = bench_a.capture(streams[0])
    GraphBench(module_b, [xb]).capture(streams[1])
    filler = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").fill_(255)  # reuse freed memory
    for _ in range(3):
        graph_a.replay()
    torch.cuda.synchronize()  # raised "unspecified launch failure" when the workspace was freed
    del filler
    assert not bench_a.eager


def test_compiled_profile_adds_compiled_surfaces_beside_the_eager_ones(tmp_path):
    """`--kernels compile-default --update`: the compiled modules get their own signatures and
    points, and the DB's eager modules stay."""
    from mosaic.profile.db import ProfileDB
    from mosaic.profile.profiler import ProfilerConfig, profile_models

    path = str(tmp_path / "p.sqlite")
    fast = {"budget_s": 60.0, "antagonist": False, "max_pairs": 0, "max_triples": 0,
            "refine_budget": 0}
    profile_models(["clip"], path, ProfilerConfig(preset="tiny", **fast))
    profile_models(["clip"], path, ProfilerConfig(preset="tiny", kernels="compile-default", **fast),
                   update=True)
    with ProfileDB.open(path) as db:
        eager, compiled = db.modules("eager"), db.modules("compile-default")
        assert {m.module for m in eager} == {m.module for m in compiled} == {"vision", "text", "align"}
        assert not {m.signature for m in eager} & {m.signature for m in compiled}
        assert all(db.points(m.signature) for m in compiled)


def test_remeasure_replaces_the_named_models_surfaces_and_update_alone_keeps_them(tmp_path):
    """`--update` skips modules the DB holds; `--update --remeasure` measures them again and
    each surface is the new run's alone. Every stored time is first set to a marker no GPU
    measures (one second), so which run wrote a row is known exactly: event timings are
    quantised and two runs can store the same value to the bit."""
    import sqlite3

    from mosaic.profile.db import ProfileDB
    from mosaic.profile.profiler import ProfilerConfig, profile_models

    path = str(tmp_path / "p.sqlite")
    fast = ProfilerConfig(preset="tiny", budget_s=60.0, antagonist=False, max_pairs=0,
                          max_triples=0, refine_budget=0)
    marker_s = 1.0
    profile_models(["clip"], path, fast)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE module_points SET time_s = ?", (marker_s,))

    def points(db):
        return {(p.signature, p.per_gpu_batch, p.num_sms): p.time_s for p in db.points()}

    with ProfileDB.open(path) as db:
        first = points(db)
    kept = profile_models(["clip"], path, fast, update=True)
    assert kept[0].points == 0
    with ProfileDB.open(path) as db:
        assert points(db) == first
    again = profile_models(["clip"], path, fast, update=True, remeasure=True)
    with ProfileDB.open(path) as db:
        now = points(db)
    assert again[0].points == len(now) > 0
    assert {key[0] for key in now} == {key[0] for key in first}
    assert marker_s not in now.values()


def test_busy_only_adds_busy_fractions_to_the_surfaces_it_keeps(tmp_path):
    """`--busy-only --update`: every distinct module gets a busy fraction at each busy batch,
    and the surfaces and the optimizer fit stay as they were."""
    from mosaic.profile.db import ProfileDB
    from mosaic.profile.profiler import ProfilerConfig, profile_models

    path = str(tmp_path / "p.sqlite")
    fast = {"budget_s": 60.0, "antagonist": False, "max_pairs": 0, "max_triples": 0,
            "refine_budget": 0}
    profile_models(["clip"], path, ProfilerConfig(preset="tiny", busy_batches=(), **fast))
    with ProfileDB.open(path) as db:
        before = (db.points(), db.fits())
        assert db.busy() == []
    reports = profile_models(["clip"], path, ProfilerConfig(
        preset="tiny", surfaces=False, busy_batches=("min", "max"), **fast), update=True)
    with ProfileDB.open(path) as db:
        assert (db.points(), db.fits()) == before
        busy = db.busy()
        sigs = {m.signature for m in db.modules()}
    assert {p.signature for p in busy} == sigs and reports[0].busy == len(busy) == 2 * len(sigs)
    assert all(0.4 < p.fraction < 2.5 and p.alone_s > 0 for p in busy), busy
    again = profile_models(["clip"], path, ProfilerConfig(
        preset="tiny", surfaces=False, busy_batches=("min", "max"), **fast), update=True)
    assert again[0].busy == 0  # what the DB holds is kept: a stopped run resumes
