"""ProfileDB: round trip, and clear errors for files that are not the DB asked for."""

from __future__ import annotations

import re
import sqlite3

import pytest

from mosaic.profile.db import (
    SCHEMA_VERSION,
    ColocPoint,
    ColocWork,
    CommPoint,
    FitRecord,
    ModulePoint,
    ProfileDB,
    ProfileDBError,
    SignaturePoint,
    default_db_path,
    has_shipped_db,
    module_signature,
)
from tests.helpers import spec


def _filled(path):
    db = ProfileDB.create(path, hardware="h200", num_sms=132, config={"repeats": 5},
                          versions={"torch": "2.11.0", "cuda": "13.0"})
    vision, text = spec("vision", dim=1024, layers=24), spec("text")
    sig_v = db.add_module("imagebind", "small", vision)
    sig_t = db.add_module("imagebind", "small", text)
    db.add_points([ModulePoint(signature=sig_v, per_gpu_batch=4, num_sms=64, time_s=0.01,
                               spread=0.02, repeats=5, phase="coarse"),
                   ModulePoint(signature=sig_v, per_gpu_batch=8, num_sms=132, time_s=0.012)])
    works = (ColocWork(module="vision", signature=sig_v, per_gpu_batch=4, num_sms=64,
                       alone_s=0.01, time_s=0.011),
             ColocWork(module="text", signature=sig_t, per_gpu_batch=4, num_sms=64, priority=1,
                       alone_s=0.004, time_s=0.005))
    db.add_colocation(ColocPoint(model="imagebind", preset="small", sharing="partition",
                                 works=works, group_time_s=0.011, spread=0.01, repeats=5))
    db.add_signature(SignaturePoint(signature=sig_v, per_gpu_batch=4, num_sms=64,
                                    antagonist_sms=64, alone_s=0.01, with_antagonist_s=0.013,
                                    bytes_per_s=1e12, method="antagonist+analytic-bytes"))
    db.add_comm([CommPoint(kind="allreduce", num_gpus=8, num_bytes=1e6, time_s=1e-4,
                           source="analytic")])
    db.add_fit(FitRecord(name="model_error.aware", params={"alpha": 1.0}, mape=7.5, n_points=3,
                         created="2026-11-29"))
    db.close()
    return sig_v, sig_t, works


def test_round_trip(tmp_path):
    path = tmp_path / "h200.sqlite"
    sig_v, sig_t, works = _filled(path)
    with ProfileDB.open(path, hardware="H200") as db:
        assert db.meta["schema_version"] == str(SCHEMA_VERSION)
        assert db.meta["torch"] == "2.11.0" and db.config == {"repeats": 5}
        assert db.hardware == "h200"
        mods = {m.module: m for m in db.modules()}
        assert mods["vision"].signature == sig_v and mods["vision"].spec == spec("vision", dim=1024, layers=24)
        pts = db.points(sig_v)
        assert [(p.per_gpu_batch, p.num_sms, p.time_s) for p in pts] == [(4, 64, 0.01), (8, 132, 0.012)]
        (coloc,) = db.colocations()
        assert coloc.works == works and coloc.sharing == "partition" and coloc.id == 1
        (sgn,) = db.signatures()
        assert sgn.slowdown == pytest.approx(1.3)
        assert db.comm("allreduce")[0].source == "analytic"
        assert db.fits()[0].mape == 7.5
        named = db.conn.execute("SELECT model, module, num_sms FROM module_points_named").fetchall()
        assert ("imagebind", "vision", 64) in named
        with pytest.raises(ProfileDBError, match="read-only"):
            db.add_points([])


def test_signature_ignores_name_but_not_cost():
    assert module_signature(spec("a")) == module_signature(spec("b"))
    assert module_signature(spec("a")) != module_signature(spec("a", tokens=128))


def test_missing_file(tmp_path):
    path = tmp_path / "nope.sqlite"
    with pytest.raises(ProfileDBError, match=re.escape(str(path))):
        ProfileDB.open(path)


def test_not_sqlite(tmp_path):
    path = tmp_path / "junk.sqlite"
    path.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(ProfileDBError, match=rf"{re.escape(str(path))}.*not a profile DB"):
        ProfileDB.open(path)


