"""The memory model follows the engine's precision: bf16 weights and bf16 moments change what a
module's training states hold (ModuleSpec.static_bytes), and the planners, the plan check and
their error messages count it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mosaic import sharding
from mosaic import tensor_parallel as tp
from mosaic.engine.main_weights import cast_weights_bf16
from mosaic.graph import GraphError, MMGraph
from mosaic.hardware import make_cluster
from mosaic.perf.analytic import AnalyticModel
from mosaic.plan import PlanError
from mosaic.planners import make_plan, plan_all
from mosaic.zoo import get_model

GIB = 2**30


@pytest.mark.parametrize("name", ["clip", "qwen3-vl", "unified-io-2"])
def test_counted_bf16_weights_are_the_ones_the_engine_casts(name):
    """The zoo's count is the engine's own rule applied to the real modules (tiny preset)."""
    model = get_model(name)
    configs, shapes = model.preset("tiny").modules, model.in_shapes("tiny")
    graph = model.graph("tiny")
    for module_name, config in configs.items():
        with torch.device("meta"):
            module = config.build(shapes[module_name])
        cast = sum(p.numel() for p in cast_weights_bf16([module]))
        assert graph.module(module_name).bf16_weight_params == cast, module_name


def test_static_bytes_follow_the_weights_and_moments_dtypes():
    graph = get_model("unified-io-2").graph("paper")
    llm = graph.module("llm")
    n, p = llm.bf16_weight_params, llm.num_params
    assert 0.99 * p < n < p  # the GEMM weights, not the norms and biases
    assert llm.static_bytes == 16 * p
    flat = graph.with_precision(bf16_weights=True).module("llm")
    # weight 2, main weight 4, gradient 2 and its flat copy 2, fp32 moments 8
    assert flat.static_bytes == 16 * (p - n) + (2 + 4 + 2 + 2 + 8) * n
    lean = graph.with_precision(bf16_weights=True, bf16_moments=True,
                                bf16_flat_grads=False).module("llm")
    assert lean.static_bytes == 16 * (p - n) + (2 + 4 + 2 + 4) * n
    # autocast copies only the weights left in fp32
    assert tp.autocast_weight_bytes(llm) == 2 * p
    assert tp.autocast_weight_bytes(lean) == 2 * (p - n)


def test_bf16_moments_save_four_bytes_a_bf16_weight_as_measured():
    """Measured on the H200 (Unified-IO 2 `paper` b4, one process): 96.7 -> 83.0 GiB, 13.7
    GiB = 4 bytes for each of its 3.68 B bf16 parameters."""
    graph = get_model("unified-io-2").graph("paper")
    fp32_moments = graph.with_precision(bf16_weights=True)
    bf16_moments = graph.with_precision(bf16_weights=True, bf16_moments=True)
    saved = sum(tp.bytes_per_gpu(a, 4) - tp.bytes_per_gpu(b, 4)
                for a, b in zip(fp32_moments.modules, bf16_moments.modules, strict=True))
    assert saved == 4 * sum(m.bf16_weight_params for m in graph.modules)
    assert saved / GIB == pytest.approx(13.7, abs=0.1)


def test_qwen3_vl_paper_plans_on_one_h200_only_with_bf16_weights_and_moments():
    cluster = make_cluster(1, "h200")
    perf = AnalyticModel(cluster)
    graph = get_model("qwen3-vl").graph("paper")
    with pytest.raises(PlanError, match="train with --bf16-weights --bf16-moments") as error:
        plan_all(graph, cluster, perf, ["megatron"])
    assert "a plan fits with" not in str(error.value)  # the flags named are enough
    huge = get_model("qwen3-vl").graph("paper", global_batch=256)
    with pytest.raises(PlanError) as error:
        plan_all(huge, cluster, perf, ["megatron"])
    assert "a plan fits with" not in str(error.value)  # no precision is enough
    lean = graph.with_precision(bf16_weights=True, bf16_moments=True)
    (plan,) = plan_all(lean, cluster, perf, ["megatron"])
    assert plan.num_gpus == 1
    # At 4x the batch the flat layout's gradient copy is too much; the error says so.
    big = get_model("qwen3-vl").graph("paper", global_batch=8)
    with pytest.raises(PlanError, match="train with --no-bf16-flat-grads"):
        plan_all(big.with_precision(bf16_weights=True, bf16_moments=True), cluster, perf,
                 ["megatron"])
    plan_all(big.with_precision(bf16_weights=True, bf16_moments=True, bf16_flat_grads=False),
             cluster, perf, ["megatron"])


def test_past_bf16_weights_and_moments_the_error_names_no_fp32_main_weights():
    """Qwen3-VL `paper` at batch 16 exceeds one H200 with bf16 weights and moments updated a
    weight at a time; without fp32 main copies (4 bytes a bf16 weight less) it fits, and the
    plan error says so. From fp32 weights the module check, which sees the LLM alone, names
    bf16 weights and moments, and the error adds the flags with which a plan was found (the
    planner tried them), so that the user needs no second error."""
    cluster = make_cluster(1, "h200")
    perf = AnalyticModel(cluster)
    graph = get_model("qwen3-vl").graph("paper", global_batch=16)
    lean = graph.with_precision(bf16_weights=True, bf16_moments=True, bf16_flat_grads=False)
    with pytest.raises(PlanError, match=r"train with --no-fp32-main-weights \(saves 29.9 GiB"):
        plan_all(lean, cluster, perf, ["megatron"])
    with pytest.raises(PlanError, match="train with --bf16-weights --bf16-moments "
                                        "--no-bf16-flat-grads .bf16 GEMM weights and moments, "
                                        "fp32 main weights") as error:
        plan_all(graph, cluster, perf, ["megatron"])
    assert str(error.value).endswith(
        "; a plan fits with `mosaic train --bf16-weights --bf16-moments --no-bf16-flat-grads "
        "--no-fp32-main-weights`")
    with pytest.raises(PlanError, match="a plan fits with `mosaic train --bf16-weights "
                                        "--bf16-moments --no-bf16-flat-grads --no-fp32-main"):
        make_plan(graph, cluster, "megatron", perf)
    leanest = graph.with_precision(bf16_weights=True, bf16_moments=True, bf16_flat_grads=False,
                                   fp32_main_weights=False)
    (plan,) = plan_all(leanest, cluster, perf, ["megatron"])
    assert plan.num_gpus == 1


def test_bf16_weights_are_neither_tensor_parallel_nor_sharded_in_plans():
    """The engine refuses both for bf16 weights, so the planners must not offer them."""
    spec = get_model("qwen3-vl").graph("paper").module("llm")
    cluster = make_cluster(8, "h200")
    assert tp.degrees(spec, cluster) != (1,)
    assert sharding.saved_bytes(spec, 4) > 0
    bf16 = replace(spec, bf16_weights=True)
    assert tp.degrees(bf16, cluster) == (1,)
    assert sharding.saved_bytes(bf16, 4) == 0


def test_precision_fields_are_checked_and_kept_in_json():
    graph = get_model("clip").graph("tiny").with_precision(bf16_weights=True, bf16_moments=True,
                                                           bf16_flat_grads=False)
    again = MMGraph.from_json(graph.to_json())
    assert again == graph
    text = graph.to_dict()
    text["modules"][0]["bf16_moments"] = "yes"
    with pytest.raises(GraphError, match=r"bf16_moments = 'yes' must be true or false"):
        MMGraph.from_dict(text)
    spec = graph.modules[0]
    with pytest.raises(GraphError, match="set bf16_weights=true too"):
        replace(spec, bf16_weights=False)
    with pytest.raises(GraphError, match="bf16_weight_params=.* must be between 0 and num_params"):
        replace(spec, bf16_weight_params=spec.num_params + 1)


def test_train_updates_a_weight_at_a_time_where_the_flat_update_cannot_be_autotuned(
        monkeypatch):
    """Qwen3-VL `paper`'s flat LLM update failed on the H200's 128 GiB host (Inductor copies
    the 70 GiB it writes to pinned memory to autotune it); Unified-IO 2 `paper`'s ran."""
    from mosaic import cli
    from mosaic.engine.session import EngineConfig

    host = 128 * GIB
    monkeypatch.setattr(cli.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096,
                                                         "SC_PHYS_PAGES": host // 4096}[name])
    engine = EngineConfig(bf16_weights=True, bf16_moments=True)
    qwen = get_model("qwen3-vl").graph("paper").with_precision(bf16_weights=True,
                                                                bf16_moments=True)
    chosen, why = cli.predicted_update_layout(None, qwen, None, engine)
    assert chosen.bf16_flat_grads is False
    assert "module 'llm' writes 70 GiB" in why
    uio2 = get_model("unified-io-2").graph("paper").with_precision(bf16_weights=True)
    assert cli._flat_update_too_large(uio2) is None
