"""Beyond one machine: the cluster model (NVLink in a node, InfiniBand between nodes), the
event simulator against the planners' own predictions, and the 1024-GPU planning bound."""

from __future__ import annotations

import time

import pytest

from mosaic.hardware import NODE_PRESETS, HardwareError, make_cluster
from mosaic.perf import make_perf_model
from mosaic.perf.analytic import AnalyticModel
from mosaic.planners import plan_all
from mosaic.planners.assembly import place_stage
from mosaic.planners.common import Block, SearchSpace, StageChoice
from mosaic.simulate import simulate
from mosaic.zoo import get_model
from tests.helpers import encoders_and_head


# --- single node: unchanged -------------------------------------------------------------------
def test_single_node_predictions_are_pinned():
    """Numbers from before the multi-node model: one node must predict exactly as it did."""
    cluster = make_cluster(8, "h200")
    graph = get_model("ofasys").graph("paper")
    # engine=None: the composed model alone (eager surfaces, no fitted engine term), as pinned
    perf = make_perf_model("profiled", cluster, preset="paper", engine=None)
    perf.optimizer_fit = None  # pinned before the optimizer step was measured (datasheet rate)
    got = {p.planner: p.predicted_iteration_s for p in plan_all(graph, cluster, perf)}
    # Re-pinned on 2026-12-01 with the model code unchanged: the OFASys LLM's cost facts
    # changed (the zoo's attention builds no mask tensors: fewer kernels, activation bytes).
    # Re-pinned on 2026-12-02 for a model change: a surface row keeps the whole GPU's time
    # where the law dips below it between sampled SM counts (profiled.monotone_row); spindle
    # moved by 0.005%, the others not at all. Then for a second: colocations' alone times
    # are points of their members' surfaces (SurfaceSet.absorb_alone_times): +2.1% to +2.3%.
    assert got == pytest.approx({"megatron": 0.07557402061230468, "distmm": 0.061321210619777605,
                                 "spindle": 0.05974364147071948, "mosaic": 0.05901959022303626},
                                rel=1e-12)
    analytic = AnalyticModel(cluster)
    assert analytic.allreduce_s(1e9, range(8)) == pytest.approx(0.004948611111111111, rel=1e-12)
    assert analytic.transfer_s(1e8, [0, 1], [2, 3]) == pytest.approx(0.0001638888888888889, rel=1e-12)
    assert perf.allreduce_s(1e9, range(8)) == pytest.approx(0.005419871145932476, rel=1e-12)


# --- the cluster ------------------------------------------------------------------------------
def test_make_cluster_nodes_and_presets():
    c = make_cluster(32, "h200", gpus_per_node=4)
    assert (c.num_nodes, c.gpus_per_node) == (8, 4)
    assert c.gpu_inter_node_bandwidth_bps == c.inter_node_bandwidth_bps  # 8 NICs >= 4 GPUs
    for name, preset in NODE_PRESETS.items():
        node = make_cluster(16, name)
        assert node.gpu.name == preset.hardware and node.num_nodes == 2
        assert "datasheet" in preset.source
    assert make_cluster(16, "hgx-h100").gpu.memory_bytes < make_cluster(16, "h200").gpu.memory_bytes
    with pytest.raises(HardwareError, match="gpus-per-node"):
        make_cluster(8, "h200", gpus_per_node=0)
    with pytest.raises(HardwareError, match="whole number of 4-GPU nodes"):
        make_cluster(10, "h200", gpus_per_node=4)


@pytest.mark.parametrize("kind", ["analytic", "profiled"])
def test_hierarchical_allreduce(kind):
    """Across nodes: reduce-scatter in node + all-reduce of the shard on the rails + all-gather;
    slower than NVLink alone, faster than a flat ring over the NICs, latency grows ~log nodes."""
    cluster = make_cluster(1024, "h200")
    perf = make_perf_model(kind, cluster, preset="paper")
    size = 1e9
    in_node = perf.allreduce_s(size, range(8))
    two_nodes = perf.allreduce_s(size, range(16))
    parts = (perf.intra_node_collective_s("reduce_scatter", size, 8)
             + perf.intra_node_collective_s("all_gather", size, 8)
             + perf.inter_node_allreduce_s(size / 8, 2))
    assert two_nodes == pytest.approx(parts, rel=1e-12)
    assert in_node < two_nodes
    flat_ring = 2 * 15 / 16 * size / cluster.gpu_inter_node_bandwidth_bps
    assert two_nodes < flat_ring
    # bandwidth term saturates at 2x the shard; the latency term grows with log2(nodes)
    assert perf.allreduce_s(size, range(1024)) < 1.2 * perf.allreduce_s(size, range(64))
    tiny = [perf.inter_node_allreduce_s(8.0, m) for m in (2, 16, 128)]
    assert tiny[0] < tiny[1] < tiny[2] < 20 * cluster.inter_node_latency_s