def test_sqlite_without_meta(tmp_path):
    path = tmp_path / "other.sqlite"
    sqlite3.connect(path).execute("CREATE TABLE x (a)").connection.close()
    with pytest.raises(ProfileDBError, match=re.escape(str(path))):
        ProfileDB.open(path)


def test_wrong_schema(tmp_path):
    path = tmp_path / "old.sqlite"
    _filled(path)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(ProfileDBError, match=rf"{re.escape(str(path))} has schema_version 0.*re-run"):
        ProfileDB.open(path)


def test_wrong_hardware(tmp_path):
    path = tmp_path / "h200.sqlite"
    _filled(path)
    with pytest.raises(ProfileDBError, match=rf"{re.escape(str(path))} was profiled on 'h200', not 'h100'"):
        ProfileDB.open(path, hardware="h100")


def test_create_refuses_overwrite(tmp_path):
    path = tmp_path / "a.sqlite"
    _filled(path)
    with pytest.raises(ProfileDBError, match="already exists"):
        ProfileDB.create(path, hardware="h200", num_sms=132)
    ProfileDB.create(path, hardware="h200", num_sms=132, overwrite=True).close()


def test_default_paths():
    assert default_db_path("H200").name == "h200.sqlite"
    assert default_db_path("h200").parent.name == "data"
    assert has_shipped_db("no-such-gpu") is False


# --- sampling (pure) -----------------------------------------------------------------------
def test_batch_grid_and_coarse_points():
    from mosaic.profile.sampling import batch_grid, coarse_points

    assert batch_grid(32) == [1, 2, 4, 8, 16, 32]
    assert batch_grid(24) == [1, 2, 4, 8, 16, 24]
    assert batch_grid(1) == [1]
    sms = [*range(8, 121, 8), 132]
    pts = coarse_points(batch_grid(32), sms)
    assert {k for _, k in pts} == {8, 16, 32, 64, 96, 132}
    assert {b for b, _ in pts} == {1, 8, 32}
    assert (32, 8) not in pts and (1, 8) in pts  # low SMs only at small batches
    assert len(pts) == len(set(pts)) == 17
    # profiled up to 4x the preset batch: the preset's own batch is measured as well
    anchored = coarse_points(batch_grid(32, 128), sms, anchor=32)
    assert {b for b, _ in anchored} == {1, 16, 32, 128}
    assert {b for b, _ in coarse_points(batch_grid(32, 128), sms, anchor=48)} == {1, 16, 128}


def test_refine_follows_the_kinks_and_the_budget():
    from mosaic.profile.sampling import _intervals, batch_grid, coarse_points, refine

    sms, batches = [*range(8, 121, 8), 132], batch_grid(32)

    def compute_bound(b, k):  # exact under rate-linear-in-k, log-log-in-b interpolation
        return 1e-3 * b / k

    measured = {p: compute_bound(*p) for p in coarse_points(batches, sms)}
    first = _intervals(measured, batches, sms)
    added = refine(compute_bound, measured, batches, sms, budget=50)
    # every first midpoint is interpolated exactly, so no interval is split again
    assert 0 < len(added) <= len(first)

    def saturating(b, k):  # bandwidth-like: flat beyond 48 SMs, a kink there
        return 1e-4 + 1e-3 * b / min(k, 48)

    measured = {p: saturating(*p) for p in coarse_points(batches, sms)}
    added = refine(saturating, measured, batches, sms, budget=6)
    assert 0 < len(added) <= 6
    assert all(p in measured for p in added)
    assert any(32 < k < 64 for _, k in added)  # the kink's interval was bisected


