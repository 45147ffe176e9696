"""Measured collectives: the gloo run writes every kind x size, the DB keeps kinds and topology,
and the profiled model interpolates, extrapolates (labelled) and falls back to analytic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mosaic.hardware import make_cluster
from mosaic.perf.profiled import ProfiledModel
from mosaic.profile.collectives import numel_for, parse_bytes, reps_and_iters, sizes_bytes
from mosaic.profile.db import (
    COMM_KINDS,
    P2P_KINDS,
    CommPoint,
    ProfileDB,
    ProfileDBError,
    comm_bus_factor,
)

ROOT = Path(__file__).resolve().parents[1]
SIZES = [float(4**i) for i in range(6, 14)]  # 4 KiB .. 64 MiB
LATENCY_S = 20e-6
BANDWIDTH_BPS = {"allreduce": 150e9, "reduce_scatter": 300e9, "all_gather": 300e9,
                 "broadcast": 280e9, "p2p": 320e9, "p2p_bidir": 300e9}


def truth_s(kind: str, num_bytes: float) -> float:
    return LATENCY_S + num_bytes / BANDWIDTH_BPS[kind]


def _db(path: Path, kinds: tuple[str, ...] = COMM_KINDS, hardware: str = "h200") -> Path:
    db = ProfileDB.create(path, hardware=hardware, num_sms=132)
    db.add_comm([CommPoint(kind=k, num_gpus=2, num_bytes=x, time_s=truth_s(k, x),
                           source="measured") for k in kinds for x in SIZES])
    db.close()
    return path


# --- pure helpers ----------------------------------------------------------------------------
def test_sizes_and_counts():
    assert parse_bytes("65536") == parse_bytes("64K") == parse_bytes("64KiB") == 65536
    assert parse_bytes("1G") == 1 << 30
    assert sizes_bytes(4096, 65536) == [4096, 8192, 16384, 32768, 65536]
    assert sizes_bytes(4096, 1 << 30)[-1] == 1 << 30 and len(sizes_bytes(4096, 1 << 30)) == 19
    assert sizes_bytes(5000, 20000) == [8192, 16384]
    assert reps_and_iters(4096, 20, 20) == (20, 20)
    assert reps_and_iters(1 << 30, 20, 20) == (16, 1)
    assert numel_for("all_gather", 4096, 3) == 1023 and numel_for("allreduce", 4096, 3) == 1024
    assert comm_bus_factor("allreduce", 8) == 1.75 and comm_bus_factor("all_gather", 4) == 0.75


# --- the DB ----------------------------------------------------------------------------------
def test_db_kinds_replace_and_topology(tmp_path):
    path = _db(tmp_path / "h200.sqlite", kinds=("allreduce",))
    with ProfileDB.open(path, readonly=False) as db:
        db.add_comm([CommPoint(kind="p2p_bidir", num_gpus=2, num_bytes=1e6, time_s=1e-5,
                               source="measured")])
        with pytest.raises(ProfileDBError, match="kind must be one of"):
            db.add_comm([CommPoint(kind="alltoall", num_gpus=2, num_bytes=1.0, time_s=1.0,
                                   source="measured")])
        again = [CommPoint(kind="allreduce", num_gpus=2, num_bytes=x, time_s=1.0,
                           source="measured") for x in SIZES[:2]]
        db.add_comm(again, replace=True)  # the old allreduce@2 curve goes, p2p_bidir stays
        assert [p.time_s for p in db.comm("allreduce")] == [1.0, 1.0]
        assert len(db.comm("p2p_bidir")) == 1
        db.set_topology(2, {"world_size": 2, "nccl_env": {"NCCL_NVLS_ENABLE": "0"}})
    with ProfileDB.open(path) as db:
        assert db.topology() == {2: {"world_size": 2, "nccl_env": {"NCCL_NVLS_ENABLE": "0"}}}


# --- the model -------------------------------------------------------------------------------
def test_comm_time_measured_interpolates_and_extrapolates_in_bytes(tmp_path):
    model = ProfiledModel(make_cluster(8, "h200"), _db(tmp_path / "h200.sqlite"))
    for kind in COMM_KINDS:
        for x in SIZES:
            assert model.comm_time(kind, x, 2) == (pytest.approx(truth_s(kind, x)), "measured")
        for lo, hi in zip(SIZES, SIZES[1:], strict=False):
            mid = (lo * hi) ** 0.5
            t, source = model.comm_time(kind, mid, 2)
            assert source == "measured" and truth_s(kind, lo) < t < truth_s(kind, hi)
            assert t == pytest.approx(truth_s(kind, mid), rel=0.15)
        # beyond the measured sizes: the latency + bandwidth line, exact for this truth
        for x in (1e3, 1e9, 1e10):
            assert model.comm_time(kind, x, 2)[0] == pytest.approx(truth_s(kind, x), rel=1e-6)


def test_comm_time_labels_unmeasured_counts_extrapolated(tmp_path):
    model = ProfiledModel(make_cluster(8, "h200"), _db(tmp_path / "h200.sqlite"))
    x = 1e8  # scaled beyond the measured sizes: the line, exact for this truth
    for n in (4, 8):
        for kind in ("allreduce", "reduce_scatter", "all_gather", "broadcast"):
            t, source = model.comm_time(kind, x, n)
            scaled = x * comm_bus_factor(kind, n) / comm_bus_factor(kind, 2)
            assert source == "extrapolated" and t == pytest.approx(truth_s(kind, scaled), rel=1e-6)
    # ring all-reduce on 8 moves 1.75x the bytes per link of 2 GPUs: large messages ~1.75x
    ratio = model.comm_time("allreduce", 1e9, 8)[0] / model.comm_time("allreduce", 1e9, 2)[0]
    assert 1.7 < ratio < 1.76
    assert model.allreduce_s(x, [0, 1, 2, 3]) == model.comm_time("allreduce", x, 4)[0]
    desc = model.describe()
    assert "allreduce measured n=2, extrapolated n=3-8" in desc
    assert "p2p measured n=2;" in desc and "analytic:" not in desc
    with pytest.raises(ValueError, match="between 2 GPUs"):
        model.comm_time("p2p", x, 4)
    with pytest.raises(ValueError, match="unknown comm kind"):
        model.comm_time("alltoall", x, 2)


def test_comm_time_falls_back_to_analytic(tmp_path):
    cluster = make_cluster(16, "h200")  # two nodes of 8
    model = ProfiledModel(cluster, _db(tmp_path / "h200.sqlite", kinds=("allreduce", "p2p")))
    for kind in ("reduce_scatter", "all_gather", "broadcast", "p2p_bidir"):
        t, source = model.comm_time(kind, 1e6, 2)
        assert source == "analytic" and np.isfinite(t) and t > 0
    t, source = model.comm_time("allreduce", 1e6, 16)  # spans nodes: the NVLink curve lies
    assert source == "analytic"
    assert t == pytest.approx(super(ProfiledModel, model).allreduce_s(1e6, range(16)))
    assert model.transfer_s(1e6, [0], [8]) == pytest.approx(
        super(ProfiledModel, model).transfer_s(1e6, [0], [8]))
    assert model.transfer_s(1e6, [0, 1], [2, 3]) == pytest.approx(truth_s("p2p", 5e5), rel=0.05)
    assert model.comm_time("allreduce", 0.0, 8) == (0.0, "extrapolated")
    assert "analytic: reduce_scatter, all_gather, broadcast, p2p_bidir" in model.describe()
    bare = ProfiledModel(make_cluster(8, "h200"), _db(tmp_path / "bare.sqlite", kinds=()))
    assert bare.comm_time("allreduce", 1e6, 8)[1] == "analytic"
    assert "comm: analytic (no measured curves)" in bare.describe()


# --- the real thing, on gloo -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_run_writes_every_kind_and_size(tmp_path):
    db_path = tmp_path / "tmp.sqlite"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mosaic.profile.collectives", "--cpu", "--db", str(db_path),
           "--max-bytes", "65536"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stdout + run.stderr
    with ProfileDB.open(db_path) as db:
        points = db.comm()
        topo = db.topology()
        hardware = db.hardware
    sizes = [4096.0, 8192.0, 16384.0, 32768.0, 65536.0]
    for kind in COMM_KINDS:
        rows = [p for p in points if p.kind == kind]
        assert [p.num_bytes for p in rows] == sizes, kind
        assert all(p.time_s > 0 and p.source == "measured" and p.num_gpus == 2 for p in rows)
    assert len(points) == len(COMM_KINDS) * len(sizes) and hardware == "cpu"
    assert topo[2]["world_size"] == 2 and topo[2]["backend"] == "gloo"
    assert topo[2]["nccl_env"]["NCCL_NVLS_ENABLE"] == "0" and topo[2]["dtype"] == "float32"
    assert set(topo[2]["host_s_per_op"]) == set(COMM_KINDS)
    assert len(topo[2]["host_s_per_op"]["p2p"]) == len(sizes)
    # the measured rows drive the model (a ProfileDB object skips the hardware check)
    with ProfileDB.open(db_path) as db:
        model = ProfiledModel(make_cluster(8, "h200"), db)
    for kind in COMM_KINDS:
        t, source = model.comm_time(kind, 12288.0, 2)
        curve = sorted((p.num_bytes, p.time_s) for p in points if p.kind == kind)
        low, high = min(c[1] for c in curve), max(c[1] for c in curve)
        assert source == "measured" and low * (1 - 1e-9) <= t <= high * (1 + 1e-9)
    assert {model.comm_time(k, 12288.0, 8)[1] for k in COMM_KINDS if k not in P2P_KINDS} == {
        "extrapolated"}
