"""The SM partition pool on a real GPU: green contexts enforce disjoint, unequal SM quotas."""

import statistics
import time

import pytest

from mosaic.engine.green import SMIdProbe, SMPartitionPool, StreamRequest

pytestmark = pytest.mark.gpu


def quota(key, num_sms, mode="partition"):
    return StreamRequest(key=key, mode=mode, num_sms=num_sms)


@pytest.fixture(scope="module")
def three_way():
    with SMPartitionPool.create([quota("a", 72), quota("b", 32), quota("c", 16)]) as pool:
        yield pool


def test_backend_is_green_and_enforced(three_way):
    assert three_way.backend == "green-context" and three_way.enforced
    assert three_way.fallback_reason is None
    assert [three_way.num_sms(k) for k in "abc"] == [72, 32, 16]


def test_three_unequal_partitions_run_on_disjoint_sms(three_way):
    probe = SMIdProbe(num_blocks=2048, spin_us=300)
    pending = {k: probe.launch(three_way.stream(k)) for k in "abc"}  # all in flight at once
    seen = {k: set(probe.result(p)[0]) for k, p in pending.items()}
    assert [len(seen[k]) for k in "abc"] == [72, 32, 16]
    assert not (seen["a"] & seen["b"] or seen["a"] & seen["c"] or seen["b"] & seen["c"])


def test_stages_reuse_the_same_sms_through_one_context():
    requests = [quota("a", 64), quota("b", 64),
                StreamRequest(key="c", mode="partition", num_sms=64, group=1)]
    with SMPartitionPool.create(requests) as pool:
        assert pool.describe()["num_green_contexts"] == 2  # c shares a's range and context
        assert pool.sm_ranges()["c"] == pool.sm_ranges()["a"] and pool.stream("c") != pool.stream("a")
        probe = SMIdProbe(num_blocks=1024, spin_us=100)
        seen = {k: set(probe.result(probe.launch(pool.stream(k)))[0]) for k in "abc"}
    assert seen["a"] == seen["c"] and not seen["a"] & seen["b"]


def test_a_small_cap_at_the_tail_runs_cublas_gemms():
    # 2026-12-03: a cap of 8 SMs laid out on the split's 12 leftover SMs alone failed every
    # bf16 GEMM (CUBLAS_STATUS_EXECUTION_FAILED: cluster launches need structured SMs).
    import torch

    requests = [quota("front", 120, "cap"), quota("small", 8, "cap")]
    with SMPartitionPool.create(requests) as pool:
        assert pool.enforced and pool.num_sms("small") >= 8
        stream = pool.stream("small")
        with torch.cuda.stream(stream):
            x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(768, 256, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(768, device="cuda", dtype=torch.bfloat16)
            got = torch.nn.functional.linear(x, w, b)
        stream.synchronize()
    torch.testing.assert_close(got.float(), x.float() @ w.float().T + b.float(), rtol=2e-2, atol=2.0)


def test_a_context_of_the_leftover_alone_fails_the_start_up_check(monkeypatch):
    # The layout never gives a quota the split's leftover alone since 2026-12-03; forced to
    # here, the pool's own GEMM check must catch it and fall back before any step runs.
    import torch

    from mosaic.engine import green

    placed = {}

    def leftover_alone(requests, unit_sms, structured_units):
        placed["units"], placed["structured"] = len(unit_sms), structured_units
        ranges = green_layout(requests, unit_sms, structured_units)
        return {**ranges, "small": (len(unit_sms) - 1, len(unit_sms))}

    green_layout = green.layout
    monkeypatch.setattr(green, "layout", leftover_alone)
    with SMPartitionPool.create([quota("front", 64, "cap"), quota("small", 8, "cap")]) as pool:
        if placed["units"] == placed["structured"]:
            pytest.skip("this GPU's split left no leftover SMs")
        assert not pool.enforced and pool.backend == "plain-streams"
        assert "a bf16 GEMM failed on the green context" in pool.fallback_reason
        assert "module 'small'" in pool.fallback_reason
        with torch.cuda.stream(pool.stream("small")):  # the failure left the device usable
            got = torch.ones(256, 256, device="cuda", dtype=torch.bfloat16) @ torch.ones(
                256, 256, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
    assert got.float().mean().item() == 256.0


def median_matmul_ms(stream, repeats=8):
    import torch

    with torch.cuda.stream(stream):
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            x @ y
        times = []
        for _ in range(repeats):
            stream.synchronize()
            t0 = time.perf_counter()
            x @ y
            stream.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def test_matmul_time_follows_the_quota():
    with SMPartitionPool.create([quota("small", 16, "cap"), quota("large", 128, "cap")]) as pool:
        small_ms = median_matmul_ms(pool.stream("small"))
        large_ms = median_matmul_ms(pool.stream("large"))
    assert small_ms > 2.5 * large_ms, (small_ms, large_ms)


def test_free_streams_get_torch_priorities():
    import torch

    requests = [StreamRequest(key="hi", mode="free", num_sms=None, priority=1),
                StreamRequest(key="lo", mode="free", num_sms=None),
                StreamRequest(key="seq", mode="temporal", num_sms=None)]
    with SMPartitionPool.create(requests) as pool:
        assert pool.stream("hi").priority == min(torch.cuda.Stream.priority_range())
        assert pool.stream("lo").priority == 0
        assert pool.stream("seq") == torch.cuda.current_stream()
