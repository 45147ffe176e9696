"""Measured collectives: all-reduce, reduce-scatter, all-gather, broadcast and p2p into a ProfileDB.

One process per GPU (NCCL), or per CPU process with `--cpu` (gloo, for tests):

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 -m mosaic.profile.collectives --db OUT.sqlite
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m mosaic.profile.collectives --cpu --db tmp.sqlite --max-bytes 64K

Every kind of db.COMM_KINDS over message sizes min..max bytes in powers of 2 (default 4 KiB ..
1 GiB on GPU), fp32 buffers (gradients are all-reduced in fp32; NCCL's time depends on bytes,
not dtype, apart from the reduction). `num_bytes` means what db.COMM_KINDS says; p2p is rank 0
-> rank 1 through batch_isend_irecv, p2p_bidir both ways at once, the other ranks idle.

Timing, per (kind, size): two untimed reps (NCCL connects lazily), then `reps` timed reps,
each after a barrier, of `iters` back-to-back ops (iters larger for small messages: it
amortises the skew between ranks' launches and the event overhead); a rep's time is CUDA
events around its ops (wall clock on CPU) / iters; the point is the median rep, the slowest
rank's median (a collective is done when its last rank is). Rank 0 writes CommPoint rows,
source 'measured', replacing earlier measured rows of the same kind and GPU count, and the run's
topology (GPU, NCCL version and NCCL_* env, `nvidia-smi topo -m`) as meta comm_topology.<n>.

NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is forced before NCCL starts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mosaic.errors import MosaicError
from mosaic.profile.db import (
    COMM_KINDS,
    P2P_KINDS,
    CommPoint,
    ProfileDB,
    ProfileDBError,
    comm_bus_factor,
)

DTYPE = torch.float32
ELEMENT_BYTES = 4
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
GPU_MAX_BYTES = GIB
CPU_MAX_BYTES = MIB
ITER_BYTES = 64 * MIB
"""Back-to-back ops per timed rep: enough to move about this many bytes (capped)."""
REP_BYTES = 16 * GIB
"""Timed reps per size: at most this many bytes over all reps (1 GiB: 16 reps), at least 3."""
WARMUP_REPS = 2

# torch >= 2.13 renames these two to *_single; the old names are the ones torch 2.11 has.
warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor)"
                        r"` is deprecated", category=FutureWarning)


class CollectivesError(MosaicError):
    """A run that cannot measure (no torchrun, one process, no GPU); the message says the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    db: Path
    cpu: bool = False
    min_bytes: int = 4 * KIB
    max_bytes: int = GPU_MAX_BYTES
    reps: int = 20
    max_iters: int = 20
    hardware: str | None = None
    """Name stored in (or checked against) the DB; default from the GPU's name, 'cpu' on CPU."""


# --- pure helpers (tested on their own) ------------------------------------------------------
def parse_bytes(text: str) -> int:
    """'65536', '64K', '16M', '1G' (binary units) -> bytes."""
    units = {"K": KIB, "M": MIB, "G": GIB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 65536, 64K, 1G)") from None
    if value < ELEMENT_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least {ELEMENT_BYTES} bytes")
    return value


def sizes_bytes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of 2 from min_bytes (rounded up to one) to max_bytes."""
    size = 1 << max(min_bytes - 1, 1).bit_length()
    out = []
    while size <= max_bytes:
        out.append(size)
        size *= 2
    return out


def reps_and_iters(num_bytes: int, reps: int, max_iters: int) -> tuple[int, int]:
    """Timed reps and ops per rep for one size: a function of the size alone, so every rank
    runs the same number of collectives (a rank-dependent count would hang NCCL)."""
    return (min(reps, max(3, REP_BYTES // num_bytes)),
            max(1, min(max_iters, ITER_BYTES // num_bytes)))


def numel_for(kind: str, num_bytes: int, world: int) -> int:
    """Elements of the kind's full tensor: scattered / gathered ones split evenly over ranks."""
    numel = num_bytes // ELEMENT_BYTES
    if kind in ("reduce_scatter", "all_gather"):
        numel -= numel % world
    return numel


def hardware_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200' (a known GPUSpec), else the name as a slug."""
    from mosaic.hardware import GPUS

    lower = device_name.lower()
    return next((k for k in GPUS if k in lower.split()), lower.replace(" ", "-"))