def test_profiler_orchestration_on_a_fake_gpu(tmp_path, monkeypatch):
    """Every profiler step (surfaces, signatures, colocations, comm) on CPU, with the GPU
    mechanics replaced: eager steps and wall-clock times instead of graphs and events."""
    import time

    from mosaic.hardware import H200
    from mosaic.perf.accuracy import model_error
    from mosaic.perf.profiled import ProfiledModel
    from mosaic.profile import profiler
    from mosaic.profile.graph_timing import Timing

    class FakeGraph:
        def __init__(self, bench):
            self.replay = bench.step

    def fake_time_group(members, cfg, background=None):
        t0 = time.perf_counter()
        times = []
        for fn, _ in members:
            fn()
            times.append(time.perf_counter() - t0)
        if background is not None:
            background[0]()
        return Timing(max(times), 0.0, 1, tuple(times))

    class FakeBank:
        gpu, full_sms = H200, 132
        sm_values = [*range(8, 121, 8), 132]

        def stream(self, k, priority=0):
            return f"s{k}", None

        def group(self, mode, sizes, priorities):
            got = [min(k, 132) for k in sizes]
            return [f"{mode}{i}" for i in range(len(sizes))], [None] * len(sizes), got

    class FakeAntagonist:
        copies = 1

        def __call__(self):
            pass

    monkeypatch.setattr(profiler.GraphBench, "capture", lambda self, stream: FakeGraph(self))
    monkeypatch.setattr(profiler, "time_group", fake_time_group)
    cfg = profiler.ProfilerConfig(preset="tiny", amp=False, refine_budget=2)
    db = ProfileDB.create(tmp_path / "fake.sqlite", hardware="h200", num_sms=132)
    prof = profiler.ModelProfiler("clip", cfg, db, FakeBank(), set(), device="cpu")
    prof.surfaces(refine_until=float("inf"))
    prof.signatures(FakeAntagonist(), copy_s=1e-3)
    prof.colocations(deadline=float("inf"))
    prof.release()
    rep = prof.report
    assert rep.num_modules == 3 and rep.num_distinct == 3 and rep.signatures == 3
    # tiny clip: global batch 8, grid to 4x = 32 (1, 2, 4, 8, 16, 32) x 16 SM counts
    assert prof.batches == [1, 2, 4, 8, 16, 32]
    assert 3 * 17 <= rep.points <= 3 * 19 and rep.full_grid == 3 * 6 * 16
    assert rep.colocations == 1 * 2 * 4  # one pair (text, vision) x 2 batches x 4 modes
    colocs = db.colocations()
    assert {c.sharing for c in colocs} == {"partition", "cap", "free"}
    assert any(w.priority == 1 for c in colocs for w in c.works)
    part = next(c for c in colocs if c.sharing == "partition")
    assert sum(w.num_sms for w in part.works) <= 128
    db.close()
    model = ProfiledModel(make_cluster_h200(), tmp_path / "fake.sqlite")
    spec_v = model.surfaces.specs[prof.sigs["vision"]]
    assert model.module_time_s(spec_v, 4, 0.5) > 0
    result = model_error(tmp_path / "fake.sqlite")
    assert result["rows"]["profiled-aware"]["n_points"]["coloc"] == 8


def make_cluster_h200():
    from mosaic.hardware import make_cluster

    return make_cluster(1, "h200")


def test_a_module_holds_eager_and_compiled_surfaces_under_distinct_signatures(tmp_path):
    db = ProfileDB.create(tmp_path / "k.sqlite", hardware="h200", num_sms=132)
    vision = spec("vision")
    eager, compiled = db.add_module("m", "small", vision), db.add_module("m", "small", vision,
                                                                          "compile-default")
    assert eager == module_signature(vision) and compiled == module_signature(vision, "compile-default")
    assert eager != compiled
    assert sorted(m.kernels for m in db.modules()) == ["compile-default", "eager"]
    assert [m.signature for m in db.modules("compile-default")] == [compiled]
    with pytest.raises(ProfileDBError, match="kernels 'turbo'"):
        db.add_module("m", "small", vision, "turbo")
    db.close()


def test_a_version_1_db_reads_as_eager_and_is_migrated_when_written(tmp_path):
    path = tmp_path / "v1.sqlite"
    db = ProfileDB.create(path, hardware="h200", num_sms=132)
    sig = db.add_module("m", "small", spec("vision"))
    db.close()
    conn = sqlite3.connect(path)  # rebuild the version-1 modules table (no kernels column)
    conn.executescript("""
        CREATE TABLE v1 (model TEXT NOT NULL, preset TEXT NOT NULL, module TEXT NOT NULL,
          signature TEXT NOT NULL, spec_json TEXT NOT NULL, PRIMARY KEY (model, preset, module));
        INSERT INTO v1 SELECT model, preset, module, signature, spec_json FROM modules;
        DROP VIEW module_points_named; DROP TABLE modules; ALTER TABLE v1 RENAME TO modules;
        CREATE VIEW module_points_named AS SELECT m.model, m.preset, m.module, p.*
          FROM modules m JOIN module_points p USING (signature);
        UPDATE meta SET value = '1' WHERE key = 'schema_version';""")
    conn.close()
    with ProfileDB.open(path) as old:
        assert [(m.signature, m.kernels) for m in old.modules()] == [(sig, "eager")]
    with ProfileDB.open(path, readonly=False) as db:
        assert db.meta["schema_version"] == str(SCHEMA_VERSION)
        db.add_module("m", "small", spec("vision"), "compile-default")
        assert sorted(m.kernels for m in db.modules()) == ["compile-default", "eager"]


