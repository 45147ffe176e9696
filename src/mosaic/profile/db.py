"""ProfileDB: measured module times, colocations, interference signatures and comm curves.

One SQLite file per GPU kind (stdlib `sqlite3`, no pickle). The profiler is the one writer;
the performance model opens it read-only. Schema (SCHEMA_VERSION 2):

- `meta(key, value)`: schema_version, hardware, num_sms, torch/cuda/driver versions, date,
  git_sha, config (the profiler's config as JSON); `comm_topology.<n>` (JSON): how the n-GPU
  comm curves were measured (GPU, NCCL version and env, `nvidia-smi topo -m`; collectives.py).
- `modules(model, preset, module, kernels, signature, spec_json)`: every profiled module, with
  the ModuleSpec it was profiled as and the kernels it ran (`eager`, or `compile-<mode>` for
  Inductor's: the engine's default, so what the engine really runs is what is measured).
  Modules with identical cost facts and kernels share a `signature` and are measured once
  (symmetry pruning). A version-1 DB (no `kernels` column) reads as all eager.
- `module_points(signature, per_gpu_batch, num_sms, time_s, spread, repeats, phase)`:
  forward + backward of one module alone, median over CUDA-graph replays; `spread` is
  (p90 - p10) / median; `phase` says which sampling pass chose the point (coarse/refine).
  The view `module_points_named` joins it to model/preset/module names.
- `colocations(id, model, preset, sharing, works_json, group_time_s, spread, repeats)`:
  `works_json` is a list of {module, signature, per_gpu_batch, num_sms, priority, alone_s,
  time_s}: per-module time alone on the same stream and inside the colocation.
- `signatures(signature, per_gpu_batch, num_sms, antagonist_sms, alone_s, with_antagonist_s,
  bytes_per_s, method)`: each module's bandwidth behaviour (see profiler.py).
- `comm(kind, num_gpus, num_bytes, time_s, source)`: kind in COMM_KINDS (allreduce,
  reduce_scatter, all_gather, broadcast, p2p, p2p_bidir), source measured | analytic.
- `fits(name, params_json, mape, n_points, created)`: fitted models and their held-out error:
  interference (`model_error.*`), engine terms (`engine_term.*`), the optimizer step, and
  `surfaces` (every surface's law parameters by a digest of its points, stored by `mosaic
  profile` so every machine predicts from the same fits: perf/profiled.py).
- `iterations(plan_json, label, model, preset, global_batch, num_gpus, predicted_s,
  engine_term_s, measured_s, engine, perf_model, date)`: whole iterations measured by
  autotune (mosaic/autotune.py), the evidence `perf/engine_term.py` refits on. Created on the
  first write, so DBs made before it still open (same SCHEMA_VERSION; readers see none).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mosaic.errors import MosaicError
from mosaic.graph import ModuleSpec

SCHEMA_VERSION = 2
READABLE_VERSIONS = ("1", "2")
"""Version 1 lacks modules.kernels (every module eager); opening it for writing migrates it."""
KERNELS = ("eager", "compile-default", "compile-max-autotune-gemm",
           "compile-max-autotune-no-cudagraphs", "compile-default-blocks",
           "compile-max-autotune-gemm-blocks", "compile-max-autotune-no-cudagraphs-blocks")
"""How a profiled module ran: eagerly, or behind Inductor in one mode, compiled whole or (with
`-blocks`) layer by layer (engine/compile.py's compile scope)."""
BLOCKS_SUFFIX = "-blocks"


def kernels_label(mode: str | None, scope: str = "module") -> str:
    """The KERNELS name of a module compiled in `mode` (None: eager) and `scope`."""
    if mode is None:
        return "eager"
    return f"compile-{mode}" + (BLOCKS_SUFFIX if scope == "blocks" else "")


TUNED_MODES = ("max-autotune-gemm", "max-autotune-no-cudagraphs")
"""Compile modes that choose among kernels by benchmarking them: Inductor keeps its default
kernel where that is fastest, and on the H200 the tuned engine stepped within 1% of the
default one (CLIP `small` b128: 21.29 vs 21.16 ms), so default surfaces stand in for them."""


def stand_in_kernels(kernels: str) -> tuple[str, ...]:
    """`kernels`, then the kernels whose surfaces stand in for it when it has none, best
    first: the same mode compiled whole (for layer-by-layer kernels), Inductor's default
    kernels for a tuned mode, then eager."""
    mode, scope = compile_of_kernels(kernels)
    chain = [kernels, kernels_label(mode)]
    if mode in TUNED_MODES:
        chain += [kernels_label("default", scope), kernels_label("default")]
    return tuple(dict.fromkeys([*chain, "eager"]))


def compile_of_kernels(kernels: str) -> tuple[str | None, str]:
    """(Inductor mode or None, compile scope) of a KERNELS name; kernels_label's inverse."""
    if kernels == "eager":
        return None, "module"
    mode = kernels.removeprefix("compile-")
    if mode.endswith(BLOCKS_SUFFIX):
        return mode.removesuffix(BLOCKS_SUFFIX), "blocks"
    return mode, "module"


def colocation_kernels(point: ColocPoint, kernels: Mapping[str, str]) -> str | None:
    """The kernels (`kernels`: by signature; absent: eager) every member of a measured
    colocation ran, or None for a mix."""
    kinds = {kernels.get(w.signature, "eager") for w in point.works}
    return kinds.pop() if len(kinds) == 1 else None


def profile_meta_key(kernels: str, preset: str, colocations: bool,
                     busy_only: bool = False) -> str:
    """The meta key under which `mosaic profile --update` records its settings: a run that
    measured colocations apart from a surfaces-only run of the same kernels and preset, and a
    busy-only run apart from both, so none hides another's budget."""
    return (f"profile.{kernels}.{preset}" + (".colocations" if colocations else "")
            + (".busy" if busy_only else ""))


TOPOLOGY_KEY = "comm_topology"
DATA_DIR = Path(__file__).parent / "data"
FIX = "re-run `python benchmarks/profile_h200.py --db PATH` on the GPU (or pass another --db)"

_MODULES = """
CREATE TABLE modules (
  model TEXT NOT NULL, preset TEXT NOT NULL, module TEXT NOT NULL,
  signature TEXT NOT NULL, spec_json TEXT NOT NULL, kernels TEXT NOT NULL DEFAULT 'eager',
  PRIMARY KEY (model, preset, module, kernels));
"""
_NAMED_POINTS = """
CREATE VIEW module_points_named AS
  SELECT m.model, m.preset, m.module, m.kernels, p.*
  FROM modules m JOIN module_points p USING (signature);
"""
_SCHEMA = _MODULES + """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE module_points (
  signature TEXT NOT NULL, per_gpu_batch INTEGER NOT NULL, num_sms INTEGER NOT NULL,
  time_s REAL NOT NULL, spread REAL NOT NULL, repeats INTEGER NOT NULL, phase TEXT NOT NULL,
  PRIMARY KEY (signature, per_gpu_batch, num_sms));
CREATE TABLE colocations (
  id INTEGER PRIMARY KEY, model TEXT NOT NULL, preset TEXT NOT NULL, sharing TEXT NOT NULL,
  works_json TEXT NOT NULL, group_time_s REAL NOT NULL, spread REAL NOT NULL,
  repeats INTEGER NOT NULL);
CREATE TABLE signatures (
  signature TEXT NOT NULL, per_gpu_batch INTEGER NOT NULL, num_sms INTEGER NOT NULL,
  antagonist_sms INTEGER NOT NULL, alone_s REAL NOT NULL, with_antagonist_s REAL NOT NULL,
  bytes_per_s REAL NOT NULL, method TEXT NOT NULL,
  PRIMARY KEY (signature, per_gpu_batch, num_sms));
CREATE TABLE comm (
  kind TEXT NOT NULL, num_gpus INTEGER NOT NULL, num_bytes REAL NOT NULL,
  time_s REAL NOT NULL, source TEXT NOT NULL);
CREATE TABLE fits (
  name TEXT PRIMARY KEY, params_json TEXT NOT NULL, mape REAL, n_points INTEGER,
  created TEXT NOT NULL);
""" + _NAMED_POINTS


_BUSY = """
CREATE TABLE IF NOT EXISTS busy (
  signature TEXT NOT NULL, per_gpu_batch INTEGER NOT NULL, alone_s REAL NOT NULL,
  pair_s REAL NOT NULL, spread REAL NOT NULL, repeats INTEGER NOT NULL,
  PRIMARY KEY (signature, per_gpu_batch));
"""
_ITERATIONS = """
CREATE TABLE IF NOT EXISTS iterations (
  plan_json TEXT NOT NULL, label TEXT NOT NULL, model TEXT NOT NULL, preset TEXT NOT NULL,
  global_batch INTEGER NOT NULL, num_gpus INTEGER NOT NULL, predicted_s REAL NOT NULL,
  engine_term_s REAL NOT NULL, measured_s REAL NOT NULL, engine TEXT NOT NULL,
  perf_model TEXT NOT NULL, date TEXT NOT NULL);
"""


class ProfileDBError(MosaicError):
    """A profile DB that cannot be used; the message names the path and the fix."""


# --- records -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class ModuleRecord:
    model: str
    preset: str
    module: str
    signature: str
    spec: ModuleSpec
    kernels: str = "eager"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModulePoint:
    signature: str
    per_gpu_batch: int
    num_sms: int
    time_s: float
    spread: float = 0.0
    repeats: int = 1
    phase: str = "coarse"


@dataclass(frozen=True, kw_only=True, slots=True)
class ColocWork:
    module: str
    signature: str
    per_gpu_batch: int
    num_sms: int
    """Quota (partition), cap (cap), or the whole GPU (free)."""
    priority: int = 0
    alone_s: float = 0.0
    """The module alone on the same stream / quota (0: not measured)."""
    time_s: float = 0.0
    """The module's own finish time inside the colocation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ColocPoint:
    model: str
    preset: str
    sharing: str
    works: tuple[ColocWork, ...]
    group_time_s: float
    spread: float = 0.0
    repeats: int = 1
    id: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SignaturePoint:
    signature: str
    per_gpu_batch: int
    num_sms: int
    antagonist_sms: int
    alone_s: float
    with_antagonist_s: float
    bytes_per_s: float
    method: str

    @property
    def slowdown(self) -> float:
        return self.with_antagonist_s / self.alone_s if self.alone_s > 0 else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class BusyPoint:
    """How much of the whole GPU a module keeps busy at one per-GPU batch: two copies of it
    run side by side on the whole GPU (free sharing, separate CUDA graphs) against one alone.
    A module that saturates the GPU takes twice as long for two copies; one that leaves SMs
    or bandwidth idle takes less."""

    signature: str
    per_gpu_batch: int
    alone_s: float
    pair_s: float
    spread: float = 0.0
    repeats: int = 1

    @property
    def fraction(self) -> float:
        """pair / (2 x alone): 1 where two copies take exactly twice one."""
        return self.pair_s / (2.0 * self.alone_s) if self.alone_s > 0 else 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class CommPoint:
    kind: str
    """One of COMM_KINDS; what `num_bytes` counts depends on it (see COMM_KINDS)."""
    num_gpus: int
    num_bytes: float
    time_s: float
    source: str
    """'measured' or 'analytic' (COMM_SOURCES)."""


COMM_KINDS = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "p2p", "p2p_bidir")
"""What `num_bytes` is, per kind (n = num_gpus):
allreduce: the tensor every rank reduces; reduce_scatter: each rank's whole input (it keeps
num_bytes / n); all_gather: the gathered output (each rank gives num_bytes / n); broadcast: the
tensor sent from one rank to all; p2p: sent from one GPU to another (n = 2); p2p_bidir: sent
each way at once between two GPUs (n = 2)."""
P2P_KINDS = ("p2p", "p2p_bidir")
COMM_SOURCES = ("measured", "analytic")


def comm_bus_factor(kind: str, num_gpus: int) -> float:
    """Bytes the busiest link of a ring carries per byte of `num_bytes`: all-reduce
    2(n-1)/n, reduce-scatter and all-gather (n-1)/n, broadcast and p2p 1 (nccl-tests' busbw)."""
    n = num_gpus
    if kind == "allreduce":
        return 2.0 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if kind in ("broadcast", *P2P_KINDS):
        return 1.0
    raise ValueError(f"unknown comm kind {kind!r}; choose one of {COMM_KINDS}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FitRecord:
    name: str
    params: dict[str, Any]
    mape: float | None
    n_points: int
    created: str


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationRecord:
    """One plan's whole iteration, predicted and measured (an autotune measurement)."""

    plan_json: str
    label: str
    model: str
    preset: str
    global_batch: int
    num_gpus: int
    predicted_s: float
    """The model's full prediction, engine term included."""
    engine_term_s: float
    """The engine term inside predicted_s (0 without one): refits subtract it."""
    measured_s: float
    engine: str
    """engine_term.engine_kind of the engine it ran on."""
    perf_model: str
    date: str


# --- helpers -------------------------------------------------------------------------------
COST_FACTS = (
    "input_shape", "num_params", "num_layers", "hidden_dim", "tokens_per_sample",
    "flops_per_sample", "activation_bytes_per_sample", "num_kernels",
)


def module_signature(spec: ModuleSpec, kernels: str = "eager") -> str:
    """Hash of the cost facts (not the name) and of the kernels: equal facts run by the same
    kernels, equal measurements. Eager signatures hash the facts alone, as version 1 did."""
    facts: dict[str, Any] = {f: getattr(spec, f) for f in COST_FACTS}
    if kernels != "eager":
        facts["kernels"] = kernels
    facts["input_shape"] = list(spec.input_shape)
    for f in ("flops_per_sample", "activation_bytes_per_sample"):
        facts[f] = float(f"{float(facts[f]):.6g}")
    blob = json.dumps(facts, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:12]


def spec_to_json(spec: ModuleSpec) -> str:
    d = asdict(spec)
    d["input_shape"] = list(spec.input_shape)
    return json.dumps(d, sort_keys=True)


def spec_from_json(text: str) -> ModuleSpec:
    d = json.loads(text)
    return ModuleSpec(**{**d, "input_shape": tuple(d["input_shape"])})


def default_db_path(hardware: str) -> Path:
    """Where the shipped DB for a GPU kind lives: src/mosaic/profile/data/<hardware>.sqlite."""
    return DATA_DIR / f"{hardware.lower()}.sqlite"


def has_shipped_db(hardware: str) -> bool:
    return default_db_path(hardware).is_file()


# --- the DB --------------------------------------------------------------------------------
class ProfileDB:
    """A profile database; `create` for the one writer, `open` (read-only) for everyone else."""

    def __init__(self, conn: sqlite3.Connection, path: Path, readonly: bool) -> None:
        self.conn = conn
        self.path = path
        self.readonly = readonly

    # construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, *, hardware: str, num_sms: int,
               config: dict[str, Any] | None = None, versions: dict[str, str] | None = None,
               overwrite: bool = False) -> ProfileDB:
        path = Path(path)
        if path.exists():
            if not overwrite:
                raise ProfileDBError(f"{path}: already exists; pass overwrite=True or another path")
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path)
        conn.executescript(_SCHEMA)
        meta = {"schema_version": str(SCHEMA_VERSION), "hardware": hardware.lower(),
                "num_sms": str(num_sms), "config": json.dumps(config or {}, sort_keys=True),
                **{k: str(v) for k, v in (versions or {}).items()}}
        conn.executemany("INSERT INTO meta VALUES (?, ?)", sorted(meta.items()))
        conn.commit()
        return cls(conn, path, readonly=False)

    @classmethod
    def open(cls, path: str | Path, *, hardware: str | None = None,
             readonly: bool = True) -> ProfileDB:
        """Open an existing DB, checking it is SQLite, of this schema and for `hardware`."""
        path = Path(path)
        if not path.is_file():
            raise ProfileDBError(f"profile DB {path} does not exist; {FIX}")
        uri = path.resolve().as_uri() + ("?mode=ro" if readonly else "?mode=rw")
        try:
            conn = sqlite3.connect(uri, uri=True)
            rows = conn.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.DatabaseError as exc:
            raise ProfileDBError(f"{path} is not a profile DB ({exc}); {FIX}") from None
        meta = dict(rows)
        version = meta.get("schema_version")
        if version not in READABLE_VERSIONS:
            conn.close()
            raise ProfileDBError(f"{path} has schema_version {version}, this mosaic reads "
                                 f"{', '.join(READABLE_VERSIONS)}; {FIX}")
        if hardware is not None and meta.get("hardware") != hardware.lower():
            conn.close()
            raise ProfileDBError(
                f"{path} was profiled on {meta.get('hardware')!r}, not {hardware.lower()!r}; "
                f"profile this hardware or pass its DB with --db")
        if not readonly and version != str(SCHEMA_VERSION):
            _migrate_to_kernels(conn)
        return cls(conn, path, readonly)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ProfileDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # meta -------------------------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, str]:
        return dict(self.conn.execute("SELECT key, value FROM meta").fetchall())

    @property
    def hardware(self) -> str:
        return self.meta["hardware"]

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.meta.get("config", "{}"))

    def set_meta(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)", [(key, str(value))])

    def _write(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if self.readonly:
            raise ProfileDBError(f"{self.path} is open read-only; open it with readonly=False to write")
        self.conn.executemany(sql, rows)
        self.conn.commit()

    # writers ----------------------------------------------------------------------------------
    def add_module(self, model: str, preset: str, spec: ModuleSpec, kernels: str = "eager") -> str:
        if kernels not in KERNELS:
            raise ProfileDBError(f"kernels {kernels!r}: choose one of {KERNELS}")
        sig = module_signature(spec, kernels)
        old = self.conn.execute("SELECT signature FROM modules WHERE model = ? AND preset = ? AND "
                                "module = ? AND kernels = ?",
                                (model, preset, spec.name, kernels)).fetchone()
        self._write("INSERT OR REPLACE INTO modules (model, preset, module, signature, spec_json,"
                    " kernels) VALUES (?, ?, ?, ?, ?, ?)",
                    [(model, preset, spec.name, sig, spec_to_json(spec), kernels)])
        if old and old[0] != sig:
            self.drop_orphaned_measurements()
        return sig

    def drop_orphaned_measurements(self) -> int:
        """Delete scaling and bandwidth points whose signature no module row names any more
        (a module whose facts changed, e.g. new kernels, and was profiled again: the old points
        measured something the zoo no longer runs). Returns the rows deleted."""
        deleted = 0
        for table in ("module_points", "signatures", "busy"):
            if not self.has_table(table):
                continue
            deleted += self.conn.execute(
                f"DELETE FROM {table} WHERE signature NOT IN (SELECT signature FROM modules)"
            ).rowcount
        self.conn.commit()
        return deleted

    def add_points(self, points: list[ModulePoint]) -> None:
        self._write("INSERT OR REPLACE INTO module_points VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(p.signature, p.per_gpu_batch, p.num_sms, p.time_s, p.spread, p.repeats,
                      p.phase) for p in points])

    def replace_points(self, signature: str, points: list[ModulePoint]) -> None:
        """A module's surface measured again: its old points go and the new ones come in one
        transaction, so no surface is ever a mix of two runs, nor lost to a stopped one. Its
        busy fractions go too: they measured the module as it ran before."""
        if self.readonly:
            raise ProfileDBError(f"{self.path} is open read-only; open it with readonly=False to write")
        if any(p.signature != signature for p in points):
            raise ProfileDBError(f"replace_points({signature!r}) got points of another signature")
        with self.conn:
            self.conn.execute("DELETE FROM module_points WHERE signature = ?", (signature,))
            if self.has_table("busy"):
                self.conn.execute("DELETE FROM busy WHERE signature = ?", (signature,))
            self.conn.executemany("INSERT INTO module_points VALUES (?, ?, ?, ?, ?, ?, ?)",
                                  [(p.signature, p.per_gpu_batch, p.num_sms, p.time_s, p.spread,
                                    p.repeats, p.phase) for p in points])

    def add_colocation(self, point: ColocPoint) -> None:
        works = json.dumps([asdict(w) for w in point.works])
        self._write("INSERT INTO colocations (model, preset, sharing, works_json, group_time_s,"
                    " spread, repeats) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(point.model, point.preset, point.sharing, works, point.group_time_s,
                      point.spread, point.repeats)])

    def add_signature(self, point: SignaturePoint) -> None:
        self._write("INSERT OR REPLACE INTO signatures VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(point.signature, point.per_gpu_batch, point.num_sms, point.antagonist_sms,
                      point.alone_s, point.with_antagonist_s, point.bytes_per_s, point.method)])

    def add_comm(self, points: list[CommPoint], *, replace: bool = False) -> None:
        """Append comm rows; `replace` first drops the stored rows of each (kind, num_gpus,
        source) given, so a re-measured curve replaces the old one instead of mixing with it."""
        bad = [(p.kind, p.source) for p in points
               if p.kind not in COMM_KINDS or p.source not in COMM_SOURCES]
        if bad:
            raise ProfileDBError(f"comm rows {sorted(set(bad))}: kind must be one of {COMM_KINDS}"
                                 f" and source one of {COMM_SOURCES}")
        if replace:
            keys = sorted({(p.kind, p.num_gpus, p.source) for p in points})
            self._write("DELETE FROM comm WHERE kind = ? AND num_gpus = ? AND source = ?", keys)
        self._write("INSERT INTO comm VALUES (?, ?, ?, ?, ?)",
                    [(p.kind, p.num_gpus, p.num_bytes, p.time_s, p.source) for p in points])

    def set_topology(self, num_gpus: int, info: dict[str, Any]) -> None:
        """How the `num_gpus`-GPU comm curves were measured (meta `comm_topology.<n>`)."""
        self.set_meta(f"{TOPOLOGY_KEY}.{int(num_gpus)}", json.dumps(info, sort_keys=True))

    def add_fit(self, fit: FitRecord) -> None:
        self._write("INSERT OR REPLACE INTO fits VALUES (?, ?, ?, ?, ?)",
                    [(fit.name, json.dumps(fit.params, sort_keys=True), fit.mape, fit.n_points,
                      fit.created)])

    def add_iterations(self, records: list[IterationRecord]) -> None:
        """Append measured iterations, creating the table in a DB made before it existed."""
        if not self.readonly:  # else _write below raises the read-only error
            self.conn.execute(_ITERATIONS)
        self._write("INSERT INTO iterations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(r.plan_json, r.label, r.model, r.preset, r.global_batch, r.num_gpus,
                      r.predicted_s, r.engine_term_s, r.measured_s, r.engine, r.perf_model,
                      r.date) for r in records])

    def add_busy(self, points: list[BusyPoint]) -> None:
        """Store busy fractions (a module measured again at a batch replaces its old row),
        creating the table in a DB made before it existed."""
        if not self.readonly:
            self.conn.execute(_BUSY)
        self._write("INSERT OR REPLACE INTO busy VALUES (?, ?, ?, ?, ?, ?)",
                    [(p.signature, p.per_gpu_batch, p.alone_s, p.pair_s, p.spread, p.repeats)
                     for p in points])

    def drop_busy(self, signatures: set[str]) -> None:
        """Forget these modules' busy fractions (to measure them again)."""
        if self.has_table("busy"):
            self._write("DELETE FROM busy WHERE signature = ?", [(s,) for s in sorted(signatures)])

    # readers ----------------------------------------------------------------------------------
    def has_table(self, name: str) -> bool:
        return self.conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                                 (name,)).fetchone() is not None

    def iterations(self) -> list[IterationRecord]:
        """Recorded iterations, oldest first ([] in a DB made before the table existed)."""
        if not self.has_table("iterations"):
            return []
        rows = self.conn.execute("SELECT * FROM iterations ORDER BY date, rowid").fetchall()
        return [IterationRecord(plan_json=r[0], label=r[1], model=r[2], preset=r[3],
                                global_batch=r[4], num_gpus=r[5], predicted_s=r[6],
                                engine_term_s=r[7], measured_s=r[8], engine=r[9],
                                perf_model=r[10], date=r[11]) for r in rows]

    def busy(self) -> list[BusyPoint]:
        """Measured busy fractions ([] in a DB made before the table existed)."""
        if not self.has_table("busy"):
            return []
        rows = self.conn.execute("SELECT * FROM busy ORDER BY signature, per_gpu_batch")
        return [BusyPoint(signature=r[0], per_gpu_batch=r[1], alone_s=r[2], pair_s=r[3],
                          spread=r[4], repeats=r[5]) for r in rows]

    def modules(self, kernels: str | None = None) -> list[ModuleRecord]:
        """Profiled modules (of one kind of kernels, or all)."""
        has_kernels = "kernels" in _columns(self.conn, "modules")
        rows = self.conn.execute(
            "SELECT model, preset, module, signature, spec_json, "
            + ("kernels" if has_kernels else "'eager'")
            + " FROM modules ORDER BY model, preset, module").fetchall()
        return [ModuleRecord(model=r[0], preset=r[1], module=r[2], signature=r[3],
                             spec=spec_from_json(r[4]), kernels=r[5]) for r in rows
                if kernels is None or r[5] == kernels]

    def points(self, signature: str | None = None) -> list[ModulePoint]:
        sql = "SELECT * FROM module_points"
        args: tuple[Any, ...] = ()
        if signature is not None:
            sql, args = sql + " WHERE signature = ?", (signature,)
        rows = self.conn.execute(sql + " ORDER BY signature, per_gpu_batch, num_sms", args)
        return [ModulePoint(signature=r[0], per_gpu_batch=r[1], num_sms=r[2], time_s=r[3],
                            spread=r[4], repeats=r[5], phase=r[6]) for r in rows]

    def colocations(self) -> list[ColocPoint]:
        rows = self.conn.execute("SELECT id, model, preset, sharing, works_json, group_time_s,"
                                 " spread, repeats FROM colocations ORDER BY id").fetchall()
        return [ColocPoint(id=r[0], model=r[1], preset=r[2], sharing=r[3],
                           works=tuple(ColocWork(**w) for w in json.loads(r[4])),
                           group_time_s=r[5], spread=r[6], repeats=r[7]) for r in rows]

    def signatures(self) -> list[SignaturePoint]:
        rows = self.conn.execute("SELECT * FROM signatures ORDER BY signature").fetchall()
        return [SignaturePoint(signature=r[0], per_gpu_batch=r[1], num_sms=r[2],
                               antagonist_sms=r[3], alone_s=r[4], with_antagonist_s=r[5],
                               bytes_per_s=r[6], method=r[7]) for r in rows]

    def comm(self, kind: str | None = None) -> list[CommPoint]:
        rows = self.conn.execute("SELECT * FROM comm ORDER BY kind, num_gpus, num_bytes").fetchall()
        pts = [CommPoint(kind=r[0], num_gpus=r[1], num_bytes=r[2], time_s=r[3], source=r[4])
               for r in rows]
        return [p for p in pts if kind is None or p.kind == kind]

    def topology(self) -> dict[int, dict[str, Any]]:
        """num_gpus -> what set_topology stored for that GPU count ({} if never measured)."""
        out = {}
        for key, value in self.meta.items():
            prefix, _, n = key.partition(".")
            if prefix == TOPOLOGY_KEY and n.isdigit():
                out[int(n)] = json.loads(value)
        return dict(sorted(out.items()))

    def fits(self) -> list[FitRecord]:
        rows = self.conn.execute("SELECT * FROM fits ORDER BY name").fetchall()
        return [FitRecord(name=r[0], params=json.loads(r[1]), mape=r[2], n_points=r[3],
                          created=r[4]) for r in rows]

    def iter_counts(self) -> Iterator[tuple[str, int]]:
        for table in ("modules", "module_points", "colocations", "signatures", "busy", "comm",
                      "fits"):
            if not self.has_table(table):
                continue
            yield table, self.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def _migrate_to_kernels(conn: sqlite3.Connection) -> None:
    """Version 1 -> 2: modules gains `kernels` (all old rows eager) and it joins the key, so
    one module can hold both eager and compiled surfaces. SQLite cannot change a primary key
    in place: the table is rebuilt, in one transaction."""
    with conn:
        conn.execute("ALTER TABLE modules RENAME TO modules_v1")
        conn.execute("DROP VIEW IF EXISTS module_points_named")
        conn.execute(_MODULES)
        conn.execute(_NAMED_POINTS)
        conn.execute("INSERT INTO modules (model, preset, module, signature, spec_json, kernels)"
                     " SELECT model, preset, module, signature, spec_json, 'eager' FROM modules_v1")
        conn.execute("DROP TABLE modules_v1")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