# --- the ops -------------------------------------------------------------------------------
def make_op(kind: str, numel: int, send: torch.Tensor, recv: torch.Tensor, rank: int,
            world: int) -> Callable[[], None] | None:
    """One op of `kind` on the first `numel` elements; None where this rank takes no part."""
    if kind == "allreduce":
        return lambda: dist.all_reduce(send[:numel])
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(recv[:numel // world], send[:numel])
    if kind == "all_gather":
        return lambda: dist.all_gather_into_tensor(recv[:numel], send[:numel // world])
    if kind == "broadcast":
        return lambda: dist.broadcast(send[:numel], src=0)
    if kind in P2P_KINDS:
        return _p2p_op(kind == "p2p_bidir", numel, send, recv, rank)
    raise ValueError(f"unknown comm kind {kind!r}; choose one of {COMM_KINDS}")


def _p2p_op(both_ways: bool, numel: int, send: torch.Tensor, recv: torch.Tensor,
            rank: int) -> Callable[[], None] | None:
    if rank > 1:
        return None
    peer = 1 - rank
    ops = []
    if rank == 0 or both_ways:
        ops.append(dist.P2POp(dist.isend, send[:numel], peer))
    if rank == 1 or both_ways:
        ops.append(dist.P2POp(dist.irecv, recv[:numel], peer))

    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # NCCL: the current stream waits (the end event follows); gloo: blocks

    return run


def self_check(send: torch.Tensor, recv: torch.Tensor, rank: int, world: int) -> None:
    """Each op once on known values, so a wrong setup fails loudly instead of timing garbage."""
    n = 4 * world
    expect = {
        "allreduce": torch.full((n,), world * (world + 1) / 2),
        "reduce_scatter": torch.full((n // world,), world * (world + 1) / 2),
        "all_gather": torch.arange(1, world + 1, dtype=DTYPE).repeat_interleave(4),
        "broadcast": torch.full((n,), 1.0),
        "p2p": torch.full((n,), 1.0 if rank == 1 else -1.0),
        "p2p_bidir": torch.full((n,), 2.0 - rank),
    }
    for kind, want in expect.items():
        send[:n] = rank + 1.0
        recv[:n] = -1.0
        op = make_op(kind, n, send, recv, rank, world)
        if op is None:
            continue
        op()
        got = send[:n] if kind in ("allreduce", "broadcast") else recv[:want.numel()]
        if not torch.equal(got.cpu(), want.to(DTYPE)):
            raise CollectivesError(f"rank {rank}: {kind} gave {got.tolist()}, expected "
                                   f"{want.tolist()}; the process group is misconfigured")
    send.zero_()
    recv.zero_()


# --- timing --------------------------------------------------------------------------------
class Timer:
    """(seconds per op, host seconds per op) of `iters` back-to-back calls: CUDA events on GPU,
    wall clock on CPU. The host time is what enqueuing took: where it is about the op time, the
    point is launch-bound (Python + c10d per call), as it is in the engine too."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, op: Callable[[], None], iters: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        if self.cuda:
            self.start.record()
        for _ in range(iters):
            op()
        host_s = (time.perf_counter() - t0) / iters
        if not self.cuda:
            return host_s, host_s
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3 / iters, host_s


def time_point(op: Callable[[], None] | None, timer: Timer, reps: int,
               iters: int) -> tuple[float, float]:
    """Median (seconds, host seconds) per op on this rank (0 where it takes no part); every rank
    joins every barrier, so ranks that idle (p2p on ranks >= 2) stay in step."""
    times: list[tuple[float, float]] = []
    for rep in range(WARMUP_REPS + reps):
        timer.sync()
        dist.barrier()  # start together: a late peer would count as op time
        if op is None:
            continue
        t = timer(op, iters)
        if rep >= WARMUP_REPS:
            times.append(t)
    timer.sync()
    if not times:
        return 0.0, 0.0
    return statistics.median(t for t, _ in times), statistics.median(h for _, h in times)


def slowest_rank(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(cfg: Config, rank: int, world: int, device: torch.device,
            log: Callable[[str], None]) -> tuple[list[CommPoint], dict[str, dict[str, float]]]:
    """Every kind x size: the points (identical on every rank: the slowest rank's times) and
    this rank's host seconds per op, kind -> {bytes: seconds} (launch overhead, for the meta)."""
    sizes = sizes_bytes(cfg.min_bytes, cfg.max_bytes)
    # One send and one receive buffer of the largest size, sliced per op: 2 x max_bytes per rank.
    send = torch.zeros(sizes[-1] // ELEMENT_BYTES, dtype=DTYPE, device=device)
    recv = torch.zeros_like(send)
    self_check(send, recv, rank, world)
    timer = Timer(device.type == "cuda")
    points, host = [], {}
    for kind in COMM_KINDS:
        for num_bytes in sizes:
            numel = numel_for(kind, num_bytes, world)
            reps, iters = reps_and_iters(num_bytes, cfg.reps, cfg.max_iters)
            op = make_op(kind, numel, send, recv, rank, world)
            time_s, host_s = time_point(op, timer, reps, iters)
            n = 2 if kind in P2P_KINDS else world
            points.append(CommPoint(kind=kind, num_gpus=n, num_bytes=float(numel * ELEMENT_BYTES),
                                    time_s=slowest_rank(time_s, device), source="measured"))
            host.setdefault(kind, {})[str(numel * ELEMENT_BYTES)] = host_s
            log(_row(points[-1], host_s, reps, iters))
    return points, host


def _row(p: CommPoint, host_s: float, reps: int, iters: int) -> str:
    algbw = p.num_bytes / p.time_s / 1e9 if p.time_s > 0 else 0.0
    busbw = algbw * comm_bus_factor(p.kind, p.num_gpus)
    return (f"{p.kind:>14} n={p.num_gpus} {_human(p.num_bytes):>9} {p.time_s * 1e6:9.1f} us "
            f"algbw {algbw:6.1f} GB/s busbw {busbw:6.1f} GB/s host {host_s * 1e6:7.1f} us/op"
            f"  ({reps} reps x {iters})")


def _human(num_bytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes:g} B"


# --- topology and the DB (rank 0) ----------------------------------------------------------
def nvidia_smi_topo() -> str:
    """`nvidia-smi topo -m` (how the GPUs are linked), or why it is unavailable."""
    try:
        run = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:  # informative only: never fail on it
        return f"unavailable: {type(exc).__name__}: {exc}"
    if run.returncode != 0:
        return f"unavailable: exit {run.returncode}: {run.stderr.strip()}"
    return re.sub(r"\x1b\[[0-9;]*m", "", run.stdout).strip()  # it underlines its header


def nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # no NCCL in this torch build (CPU wheels)
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def topology(cfg: Config, world: int, device: torch.device, wall_s: float,
             host_s: dict[str, dict[str, float]]) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "world_size": world,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "visible_gpus": torch.cuda.device_count() if cuda else 0,
        "dtype": str(DTYPE).removeprefix("torch."),
        "nccl_version": nccl_version() if cuda else None,
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        "nvidia_smi_topo": nvidia_smi_topo() if cuda else "not run (--cpu)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "timing": "cuda events" if cuda else "perf_counter",
        "host_s_per_op": host_s,
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "wall_s": round(wall_s, 1),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def device_facts(cfg: Config, device: torch.device) -> tuple[str, int, str]:
    """(hardware name for the DB, SM count, device name) of this rank's device."""
    if device.type != "cuda":
        return cfg.hardware or "cpu", 0, "cpu"
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return cfg.hardware or hardware_name(name), sms, name


def check_db(path: Path, hardware: str) -> None:
    """Fail before measuring when --db exists but cannot take these rows (other hardware,
    other schema, read-only)."""
    if path.exists():
        ProfileDB.open(path, hardware=hardware, readonly=False).close()


def write_db(cfg: Config, points: list[CommPoint], topo: dict[str, Any], hardware: str,
             num_sms: int) -> None:
    if cfg.db.exists():
        db = ProfileDB.open(cfg.db, hardware=hardware, readonly=False)
    else:
        versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda),
                    "gpu_name": topo["device"], "date": topo["date"]}
        db = ProfileDB.create(cfg.db, hardware=hardware, num_sms=num_sms,
                              config={"collectives": topo["config"]}, versions=versions)
    with db:
        db.add_comm(points, replace=True)
        db.set_topology(topo["world_size"], topo)


# --- the run -------------------------------------------------------------------------------
LAUNCH = ("PYTHONPATH=src torchrun --standalone --nproc-per-node 2 "
          "-m mosaic.profile.collectives --db OUT.sqlite")


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m mosaic.profile.collectives",
                                description="Measure NCCL (or gloo, --cpu) collectives into a "
                                            f"ProfileDB. Launch: {LAUNCH}")
    p.add_argument("--db", type=Path, required=True,
                   help="ProfileDB to create, or to add to (same hardware); measured rows of "
                        "the same kind and GPU count are replaced")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (tests), default max 1M")
    p.add_argument("--min-bytes", type=parse_bytes, default=4 * KIB, help="default 4K")
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="default 1G (GPU)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed reps per size (default 20, --cpu 5; fewer from 1G up)")
    p.add_argument("--max-iters", type=int, default=None,
                   help="ops per timed rep at small sizes (default 20, --cpu 4)")
    p.add_argument("--hardware", default=None,
                   help="hardware name in the DB (default: from the GPU name, e.g. h200)")
    a = p.parse_args(argv)
    # gloo on a shared CPU is slow and noisy: fewer, shorter reps keep a test run in seconds.
    max_bytes = a.max_bytes or (CPU_MAX_BYTES if a.cpu else GPU_MAX_BYTES)
    reps = a.reps or (5 if a.cpu else 20)
    max_iters = a.max_iters or (4 if a.cpu else 20)
    if max_bytes < a.min_bytes:
        p.error(f"--max-bytes {max_bytes} is below --min-bytes {a.min_bytes}")
    if reps < 1 or max_iters < 1:
        p.error("--reps and --max-iters must be >= 1")
    return Config(db=a.db, cpu=a.cpu, min_bytes=a.min_bytes, max_bytes=max_bytes, reps=reps,
                  max_iters=max_iters, hardware=a.hardware)


def disable_nvls() -> str | None:
    """NVLink multicast can take a shared host's GPUs out of service: force it off before NCCL
    reads its environment. Returns the value it overrode, if any."""
    before = os.environ.get("NCCL_NVLS_ENABLE")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    return before if before not in (None, "0") else None


def setup(cfg: Config) -> tuple[int, int, torch.device, str]:
    """(rank, world size, device, backend) from torchrun's environment."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise CollectivesError(f"not launched by torchrun; run: {LAUNCH}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world < 2:
        raise CollectivesError("one process measures nothing; use --nproc-per-node 2 or more")
    if cfg.cpu:
        return rank, world, torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise CollectivesError("no CUDA GPU here; pass --cpu to measure gloo on CPU")
    if local >= torch.cuda.device_count():
        raise CollectivesError(f"local rank {local} but {torch.cuda.device_count()} GPUs visible; "
                               "use --nproc-per-node <= the GPU count")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    return rank, world, device, "nccl"


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    overridden = disable_nvls()
    try:
        rank, world, device, backend = setup(cfg)
        hardware, num_sms, device_name = device_facts(cfg, device)
        if rank == 0:
            check_db(cfg.db, hardware)
    except (CollectivesError, ProfileDBError) as exc:
        print(f"collectives: error: {exc}", file=sys.stderr)
        return 2
    log = print if rank == 0 else (lambda _: None)
    if overridden:
        log(f"NCCL_NVLS_ENABLE was {overridden!r}; forced to '0' (NVLink multicast stays off)")
    start = time.perf_counter()
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None,
                            timeout=datetime.timedelta(minutes=5))
    log(f"collectives: {world} x {device_name} ({backend}"
        f"{', NCCL ' + str(nccl_version()) if backend == 'nccl' else ''}), "
        f"{_human(cfg.min_bytes)} .. {_human(cfg.max_bytes)} fp32, NCCL_NVLS_ENABLE=0")
    points, host_s = measure(cfg, rank, world, device, log)
    if rank == 0:
        topo = topology(cfg, world, device, time.perf_counter() - start, host_s)
        write_db(cfg, points, topo, hardware, num_sms)
        log(f"wrote {len(points)} measured rows to {cfg.db} (hardware {hardware!r}) "
            f"in {topo['wall_s']:.1f} s")
    dist.barrier()  # the others wait for the DB: an error on rank 0 then fails the whole run
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