def test_the_batch_grid_reaches_past_the_global_batch():
    from mosaic.profile.sampling import batch_grid

    assert batch_grid(32, 128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert batch_grid(24, 96) == [1, 2, 4, 8, 16, 24, 32, 64, 96]


def test_kernels_names_round_trip_to_the_engines_compile_settings():
    from mosaic.profile.db import KERNELS, compile_of_kernels, kernels_label

    for kernels in KERNELS:
        assert kernels_label(*compile_of_kernels(kernels)) == kernels
    assert compile_of_kernels("compile-default-blocks") == ("default", "blocks")
    assert kernels_label(None, "blocks") == "eager"


def test_default_kernels_stand_in_for_tuned_ones_before_eager():
    from mosaic.profile.db import stand_in_kernels

    assert stand_in_kernels("compile-max-autotune-gemm-blocks") == (
        "compile-max-autotune-gemm-blocks", "compile-max-autotune-gemm",
        "compile-default-blocks", "compile-default", "eager")
    assert stand_in_kernels("compile-default-blocks") == (
        "compile-default-blocks", "compile-default", "eager")
    assert stand_in_kernels("eager") == ("eager",)


def test_a_module_profiled_again_with_new_facts_drops_its_old_points(tmp_path):
    from dataclasses import replace

    sig_v, sig_t, _ = _filled(tmp_path / "p.sqlite")
    with ProfileDB.open(tmp_path / "p.sqlite", readonly=False) as db:
        vision = next(m.spec for m in db.modules() if m.signature == sig_v)
        new_sig = db.add_module("imagebind", "small", replace(vision, num_kernels=7))
        db.add_points([ModulePoint(signature=new_sig, per_gpu_batch=4, num_sms=64, time_s=0.009)])
        assert {p.signature for p in db.points()} == {new_sig}  # vision's old points are gone
        assert db.signatures() == []
        db.add_module("imagebind", "small", next(m.spec for m in db.modules()
                                                   if m.signature == sig_t))  # same facts: kept
        assert {p.signature for p in db.points()} == {new_sig}


def test_a_surface_measured_again_replaces_its_points_in_one_transaction(tmp_path):
    """`mosaic profile --update --remeasure`: a module whose kernels changed without its cost
    facts (the zoo's attention lost its mask tensors) is measured again, and its surface is
    the new run's alone, never a mix."""
    sig_v, sig_t, _ = _filled(tmp_path / "p.sqlite")
    with ProfileDB.open(tmp_path / "p.sqlite", readonly=False) as db:
        db.add_points([ModulePoint(signature=sig_t, per_gpu_batch=4, num_sms=64, time_s=0.004)])
        new = [ModulePoint(signature=sig_v, per_gpu_batch=2, num_sms=32, time_s=0.007)]
        db.replace_points(sig_v, new)
        assert db.points(sig_v) == new and len(db.points(sig_t)) == 1  # the other module stays
        with pytest.raises(ProfileDBError, match="another signature"):
            db.replace_points(sig_v, [ModulePoint(signature=sig_t, per_gpu_batch=1, num_sms=8,
                                                  time_s=1e-3)])
        assert db.points(sig_v) == new


def test_the_modules_to_measure_again_are_the_named_models_signatures(tmp_path):
    from mosaic.profile.profiler import model_signatures
    from mosaic.zoo import get_model

    db = ProfileDB.create(tmp_path / "p.sqlite", hardware="h200", num_sms=132)
    stored = {db.add_module("clip", "tiny", m, "compile-default")
              for m in get_model("clip").graph("tiny").modules}
    assert model_signatures(["clip"], "tiny", "compile-default") == stored
    assert model_signatures(["clip"], "tiny", "eager").isdisjoint(stored)
    db.close()