def test_cross_node_transfers_cost_more():
    perf = AnalyticModel(make_cluster(16, "h200"))
    inside, across = perf.transfer_s(1e8, [0, 1], [2, 3]), perf.transfer_s(1e8, [0, 1], [8, 9])
    assert across > 4 * inside
    assert across == pytest.approx(perf.cluster.collective_latency_s + perf.cluster.inter_node_latency_s
                                   + 1e8 / (2 * perf.cluster.gpu_inter_node_bandwidth_bps))


def test_placement_keeps_blocks_inside_a_node():
    graph = encoders_and_head(4, batch=64)
    cluster = make_cluster(40, "h200")  # 34 GPUs of blocks: the 4-block must skip node 3's tail
    space = SearchSpace(graph, cluster, AnalyticModel(cluster))
    blocks = (Block(("enc0",), 4, (1.0,)), Block(("enc1",), 8, (1.0,)), Block(("enc2",), 6, (1.0,)),
              Block(("enc3",), 16, (1.0,)))
    placed = place_stage(space, StageChoice("temporal", blocks, 0.0))
    for block, gpus in placed:
        nodes = {g // 8 for g in gpus}
        assert len(nodes) == -(-block.size // 8), (block, gpus)
        assert len(gpus) == block.size
    assert len({g for _, gpus in placed for g in gpus}) == 4 + 8 + 6 + 16  # disjoint


# --- the simulator --------------------------------------------------------------------------
CASES = [("clip", 8), ("clip", 32), ("imagebind", 16), ("qwen3-vl", 8), ("ofasys", 64),
         ("unified-io-2", 128)]


@pytest.mark.parametrize(("model", "gpus"), CASES)
def test_simulator_matches_every_planners_prediction(model, gpus):
    """With the model's composition (all-reduce at the stage barrier) the event simulation
    reproduces each planner's predicted iteration time; per-group overlap never costs more."""
    cluster = make_cluster(gpus, "h200")
    base = get_model(model).graph("paper")
    graph = get_model(model).graph("paper", global_batch=base.global_batch * cluster.num_nodes)
    perf = make_perf_model("profiled", cluster, preset="paper")
    plans = plan_all(graph, cluster, perf)
    assert {p.planner for p in plans} == {"megatron", "distmm", "spindle", "mosaic"}
    for plan in plans:
        sim = simulate(plan, graph, perf)
        assert sim.iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-6), plan.planner
        assert simulate(plan, graph, perf, overlap=True).iteration_s <= sim.iteration_s * (1 + 1e-12)
        util = sim.utilisation()
        assert len(util) == gpus and all(0.0 <= u <= 1.0 for u in util.values())
        assert max(e.end_s for e in sim.events) == pytest.approx(sim.iteration_s, rel=1e-9)


def test_simulator_covers_micro_batch_overlap():
    """mosaic's one-GPU micro-batch overlap (PerfModel.pipelined_s) as events."""
    from dataclasses import replace

    cluster = make_cluster(1, "h200")
    graph = get_model("clip").graph("paper")
    perf = make_perf_model("profiled", cluster, preset="paper")
    plan = plan_all(graph, cluster, perf, ["distmm"])[0]
    if len(plan.stages) < 2:
        pytest.skip("needs a plan of two stages")
    piped = perf.predict(replace(plan, micro_batches=2).validate(graph, cluster), graph)
    assert simulate(piped, graph, perf).iteration_s == pytest.approx(piped.predicted_iteration_s, rel=1e-9)


@pytest.mark.timeout(120)
def test_planning_1024_gpus_is_bounded():
    """The mosaic planner at 1024 GPUs (batch weak-scaled to 1024): placement runs in O(GPUs)
    per block and the sizing knapsack is only as wide as the groups' sizes."""
    cluster = make_cluster(1024, "h200")
    graph = get_model("ofasys").graph("paper", global_batch=1024)
    perf = make_perf_model("profiled", cluster, preset="paper")
    start = time.process_time()  # CPU seconds, as test_mosaic_plans_20_modules_on_32_gpus_quickly
    plan = plan_all(graph, cluster, perf, ["mosaic"])[0]
    assert time.process_time() - start < 20.0
    assert simulate(plan, graph, perf).iteration_s == pytest.approx(plan.predicted_iteration_s, rel=1e-6)


def test_simulate_command_plans_and_simulates(tmp_path):
    """`mosaic simulate MODEL --gpus N --gpus-per-node G --planner P` without --plan: plans,
    weak-scales the batch per node, writes the trace, and agrees with the plan's prediction."""
    import json

    from tests.test_cli import mosaic

    result = mosaic("simulate", "clip", "--gpus", "16", "--gpus-per-node", "4", "--planner", "spindle",
                    "--json", "--out", str(tmp_path / "sim"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    sim, plan = report["simulation"], report["plans"][0]
    assert report["global_batch"] == 32 * 4 and plan["planner"] == "spindle"
    assert sim["iteration_s"] == pytest.approx(plan["predicted_iteration_s"], rel=1e-6)
    assert len(sim["gpu_utilisation"]) == 16
    trace = json.loads((tmp_path / "sim" / "spindle.sim-trace.json").read_text())
    assert {e["cat"] for e in trace["traceEvents"]} >= {"fwd+bwd", "allreduce"}
