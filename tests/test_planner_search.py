"""The searches against slow references: brute-force sizing and shares, exhaustive plans."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.perf import AnalyticModel
from mosaic.plan import PlanError
from mosaic.planners import PLANNERS
from mosaic.planners.common import SearchSpace
from mosaic.planners.exhaustive import ExhaustiveConfig, _Exhaustive, plan_exhaustive
from mosaic.planners.gahc import GAHCConfig, run_gahc
from mosaic.planners.lower import StageSolver, set_partitions, symmetry_classes
from mosaic.planners.mosaic import MosaicPlannerConfig, UpperSearch, plan_mosaic
from mosaic.planners.search_bench import bench_planner, plot_bench
from mosaic.planners.sizing import best_sizes, stage_cost_s
from mosaic.synthetic import synthetic_graph
from tests.test_planners import check_plan, random_dag, random_module


def random_options(rng: random.Random, num_groups: int, sizes: list[int]) -> list[list[tuple]]:
    options = []
    for _ in range(num_groups):
        work, reduce, transfer = rng.uniform(1, 100), rng.uniform(0, 5), rng.uniform(0, 20)
        opts = [(k, work / k ** rng.uniform(0.4, 1.0) + rng.uniform(0, 1),
                 reduce * (k - 1) / k * rng.uniform(0.5, 2), transfer / k * (rng.random() < 0.7))
                for k in sizes if rng.random() < 0.85]
        options.append(opts or [(1, work, 0.0, transfer)])
    return options


def test_best_sizes_is_exact_against_brute_force():
    for trial in range(400):
        rng = random.Random(trial)
        num_gpus = rng.choice([2, 4, 8, 16])
        options = random_options(rng, rng.randint(1, 4), [k for k in (1, 2, 4, 8, 16) if k <= num_gpus])
        combos = [c for c in itertools.product(*(range(len(o)) for o in options))
                  if sum(options[j][i][0] for j, i in enumerate(c)) <= num_gpus]
        reference = min((stage_cost_s(options, c) for c in combos), default=float("inf"))
        cost, picks = best_sizes(options, num_gpus)
        assert cost == pytest.approx(reference, rel=1e-9), trial
        if picks:
            assert stage_cost_s(options, picks) == pytest.approx(cost, rel=1e-12)
            assert sum(options[j][i][0] for j, i in enumerate(picks)) <= num_gpus


def test_set_partitions_count_bell_numbers_and_skip_symmetric_ones():
    graph = synthetic_graph(6, 0)
    space = SearchSpace(graph, make_cluster(4), AnalyticModel(make_cluster(4)))
    classes = symmetry_classes(space)
    for n, bell in zip(range(1, 6), (1, 2, 5, 15, 52), strict=True):
        assert len(list(set_partitions(graph.names[:n], classes))) == bell
    same = {f"x{i}": 0 for i in range(5)}  # five interchangeable modules: integer partitions of 5
    assert len(list(set_partitions(list(same), same))) == 7


def test_identical_modules_are_one_symmetry_class():
    rng = random.Random(3)
    enc = random_module(rng, "a")
    mods = [enc.__class__(**{**{f: getattr(enc, f) for f in enc.__slots__}, "name": f"enc{i}"})
            for i in range(3)]
    head = random_module(rng, "head", "head")
    graph = MMGraph(name="twins", modules=(*mods, head), edges=tuple((m.name, "head") for m in mods),
                    global_batch=16)
    cluster = make_cluster(4)
    perf = AnalyticModel(cluster)
    space = SearchSpace(graph, cluster, perf)
    assert len(set(symmetry_classes(space).values())) == 2
    upper = UpperSearch(space, StageSolver(space), MosaicPlannerConfig(), time.perf_counter() + 60)
    assert len(upper.ready_sets(frozenset())) == 3  # 1..3 encoders, not 7 subsets
    mosaic = plan_mosaic(graph, cluster, perf)
    exhaustive = plan_exhaustive(graph, cluster, perf)
    assert mosaic.predicted_iteration_s <= exhaustive.predicted_iteration_s * 1.01


@pytest.mark.parametrize("mode", ["partition", "cap"])
def test_share_search_matches_brute_force(mode):
    graph = synthetic_graph(8, 4, num_gpus=4)
    cluster = make_cluster(4)
    space = SearchSpace(graph, cluster, AnalyticModel(cluster))
    solver = StageSolver(space)
    reference = _Exhaustive(space, ExhaustiveConfig(), time.perf_counter())
    rng = random.Random(0)
    encoders = [m for m in graph.names if m.startswith("enc")]
    for _ in range(8):
        group = tuple(sorted(rng.sample(encoders, rng.choice((2, 3)))))
        size = rng.choice([k for k in space.sizes if space.fits(group, k)])
        got_s, shares = solver.shares(group, size, mode, thorough=True)
        best_s = space.block_s(group, size, mode, reference.best_shares(group, size, mode)[1])
        assert got_s == pytest.approx(space.block_s(group, size, mode, shares))
        assert got_s <= best_s * 1.01
        if mode == "partition":
            assert space.partition_fits(shares)


def small_graphs():
    for seed in range(6):
        yield synthetic_graph(2 + seed % 3, seed, num_gpus=4)
    for seed in range(4):
        yield random_dag(seed, 3 + seed % 2, batch=16)


@pytest.mark.parametrize(("num_gpus", "sm_step"), [(2, None), (4, None), (3, 0.2), (4, 0.2), (2, 0.3)])
def test_mosaic_matches_exhaustive_on_small_graphs(num_gpus, sm_step):
    cluster = make_cluster(num_gpus)
    perf = AnalyticModel(cluster)
    for graph in small_graphs():
        mosaic = plan_mosaic(graph, cluster, perf, MosaicPlannerConfig(sm_step=sm_step))
        exhaustive = plan_exhaustive(graph, cluster, perf, ExhaustiveConfig(sm_step=sm_step))
        check_plan(exhaustive, graph, cluster, perf)
        assert exhaustive.predicted_iteration_s <= mosaic.predicted_iteration_s * (1 + 1e-9), graph.name
        assert mosaic.predicted_iteration_s <= exhaustive.predicted_iteration_s * 1.01, graph.name


def test_exact_upper_level_matches_every_grouping():
    """The DP over down-sets finds the cheapest of all stage groupings (same stage solver)."""
    for seed in range(4):
        graph = random_dag(seed + 10, 5, batch=32)
        cluster = make_cluster(4)
        space = SearchSpace(graph, cluster, AnalyticModel(cluster))
        solver = StageSolver(space)
        upper = UpperSearch(space, solver, MosaicPlannerConfig(), time.perf_counter() + 60)
        (found,) = upper.candidates()
        assert upper.method == "exact-dp"
        groupings = _Exhaustive(space, ExhaustiveConfig(), time.perf_counter()).groupings()
        best = min(upper.total(g) for g in groupings)
        assert upper.total(found) == pytest.approx(best, rel=1e-12)
        assert upper.valid(found)


def test_local_search_is_close_to_the_exact_dp():
    cluster = make_cluster(8)
    perf = AnalyticModel(cluster)
    for seed in range(3):
        graph = synthetic_graph(7, seed, num_gpus=8)
        exact = plan_mosaic(graph, cluster, perf)
        local = plan_mosaic(graph, cluster, perf, MosaicPlannerConfig(exact_transitions=0))
        assert exact.meta["upper_level"] == "exact-dp" and local.meta["upper_level"] == "local-search"
        assert local.predicted_iteration_s <= exact.predicted_iteration_s * 1.03


def test_mosaic_plans_20_modules_on_32_gpus_quickly():
    cluster = make_cluster(32)
    perf = AnalyticModel(cluster)
    graph = synthetic_graph(20, 0, num_gpus=32)
    # CPU seconds of this process: the planner runs in one thread, so on an idle machine this is
    # its wall time, but neither the other xdist worker nor a busy CI host inflates it.
    start = time.process_time()
    plan = plan_mosaic(graph, cluster, perf)
    elapsed_s = time.process_time() - start
    check_plan(plan, graph, cluster, perf)
    assert elapsed_s < 5.0  # about 2 s on a 2-core CI machine; generous against noise
    for name in ("megatron", "distmm", "spindle"):
        assert plan.predicted_iteration_s < PLANNERS[name](graph, cluster, perf).predicted_iteration_s


def test_exhaustive_refuses_a_space_over_its_limits():
    cluster = make_cluster(8)
    perf = AnalyticModel(cluster)
    graph = synthetic_graph(7, 0, num_gpus=8)
    with pytest.raises(PlanError, match="max_plans=1000;"):
        plan_exhaustive(graph, cluster, perf, ExhaustiveConfig(max_plans=1000))
    with pytest.raises(PlanError, match="time_limit_s=0.01"):
        plan_exhaustive(synthetic_graph(6, 0, num_gpus=8), cluster, perf,
                        ExhaustiveConfig(time_limit_s=0.01, sm_step=0.3))


def test_gahc_is_seeded_and_caching_only_saves_evaluations():
    graph = synthetic_graph(5, 2, num_gpus=4)
    cluster = make_cluster(4)
    perf = AnalyticModel(cluster)
    config = GAHCConfig(seed=3, generations=25, population=12, sm_step=0.3)
    cached = run_gahc(graph, cluster, perf, config)
    again = run_gahc(graph, cluster, perf, config)
    uncached = run_gahc(graph, cluster, perf, GAHCConfig(seed=3, generations=25, population=12,
                                                         sm_step=0.3, use_cache=False))
    assert cached.cost_s == again.cost_s == uncached.cost_s
    assert cached.evaluations < uncached.evaluations
    assert uncached.cache_hits == 0 and cached.fitness_evaluations < uncached.fitness_evaluations
    exhaustive = plan_exhaustive(graph, cluster, perf, ExhaustiveConfig(sm_step=0.3))
    assert cached.cost_s <= exhaustive.predicted_iteration_s * 1.05


def test_bench_reports_the_cli_keys_and_plots(tmp_path):
    rows = bench_planner(3, 2, seeds=(0, 1), gahc_generations=4, sm_steps=(None, 0.3))
    assert len(rows) == 2
    for row in rows:
        assert {"search_time_s", "optimality_ratio", "worst_optimality_ratio"} <= set(row)
        assert row["reference"] == ["exhaustive"]
        assert row["worst_optimality_ratio"] == pytest.approx(1.0, abs=0.01)
        assert row["gahc_uncached_evaluations"] >= row["gahc_cached_evaluations"]
    path = plot_bench(rows, tmp_path / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("optimizer_bytes_per_param", [0.0, 28.0])
def test_the_searches_exact_cost_is_the_perf_models_prediction(optimizer_bytes_per_param):
    from mosaic.planners.assembly import PlanCoster, assemble
    from mosaic.planners.distmm import distmm_stages
    from mosaic.planners.spindle import spindle_stages

    for seed in range(3):
        graph = synthetic_graph(9, seed, num_gpus=16)
        cluster = make_cluster(16)
        perf = AnalyticModel(cluster)
        perf.optimizer_bytes_per_param = optimizer_bytes_per_param
        space = SearchSpace(graph, cluster, perf)
        coster = PlanCoster(space)
        for stages in (spindle_stages(space), distmm_stages(space)):
            plan = assemble(space, stages, "x")
            assert coster.total_s(stages) == pytest.approx(perf.iteration_time_s(plan, graph), rel=1e-12)
