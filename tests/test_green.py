"""SM partition pool on CPU: request building, layout, checks, the CPU fallback, and the green
path driven by a stand-in for cuda.bindings.driver (the real one runs in tests/gpu)."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest

from mosaic.engine import green
from mosaic.engine.green import PoolError, SMPartitionPool, StreamRequest, layout, requests_for_plan
from mosaic.hardware import H200, HardwareError
from mosaic.plan import Placement, Plan, Stage

H200_UNITS = [8] * 15 + [12]  # what cuDevSmResourceSplitByCount returned on the lent H200


def req(key, mode="partition", num_sms=None, priority=0, group=0):
    return StreamRequest(key=key, mode=mode, num_sms=num_sms, priority=priority, group=group)


def three_partitions(group=0, sizes=(72, 32, 16)):
    return [req(f"m{i}", num_sms=n, group=group) for i, n in enumerate(sizes)]


# --- requests_for_plan ---------------------------------------------------------------------------
def test_requests_for_plan_maps_each_mode_and_filters_by_gpu():
    plan = Plan(model="toy", planner="manual", num_gpus=2, stages=(
        Stage(sharing="partition", placements=(
            Placement(module="vision", gpus=(0, 1), sm_share=66 / 132, priority=1),
            Placement(module="audio", gpus=(0,), sm_share=0.25),
            Placement(module="text", gpus=(1,), sm_share=0.25))),
        Stage(sharing="cap", placements=(
            Placement(module="imu", gpus=(0,), sm_share=0.2),
            Placement(module="video", gpus=(0,), sm_share=1.0))),
        Stage(sharing="free", placements=(Placement(module="llm", gpus=(0,), priority=1),)),
        Stage(placements=(Placement(module="head", gpus=(0, 1)),)),
    ))
    got = {r.key: r for r in requests_for_plan(plan, 0, H200)}
    assert list(got) == ["vision", "audio", "imu", "video", "llm", "head"]
    assert got["vision"] == req("vision", num_sms=72, priority=1, group=0)  # 66 rounds up to 72
    assert got["audio"] == req("audio", num_sms=40, group=0)  # 33 -> 40
    assert got["imu"] == req("imu", mode="cap", num_sms=32, group=1)  # 26.4 -> 27 -> 32
    assert got["video"] == req("video", mode="free", group=1)  # a cap of the whole GPU is no cap
    assert got["llm"] == req("llm", mode="free", priority=1, group=2)
    assert got["head"] == req("head", mode="temporal", group=3)
    assert [r.key for r in requests_for_plan(plan, 1, H200)] == ["vision", "text", "head"]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"mode": "bogus"}, "mode='bogus'"),
    ({"mode": "partition", "num_sms": None}, "needs num_sms"),
    ({"mode": "cap", "num_sms": 0}, "needs num_sms"),
    ({"mode": "free", "num_sms": 8}, "takes no quota"),
    ({"mode": "free", "priority": 2}, "priority=2"),
])
def test_bad_requests_name_the_field(kwargs, needle):
    with pytest.raises(PoolError, match=needle):
        StreamRequest(key="x", **{"num_sms": None, **kwargs})


# --- layout and checks ---------------------------------------------------------------------------
def test_partitions_are_disjoint_within_a_group_and_reuse_sms_across_groups():
    requests = three_partitions(0, (72, 32, 24)) + [req("n0", num_sms=64, group=1)]
    ranges = layout(requests, H200_UNITS, structured=15)
    assert ranges == {"m2": (0, 3), "m1": (3, 7), "m0": (7, 16), "n0": (0, 8)}
    assert sum(H200_UNITS[7:16]) == 76  # the largest, laid last, absorbs the split's leftover


def test_caps_pack_while_they_fit_then_overlap():
    requests = [req("a", "cap", 96), req("b", "cap", 64), req("c", "cap", 8)]
    ranges = layout(requests, H200_UNITS, structured=15)
    assert ranges["a"] == (0, 12)
    assert ranges["b"] == (8, 16)  # shortest tail covering 64 SMs: 7 x 8 + 12
    assert ranges["c"] == (14, 16)  # caps overlap rather than fail, never on the leftover alone


def test_no_quota_gets_the_splits_leftover_alone():
    # On the H200 a context of only the 12 leftover SMs fails every cluster launch (cuBLAS's
    # GEMMs): a cap that would land there takes the group before it too.
    ranges = layout([req("front", "cap", 120), req("small", "cap", 8)], H200_UNITS, structured=15)
    assert ranges == {"front": (0, 15), "small": (14, 16)}
    assert layout([req("whole", "cap", 132)], H200_UNITS, structured=15)["whole"] == (0, 16)
    # Partitions go smallest first, so the largest takes the leftover with its groups...
    assert layout(three_partitions(0, (120, 8)), H200_UNITS, structured=15) == {
        "m1": (0, 1), "m0": (1, 16)}
    # ...unless every group is taken by then: sixteen partitions of 8 SMs.
    with pytest.raises(green._GreenUnavailable, match=r"partition 'm15' \(8 SMs\).*leftover"):
        layout(three_partitions(0, (8,) * 16), H200_UNITS, structured=15)


def test_pool_error_when_a_group_needs_more_sms_than_the_device():
    with pytest.raises(PoolError, match=r"stage 0: .*'m0', 'm1', 'm2'.* need 136 SMs"):
        SMPartitionPool.create(three_partitions(0, (72, 48, 16)), gpu=H200)
    # the same partitions over two stages fit: stages may reuse SMs
    split = three_partitions(0, (72, 48)) + [req("m2", num_sms=16, group=1)]
    assert SMPartitionPool.create(split, gpu=H200).backend in ("cpu", "green-context", "plain-streams")
    with pytest.raises(PoolError, match="cap of 140 SMs exceeds"):
        SMPartitionPool.create([req("a", "cap", 140)], gpu=H200)
    with pytest.raises(PoolError, match=r"\['m0'\] are requested more than once"):
        SMPartitionPool.create([req("m0", "free"), req("m0", "temporal")], gpu=H200)


# --- CPU fallback --------------------------------------------------------------------------------
def test_cpu_fallback_records_quotas_without_streams(monkeypatch):
    monkeypatch.setattr(green, "_cuda_available", lambda: False)
    requests = three_partitions() + [req("llm", "free", priority=1), req("head", "temporal", group=1)]
    with SMPartitionPool.create(requests, gpu=H200) as pool:
        assert pool.backend == "cpu" and pool.enforced is False
        assert all(pool.stream(r.key) is None for r in requests)
        assert pool.sm_ranges() == {"m0": (6, 15), "m1": (2, 6), "m2": (0, 2), "llm": None, "head": None}
        summary = json.loads(json.dumps(pool.describe()))
        assert summary["backend"] == "cpu" and summary["enforced"] is False
        assert "no CUDA" in summary["fallback_reason"]
        assert summary["modules"]["m1"]["num_sms"] == 32 and summary["modules"]["llm"]["priority"] == 1
        assert pool.setup_s >= 0
        with pytest.raises(KeyError, match="no stream for module 'nope'"):
            pool.stream("nope")


def test_without_a_gpu_the_pool_records_the_ranges_the_h200s_split_gives(monkeypatch):
    monkeypatch.setattr(green, "_cuda_available", lambda: False)
    with SMPartitionPool.create([req("front", "cap", 120), req("small", "cap", 8)],
                                gpu=H200) as pool:
        summary = pool.describe()
        assert summary["unit_sms"] == H200_UNITS and summary["structured_units"] == 15
        assert pool.sm_ranges() == {"front": (0, 15), "small": (14, 16)}  # never the leftover alone
    assert green.regular_units(132, 8) == [8] * 16 + [4]  # a GPU whose split was not measured
    with pytest.raises(HardwareError, match="split_groups=17"):
        dataclasses.replace(H200, split_groups=17)


# --- the green path, with a stand-in driver ------------------------------------------------------
class FakeDriver:
    """Records calls; returns (CUresult, ...) tuples like cuda.bindings.driver."""

    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM="SM")
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM="DEFAULT_STREAM")
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING="NON_BLOCKING")

    def __init__(self, fail_at=None):
        self.fail_at, self.calls, self.live = fail_at, [], set()
        self._next = 100

    def _ok(self, name, *out):
        self.calls.append(name)
        return (0, *out)

    def _fails(self, name):
        return self.fail_at == (name, self.calls.count(name) + 1)

    @staticmethod
    def _res(sms):
        return SimpleNamespace(sm=SimpleNamespace(smCount=sms))

    def _handle(self, kind, **extra):
        self._next += 1
        self.live.add((kind, self._next))
        return SimpleNamespace(kind=kind, id=self._next, **extra)

    def cuInit(self, flags):
        return self._ok("cuInit")

    def cuDriverGetVersion(self):
        return self._ok("cuDriverGetVersion", 13000)

    def cuDeviceGet(self, ordinal):
        return self._ok("cuDeviceGet", ordinal)

    def cuDeviceGetDevResource(self, device, kind):
        return self._ok("cuDeviceGetDevResource", self._res(132))

    def cuDevSmResourceSplitByCount(self, num_groups, resource, flags, min_count):
        groups = [self._res(min_count) for _ in range(num_groups)]  # array sized as asked
        return self._ok("cuDevSmResourceSplitByCount", groups, 15, self._res(12))

    def cuDevResourceGenerateDesc(self, units, count):
        assert count == len(units)
        return self._ok("cuDevResourceGenerateDesc", sum(u.sm.smCount for u in units))

    def cuGreenCtxCreate(self, desc, device, flags):
        assert flags == "DEFAULT_STREAM"
        if self._fails("cuGreenCtxCreate"):
            self.calls.append("cuGreenCtxCreate")
            return (999,)
        return self._ok("cuGreenCtxCreate", self._handle("ctx", sms=desc))

    def cuGreenCtxGetDevResource(self, ctx, kind):
        return self._ok("cuGreenCtxGetDevResource", self._res(ctx.sms))

    def cuGreenCtxStreamCreate(self, ctx, flags, priority):
        assert flags == "NON_BLOCKING"
        self.priorities = [*getattr(self, "priorities", []), priority]
        return self._ok("cuGreenCtxStreamCreate", FakeStream(self._handle("stream").id))

    def cuStreamSynchronize(self, stream):
        return self._ok("cuStreamSynchronize")

    def cuStreamDestroy(self, stream):
        self.live.discard(("stream", int(stream)))
        return self._ok("cuStreamDestroy")

    def cuGreenCtxDestroy(self, ctx):
        self.live.discard(("ctx", ctx.id))
        return self._ok("cuGreenCtxDestroy")

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_FAKE")


class FakeStream:
    def __init__(self, handle):
        self.handle = handle

    def __int__(self):
        return self.handle


@pytest.fixture
def fake_cuda(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(green, "_cuda_available", lambda: True)
    monkeypatch.setattr(green, "_device_index", lambda d: 0 if d is None else d)
    monkeypatch.setattr(green, "_device_sms", lambda d: 132)
    monkeypatch.setattr(green, "_init_primary_context", lambda d: None)
    monkeypatch.setattr(green, "_high_priority", lambda: -5)
    monkeypatch.setattr(green, "_plain_stream", lambda d, prio: ("plain", prio))
    monkeypatch.setattr(green, "_external_stream", lambda handle, d: ("green", handle))
    monkeypatch.setattr(green, "_current_stream", lambda d: "current")
    monkeypatch.setattr(green, "_load_driver", lambda: driver)
    monkeypatch.setattr(green, "_gemm_error", lambda stream: None)
    return driver


def mixed_requests():
    return [
        *three_partitions(0),  # disjoint 72 / 32 / 16
        req("n0", num_sms=16, group=1, priority=1),  # same range as m2 in the next stage
        req("capped", "cap", 32, group=2),
        req("llm", "free", priority=1, group=2),
        req("head", "temporal", group=3),
    ]


def test_green_pool_creates_everything_at_start_and_dedups_contexts(fake_cuda):
    pool = SMPartitionPool.create(mixed_requests(), gpu=H200)
    assert pool.backend == "green-context" and pool.enforced and pool.fallback_reason is None
    ranges = pool.sm_ranges()
    assert ranges["m2"] == ranges["n0"] == (0, 2) and ranges["m1"] == (2, 6) and ranges["m0"] == (6, 15)
    assert ranges["capped"] == (0, 4) and ranges["llm"] is None and ranges["head"] is None
    # one split, one context per distinct range (m2 and n0 share), one stream per quota module
    assert fake_cuda.calls.count("cuDevSmResourceSplitByCount") == 1
    assert fake_cuda.calls.count("cuGreenCtxCreate") == 4
    assert fake_cuda.calls.count("cuGreenCtxStreamCreate") == 5
    assert fake_cuda.priorities == [0, 0, 0, -5, 0]
    created = list(fake_cuda.calls)
    for _ in range(3):
        for r in mixed_requests():
            pool.stream(r.key)
    assert fake_cuda.calls == created  # stream() only looks up
    assert pool.stream("m2")[0] == "green" and pool.stream("m2") != pool.stream("n0")
    assert pool.stream("llm") == ("plain", -5) and pool.stream("head") == "current"
    summary = json.loads(json.dumps(pool.describe()))
    assert summary["num_green_contexts"] == 4 and summary["unit_sms"] == H200_UNITS
    assert summary["structured_units"] == 15  # the driver's 15 groups; unit 15 is the leftover
    assert summary["modules"]["m2"]["num_sms"] == 16 and summary["modules"]["m0"]["sm_range"] == [6, 15]
    live = set(fake_cuda.live)
    pool.close()
    # Retired, not destroyed: memory freed later may still record events on these streams.
    assert fake_cuda.live == live and pool.backend == "closed" and not pool.enforced
    assert fake_cuda.calls.count("cuStreamSynchronize") == 5
    with pytest.raises(RuntimeError, match="after close"):
        pool.stream("m0")


def test_a_driver_error_falls_back_to_plain_streams_with_one_warning(fake_cuda, caplog):
    fake_cuda.fail_at = ("cuGreenCtxCreate", 2)
    with caplog.at_level(logging.WARNING, logger="mosaic.engine.green"):
        pool = SMPartitionPool.create(mixed_requests(), gpu=H200)
    assert pool.backend == "plain-streams" and not pool.enforced
    assert "cuGreenCtxCreate failed: CUDA_ERROR_FAKE (999)" in pool.fallback_reason
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert fake_cuda.live == set()  # the first context and its stream were destroyed
    assert pool.stream("m0") == ("plain", 0) and pool.stream("n0") == ("plain", -5)
    assert pool.sm_ranges()["m1"] == (2, 6)  # quotas still recorded for reports
    assert pool.describe()["fallback_reason"] == pool.fallback_reason


def test_a_context_that_cannot_run_a_gemm_falls_back_and_names_it(fake_cuda, monkeypatch):
    checked = []

    def gemm_error(stream):
        checked.append(stream)
        return "CUBLAS_STATUS_EXECUTION_FAILED" if len(checked) == 2 else None

    monkeypatch.setattr(green, "_gemm_error", gemm_error)
    pool = SMPartitionPool.create(mixed_requests(), gpu=H200)
    assert pool.backend == "plain-streams" and not pool.enforced
    assert len(checked) == 2 and all(s[0] == "green" for s in checked)  # stopped at the first
    assert "a bf16 GEMM failed on the green context of SM units [0, 2) (16 SMs, module 'm2')" \
        in pool.fallback_reason and "CUBLAS_STATUS_EXECUTION_FAILED" in pool.fallback_reason
    assert pool.stream("m2") == ("plain", 0) and pool.sm_ranges()["m2"] == (0, 2)
    assert fake_cuda.live  # retired, not destroyed: tensors ran on its streams


def test_each_green_context_runs_the_gemms_once(fake_cuda, monkeypatch):
    checked = []
    monkeypatch.setattr(green, "_gemm_error", lambda stream: checked.append(stream))
    pool = SMPartitionPool.create(mixed_requests(), gpu=H200)
    assert pool.enforced and len(checked) == 4  # five green streams, four distinct ranges


def test_a_partition_left_only_the_leftover_falls_back_to_plain_streams(fake_cuda):
    pool = SMPartitionPool.create(three_partitions(0, (8,) * 16), gpu=H200)
    assert pool.backend == "plain-streams" and "cannot run cluster launches" in pool.fallback_reason
    assert fake_cuda.calls.count("cuGreenCtxCreate") == 0
    assert pool.sm_ranges()["m15"] == (15, 16)  # recorded on the promised 16 groups of 8


def test_missing_cuda_bindings_falls_back(fake_cuda, monkeypatch):
    def no_bindings():
        raise green._GreenUnavailable("cuda-bindings is not installed (No module named 'cuda')")

    monkeypatch.setattr(green, "_load_driver", no_bindings)
    pool = SMPartitionPool.create(three_partitions(), gpu=H200)
    assert pool.backend == "plain-streams" and "cuda-bindings" in pool.fallback_reason


def test_no_quota_requests_need_no_green_context(fake_cuda):
    pool = SMPartitionPool.create([req("a", "free"), req("b", "temporal")])
    assert pool.backend == "plain-streams" and pool.fallback_reason is None
    assert fake_cuda.calls == []
