"""`mosaic kernel-time`: a torch.profiler trace's GPU kernels by class, busy and idle time."""

from __future__ import annotations

import gzip
import json

import pytest

from mosaic.cli import main
from mosaic.report.kernel_time import kernel_class, kernel_time


def _kernel(name: str, ts: float, dur: float, device: int = 0, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": device,
            "args": {"device": device, "stream": stream}}


TRACE = {"traceEvents": [
    _kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 0, 400),
    _kernel("triton_poi_fused_add_gelu_0", 300, 200, stream=9),    # overlaps the GEMM by 100
    _kernel("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 600, 300),
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 1000,
     "dur": 100, "pid": 0, "args": {"device": 0}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},   # host: ignored
    _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 50, device=1),
]}


def test_busy_time_counts_overlapping_streams_once_and_classes_sum_to_the_kernel_time():
    summary = kernel_time(TRACE, steps=2)
    gpu0 = summary["devices"]["0"]
    assert gpu0["span_ms"] == pytest.approx(1.1 / 2)             # 0 .. 1100 us, two steps
    assert gpu0["busy_ms"] == pytest.approx((500 + 300 + 100) / 2e3)
    assert gpu0["idle_ms"] == pytest.approx(0.2 / 2)             # 500..600 and 900..1000
    assert gpu0["kernel_ms"] == pytest.approx(1.0 / 2)
    assert gpu0["concurrency"] == pytest.approx(1000 / 900)
    assert {k: round(v["ms"] * 2e3) for k, v in gpu0["classes"].items()} == {
        "gemm": 400, "optimizer": 300, "triton (fused)": 200, "copy/cast": 100}
    assert sum(v["share_of_kernel_time"] for v in gpu0["classes"].values()) == pytest.approx(1)
    assert gpu0["top_kernels"][0]["class"] == "gemm"
    assert gpu0["idle_gaps"] == {"long_ms": 0.0, "short_ms": pytest.approx(0.1),
                                 "short_count": 1.0, "longest_ms": []}
    assert summary["devices"]["1"]["classes"] == {
        "collective": {"ms": pytest.approx(0.025), "count": 0.5, "share_of_kernel_time": 1.0}}


@pytest.mark.parametrize(("name", "label"), [
    ("flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_TNT", "gemm"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "elementwise/reduce"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "copy/cast"),
    ("Memcpy HtoD (Pinned -> Device)", "copy/cast"),
    ("triton_red_fused__to_copy_add_native_layer_norm_1", "triton (fused)"),
    ("some_custom_kernel", "other"),
])
def test_kernel_names_map_to_classes(name, label):
    assert kernel_class(name) == label


def test_kernel_time_command_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "trace-rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(TRACE, f)
    with pytest.raises(SystemExit) as info:
        main(["kernel-time", str(path), "--steps", "2"])
    assert not info.value.code
    out = capsys.readouterr().out
    assert out.startswith("GPU 0, per step: span 0.55 ms, busy 0.45 ms, idle 0.10 ms")
    assert "gemm" in out and "GPU 1" in out
    with pytest.raises(SystemExit) as info:
        main(["kernel-time", str(tmp_path / "missing.json")])
    assert info.value.code == 2


def test_idle_time_is_split_into_the_hosts_long_gaps_and_the_short_ones_between_kernels():
    """Two steps of two kernels each, 10 us apart inside a step and 2.5 ms apart between the
    steps (a sync): the long gap is the host's, the short ones the launches'."""
    events = [_kernel("triton_poi_fused_0", ts, 100) for ts in (0, 110, 2710, 2820)]
    gaps = kernel_time({"traceEvents": events}, steps=2)["devices"]["0"]["idle_gaps"]
    assert gaps == {"long_ms": pytest.approx(2.5 / 2), "short_ms": pytest.approx(0.02 / 2),
                    "short_count": 1.0, "longest_ms": [pytest.approx(2.5)]}
