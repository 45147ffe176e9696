"""SM partition pool: one CUDA stream per colocated module, SM quotas through green contexts.

Every green context and stream is made once, in `SMPartitionPool.create`: on the H200 each
costs about 2 ms and 4 MiB of device memory, and creating one WAITS for the work already queued
on the device (29 ms behind 30 ms of matmuls, against 1.6 ms idle), so making one inside a step
would drain the pipeline. A step only looks streams up (0.1 us). How the contexts are carved
(split once, then one descriptor per partition):

1. ONE `cuDevSmResourceSplitByCount` of the device's SM resource into granularity-sized groups
   ("units"). The driver decides how many it can make (clusters and GPC layout): on the H200 it
   returned 15 groups of 8 plus 12 SMs left, not 16 + 4, so the leftover is kept as one more unit.
   The groups are "structured" (their SMs are co-scheduled, so thread-block clusters fit); the
   leftover is not: a context of the leftover alone fails every cluster launch, and cuBLAS's
   Hopper GEMMs are cluster launches (CUBLAS_STATUS_EXECUTION_FAILED, the driver saying
   CUDA_ERROR_INVALID_CLUSTER_SIZE, measured 2026-12-03). So every quota's range holds at least
   one structured group; the leftover only ever joins one.
2. One descriptor per partition over k consecutive units (`cuDevResourceGenerateDesc(units, k)`),
   then `cuGreenCtxCreate` and `cuGreenCtxStreamCreate`, wrapped for torch with
   `torch.cuda.get_stream_from_external`. A split result cannot be split again, but any subset
   of one split combines, so partitions of unequal sizes come out disjoint.

Modes (plan.py): `partition` packs disjoint unit ranges within one stage (`group`), smallest
first, stages reuse the same SMs; `cap` packs the same way while the caps fit and overlaps
once they do not (an upper bound, not a reservation); `free` is a plain torch stream with a
priority; `temporal` is the caller's current stream. Where green contexts are unavailable, the pool falls back to plain
streams (quotas recorded, not enforced) and says why, once; so it does where a context the
driver made cannot run cuBLAS's cluster-launched GEMMs, which each context is made to run once
at start-up (`SELF_CHECK_GEMMS`), rather than a step failing far from the cause.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mosaic.errors import MosaicError
from mosaic.hardware import GPUSpec
from mosaic.plan import SHARING_MODES, Plan

log = logging.getLogger(__name__)

QUOTA_MODES = ("partition", "cap")
DEFAULT_SM_GRANULARITY = 8
"""SMs per green-context group when no GPUSpec is given (Hopper's minimum partition)."""


class PoolError(MosaicError):
    """Requests that no device can satisfy; the message names the module and the fix."""


class _GreenUnavailable(RuntimeError):
    """Green contexts cannot be used here; the message says why (the fallback reason)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamRequest:
    key: str
    """Module name; `SMPartitionPool.stream(key)` returns its stream."""
    mode: str
    """'temporal' | 'partition' | 'cap' | 'free' (plan.py's sharing modes)."""
    num_sms: int | None
    """SMs for partition/cap, already rounded to the granularity; None for free/temporal."""
    priority: int = 0
    """1 = high-priority stream (the critical path), 0 = normal."""
    group: int = 0
    """Stage index: partitions must be disjoint only within one group."""

    def __post_init__(self) -> None:
        what = f"stream request {self.key!r}"
        if self.mode not in SHARING_MODES:
            raise PoolError(f"{what}: mode={self.mode!r}; use one of {SHARING_MODES}")
        if self.mode in QUOTA_MODES and (self.num_sms is None or self.num_sms < 1):
            raise PoolError(f"{what}: mode={self.mode!r} needs num_sms >= 1, got {self.num_sms}")
        if self.mode not in QUOTA_MODES and self.num_sms is not None:
            raise PoolError(f"{what}: mode={self.mode!r} takes no quota; set num_sms=None")
        if self.priority not in (0, 1):
            raise PoolError(f"{what}: priority={self.priority} must be 0 (normal) or 1 (high)")


def requests_for_plan(plan: Plan, gpu_id: int, gpu: GPUSpec) -> list[StreamRequest]:
    """One request per module placed on `gpu_id`, in plan order.

    A cap of the whole GPU (sm_share 1.0) is no cap: it becomes a `free` stream.
    """
    requests = []
    for index, stage in enumerate(plan.stages):
        for p in stage.on_gpu(gpu_id):
            mode, num_sms = stage.sharing, None
            if mode in QUOTA_MODES:
                num_sms = gpu.round_sms(p.sm_share)
                if mode == "cap" and num_sms >= gpu.num_sms:
                    mode, num_sms = "free", None
            requests.append(StreamRequest(
                key=p.module, mode=mode, num_sms=num_sms, priority=p.priority, group=index))
    return requests


# --- layout: which SM units each quota gets (pure, tested on CPU) ------------------------------
def regular_units(num_sms: int, granularity: int, groups: int | None = None) -> list[int]:
    """The units a GPUSpec promises: `groups` whole groups (default: as many as fit, else the
    count the GPU's split was measured to make), then the leftover SMs as one more unit."""
    groups = num_sms // granularity if groups is None else groups
    leftover = num_sms - groups * granularity
    return [granularity] * groups + ([leftover] if leftover else [])


def check_requests(requests: Sequence[StreamRequest], device_sms: int | None) -> None:
    """Raise PoolError for duplicate keys, or quotas that do not fit `device_sms`."""
    keys = [r.key for r in requests]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise PoolError(f"modules {duplicates} are requested more than once; one stream per module")
    if device_sms is None:
        return
    for r in requests:
        if r.mode == "cap" and r.num_sms > device_sms:
            raise PoolError(
                f"module {r.key!r}: cap of {r.num_sms} SMs exceeds the device's {device_sms}; "
                "lower its sm_share")
    partitions: dict[int, list[StreamRequest]] = defaultdict(list)
    for r in requests:
        if r.mode == "partition":
            partitions[r.group].append(r)
    for group, members in sorted(partitions.items()):
        sizes = [r.num_sms for r in members]
        if sum(sizes) > device_sms:
            raise PoolError(
                f"stage {group}: disjoint partitions of {[r.key for r in members]} need "
                f"{sum(sizes)} SMs ({sizes}) but the device has {device_sms}; lower their "
                "sm_share or use sharing 'cap' or 'free'")


def layout(requests: Sequence[StreamRequest], unit_sms: Sequence[int],
           structured: int) -> dict[str, tuple[int, int]]:
    """Unit range [start, stop) for each quota request; units [0, structured) are the split's
    structured groups, any after them its unstructured leftover.

    Partitions of one group take consecutive, disjoint ranges, smallest first, so the largest
    ends on the tail and absorbs the leftover when the group needs it; caps do the same in
    request order while they fit, and otherwise take the shortest tail that covers them
    (overlapping others). No range is the leftover alone: cluster launches (cuBLAS's GEMMs)
    cannot run there. Raises _GreenUnavailable naming the module when a partition does not fit.
    """
    cursor: dict[tuple[str, int], int] = defaultdict(int)
    ranges: dict[str, tuple[int, int]] = {}
    quotas = [r for r in requests if r.mode in QUOTA_MODES]
    for r in sorted(quotas, key=lambda r: r.num_sms if r.mode == "partition" else 0):
        start = cursor[(r.mode, r.group)]
        stop = _cover(unit_sms, start, r.num_sms) if start < structured else None
        if stop is None:
            if r.mode == "partition" or structured == 0:
                raise _GreenUnavailable(
                    f"{r.mode} {r.key!r} ({r.num_sms} SMs) does not fit the SM groups left "
                    f"by the split {list(unit_sms)} ({structured} structured: a range of only "
                    "the leftover SMs cannot run cluster launches)")
            start, stop = _tail(unit_sms, r.num_sms, structured)
        ranges[r.key] = (start, stop)
        cursor[(r.mode, r.group)] = stop
    return ranges


def _recorded_ranges(requests: Sequence[StreamRequest], units: Sequence[int],
                     granularity: int) -> dict[str, tuple[int, int]]:
    """The ranges a pool without green contexts reports (quotas recorded, not enforced):
    `regular_units` are whole groups then the leftover; none when the quotas do not fit."""
    try:
        return layout(requests, units, _whole_groups(units, granularity))
    except _GreenUnavailable:
        return {}


def _whole_groups(units: Sequence[int], granularity: int) -> int:
    """The groups among `regular_units` (a split the driver did not make: no green state)."""
    return sum(1 for u in units if u == granularity)


def _cover(unit_sms: Sequence[int], start: int, need: int) -> int | None:
    total = 0
    for stop in range(start, len(unit_sms)):
        total += unit_sms[stop]
        if total >= need:
            return stop + 1
    return None


def _tail(unit_sms: Sequence[int], need: int, structured: int) -> tuple[int, int]:
    """The shortest tail covering `need` SMs that starts on a structured group."""
    total = 0
    for start in range(len(unit_sms) - 1, -1, -1):
        total += unit_sms[start]
        if total >= need and start < structured:
            return start, len(unit_sms)
    return 0, len(unit_sms)


# --- torch and driver seams (module functions so CPU tests can stand in for them) --------------
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_index(device: int | None) -> int:
    import torch

    return torch.cuda.current_device() if device is None else int(device)


def _device_sms(device: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def _init_primary_context(device: int) -> None:
    # cuGreenCtxCreate retains the primary context: have torch make it first, once.
    import torch

    torch.cuda.synchronize(device)


def _high_priority() -> int:
    import torch

    return min(torch.cuda.Stream.priority_range())  # lower number = more urgent


def _plain_stream(device: int, priority: int) -> Any:
    import torch

    return torch.cuda.Stream(device=device, priority=priority)


def _external_stream(handle: int, device: int) -> Any:
    import torch

    return torch.cuda.get_stream_from_external(handle, device)


def _current_stream(device: int) -> Any:
    import torch

    return torch.cuda.current_stream(device)


def _load_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise _GreenUnavailable(f"cuda-bindings is not installed ({exc})") from None
    return driver


def _check(drv: Any, name: str, *args: Any) -> Any:
    """Call driver function `name`; raise _GreenUnavailable naming it on any error."""
    fn = getattr(drv, name, None)
    if fn is None:
        raise _GreenUnavailable(f"cuda.bindings has no {name} (bindings too old)")
    try:
        err, *out = fn(*args)
    except RuntimeError as exc:  # the bindings raise when the driver lacks the symbol
        raise _GreenUnavailable(f"{name}: {exc}") from None
    code = int(getattr(err, "value", err))
    if code != 0:
        raise _GreenUnavailable(f"{name} failed: {_error_name(drv, err)} ({code})")
    return out[0] if len(out) == 1 else tuple(out)


def _error_name(drv: Any, err: Any) -> str:
    try:
        status, name = drv.cuGetErrorName(err)
        return name.decode() if int(getattr(status, "value", status)) == 0 else str(err)
    except Exception:  # the name is only for the message
        return str(err)


# --- the green contexts -------------------------------------------------------------------------
@dataclass(slots=True)
class _GreenState:
    """Everything created through the driver, kept alive until close()."""

    driver: Any
    unit_sms: list[int] = field(default_factory=list)
    units: list[Any] = field(default_factory=list)
    structured_units: int = 0
    """How many of `units` are the split's groups; a leftover unit follows them."""
    contexts: dict[tuple[int, int], Any] = field(default_factory=dict)
    context_sms: dict[tuple[int, int], int] = field(default_factory=dict)
    raw_streams: dict[str, Any] = field(default_factory=dict)
    driver_version: int | None = None

    def synchronize(self) -> None:
        for key, stream in self.raw_streams.items():
            try:
                _check(self.driver, "cuStreamSynchronize", stream)
            except _GreenUnavailable as exc:
                log.warning("green-context teardown: %s: %s", key, exc)

    def destroy(self) -> None:
        drv, errors = self.driver, []
        for key, stream in self.raw_streams.items():
            for name in ("cuStreamSynchronize", "cuStreamDestroy"):
                try:
                    _check(drv, name, stream)
                except _GreenUnavailable as exc:
                    errors.append(f"{key}: {exc}")
        for rng, ctx in self.contexts.items():
            try:
                _check(drv, "cuGreenCtxDestroy", ctx)
            except _GreenUnavailable as exc:
                errors.append(f"context {rng}: {exc}")
        self.raw_streams.clear()
        self.contexts.clear()
        if errors:
            log.warning("green-context teardown: %s", "; ".join(errors))


_RETIRED: list[_GreenState] = []
"""Closed pools' green contexts, kept alive until the process ends (SMPartitionPool.close)."""


def _split_device(state: _GreenState, device: int, granularity: int, device_sms: int) -> Any:
    drv = state.driver
    _check(drv, "cuInit", 0)
    state.driver_version = _check(drv, "cuDriverGetVersion")
    cu_device = _check(drv, "cuDeviceGet", device)
    sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    whole = _check(drv, "cuDeviceGetDevResource", cu_device, sm_type)
    groups, num_groups, rest = _check(
        drv, "cuDevSmResourceSplitByCount", device_sms // granularity, whole, 0, granularity)
    state.units = list(groups)[: int(num_groups)]
    state.structured_units = len(state.units)
    if rest.sm.smCount:
        state.units.append(rest)
    state.unit_sms = [int(u.sm.smCount) for u in state.units]
    return cu_device


def _make_green(requests: Sequence[StreamRequest], device: int, granularity: int,
                device_sms: int) -> tuple[_GreenState, dict[str, Any], dict[str, tuple[int, int]]]:
    """Create every context and stream for the quota requests; on error destroy what was made."""
    state = _GreenState(driver=_load_driver())
    drv = state.driver
    try:
        cu_device = _split_device(state, device, granularity, device_sms)
        ranges = layout(requests, state.unit_sms, state.structured_units)
        high = _high_priority()
        streams = {}
        for r in requests:
            if r.key not in ranges:
                continue
            rng = ranges[r.key]
            if rng not in state.contexts:  # stages and caps with the same range share a context
                units = state.units[rng[0]:rng[1]]
                desc = _check(drv, "cuDevResourceGenerateDesc", units, len(units))
                ctx = _check(drv, "cuGreenCtxCreate", desc, cu_device,
                             drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
                state.contexts[rng] = ctx
                got = _check(drv, "cuGreenCtxGetDevResource", ctx,
                             drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)
                state.context_sms[rng] = int(got.sm.smCount)
            raw = _check(drv, "cuGreenCtxStreamCreate", state.contexts[rng],
                         drv.CUstream_flags.CU_STREAM_NON_BLOCKING, high if r.priority else 0)
            state.raw_streams[r.key] = raw
            streams[r.key] = _external_stream(int(raw), device)
        return state, streams, ranges
    except BaseException:
        state.destroy()
        raise


SELF_CHECK_GEMMS = ((256, 256, 768), (392, 256, 768))
"""bf16 `F.linear` shapes (rows, in, out) each green context runs once when the pool is made:
cuBLAS launches them as thread-block clusters on the H200, which is what failed on a context
the driver cannot co-schedule (the split's leftover alone, 2026-12-03)."""


def _failed_gemm(state: _GreenState, streams: dict[str, Any],
                 ranges: dict[str, tuple[int, int]]) -> str | None:
    """Why some green context of the pool cannot run cuBLAS's GEMMs, naming it; None when each
    ran them. Checked at start-up because a context the driver made can still refuse a launch
    (a GPU whose split this layout does not know), and a step would fail far from the cause."""
    checked: set[tuple[int, int]] = set()
    for key, rng in ranges.items():
        if key not in streams or rng in checked:
            continue
        checked.add(rng)
        if (error := _gemm_error(streams[key])) is not None:
            return (f"a bf16 GEMM failed on the green context of SM units [{rng[0]}, {rng[1]}) "
                    f"({state.context_sms.get(rng)} SMs, module {key!r}): {error}")
    return None


def _gemm_error(stream: Any) -> str | None:
    """Run SELF_CHECK_GEMMS on `stream` and wait; the error's first line, or None. Inputs are
    constant: the check must not draw from the CUDA generator a seeded run replays."""
    import torch

    try:
        with torch.cuda.stream(stream):
            for rows, width, features in SELF_CHECK_GEMMS:
                x = torch.ones(rows, width, device=stream.device, dtype=torch.bfloat16)
                w = torch.ones(features, width, device=stream.device, dtype=torch.bfloat16)
                torch.nn.functional.linear(x, w)
        stream.synchronize()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


# --- the pool -----------------------------------------------------------------------------------
class SMPartitionPool:
    """Streams for the modules on one GPU, made at start-up; use `create`, then `stream(key)`."""

    def __init__(self, *, requests: Sequence[StreamRequest], device: int | None, backend: str,
                 streams: dict[str, Any], ranges: dict[str, tuple[int, int]], unit_sms: list[int],
                 device_sms: int | None, granularity: int, green: _GreenState | None = None,
                 fallback_reason: str | None = None) -> None:
        self.requests = {r.key: r for r in requests}
        self.device = device
        self.backend = backend
        self.enforced = backend == "green-context"
        self.setup_s = 0.0
        self.fallback_reason = fallback_reason
        self._streams = streams
        self._ranges = ranges
        self._unit_sms = unit_sms
        self._device_sms = device_sms
        self._granularity = granularity
        self._green = green

    @classmethod
    def create(cls, requests: Sequence[StreamRequest], device: int | None = None,
               gpu: GPUSpec | None = None) -> SMPartitionPool:
        """Make every stream (and green context) now. Raises PoolError on impossible quotas."""
        t0 = time.perf_counter()
        requests = list(requests)
        granularity = gpu.sm_granularity if gpu else DEFAULT_SM_GRANULARITY
        if not _cuda_available():
            device_sms = gpu.num_sms if gpu else None
            check_requests(requests, device_sms)
            units = (regular_units(device_sms, granularity, gpu.split_groups if gpu else None)
                     if device_sms else [])
            pool = cls(requests=requests, device=None, backend="cpu", streams={},
                       ranges=_recorded_ranges(requests, units, granularity), unit_sms=units,
                       device_sms=device_sms, granularity=granularity,
                       fallback_reason="no CUDA device: quotas recorded, not enforced")
        else:
            index = _device_index(device)
            device_sms = _device_sms(index)
            check_requests(requests, device_sms)
            pool = cls._create_cuda(requests, index, device_sms, granularity)
        pool.setup_s = time.perf_counter() - t0
        return pool

    @classmethod
    def _create_cuda(cls, requests: list[StreamRequest], device: int, device_sms: int,
                     granularity: int) -> SMPartitionPool:
        green, reason, streams = None, None, {}
        ranges: dict[str, tuple[int, int]] = {}
        units = regular_units(device_sms, granularity)
        if any(r.mode in QUOTA_MODES for r in requests):
            _init_primary_context(device)
            try:
                green, streams, ranges = _make_green(requests, device, granularity, device_sms)
                units = green.unit_sms
                if (failed := _failed_gemm(green, streams, ranges)) is not None:
                    _RETIRED.append(green)  # tensors ran on its streams: retire (see close)
                    green, streams = None, {}
                    raise _GreenUnavailable(failed)
            except Exception as exc:  # any failure: run unenforced rather than not at all
                reason = f"{type(exc).__name__}: {exc}" if not isinstance(
                    exc, _GreenUnavailable) else str(exc)
                log.warning("green contexts unavailable on cuda:%d, SM quotas NOT enforced "
                            "(plain streams instead): %s", device, reason)
                ranges = _recorded_ranges(requests, units, granularity)
        high = _high_priority()
        for r in requests:
            if r.key in streams:
                continue
            if r.mode == "temporal":
                streams[r.key] = None  # resolved to the current stream at lookup
            else:
                streams[r.key] = _plain_stream(device, high if r.priority else 0)
        backend = "green-context" if green is not None else "plain-streams"
        return cls(requests=requests, device=device, backend=backend, streams=streams,
                   ranges=ranges, unit_sms=units, device_sms=device_sms,
                   granularity=granularity, green=green, fallback_reason=reason)

    def stream(self, key: str) -> Any:
        """The module's torch.cuda.Stream (green or plain); the current stream for temporal;
        None on CPU. Only looks up: everything was created in `create`."""
        if key not in self.requests:
            raise KeyError(f"no stream for module {key!r}; the pool has {sorted(self.requests)}")
        if self.backend == "cpu":
            return None
        if self.backend == "closed":
            raise RuntimeError(f"stream({key!r}) after close(): the pool's streams are destroyed")
        stream = self._streams[key]
        return _current_stream(self.device) if stream is None else stream

    def sm_ranges(self) -> dict[str, tuple[int, int] | None]:
        """SM-group (unit) range [start, stop) per key; None for free/temporal. Recorded on every
        backend; `enforced` says whether hardware holds modules to it."""
        return {key: self._ranges.get(key) for key in self.requests}

    def num_sms(self, key: str) -> int | None:
        """SMs the module's quota actually covers (the green context's count when enforced)."""
        rng = self._ranges.get(key)
        if rng is None:
            return None
        if self._green is not None and rng in self._green.context_sms:
            return self._green.context_sms[rng]
        return sum(self._unit_sms[rng[0]:rng[1]])

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for run reports."""
        return {
            "backend": self.backend,
            "enforced": self.enforced,
            "device": self.device,
            "device_sms": self._device_sms,
            "sm_granularity": self._granularity,
            "unit_sms": list(self._unit_sms),
            # the split's groups; a unit after them is its leftover (never a quota alone)
            "structured_units": (self._green.structured_units if self._green else
                                 _whole_groups(self._unit_sms, self._granularity)),
            "num_green_contexts": len(self._green.contexts) if self._green else 0,
            "driver_version": self._green.driver_version if self._green else None,
            "setup_s": self.setup_s,
            "fallback_reason": self.fallback_reason,
            "modules": {
                key: {
                    "mode": r.mode,
                    "group": r.group,
                    "priority": r.priority,
                    "num_sms_requested": r.num_sms,
                    "num_sms": self.num_sms(key),
                    "sm_range": list(self._ranges[key]) if key in self._ranges else None,
                }
                for key, r in self.requests.items()
            },
        }

    def close(self) -> None:
        """Synchronize the green streams and retire them with their contexts (plain streams go
        with torch); `backend` becomes 'closed'.

        Retired, not destroyed: memory used on these streams (record_stream, tensors NCCL
        stashes until its process group is destroyed) records an event on them when it is
        finally freed, which can be after the session, as late as interpreter exit. On a
        destroyed context that aborts the process ("context is destroyed", measured on two
        H200s in the NCCL tests). Contexts are few (one per partition of a pool) and
        the driver frees them with the process."""
        if self._green is not None:
            self._green.synchronize()
            _RETIRED.append(self._green)
            self._green = None
        self._streams.clear()
        self.backend = "closed"
        self.enforced = False

    def __enter__(self) -> SMPartitionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- diagnostics (GPU only): which SMs a stream's kernels land on ------------------------------
_SMID_SOURCE = r"""
extern "C" __global__ void smid_probe(int* smid, unsigned long long* t_ns, unsigned long long spin_ns) {
    unsigned int s;
    unsigned long long t0, t;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    t = t0;
    while (t - t0 < spin_ns) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    if (threadIdx.x == 0) {
        smid[blockIdx.x] = (int)s;
        t_ns[2 * blockIdx.x] = t0;
        t_ns[2 * blockIdx.x + 1] = t;
    }
}
"""


class SMIdProbe:
    """Launch a spinning kernel that records `%smid` per block on a stream (CuPy, GPU only).

    `launch` is asynchronous so several streams can be probed at once; `result` synchronizes
    and returns (sorted SM ids seen, first block start ns, last block end ns).
    """

    def __init__(self, num_blocks: int = 2048, spin_us: float = 200.0) -> None:
        import cupy

        self._cupy = cupy
        self._kernel = cupy.RawKernel(_SMID_SOURCE, "smid_probe")
        self.num_blocks = num_blocks
        self.spin_ns = int(spin_us * 1e3)

    def launch(self, stream: Any) -> tuple[Any, Any, Any]:
        cp = self._cupy
        with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
            warnings.simplefilter("ignore", DeprecationWarning)
            ext = cp.cuda.ExternalStream(stream.cuda_stream, stream.device_index)
        with ext:  # fill on the same stream: a non-blocking stream does not wait for the null one
            smid = cp.full(self.num_blocks, -1, dtype=cp.int32)
            t_ns = cp.zeros(2 * self.num_blocks, dtype=cp.uint64)
            self._kernel((self.num_blocks,), (32,), (smid, t_ns, cp.uint64(self.spin_ns)))
        return ext, smid, t_ns

    @staticmethod
    def result(pending: tuple[Any, Any, Any]) -> tuple[list[int], int, int]:
        ext, smid, t_ns = pending
        ext.synchronize()
        ids = smid.get()
        if (ids < 0).any():
            raise RuntimeError("SM-id probe: some blocks did not run")
        times = t_ns.get().reshape(-1, 2)
        return sorted({int(i) for i in ids}), int(times[:, 0].min()), int(times[:, 1].max())
