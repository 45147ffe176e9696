"""Tensor parallelism without processes: the plan field and its validation, the cost model,
the planners' use of it, the engine's sample routes and the TP plans of modules
(tests/test_tensor_parallel_dist.py trains it across processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

from mosaic import tensor_parallel as tp
from mosaic.engine.comm import grad_pieces, pieces, sample_range
from mosaic.engine.tensor_parallel import parallelize, tp_plan
from mosaic.graph import MMGraph
from mosaic.hardware import make_cluster
from mosaic.perf.analytic import AnalyticModel
from mosaic.perf.base import PerfModel, Work
from mosaic.plan import Placement, Plan, PlanError, Stage, TensorParallelError, gpu_memory_bytes
from mosaic.planners.assembly import PlanCoster, assemble
from mosaic.planners.common import SearchSpace, faster_tensor_parallel, needed_tensor_parallel
from mosaic.planners.megatron import megatron_stages
from mosaic.simulate import simulate
from mosaic.zoo import get_model
from tests.helpers import spec


def _llm_graph(batch: int = 8, params_m: float = 2000.0, max_tp: int = 8) -> MMGraph:
    encoder = spec("vision", params_m=50.0, tokens=256, dim=768, layers=12)
    llm = replace(spec("llm", kind="llm", params_m=params_m, tokens=512, dim=4096, layers=32),
                  max_tensor_parallel=max_tp)
    return MMGraph(name="toyvlm", modules=(encoder, llm), edges=(("vision", "llm"),),
                   global_batch=batch)


def _plan(graph: MMGraph, num_gpus: int, llm_gpus: tuple[int, ...], t: int,
          vision_gpus: tuple[int, ...] = (0,)) -> Plan:
    return Plan(model=graph.name, planner="manual", num_gpus=num_gpus, stages=(
        Stage(placements=(Placement(module="vision", gpus=vision_gpus),)),
        Stage(placements=(Placement(module="llm", gpus=llm_gpus, tensor_parallel=t),))))


# --- the plan --------------------------------------------------------------------------------
def test_placement_groups_and_json_round_trip():
    p = Placement(module="llm", gpus=(4, 5, 6, 7, 0, 1), tensor_parallel=2)
    assert p.dp_degree == 3
    assert p.tp_groups == ((4, 5), (6, 7), (0, 1))
    assert p.dp_groups == ((4, 6, 0), (5, 7, 1))
    plan = _plan(_llm_graph(), 4, (0, 1, 2, 3), 2)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.placement("llm").tensor_parallel == 2
    old = plan.to_dict()  # a plan written before the field existed loads as plain DP
    for stage in old["stages"]:
        for placement in stage["placements"]:
            del placement["tensor_parallel"]
    assert Plan.from_dict(old).placement("llm").tensor_parallel == 1


@pytest.mark.parametrize(("llm_gpus", "t", "message"), [
    ((0, 1, 2), 2, "must be >= 1 and divide its 3 GPUs"),
    ((1, 2), 2, "spans nodes [0, 1]"),
    ((0, 1, 2, 3), 4, "split evenly only by divisors of 2"),
])
def test_validation_names_the_tensor_parallel_fix(llm_gpus, t, message):
    graph = _llm_graph(batch=6, params_m=10.0, max_tp=2)
    cluster = make_cluster(4, gpus_per_node=2)
    with pytest.raises(TensorParallelError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _plan(graph, 4, llm_gpus, t).validate(graph, cluster)


def test_validation_refuses_a_module_without_a_tp_plan():
    graph = _llm_graph(params_m=10.0)
    plan = Plan(model=graph.name, planner="manual", num_gpus=2, stages=(
        Stage(placements=(Placement(module="vision", gpus=(0, 1), tensor_parallel=2),)),
        Stage(placements=(Placement(module="llm", gpus=(0, 1)),))))
    with pytest.raises(TensorParallelError, match="'vision'.*no tensor-parallel plan.*tp_plan"):
        plan.validate(graph, make_cluster(2))
    assert issubclass(TensorParallelError, PlanError)


def test_dp_degree_with_tp_must_divide_the_batch():
    graph = _llm_graph(batch=3, params_m=10.0)
    _plan(graph, 6, (0, 1, 2, 3, 4, 5), 2).validate(graph, make_cluster(6))  # DP 3
    with pytest.raises(PlanError, match="DP degree 2 does not divide global_batch 3"):
        _plan(graph, 4, (0, 1, 2, 3), 2).validate(graph, make_cluster(4))


def test_memory_of_a_tp_shard():
    graph = _llm_graph(batch=8)
    llm = graph.module("llm")
    plain = gpu_memory_bytes(_plan(graph, 4, (0, 1, 2, 3), 1), graph)[3]
    sharded = gpu_memory_bytes(_plan(graph, 4, (0, 1, 2, 3), 2), graph)[3]
    act = llm.activation_bytes_per_sample
    casts = 2.0 * llm.num_params  # autocast's bf16 weight copies, kept for the backward
    assert plain == pytest.approx(llm.static_bytes + casts + act * 2)  # DP 4: 2 samples per GPU
    # DP 2: 4 samples per replica; weights / 2, activations (10 + 24 / 2) / 34 of them
    assert sharded == pytest.approx((llm.static_bytes + casts) / 2 + act * 4 * (10 + 12) / 34)


# --- the cost model --------------------------------------------------------------------------
def test_tp_is_faster_for_a_large_module_when_comm_is_cheap():
    graph = _llm_graph(batch=2)
    llm = graph.module("llm")
    cheap = AnalyticModel(make_cluster(8))
    slow = AnalyticModel(replace(make_cluster(8), intra_node_bandwidth_bps=1e9))
    alone = cheap.work_time_s(Work(llm, 2, 1.0, 0, 1), 1.0)
    shard = cheap.work_time_s(Work(llm, 2, 1.0, 0, 2), 1.0)
    comm = cheap.tp_comm_s(llm, 2, 2)
    assert shard == pytest.approx(cheap.module_time_s(llm, 2) / 2 + comm)
    assert comm == pytest.approx(4 * 32 * cheap.allreduce_s(2 * 512 * 4096 * 2, (0, 1)))
    assert shard < 0.75 * alone
    assert slow.work_time_s(Work(llm, 2, 1.0, 0, 2), 1.0) > alone  # slow links: TP loses
    # Batch 2 leaves DP 6 of 8 GPUs idle; TP 4 x DP 2 uses them all, and its gradient
    # all-reduce moves a quarter of the bytes.
    dp = cheap.iteration_time_s(_plan(graph, 8, (0, 1), 1), graph)
    tp4 = cheap.iteration_time_s(_plan(graph, 8, tuple(range(8)), 4), graph)
    assert tp4 < 0.5 * dp


@pytest.mark.parametrize("perf_model", ["analytic", "profiled"])
def test_simulator_and_plan_coster_agree_with_the_prediction(perf_model):
    from mosaic.perf import make_perf_model

    graph = _llm_graph(batch=4)
    cluster = make_cluster(8)
    perf = make_perf_model(perf_model, cluster, preset="paper")
    plan = _plan(graph, 8, tuple(range(8)), 4, (0, 1, 2, 3)).validate(graph, cluster)
    # The simulator adds the fitted engine term as the prediction does.
    assert simulate(plan, graph, perf).iteration_s == pytest.approx(
        perf.iteration_time_s(plan, graph), rel=1e-9)
    space = SearchSpace(graph, cluster, perf, tensor_parallel={"llm": 4})
    stages = megatron_stages(space)
    assembled = assemble(space, stages, "x")
    assert assembled.placement("llm").tensor_parallel == 4
    assert PlanCoster(space).total_s(stages) == pytest.approx(
        PerfModel.iteration_time_s(perf, assembled, graph), rel=1e-12)


# --- the planners ----------------------------------------------------------------------------
def test_planners_shard_a_module_that_fits_no_gpu_otherwise():
    graph = _llm_graph(batch=8, params_m=12_000.0)  # 192 GB of states: no H200 holds them
    cluster = make_cluster(8)
    space = SearchSpace(graph, cluster, AnalyticModel(cluster))
    assert needed_tensor_parallel(space) == {"vision": 1, "llm": 2}
    assert space.tp == {"llm": 2}
    assert 4 in space.sizes_of("llm") and 3 not in space.sizes_of("llm")
    from mosaic.planners import plan_all

    for plan in plan_all(graph, cluster, AnalyticModel(cluster)):
        assert plan.placement("llm").tensor_parallel >= 2, plan.planner


def test_mosaic_tp_uses_tp_where_it_is_predicted_faster():
    from mosaic.perf import make_perf_model
    from mosaic.planners import get_planner, plan_all

    # Batch 2: DP alone uses 2 of 8 GPUs. Its LLM at 85% of its size fits a GPU whole (the
    # real one, with autocast's weight copies, does not: TP would be needed, not chosen).
    paper = get_model("qwen3-vl").graph("paper")
    graph = replace(paper, modules=tuple(
        replace(m, num_params=int(0.85 * m.num_params),
                bf16_weight_params=int(0.85 * m.bf16_weight_params)) if m.name == "llm" else m
        for m in paper.modules))
    cluster = make_cluster(8)
    perf = make_perf_model("profiled", cluster, preset="paper")
    space = SearchSpace(graph, cluster, perf)
    assert space.tp == {} and faster_tensor_parallel(space)["llm"] > 1
    plans = {p.planner: p for p in plan_all(graph, cluster, perf)}
    assert all(p.placement("llm").tensor_parallel == 1 for p in plans.values())  # fits without
    tp_plan_ = get_planner("mosaic-tp")(graph, cluster, perf)
    assert tp_plan_.planner == "mosaic-tp" and tp_plan_.placement("llm").tensor_parallel > 1
    assert tp_plan_.predicted_iteration_s < min(p.predicted_iteration_s for p in plans.values())


@pytest.mark.parametrize("batch, chosen", [(2, "tensor_parallel"), (16, "sharded")])
def test_planners_fit_a_module_by_tp_or_sharded_states_whichever_is_predicted_faster(batch, chosen):
    from mosaic.perf import make_perf_model
    from mosaic.planners import plan_all
    from mosaic.planners.megatron import _plan_in
    from mosaic.planners.shard_fallback import plan_sharding_if_needed

    # Qwen3-VL's LLM fits no H200 whole. TP's all-reduces grow with the batch and FSDP's
    # gathers do not: at batch 2 TP is predicted faster, at 16 sharding.
    graph = get_model("qwen3-vl").graph("paper", global_batch=batch)
    cluster = make_cluster(2)
    perf = make_perf_model("profiled", cluster, preset="paper")
    split = plan_sharding_if_needed(SearchSpace(graph, cluster, perf), _plan_in)
    sharded_space = SearchSpace(graph, cluster, perf, tensor_parallel={})
    sharded_space.set_sharded({"llm"})
    sharded = plan_sharding_if_needed(sharded_space, _plan_in)
    assert split.placement("llm").tensor_parallel == 2 and not split.placement("llm").shard
    assert sharded.placement("llm").tensor_parallel == 1 and sharded.placement("llm").shard
    faster = min((split, sharded), key=lambda p: p.predicted_iteration_s)
    assert faster is (split if chosen == "tensor_parallel" else sharded)
    for plan in plan_all(graph, cluster, perf):
        note = plan.meta["split_by"]
        assert note["chose"] == chosen and note["modules"] == ["llm"], plan.planner
        assert note[chosen] == pytest.approx(plan.predicted_iteration_s * 1e3, abs=1e-3)
        other = note["sharded" if chosen == "tensor_parallel" else "tensor_parallel"]
        assert other > note[chosen], plan.planner
        assert (plan.placement("llm").tensor_parallel == 2) == (chosen == "tensor_parallel")
        if plan.planner == "megatron":
            assert plan.predicted_iteration_s == pytest.approx(faster.predicted_iteration_s)


def test_a_module_that_sharding_cannot_fit_is_split_by_tp_alone():
    from mosaic.planners import get_planner
    from mosaic.planners.shard_fallback import splittable_by_sharding

    graph = _llm_graph(batch=8, params_m=12_000.0)
    cluster = make_cluster(8)
    assert splittable_by_sharding(SearchSpace(graph, cluster, AnalyticModel(cluster))) == ["llm"]
    one = replace(graph, global_batch=1)  # DP 1 only: nothing to shard over, TP 2 fits
    space = SearchSpace(one, cluster, AnalyticModel(cluster))
    assert space.tp == {"llm": 2} and splittable_by_sharding(space) == []
    plan = get_planner("megatron")(one, cluster, AnalyticModel(cluster))
    assert plan.placement("llm").tensor_parallel == 2 and "split_by" not in plan.meta


# --- the engine: sample routes -----------------------------------------------------------------
def test_every_gpu_of_a_tp_group_gets_its_replicas_samples_and_sends_gradients_once():
    n, src, dst = 12, (0, 1, 2), (4, 5, 0, 1)  # DP 3 producer -> TP 2 x DP 2 consumer
    assert sample_range(n, dst, 5, 2) == (0, 6) and sample_range(n, dst, 1, 2) == (6, 12)
    forward = pieces(n, src, dst, 1, 2)
    for rank in dst:
        got = sorted((p.start, p.stop) for p in forward if p.dst == rank)
        start, stop = sample_range(n, dst, rank, 2)
        assert got[0][0] == start and got[-1][1] == stop
        assert sum(b - a for a, b in got) == stop - start
    backward = grad_pieces(n, src, dst, 1, 2)
    for rank in src:  # each producer sample's gradient arrives exactly once
        got = sorted((p.start, p.stop) for p in backward if p.src == rank)
        assert sum(b - a for a, b in got) == n // 3
    assert {p.dst for p in backward} == {4, 0}  # the first GPU of each consumer group
    # A TP producer: each consumer GPU hears from one of its GPUs; all of them get gradients.
    assert {p.src for p in pieces(n, (0, 1), (2, 3), 2, 1)} == {0}
    assert {p.src for p in grad_pieces(n, (0, 1), (2, 3), 2, 1)} == {0, 1}
    assert grad_pieces(n, src, dst) == pieces(n, src, dst)  # without TP: the same pieces


# --- the engine: TP plans ------------------------------------------------------------------------
class _Mesh:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_zoo_llm_plan_splits_projections_and_head_counts():
    llm = get_model("qwen3-vl").build_modules("tiny", names=["llm"])["llm"]
    attention = llm.backbone.layers[0].self_attn
    attention.num_heads, attention.num_key_value_heads = 4, 2  # as transformers 4.x reads them
    plan = tp_plan(llm, 2)
    assert type(plan["backbone.layers.1.self_attn.q_proj"]).__name__ == "ColwiseParallel"
    assert type(plan["backbone.layers.1.mlp.down_proj"]).__name__ == "RowwiseParallel"
    assert "lm_head" in plan and not any("norm" in k or "adapters" in k for k in plan)
    assert (attention.num_heads, attention.num_key_value_heads) == (2, 1)
    with pytest.raises(TensorParallelError, match="does not split 4 attention heads, 2 KV"):
        tp_plan(get_model("qwen3-vl").build_modules("tiny", names=["llm"])["llm"], 4)


def test_modules_without_a_plan_are_refused_and_own_plans_are_used():
    vision = get_model("qwen3-vl").build_modules("tiny", names=["vision"])["vision"]
    assert tp_plan(vision, 2) is None
    with pytest.raises(TensorParallelError, match="'vision'.*no tensor-parallel plan"):
        parallelize("vision", vision, _Mesh(2))

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def tp_plan(self, tensor_parallel: int) -> dict:
            from torch.distributed.tensor.parallel import ColwiseParallel

            return {"fc": ColwiseParallel()}

    assert list(tp_plan(Own(), 2)) == ["fc"]


def test_zoo_llms_declare_their_tp_degrees():
    graph = get_model("qwen3-vl").graph("paper")
    assert graph.module("llm").max_tensor_parallel == 8  # gcd(32 heads, 8 KV heads, 12288)
    assert graph.module("vision").max_tensor_parallel == 1
    assert tp.degrees(graph.module("llm"), make_cluster(16)) == (1, 2, 4, 8)
    assert tp.degrees(graph.module("llm"), make_cluster(2)) == (1, 2)
    assert MMGraph.from_json(graph.to_json()) == graph


class _OwnLoss(nn.Module):
    """A user's module with its own TP plan (docs/own-model.md)."""

    max_tensor_parallel = 2

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def tp_plan(self, tensor_parallel: int) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"up": ColwiseParallel(), "down": RowwiseParallel()}

    def forward(self, x):
        return self.down(self.up(x).relu()).square().mean()


def test_own_module_declares_its_tp_degrees():
    import torch

    from mosaic.user_model import UserModelError, graph_from_modules

    graph = graph_from_modules("own", {"loss": _OwnLoss()}, [], {"loss": torch.randn(2, 4)}, 4)
    assert graph.module("loss").max_tensor_parallel == 2
    assert list(tp_plan(_OwnLoss(), 2)) == ["up", "down"]
    no_plan = _OwnLoss()
    no_plan.tp_plan = None  # degrees without a plan
    with pytest.raises(UserModelError, match="no tp_plan"):
        graph_from_modules("own", {"loss": no_plan}, [], {"loss": torch.randn(2, 4)}, 4)
