"""GPU and cluster specifications: the numbers the performance model and the planner read."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mosaic.errors import MosaicError

GIB = 1024**3

MAX_GPUS = 4096
"""Largest cluster the planners and performance models are meant for (512 8-GPU nodes): far
past any measured point, and a typo (--gpus 80000) should be refused, not planned for minutes."""


class HardwareError(MosaicError):
    """Unknown hardware or an impossible cluster shape."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    name: str
    num_sms: int
    sm_granularity: int
    """Green contexts hand out SMs in groups of this size (8 on Hopper)."""
    peak_bf16_flops: float
    """Dense bf16 matrix rate actually reached (FLOP/s), not the datasheet's."""
    mem_bandwidth_bps: float
    """Device-memory bandwidth reached by a large copy (bytes/s, read + write)."""
    memory_bytes: float
    bandwidth_saturation_sms: int
    """SMs from which a memory-bound kernel saturates bandwidth."""
    kernel_latency_s: float
    """Minimum time of one kernel in a replayed CUDA graph (launch + ramp + tail)."""
    source: str
    """Where the numbers come from (measured here, or datasheet leads)."""
    datasheet_bf16_flops: float = 989e12
    """The vendor's dense bf16 peak (FLOP/s): MFU is quoted against it, as the field does."""
    split_groups: int | None = None
    """Groups of sm_granularity SMs that the driver's SM split makes (the rest is one leftover,
    whose SMs are not co-scheduled, so a green context of them alone fails cluster launches);
    None: as many as fit. Lets a pool without a GPU record the ranges the GPU would give."""

    def __post_init__(self) -> None:
        if self.num_sms < 1 or self.sm_granularity < 1:
            raise HardwareError(f"{self.name}: num_sms and sm_granularity must be >= 1")
        if self.split_groups is not None and not (
                0 < self.split_groups * self.sm_granularity <= self.num_sms):
            raise HardwareError(f"{self.name}: split_groups={self.split_groups} groups of "
                                f"{self.sm_granularity} SMs do not fit its {self.num_sms} SMs")

    @property
    def num_sm_groups(self) -> int:
        """Whole granularity groups a partition can be made of (132 SMs -> 16 groups of 8)."""
        return self.num_sms // self.sm_granularity

    def round_sms(self, sm_share: float) -> int:
        """SMs a green context gets for a share: rounded up to the granularity, at most the GPU."""
        want = max(1, round(sm_share * self.num_sms))
        groups = -(-want // self.sm_granularity)
        return min(self.num_sms, groups * self.sm_granularity)


# H200: measured on the lent card (DESIGN.md, device KINDS.md): 8192^3 bf16 matmul at
# 769-798 TFLOP/s on random data; device copy at about 4.3 TB/s; bandwidth saturates from
# about 48 SMs; SM counts round up to multiples of 8.
H200 = GPUSpec(
    name="h200",
    num_sms=132,
    sm_granularity=8,
    peak_bf16_flops=790e12,
    mem_bandwidth_bps=4.3e12,
    memory_bytes=139 * GIB,
    bandwidth_saturation_sms=48,
    kernel_latency_s=4e-6,
    source="measured on the lent H200 (torch 2.11+cu130), 2026-10/11",
    split_groups=15,  # cuDevSmResourceSplitByCount(8): 15 groups + 12 leftover SMs, 2026-12-03
)

# H100 SXM: same SM array as the H200; matrix rate scaled from the H200's measured/datasheet
# ratio, bandwidth the datasheet's 3.35 TB/s at the same achieved fraction. Leads, not readings.
H100 = GPUSpec(
    name="h100",
    num_sms=132,
    sm_granularity=8,
    peak_bf16_flops=790e12,
    mem_bandwidth_bps=3.0e12,
    memory_bytes=79 * GIB,
    bandwidth_saturation_sms=48,
    kernel_latency_s=4e-6,
    source="datasheet-derived estimate (not measured here)",
)

GPUS: dict[str, GPUSpec] = {g.name: g for g in (H200, H100)}


def gpu_spec(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown hardware {name!r}; choose one of {sorted(GPUS)}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """nodes x GPUs of one kind; GPU ids are global, node-major (node = id // gpus_per_node)."""

    gpu: GPUSpec
    num_nodes: int = 1
    gpus_per_node: int = 8
    intra_node_bandwidth_bps: float = 360e9
    """Per-GPU bus bandwidth a ring all-reduce reaches over NVLink (NVLink 4: ~450 GB/s uni)."""
    inter_node_bandwidth_bps: float = 45e9
    """Bandwidth one NIC reaches across nodes: 400 Gb/s InfiniBand / RoCE line rate (50 GB/s)
    at ~90% (datasheet lead, not measured here: the lent machines are single nodes)."""
    nics_per_node: int = 8
    """NICs of a node (HGX H100 / H200: 8 ConnectX-7, one per GPU, rail-optimised)."""
    inter_node_latency_s: float = 5e-6
    """One hop across the fabric (NIC + switch + NCCL proxy): a few us (datasheet lead)."""
    collective_latency_s: float = 25e-6

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise HardwareError(f"num_nodes={self.num_nodes}: a cluster needs at least one node")
        if self.gpus_per_node < 1:
            raise HardwareError(f"gpus_per_node={self.gpus_per_node}: use --gpus 1 or more")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def node_of(self, gpu_id: int) -> int:
        return gpu_id // self.gpus_per_node

    def spans_nodes(self, gpu_ids: tuple[int, ...] | list[int]) -> bool:
        # min/max, not a set of nodes: asked for every block of a search over 1024 GPUs
        return bool(gpu_ids) and self.node_of(min(gpu_ids)) != self.node_of(max(gpu_ids))

    @property
    def gpu_inter_node_bandwidth_bps(self) -> float:
        """A GPU's share of its node's NICs (all GPUs of a node send across at once)."""
        return self.inter_node_bandwidth_bps * min(1.0, self.nics_per_node / self.gpus_per_node)

    def link_bandwidth_bps(self, gpu_ids: tuple[int, ...] | list[int]) -> float:
        """Bottleneck per-GPU bandwidth of a collective over these GPUs."""
        if self.spans_nodes(gpu_ids):
            return self.gpu_inter_node_bandwidth_bps
        return self.intra_node_bandwidth_bps

    def nodes_of(self, gpu_ids: tuple[int, ...] | list[int]) -> dict[int, int]:
        """node -> how many of these GPUs it holds."""
        counts: dict[int, int] = {}
        for g in gpu_ids:
            counts[self.node_of(g)] = counts.get(self.node_of(g), 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterSpec:
        return cls(**{**d, "gpu": GPUSpec(**d["gpu"])})


GPUS_PER_NODE = 8
"""GPUs of one node (HGX H100 / H200 boards): the unit clusters grow by."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePreset:
    """A common node: its GPU kind and fabric (the ClusterSpec fields it sets)."""

    name: str
    hardware: str
    gpus_per_node: int = GPUS_PER_NODE
    intra_node_bandwidth_bps: float = 360e9
    inter_node_bandwidth_bps: float = 45e9
    nics_per_node: int = 8
    inter_node_latency_s: float = 5e-6
    source: str = ("datasheet leads: NVLink 4 (900 GB/s bidirectional per GPU), 8 x 400 Gb/s "
                   "ConnectX-7 InfiniBand / RoCE per node, ~5 us per fabric hop; not measured")


NODE_PRESETS: dict[str, NodePreset] = {
    p.name: p for p in (
        NodePreset(name="hgx-h200", hardware="h200"),  # HGX / DGX H200: 8 GPUs, NVSwitch, 8 NICs
        NodePreset(name="hgx-h100", hardware="h100"),  # HGX / DGX H100 SXM: the same fabric
    )
}


def node_preset(name: str) -> NodePreset:
    try:
        return NODE_PRESETS[name.lower()]
    except KeyError:
        raise HardwareError(f"unknown node preset {name!r}; choose one of {sorted(NODE_PRESETS)}") from None


def make_cluster(num_gpus: int, hardware: str = "h200", gpus_per_node: int = GPUS_PER_NODE) -> ClusterSpec:
    """A cluster of `num_gpus`, filling nodes of `gpus_per_node` (fewer GPUs: one partial node).

    `hardware` is a GPU kind (`h200`, `h100`: the HGX fabric of that GPU) or a node preset
    (`hgx-h200`, `hgx-h100`)."""
    preset = NODE_PRESETS.get(hardware.lower()) or next(
        (p for p in NODE_PRESETS.values() if p.hardware == hardware.lower()), None)
    if gpus_per_node < 1:
        raise HardwareError(f"--gpus-per-node {gpus_per_node}: a node has at least 1 GPU")
    if num_gpus < 1:
        raise HardwareError(f"--gpus {num_gpus}: need at least 1 GPU")
    if num_gpus > MAX_GPUS:
        raise HardwareError(f"--gpus {num_gpus}: at most {MAX_GPUS} GPUs are modelled; use fewer")
    gpu = gpu_spec(preset.hardware if preset else hardware)
    fabric = {} if preset is None else {
        "intra_node_bandwidth_bps": preset.intra_node_bandwidth_bps,
        "inter_node_bandwidth_bps": preset.inter_node_bandwidth_bps,
        "nics_per_node": preset.nics_per_node, "inter_node_latency_s": preset.inter_node_latency_s}
    if num_gpus <= gpus_per_node:
        return ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=num_gpus, **fabric)
    if num_gpus % gpus_per_node:
        raise HardwareError(
            f"--gpus {num_gpus} is not a whole number of {gpus_per_node}-GPU nodes; "
            f"use a multiple of {gpus_per_node} or at most {gpus_per_node}"
        )
    return ClusterSpec(gpu=gpu, num_nodes=num_gpus // gpus_per_node, gpus_per_node=gpus_per_node,
                       **fabric)
