import pytest

from mosaic.hardware import H200, HardwareError, make_cluster
from mosaic.plan import Placement, Plan, PlanError, Stage, gpu_memory_bytes
from tests.helpers import encoders_and_head, spec


def two_stage_plan(sharing="partition", shares=(64 / 132, 32 / 132, 32 / 132), gpus=(0, 1), num_gpus=2):
    stage0 = Stage(sharing=sharing, placements=tuple(
        Placement(module=f"enc{i}", gpus=gpus, sm_share=s) for i, s in enumerate(shares)))
    stage1 = Stage(placements=(Placement(module="head", gpus=gpus),))
    return Plan(model="toy", planner="manual", num_gpus=num_gpus, stages=(stage0, stage1))


def test_a_good_plan_validates_and_round_trips():
    g, c = encoders_and_head(3), make_cluster(2)
    plan = two_stage_plan().validate(g, c)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.stage_of("head") == 1 and plan.placement("enc0").dp_degree == 2


@pytest.mark.parametrize(
    ("plan", "needle"),
    [
        (two_stage_plan(shares=(0.6, 0.3, 0.2)), "need 152 SMs"),
        (two_stage_plan(sharing="free"), "takes no quota"),
        (two_stage_plan(sharing="bogus", shares=(1, 1, 1)), "sharing='bogus'"),
        (two_stage_plan(shares=(1.5, 0.1, 0.1)), "beyond the GPU"),
        (two_stage_plan(gpus=(0, 2)), "do not exist"),
        (two_stage_plan(num_gpus=4), "num_gpus=4"),
        (two_stage_plan(gpus=(0, 0)), "repeats"),
    ],
)
def test_malformed_plans_name_the_problem(plan, needle):
    with pytest.raises(PlanError, match=needle):
        plan.validate(encoders_and_head(3), make_cluster(2))


def test_dag_order_and_completeness_are_enforced():
    g, c = encoders_and_head(2), make_cluster(1)
    same_stage = Plan(model="toy", planner="m", num_gpus=1, stages=(Stage(sharing="free", placements=(
        Placement(module="enc0", gpus=(0,)), Placement(module="enc1", gpus=(0,)),
        Placement(module="head", gpus=(0,)))),))
    with pytest.raises(PlanError, match="later stage"):
        same_stage.validate(g, c)
    missing = Plan(model="toy", planner="m", num_gpus=1,
                   stages=(Stage(placements=(Placement(module="enc0", gpus=(0,)),)),))
    with pytest.raises(PlanError, match="not placed"):
        missing.validate(g, c)


def test_dp_degree_must_divide_the_batch():
    g, c = encoders_and_head(3, batch=30), make_cluster(4)
    plan = two_stage_plan(gpus=(0, 1, 2, 3), num_gpus=4)
    with pytest.raises(PlanError, match="does not divide global_batch 30"):
        plan.validate(g, c)


def test_memory_that_does_not_fit_is_rejected():
    from mosaic.graph import MMGraph

    huge = spec("enc0", params_m=9000.0)  # 9B params x 16 bytes = 144 GB > 139 GiB
    g = MMGraph(name="toy", modules=(huge,), edges=(), global_batch=8)
    plan = Plan(model="toy", planner="m", num_gpus=1,
                stages=(Stage(placements=(Placement(module="enc0", gpus=(0,)),)),))
    assert gpu_memory_bytes(plan, g)[0] > 9e9 * 16
    with pytest.raises(PlanError, match="GiB"):
        plan.validate(g, make_cluster(1))


def test_malformed_plan_json_is_one_clear_error():
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")
    with pytest.raises(PlanError, match="missing key"):
        Plan.from_json('{"model": "toy"}')
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json('{"model": "toy", "num_gpus": 1, "stages": [{"placements": [{"module": "a", "gpus": 3}]}]}')


def test_sm_rounding_follows_the_hardware_granularity():
    assert H200.round_sms(66 / 132) == 72
    assert H200.round_sms(100 / 132) == 104
    assert H200.round_sms(1.0) == 132
    assert H200.round_sms(0.01) == 8


def test_cluster_shapes():
    assert make_cluster(32).num_nodes == 4
    assert make_cluster(4).num_gpus == 4
    with pytest.raises(HardwareError, match="--gpus 0"):
        make_cluster(0)
    with pytest.raises(HardwareError, match="unknown hardware"):
        make_cluster(8, "a100")
    with pytest.raises(HardwareError, match="whole number"):
        make_cluster(12)


def test_plans_that_run_alike_share_a_run_key():
    """Autotune measures each run_key once: modules one by one in any grouping or order, a
    single whole-GPU module in any mode, and caps of the whole GPU (plain streams) as free."""
    from mosaic.plan import plan_key, run_key

    def plan(*stages):
        return Plan(model="toy", planner="x", num_gpus=1, stages=tuple(
            Stage(sharing=mode, placements=tuple(
                Placement(module=m, gpus=(0,), sm_share=share, priority=prio)
                for m, share, prio in placed)) for mode, placed in stages))

    one_stage = plan(("temporal", [("text", 1.0, 0), ("vision", 1.0, 0)]), ("temporal", [("head", 1.0, 0)]))
    one_each = plan(("temporal", [("vision", 1.0, 0)]), ("temporal", [("text", 1.0, 0)]),
                    ("cap", [("head", 1.0, 1)]))
    assert plan_key(one_stage) != plan_key(one_each) and run_key(one_stage) == run_key(one_each)
    caps = plan(("cap", [("text", 1.0, 0), ("vision", 1.0, 1)]), ("temporal", [("head", 1.0, 0)]))
    free = plan(("free", [("vision", 1.0, 1), ("text", 1.0, 0)]), ("temporal", [("head", 1.0, 0)]))
    assert run_key(caps) == run_key(free) != run_key(one_stage)
    capped = plan(("cap", [("text", 0.5, 0), ("vision", 1.0, 1)]), ("temporal", [("head", 1.0, 0)]))
    high = plan(("free", [("vision", 1.0, 0), ("text", 1.0, 1)]), ("temporal", [("head", 1.0, 0)]))
    assert len({run_key(capped), run_key(free), run_key(high)}) == 3
