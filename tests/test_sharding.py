"""Sharded states (`Placement.shard`, mosaic.sharding): the plan field, its memory and cost
models, and the planners that shard when nothing fits otherwise. No torch needed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mosaic import sharding
from mosaic.graph import MMGraph, ModuleSpec
from mosaic.hardware import make_cluster
from mosaic.perf import make_perf_model
from mosaic.perf.analytic import AnalyticModel
from mosaic.perf.base import ACCUMULATE_BYTES_PER_PARAM
from mosaic.plan import MEMORY_MARGIN, Placement, Plan, PlanError, Stage, gpu_memory_bytes
from mosaic.planners import PLANNERS, plan_all
from tests.helpers import spec


def big_llm_graph(batch: int = 4) -> MMGraph:
    """A 10B-parameter LLM (149 GiB of states: no H200 holds them) fed by a small encoder."""
    llm = ModuleSpec(name="llm", kind="llm", input_shape=(256, 4096), num_params=int(10e9),
                     num_layers=40, hidden_dim=4096, tokens_per_sample=256,
                     flops_per_sample=6.0 * 10e9 * 256, activation_bytes_per_sample=2e8,
                     output_bytes_per_sample=1e3)
    return MMGraph(name="bigllm", modules=(spec("vision", params_m=300.0), llm),
                   edges=(("vision", "llm"),), global_batch=batch)


def two_stage_plan(graph: MMGraph, shard_llm: bool, llm_gpus=(0, 1)) -> Plan:
    return Plan(model=graph.name, planner="manual", num_gpus=2, stages=(
        Stage(placements=(Placement(module="vision", gpus=(0, 1)),)),
        Stage(placements=(Placement(module="llm", gpus=llm_gpus, shard=shard_llm),))))


def unsharded(plan: Plan) -> Plan:
    return replace(plan, stages=tuple(
        replace(s, placements=tuple(replace(p, shard=False) for p in s.placements))
        for s in plan.stages))


# --- the plan field --------------------------------------------------------------------------
def test_shard_round_trips_and_plans_without_it_load():
    plan = two_stage_plan(big_llm_graph(), shard_llm=True)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.placement("llm").shard
    old = plan.to_dict()
    for stage in old["stages"]:
        for p in stage["placements"]:
            del p["shard"]  # a plan written before the field existed
    assert not Plan.from_dict(old).placement("llm").shard
    old["stages"][1]["placements"][0]["shard"] = "yes"
    with pytest.raises(PlanError, match="shard='yes' must be true or false"):
        Plan.from_dict(old)


def test_shard_needs_a_dp_degree_of_two():
    graph, cluster = big_llm_graph(), make_cluster(2)
    plan = two_stage_plan(graph, shard_llm=True, llm_gpus=(1,))
    with pytest.raises(PlanError, match=r"module 'llm'.*shard=true needs a DP degree >= 2"):
        plan.validate(graph, cluster)


def hybrid_plan(graph: MMGraph, num_gpus: int = 16, degree: int = 8) -> Plan:
    every = tuple(range(num_gpus))
    return Plan(model=graph.name, planner="manual", num_gpus=num_gpus, stages=(
        Stage(placements=(Placement(module="vision", gpus=every),)),
        Stage(placements=(Placement(module="llm", gpus=every, shard=True, shard_degree=degree),))))


def test_hybrid_sharding_cuts_the_gpus_into_copies_and_is_checked():
    graph, cluster = big_llm_graph(batch=16), make_cluster(16)
    plan = hybrid_plan(graph).validate(graph, cluster)
    llm = plan.placement("llm")
    assert Plan.from_json(plan.to_json()) == plan and llm.states_over == 8
    assert llm.shard_groups == (tuple(range(8)), tuple(range(8, 16)))
    assert llm.replica_groups[3] == (3, 11) and len(llm.replica_groups) == 8
    assert plan.placement("vision").states_over == 1
    for degree, message in ((3, "shard_degree=3 must be >= 2 and divide the DP degree 16"),
                            (1, "shard_degree=1 must be >= 2")):
        with pytest.raises(PlanError, match=message):
            hybrid_plan(graph, degree=degree).validate(graph, cluster)
    loose = replace(plan, stages=(plan.stages[0], Stage(placements=(
        replace(llm, shard=False),))))
    with pytest.raises(PlanError, match="shard_degree=8 without shard=true"):
        loose.validate(graph, cluster)


def test_hybrid_sharding_keeps_states_over_a_copy_and_gathers_inside_it():
    """HSDP over 2 nodes, a copy a node: each GPU holds 1/8 of the states (not 1/16) and steps
    1/8 of the parameters; the gathers and reduce-scatter run inside a node, then 1/8 of the
    gradients is all-reduced across the two nodes."""
    graph, cluster = big_llm_graph(batch=16), make_cluster(16)
    perf = AnalyticModel(cluster)
    llm, every = graph.module("llm"), tuple(range(16))
    hybrid, flat = hybrid_plan(graph), hybrid_plan(graph, degree=0)
    assert gpu_memory_bytes(hybrid, graph)[0] - gpu_memory_bytes(flat, graph)[0] == pytest.approx(
        sharding.added_bytes(llm, 8) - sharding.added_bytes(llm, 16))
    gather, scatter = perf.sharded_collectives_s(llm, every, 8)
    node = tuple(range(8))
    grads = sharding.reduce_scatter_bytes(llm, perf.grad_wire_bytes)
    assert gather == pytest.approx(perf.collective_s("all_gather", sharding.all_gather_bytes(llm), node))
    assert scatter == pytest.approx(perf.collective_s("reduce_scatter", grads, node)
                                    + perf.allreduce_s(grads / 8, (0, 8)))
    assert perf.sharded_sync_s(llm, every, 8) < perf.sharded_sync_s(llm, every)  # no IB gathers
    params = llm.num_params / 8 + graph.module("vision").num_params
    assert perf.optimizer_s(hybrid, graph) == pytest.approx(perf.optimizer_step_s(params))


def test_planners_shard_a_module_over_several_nodes_a_node_a_copy():
    from mosaic.planners.common import SearchSpace

    graph, cluster = big_llm_graph(batch=16), make_cluster(16)
    space = SearchSpace(graph, cluster, AnalyticModel(cluster), tensor_parallel={})
    space.set_sharded({"llm"})
    assert space.shard_degree("llm", 16) == 8 and space.states_over("llm", 16) == 8
    assert space.shard_degree("llm", 8) == 0 and space.states_over("llm", 8) == 8
    assert space.shard_degree("vision", 16) == 0 and space.states_over("vision", 16) == 1
    perf = AnalyticModel(cluster)
    megatron = PLANNERS["megatron"](graph, cluster, perf)  # the LLM on all 16 GPUs, sharded
    placed = megatron.placement("llm")
    assert placed.shard and placed.shard_degree == 8 and len(placed.gpus) == 16
    over_all = replace(megatron, stages=tuple(replace(s, placements=tuple(
        replace(p, shard_degree=0) for p in s.placements)) for s in megatron.stages))
    assert perf.iteration_time_s(megatron, graph) < perf.iteration_time_s(over_all, graph)


# --- memory ----------------------------------------------------------------------------------
def test_sharded_memory_is_states_over_dp_plus_the_whole_units():
    graph = big_llm_graph(batch=4)
    llm = graph.module("llm")
    used = gpu_memory_bytes(two_stage_plan(graph, shard_llm=True), graph)
    enc = graph.module("vision")
    vision = enc.static_bytes + 2.0 * enc.num_params + enc.activation_bytes_per_sample * 2
    # 3 of 40 layers whole: bf16 weights 2 + bf16 gradients 2 + their fp32 copy reduce-scattered 4
    whole_units = 8.0 * llm.num_params * 3 / 40
    # gathered in bf16: no autocast copies of the LLM's weights (the encoder keeps its 2 B each)
    expected = llm.static_bytes / 2 + whole_units + llm.activation_bytes_per_sample * 2
    assert used[0] == used[1] == pytest.approx(vision + expected)
    assert sharding.working_set_bytes(llm) == pytest.approx(whole_units)
    one_layer = replace(llm, num_layers=1)  # gathered whole: over 2 it saves the copies alone
    assert sharding.saved_bytes(one_layer, 2) == pytest.approx(2.0 * llm.num_params)
    assert sharding.saved_bytes(one_layer, 4) > 2.0 * llm.num_params


def test_a_memory_error_names_the_module_to_shard():
    graph, cluster = big_llm_graph(), make_cluster(2)
    plan = two_stage_plan(graph, shard_llm=True)
    plan.validate(graph, cluster)
    with pytest.raises(PlanError, match=r"GPU 0 needs .* shard the states of module 'llm'"):
        unsharded(plan).validate(graph, cluster)


# --- cost ------------------------------------------------------------------------------------
def test_sharded_sync_is_two_bf16_all_gathers_and_a_reduce_scatter():
    graph, cluster = big_llm_graph(), make_cluster(2)
    perf = AnalyticModel(cluster)
    plan = two_stage_plan(graph, shard_llm=True)
    llm, gpus = graph.module("llm"), (0, 1)
    gather = perf.collective_s("all_gather", 2.0 * llm.num_params, gpus)  # bf16 weights
    scatter = perf.collective_s("reduce_scatter", 4.0 * llm.num_params, gpus)  # fp32 gradients
    assert gather > 0 and scatter > 0
    assert perf.sharded_sync_s(llm, gpus) == pytest.approx(2 * gather + scatter)
    ring = perf.allreduce_s(4.0 * llm.num_params, gpus)  # = reduce-scatter + all-gather
    assert perf.stage_allreduce_s(unsharded(plan).stages[1], graph) == pytest.approx(ring)
    assert 2 * gather + scatter == pytest.approx(ring, rel=0.01)  # as the fp32 all-reduce
    perf.grad_wire_bytes = 2.0  # reduce_dtype=bf16: the reduce-scatter halves too
    assert perf.sharded_sync_s(llm, gpus) == pytest.approx(2 * gather + scatter / 2, rel=1e-3)


def test_fsdp_hides_its_gathers_and_reduce_scatter_under_the_units_compute_but_one_units():
    """Forward: each unit's gather beside the unit before's compute; backward: its gather
    and reduce-scatter beside the next one's. Of 41 units (40 layers and the module's own),
    the step waits for one unit's share where the compute is longer, for the excess where
    the communication is; a module without layers hides nothing."""
    graph, cluster = big_llm_graph(batch=16), make_cluster(2)
    perf = AnalyticModel(cluster)
    llm, gpus = graph.module("llm"), (0, 1)
    gather, scatter = perf.sharded_collectives_s(llm, gpus)
    compute = perf.module_time_s(llm, 8, 1.0)
    forward, backward = compute / 3, 2 * compute / 3
    assert forward > gather and backward > gather + scatter  # compute-bound at 8 a GPU
    exposed = perf.exposed_sharded_sync_s(llm, 8, 1.0, gpus)
    assert exposed == pytest.approx((2 * gather + scatter) / 41)
    plan = two_stage_plan(graph, shard_llm=True)
    assert perf.stage_allreduce_s(plan.stages[1], graph) == pytest.approx(exposed)
    assert perf.exposed_sharded_sync_s(llm, 1, 1.0, gpus) > (2 * gather + scatter) / 41
    one_unit = replace(llm, num_layers=1)
    assert perf.exposed_sharded_sync_s(one_unit, 8, 1.0, gpus) == pytest.approx(
        perf.sharded_sync_s(one_unit, gpus))


def test_accumulating_a_sharded_module_gathers_and_reduce_scatters_every_micro_step():
    """The engine keeps only sharded gradients, so each of K micro-steps gathers the weights
    and reduce-scatters beside its own compute, as one step of the micro-batch would; an
    unsharded module all-reduces once, after the last."""
    graph, cluster, k = big_llm_graph(batch=16), make_cluster(2), 4
    micro = replace(graph, global_batch=graph.global_batch // k)
    one_step, accumulating = AnalyticModel(cluster), AnalyticModel(cluster).accumulating(k)
    sharded = two_stage_plan(graph, shard_llm=True)
    adds = accumulating.memory_pass_s(accumulating._most_params(sharded, graph),
                                      ACCUMULATE_BYTES_PER_PARAM)
    vision_sync = one_step.stage_allreduce_s(sharded.stages[0], graph)  # unsharded: once
    micro_step = (one_step.iteration_time_s(sharded, micro) - one_step.optimizer_s(sharded, micro)
                  - one_step.stage_allreduce_s(sharded.stages[0], micro))
    assert accumulating.iteration_time_s(sharded, graph) == pytest.approx(
        k * (micro_step + adds) + vision_sync + one_step.optimizer_s(sharded, graph))
    llm_sync = one_step.stage_allreduce_s(sharded.stages[1], micro)
    assert llm_sync == pytest.approx(
        one_step.exposed_sharded_sync_s(graph.module("llm"), 2, 1.0, (0, 1))) and llm_sync > 0


def test_profiled_model_costs_sharding_on_its_measured_curves_and_steps_a_shard():
    graph, cluster = big_llm_graph(), make_cluster(2)
    perf = make_perf_model("profiled", cluster)
    num_bytes = 4.0 * graph.module("llm").num_params
    for kind in ("all_gather", "reduce_scatter"):
        measured, source = perf.comm_time(kind, num_bytes, 2)
        assert source == "measured"
        assert perf.collective_s(kind, num_bytes, (0, 1)) == pytest.approx(measured)
    plan = two_stage_plan(graph, shard_llm=True)
    # the optimizer steps the GPU holding the most parameters: half the LLM, plus the vision
    params = graph.module("llm").num_params / 2 + graph.module("vision").num_params
    assert perf.optimizer_s(plan, graph) == pytest.approx(
        perf.optimizer_step_s(params))


def test_the_profiled_model_takes_off_the_casts_a_bf16_gather_skips():
    """Its surfaces hold autocast's forward cast of every fp32 weight; a sharded module
    gathered in bf16 casts only its own shard: 6 bytes over the other half of the LLM."""
    from mosaic.perf.base import PerfModel
    from mosaic.perf.profiled import GATHER_CAST_SAVED_BYTES

    graph, cluster = big_llm_graph(), make_cluster(2)
    perf = make_perf_model("profiled", cluster)
    plan = two_stage_plan(graph, shard_llm=True)
    saving = perf.memory_pass_s(graph.module("llm").num_params / 2, GATHER_CAST_SAVED_BYTES)
    assert perf.gathered_bf16_saving_s(plan, graph) == pytest.approx(saving)
    assert perf.composed_time_s(plan, graph) == pytest.approx(
        PerfModel.iteration_time_s(perf, plan, graph) - saving)
    assert perf.gathered_bf16_saving_s(unsharded(plan), graph) == 0.0


# --- planners --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["megatron", "distmm", "spindle", "mosaic"])
def test_planners_shard_a_module_that_fits_only_sharded(name):
    graph, cluster = big_llm_graph(), make_cluster(2)
    perf = AnalyticModel(cluster)
    plan = PLANNERS[name](graph, cluster, perf)  # validated
    llm = plan.placement("llm")
    assert llm.shard and llm.dp_degree == 2
    assert not plan.placement("vision").shard  # fits unsharded: never sharded for nothing
    assert plan.predicted_iteration_s == pytest.approx(perf.iteration_time_s(plan, graph))
    budget = cluster.gpu.memory_bytes * (1 - MEMORY_MARGIN)
    assert max(gpu_memory_bytes(plan, graph).values()) <= budget
    with pytest.raises(PlanError, match="shard the states of module 'llm'"):
        unsharded(plan).validate(graph, cluster)


def test_qwen3_vl_paper_on_two_h200s_needs_its_llm_split():
    """Its LLM's states (113 GiB) and autocast's bf16 copies of its weights (14 GiB) fit no
    H200 whole: every planner splits it over both GPUs with tensor parallelism (tried before
    sharding), and the megatron-style plan that shards its states with FSDP2 instead (the one
    the 2-GPU bench runs, benchmarks/plans) fits too, where the same plan unsharded does not."""
    from pathlib import Path

    from mosaic.zoo import get_model

    graph, cluster = get_model("qwen3-vl").graph("paper"), make_cluster(2)
    perf = make_perf_model("auto", cluster, preset="paper")
    plans = {p.planner: p for p in plan_all(graph, cluster, perf)}
    assert set(plans) == {"megatron", "distmm", "spindle", "mosaic"}
    assert all(p.placement("llm").tensor_parallel == 2 for p in plans.values())
    saved = Path(__file__).parents[1] / "benchmarks/plans/h200-paper-compiled/qwen3-vl-2gpu"
    sharded = Plan.load(saved / "megatron.json").validate(graph, cluster)
    assert [p.module for s in sharded.stages for p in s.placements if p.shard] == ["llm"]
    with pytest.raises(PlanError, match="shard the states of module 'llm'"):
        unsharded(sharded).validate(graph, cluster)
    for name in ("distmm", "spindle", "mosaic"):  # what the planners make today
        assert Plan.load(saved / f"{name}.json").validate(graph, cluster).placement(
            "llm").tensor_parallel == 2


def test_planners_say_when_even_sharding_is_not_enough_or_would_be():
    graph, cluster = big_llm_graph(), make_cluster(2)
    perf = AnalyticModel(cluster)
    with pytest.raises(PlanError, match="shard the states of module 'llm' over 2 GPUs"):
        PLANNERS["exhaustive"](graph, cluster, perf)  # a planner that does not shard
    huge = replace(graph, modules=(graph.module("vision"),
                                   replace(graph.module("llm"), num_params=int(20e9))))
    with pytest.raises(PlanError, match=r"'llm' needs .* with its states sharded over 2 GPUs"):
        PLANNERS["mosaic"](huge, cluster, perf)
