"""Bootstrap performance model: a roofline per module plus a fluid model of sharing.

Used until (and where) measured profiles are missing. Three effects decide whether
colocation pays, and this model keeps all three:

1. Small modules cannot fill the GPU: the GEMM tiles of a small per-GPU batch cover only some
   SMs, so their compute term stops improving beyond that share (saturation).
2. Kernel latency (launch, ramp, tail) does not shrink with SMs; concurrent streams overlap it.
3. Memory bandwidth is shared: colocated modules whose summed bandwidth demand exceeds the
   device's slow each other down, non-linearly in how memory-bound each one is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from mosaic.graph import ModuleSpec
from mosaic.hardware import ClusterSpec, GPUSpec
from mosaic.perf.base import PerfModel, Work

MATMUL_EFFICIENCY = 0.45
"""Fraction of the measured matmul peak a whole transformer step reaches when it fills the GPU."""
TILE = 128
CONCURRENCY_OVERHEAD = 0.08
"""Per extra concurrent stream: scheduler and cache interference without a quota."""


@lru_cache(maxsize=65536)
def _roofline_terms(module: ModuleSpec, per_gpu_batch: int, gpu: GPUSpec) -> tuple[float, float, float, int]:
    """(compute_s at full GPU, memory_s at full bandwidth, latency_s, SMs the work can fill)."""
    tokens = per_gpu_batch * module.tokens_per_sample
    width = max(module.hidden_dim, TILE)
    tiles = math.ceil(tokens / TILE) * math.ceil(width / TILE) * 2
    fill_sms = max(gpu.sm_granularity, min(gpu.num_sms, tiles))
    compute_s = module.flops_per_sample * per_gpu_batch / (gpu.peak_bf16_flops * MATMUL_EFFICIENCY)
    memory_s = module.step_traffic_bytes(per_gpu_batch) / gpu.mem_bandwidth_bps
    latency_s = module.kernels_per_step * gpu.kernel_latency_s
    return compute_s, memory_s, latency_s, fill_sms


class AnalyticModel(PerfModel):
    name = "analytic"

    def __init__(self, cluster: ClusterSpec) -> None:
        super().__init__(cluster)
        self.gpu = cluster.gpu

    def describe(self) -> str:
        return f"analytic roofline ({self.gpu.name}: {self.gpu.source})"

    def _terms(self, module: ModuleSpec, per_gpu_batch: int) -> tuple[float, float, float, int]:
        return _roofline_terms(module, per_gpu_batch, self.gpu)

    def _compute_s(self, module: ModuleSpec, per_gpu_batch: int, sms: int) -> float:
        compute_s, _, _, fill_sms = self._terms(module, per_gpu_batch)
        # Work that fills only `fill_sms` SMs runs at fill_sms/num_sms of the peak at best.
        return compute_s * self.gpu.num_sms / min(sms, fill_sms)

    def _memory_s(self, module: ModuleSpec, per_gpu_batch: int, sms: int) -> float:
        _, memory_s, _, _ = self._terms(module, per_gpu_batch)
        return memory_s / min(1.0, sms / self.gpu.bandwidth_saturation_sms)

    def module_time_s(self, module: ModuleSpec, per_gpu_batch: int, sm_share: float = 1.0) -> float:
        sms = self.gpu.round_sms(sm_share)
        _, _, latency_s, _ = self._terms(module, per_gpu_batch)
        compute = self._compute_s(module, per_gpu_batch, sms)
        memory = self._memory_s(module, per_gpu_batch, sms)
        return max(compute, memory) + latency_s

    def bandwidth_demand(self, work: Work) -> float:
        """Fraction of device bandwidth the module uses while it runs alone on its share."""
        memory_s = self._terms(work.module, work.per_gpu_batch)[1]
        return min(1.0, memory_s / self.module_time_s(work.module, work.per_gpu_batch, work.sm_share))

    def _contention(self, works: Sequence[Work]) -> list[float]:
        """Slowdown factor per module from shared bandwidth (1.0 = none).

        Only the memory-bound fraction of a module stretches, and it stretches by how far the
        summed demand exceeds the device: a product, hence not linear in either.
        """
        demands = [self.bandwidth_demand(w) for w in works]
        excess = max(0.0, sum(demands) - 1.0)
        return [1.0 + d * excess for d in demands]

    def colocated_time_s(self, works: Sequence[Work], sharing: str) -> float:
        if len(works) == 1 or sharing == "temporal":
            return sum(self.work_time_s(w, 1.0) for w in works)
        if sharing == "partition":
            slowdowns = self._contention(works)
            return max(
                self.work_time_s(w, w.sm_share) * s
                for w, s in zip(works, slowdowns, strict=True)
            )
        return self._shared_time_s(works, sharing)

    def _shared_time_s(self, works: Sequence[Work], sharing: str) -> float:
        """Free streams or caps: a fluid schedule of SM-seconds and bytes, latencies overlapped.

        No module finishes before it would alone on its cap; all SM-work together cannot
        finish before it is packed onto the whole GPU; all bytes cannot move faster than the
        device's bandwidth.
        """
        alone = [self.work_time_s(w, 1.0 if sharing == "free" else w.sm_share) for w in works]
        # A TP shard moves and computes 1/t of its replica's bytes and FLOPs.
        memory_s = sum(self._terms(w.module, w.per_gpu_batch)[1] / w.tensor_parallel for w in works)
        packed_s = self._packed_sm_time(works, sharing)
        # Streams without a quota steal SMs from the longest module: it runs a little slower
        # than alone, while the packed work still cannot beat the whole GPU.
        overhead = 1.0 + CONCURRENCY_OVERHEAD * (len(works) - 1)
        return max(max(alone) * overhead, packed_s, memory_s)

    def _packed_sm_time(self, works: Sequence[Work], sharing: str) -> float:
        """Time to run all SM-work packed onto the GPU: sum of SM-seconds / SMs."""
        n = self.gpu.num_sms
        total = 0.0
        for w in works:
            cap = 1.0 if sharing == "free" else w.sm_share
            sms = min(self._terms(w.module, w.per_gpu_batch)[3], self.gpu.round_sms(cap))
            total += self._compute_s(w.module, w.per_gpu_batch, sms) * sms / w.tensor_parallel
        return total / n
