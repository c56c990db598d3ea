"""The incident store: one SQLite database per rank in the run directory.

- WAL journal: a committed transaction survives `kill -9` of the process (the WAL is written before
  COMMIT returns); an uncommitted one vanishes whole, so a reader never sees half a step. Steps commit
  with `synchronous=NORMAL` (no fsync per step: the step's end is on the training loop's critical
  path); a transaction that holds an incident commits with `synchronous=FULL`, so incidents also
  survive a power loss.
- One transaction per training step (statistics, vTasks, verdicts, incidents together), plus an
  immediate commit for each incident, so a crash loses at most the step in flight.
- Versioned schema (`PRAGMA user_version`); opening a store written by a newer version fails with a
  clear message instead of misreading it.
- SQLite is unsafe on network file systems: keep the run directory on local disk.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

SCHEMA_VERSION = 5

_SCHEMA_V1 = """
CREATE TABLE run (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    started_wall REAL NOT NULL,
    finished_wall REAL,
    host TEXT NOT NULL, rank INTEGER NOT NULL, local_rank INTEGER NOT NULL, world_size INTEGER NOT NULL,
    device TEXT NOT NULL, gpu_uuid TEXT,
    config_json TEXT NOT NULL, versions_json TEXT NOT NULL, summary_json TEXT
);
CREATE TABLE sites (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, module TEXT NOT NULL, kind TEXT NOT NULL, op TEXT NOT NULL
);
CREATE TABLE steps (
    step INTEGER PRIMARY KEY, wall REAL NOT NULL, checks INTEGER NOT NULL, alarms INTEGER NOT NULL,
    verified INTEGER NOT NULL, backlog INTEGER NOT NULL, verify_ms REAL NOT NULL
);
CREATE TABLE step_stats (
    step INTEGER NOT NULL, site_id INTEGER NOT NULL REFERENCES sites(id),
    calls INTEGER NOT NULL, checks INTEGER NOT NULL, alarms INTEGER NOT NULL, faults INTEGER NOT NULL,
    nonfinite INTEGER NOT NULL, max_row REAL, max_col REAL, threshold_row REAL, threshold_col REAL,
    calibrating INTEGER NOT NULL,
    PRIMARY KEY (step, site_id)
);
CREATE TABLE vtasks (
    id INTEGER PRIMARY KEY, site_id INTEGER NOT NULL REFERENCES sites(id), step INTEGER NOT NULL,
    call INTEGER NOT NULL, channel TEXT NOT NULL, value REAL, threshold REAL, idx INTEGER, raw_l2 REAL,
    tile_json TEXT, raised_wall REAL NOT NULL
);
CREATE TABLE verdicts (
    vtask_id INTEGER PRIMARY KEY REFERENCES vtasks(id), kind TEXT NOT NULL, wrong_execution TEXT,
    no_effect_on_output INTEGER NOT NULL, tiles_json TEXT NOT NULL, detail TEXT NOT NULL,
    replay_ms REAL NOT NULL, latency_steps INTEGER NOT NULL, latency_ms REAL NOT NULL,
    decided_step INTEGER NOT NULL, decided_wall REAL NOT NULL
);
CREATE TABLE incidents (
    id INTEGER PRIMARY KEY, vtask_id INTEGER REFERENCES vtasks(id), site_id INTEGER NOT NULL REFERENCES sites(id),
    step INTEGER NOT NULL, host TEXT NOT NULL, rank INTEGER NOT NULL, local_rank INTEGER NOT NULL,
    device TEXT NOT NULL, gpu_uuid TEXT, record_json TEXT NOT NULL, created_wall REAL NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER, site_id INTEGER, kind TEXT NOT NULL,
    message TEXT NOT NULL, data_json TEXT, wall REAL NOT NULL
);
CREATE INDEX step_stats_site ON step_stats(site_id, step);
CREATE INDEX incidents_step ON incidents(step);
"""

# Version 2: the results of a paired healthy-vs-suspect study (aegis_sdc.study), one per run directory.
# A metric row is (step, scope, metric, value); docs/study.md lists the scopes and metrics. NaN is NULL.
_SCHEMA_V2 = """
CREATE TABLE study (
    id INTEGER PRIMARY KEY CHECK (id = 1), mode TEXT NOT NULL, config_json TEXT NOT NULL,
    started_wall REAL NOT NULL, finished_wall REAL, summary_json TEXT
);
CREATE TABLE study_metrics (
    step INTEGER NOT NULL, scope TEXT NOT NULL, metric TEXT NOT NULL, value REAL,
    PRIMARY KEY (step, scope, metric)
);
CREATE INDEX study_metrics_metric ON study_metrics(metric, scope, step);
"""

# Migrations from version N-1 to N, applied in order. Version 1 is the first schema.
# v3: the GEMM FLOPs of each step and how many of them were checked (sampling's coverage per step)
_SCHEMA_V3 = """
ALTER TABLE steps ADD COLUMN gemm_flops REAL NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN checked_flops REAL NOT NULL DEFAULT 0;
"""

# v4: checkpoints and their certificates (response/checkpoints.py); one row per checkpoint path,
# rewritten when its status is decided
_SCHEMA_V4 = """
CREATE TABLE checkpoints (
    path TEXT PRIMARY KEY, step INTEGER NOT NULL, status TEXT NOT NULL, reason TEXT NOT NULL,
    verified_through INTEGER NOT NULL, certificate_json TEXT NOT NULL, created_wall REAL NOT NULL,
    decided_wall REAL
);
"""

# v5: a confirmed verdict that found an incident's fault again (a backward check, a recomputation, a
# peer replay after the op's own check) names that incident; NULL for every other verdict
_SCHEMA_V5 = """
ALTER TABLE verdicts ADD COLUMN same_fault_as INTEGER;
"""

_MIGRATIONS: dict[int, str] = {1: _SCHEMA_V1, 2: _SCHEMA_V2, 3: _SCHEMA_V3, 4: _SCHEMA_V4, 5: _SCHEMA_V5}


class StoreError(RuntimeError):
    pass


def rank_db_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"aegis-rank{rank:05d}.sqlite"


def _connect(path: Path) -> sqlite3.Connection:
    # explicit transactions only; the guard writes from its writer thread (runtime/record.py), one
    # thread at a time
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {version}, newer than this aegis-sdc understands ({SCHEMA_VERSION}); "
            "upgrade aegis-sdc to read it"
        )
    for target in range(version + 1, SCHEMA_VERSION + 1):
        # One script, one transaction: a crash mid-migration leaves the previous version intact.
        try:
            conn.executescript(f"BEGIN IMMEDIATE;\n{_MIGRATIONS[target]}\nPRAGMA user_version = {target};\nCOMMIT;")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class StoreInUseError(StoreError):
    """Another live writer (in this process or another) holds the rank's store."""


def _take_writer_lock(path: Path) -> int:
    """An exclusive lock on `aegis-rankNNNNN.lock` beside the store, held while the store is open for
    writing: one writer per rank store, whatever the process. Two guards writing one store would
    collide on vTask ids and race the schema's creation; the lock turns that into a clear error at
    `protect()` (or, for the default run directory, into a directory of its own: runtime/run_dir.py).
    The lock dies with its process, so a killed run never leaves a stale one; the file names the
    holder for the error. It is never removed: unlinking a lock file races a process opening it."""
    lock_path = path.with_suffix(".lock")  # aegis-rankNNNNN.lock: no reader's *.sqlite* glob takes it
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
        os.close(fd)
        raise StoreInUseError(
            f"{path} is being written by another guard ({holder}): give each guard its own run directory "
            "(GuardConfig.run_dir)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, the note is for error messages
    return fd


class Store:
    """Writer of one rank's database; `lock=True` (the guard's writer) takes the rank's writer lock."""

    def __init__(self, path: str | os.PathLike, *, lock: bool = False) -> None:
        self.path = Path(path)
        if self.path.parent.exists() and not self.path.parent.is_dir():
            raise StoreError(f"the run directory {self.path.parent} is a file, not a directory (GuardConfig.run_dir)")
        try:  # a run directory this process cannot make or write (permissions, a file on its path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _take_writer_lock(self.path) if lock else None
        except OSError as error:
            raise StoreError(f"cannot write the run directory {self.path.parent} ({error.strerror or error}): "
                             "choose a GuardConfig.run_dir this process can create and write") from error  # fmt: skip
        try:
            self.conn = _connect(self.path)
            _migrate(self.conn, self.path)
        except sqlite3.DatabaseError as error:  # a damaged or foreign file: named, never overwritten
            self._release_lock()
            raise self.unreadable(error) from error
        except BaseException:
            self._release_lock()
            raise
        self._in_tx = False
        # A site's row is found by its name: the guard numbers its sites in the order it meets them,
        # and a guard that writes to a store an earlier one wrote (a resumed run, another model in
        # the same run directory) may meet other sites, or the same in another order. Its ids map
        # to the rows' here; a fresh store's rows take the guard's own ids.
        self._site_ids: dict[int, int] = {}

    def unreadable(self, error: sqlite3.DatabaseError) -> StoreError:
        """The error for a store SQLite cannot read (a damaged or foreign file), naming it; also for
        damage found past the opening (pages the first reads reach)."""
        why = f"{self.path} is not a readable aegis store ({error})"
        return StoreError(f"{why}; move it away or choose another GuardConfig.run_dir (`aegis incidents` "
                          "shows what can still be read)")  # fmt: skip

    # -- transactions ----------------------------------------------------------------------------
    @contextmanager
    def transaction(self, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction; `durable` makes its COMMIT fsync (for incidents). A transaction that fails
        anywhere — its body, or its COMMIT on a full disk — leaves nothing behind: the connection is
        rolled back and ready for the next one (a retried write starts from scratch)."""
        if self._in_tx:
            yield self.conn
            return
        try:
            if durable:
                self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("BEGIN IMMEDIATE")
            self._in_tx = True
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException:
            # SQLite may already have rolled back on its own (SQLITE_FULL, SQLITE_IOERR at COMMIT)
            if self.conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
            raise
        finally:
            self._in_tx = False
            if durable:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        try:
            self.conn.close()
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def incident_records(self) -> list[dict[str, Any]]:
        """Every committed incident of this store (`Incident.to_dict()`), in the order committed."""
        return [json.loads(row[0]) for row in self.conn.execute("SELECT record_json FROM incidents ORDER BY id")]

    # -- writers ---------------------------------------------------------------------------------
    def write_run(self, identity: dict[str, Any], config: dict[str, Any], versions: dict[str, str]) -> None:
        with self.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO run (id, started_wall, host, rank, local_rank, world_size, device, gpu_uuid,"
                " config_json, versions_json) VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    time.time(),
                    identity["host"],
                    identity["rank"],
                    identity["local_rank"],
                    identity["world_size"],
                    identity["device"],
                    identity.get("gpu_uuid"),
                    _dumps(config),
                    _dumps(versions),
                ),
            )

    def finish_run(self, summary: dict[str, Any]) -> None:
        with self.transaction() as c:
            c.execute(
                "UPDATE run SET finished_wall = ?, summary_json = ? WHERE id = 1",
                (time.time(), _dumps(summary)),
            )

    def write_sites(self, sites: Iterable[Any]) -> None:
        """The sites' rows: a name the store holds keeps its row (and id), a new name takes the
        guard's id when free, else the next free id."""
        with self.transaction() as c:
            for site in sites:
                row = c.execute("SELECT id FROM sites WHERE name = ?", (site.name,)).fetchone()
                if row is not None:
                    store_id = row[0]
                    c.execute("UPDATE sites SET module = ?, kind = ?, op = ? WHERE id = ?",
                              (site.module, site.kind.value, site.op, store_id))  # fmt: skip
                else:
                    taken = c.execute("SELECT 1 FROM sites WHERE id = ?", (site.id,)).fetchone()
                    store_id = site.id if taken is None else c.execute("SELECT MAX(id) + 1 FROM sites").fetchone()[0]
                    c.execute("INSERT INTO sites (id, name, module, kind, op) VALUES (?, ?, ?, ?, ?)",
                              (store_id, site.name, site.module, site.kind.value, site.op))  # fmt: skip
                self._site_ids[site.id] = store_id

    def _site_id(self, site_id: int | None) -> int | None:
        """The store's id of the guard's site `site_id` (written by `write_sites` before any record
        names it)."""
        if site_id is None:
            return None
        try:
            return self._site_ids[site_id]
        except KeyError:
            raise StoreError(f"site {site_id} named in a record before its row was written") from None

    # A step may be flushed more than once (inference loops, full buffers): rows accumulate.
    def write_step(
        self, step: int, *, checks: int, alarms: int, verified: int, backlog: int, verify_ms: float,
        gemm_flops: float = 0.0, checked_flops: float = 0.0,
    ) -> None:  # fmt: skip
        self.conn.execute(
            "INSERT INTO steps (step, wall, checks, alarms, verified, backlog, verify_ms, gemm_flops, checked_flops)"
            " VALUES (?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(step) DO UPDATE SET wall = excluded.wall, checks = checks + excluded.checks,"
            " alarms = alarms + excluded.alarms, verified = verified + excluded.verified,"
            " backlog = excluded.backlog, verify_ms = verify_ms + excluded.verify_ms,"
            " gemm_flops = gemm_flops + excluded.gemm_flops, checked_flops = checked_flops + excluded.checked_flops",
            (step, time.time(), checks, alarms, verified, backlog, verify_ms, gemm_flops, checked_flops),
        )

    def write_step_stats(self, rows: Iterable[tuple]) -> None:
        self.conn.executemany(
            "INSERT INTO step_stats (step, site_id, calls, checks, alarms, faults, nonfinite, max_row,"
            " max_col, threshold_row, threshold_col, calibrating) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(step, site_id) DO UPDATE SET calls = calls + excluded.calls,"
            " checks = checks + excluded.checks, alarms = alarms + excluded.alarms,"
            " faults = faults + excluded.faults, nonfinite = nonfinite + excluded.nonfinite,"
            " max_row = MAX(COALESCE(max_row, excluded.max_row), COALESCE(excluded.max_row, max_row)),"
            " max_col = MAX(COALESCE(max_col, excluded.max_col), COALESCE(excluded.max_col, max_col)),"
            " threshold_row = excluded.threshold_row, threshold_col = excluded.threshold_col,"
            " calibrating = excluded.calibrating",
            [(row[0], self._site_id(row[1]), *row[2:]) for row in rows],
        )

    def write_vtask(self, task: Any) -> None:
        e = task.evidence
        self.conn.execute(
            "INSERT INTO vtasks (id, site_id, step, call, channel, value, threshold, idx, raw_l2, tile_json,"
            " raised_wall) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                task.id,
                self._site_id(e.site.id),
                e.step,
                e.call,
                e.channel.value,
                _finite_or_none(e.value),
                _finite_or_none(e.threshold),
                e.index,
                _finite_or_none(e.raw_l2),
                _dumps(e.tile.to_dict() if e.tile else None),
                task.raised_wall,
            ),
        )

    def write_verdict(self, verdict: Any, decided_step: int) -> None:
        self.conn.execute(
            "INSERT INTO verdicts (vtask_id, kind, wrong_execution, no_effect_on_output, tiles_json, detail,"
            " replay_ms, latency_steps, latency_ms, decided_step, decided_wall, same_fault_as)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                verdict.vtask_id,
                verdict.kind.value,
                verdict.wrong_execution.value if verdict.wrong_execution else None,
                int(verdict.no_effect_on_output),
                _dumps([t.to_dict() for t in verdict.mismatched_tiles]),
                verdict.detail,
                verdict.replay_ms,
                verdict.latency_steps,
                verdict.latency_ms,
                decided_step,
                time.time(),
                verdict.same_fault_as,
            ),
        )

    def write_incident(self, incident: Any) -> None:
        who = incident.identity
        self.conn.execute(
            "INSERT INTO incidents (id, vtask_id, site_id, step, host, rank, local_rank, device, gpu_uuid,"
            " record_json, created_wall) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                incident.id,
                incident.verdict.vtask_id,
                self._site_id(incident.site.id),
                incident.step,
                who.host,
                who.rank,
                who.local_rank,
                who.device,
                who.gpu_uuid,
                _dumps(incident.to_dict()),
                incident.created_wall,
            ),
        )

    def write_event(
        self,
        kind: str,
        message: str,
        *,
        step: int | None = None,
        site_id: int | None = None,
        data: Any = None,
    ) -> None:
        self.conn.execute(
            "INSERT INTO events (step, site_id, kind, message, data_json, wall) VALUES (?,?,?,?,?,?)",
            (step, self._site_id(site_id), kind, message, None if data is None else _dumps(data), time.time()),
        )

    def write_certificate(self, certificate: Any) -> None:
        """A checkpoint's certificate (response/checkpoints.Certificate), replacing its earlier status."""
        c = certificate
        self.conn.execute(
            "INSERT OR REPLACE INTO checkpoints (path, step, status, reason, verified_through, certificate_json,"
            " created_wall, decided_wall) VALUES (?,?,?,?,?,?,?,?)",
            (c.path, c.step, c.status, c.reason, c.verified_through, _dumps(c.to_dict()), c.created_wall,
             c.decided_wall),
        )  # fmt: skip

    # -- a study (aegis_sdc.study) ------------------------------------------------------------------
    def write_study(self, mode: str, config: dict[str, Any]) -> None:
        with self.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO study (id, mode, config_json, started_wall) VALUES (1, ?, ?, ?)",
                (mode, _dumps(config), time.time()),
            )

    def write_study_metrics(self, rows: Iterable[tuple[int, str, str, float]]) -> None:
        """One step's rows, committed together (a crash loses at most the step in flight)."""
        with self.transaction() as c:
            c.executemany("INSERT OR REPLACE INTO study_metrics (step, scope, metric, value) VALUES (?,?,?,?)", rows)

    def finish_study(self, summary: dict[str, Any]) -> None:
        with self.transaction(durable=True) as c:
            c.execute(
                "UPDATE study SET finished_wall = ?, summary_json = ? WHERE id = 1", (time.time(), _dumps(summary))
            )


def _finite_or_none(value: float) -> float | None:
    return value if value == value and abs(value) != float("inf") else None


# -- reading a run directory (all ranks) --------------------------------------------------------
# A reader trusts no file and changes none: a run directory may hold an empty, truncated, damaged or
# foreign file, a copy of a store under another name, or belong to someone else (read-only). Readers
# open stores read-only (no PRAGMA that writes, no journal mode set, no -wal/-shm created next to a
# store nobody writes), check each before reading it, and name the file in every problem they report.
_STORE_NAME = re.compile(r"aegis-rank([0-9]+)\.sqlite")
_SQLITE_MAGIC = b"SQLite format 3\x00"
# the tables of schema version 1: later versions only add tables and columns
_AEGIS_TABLES = ("run", "sites", "steps", "step_stats", "vtasks", "verdicts", "incidents", "events")
# SQLite's primary result codes (sqlite3.SQLITE_* exist from Python 3.11 on)
_SQLITE_READONLY, _SQLITE_CANTOPEN = 8, 14
_T = TypeVar("_T")


@dataclass(frozen=True)
class RankDatabase:
    rank: int
    path: Path


@dataclass(frozen=True)
class StoreProblem:
    """What is wrong with one file of a run directory. `skipped`: nothing was read from it; otherwise
    it was read, but what it gave may be incomplete or wrong."""

    path: Path
    reason: str
    skipped: bool = True

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class UnreadableStore(StoreError):
    """A file that cannot be read as an aegis store; `reason` says what is wrong, without the path."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def rank_databases(run_dir: str | os.PathLike, skipped: list[StoreProblem] | None = None) -> list[RankDatabase]:
    """The stores of a run directory, ordered by rank: the files named as the guard names a rank's store
    (`aegis-rank%05d.sqlite`, rank_db_path). Any other `aegis-rank*.sqlite` (`aegis-rank1.sqlite`, a copy
    under another name) is not a store: reading it too would list its rank twice. Such files are
    appended to `skipped` when it is given. Raises StoreError when `run_dir` is not a directory, or
    holds no store (and `skipped` is not given: the caller reports what was skipped itself)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise StoreError(f"{root} is not a directory")
    found: list[RankDatabase] = []
    others: list[StoreProblem] = []
    for path in sorted(root.glob("aegis-rank*.sqlite")):
        match = _STORE_NAME.fullmatch(path.name)
        if match is None or rank_db_path(root, int(match[1])).name != path.name:
            canonical = f"aegis-rank{int(match[1]):05d}.sqlite" if match else "aegis-rank%05d.sqlite"
            others.append(StoreProblem(path, f"not a store's name ({canonical} is); not read"))
        elif not path.is_file():
            others.append(StoreProblem(path, "not a regular file"))
        else:
            found.append(RankDatabase(int(match[1]), path))
    if not found and (skipped is None or not others):
        names = f" (not read: {', '.join(p.path.name for p in others)})" if others else ""
        raise StoreError(f"no aegis store (aegis-rank*.sqlite) in {root}{names}")
    if skipped is not None:
        skipped.extend(others)
    return sorted(found, key=lambda db: db.rank)  # by name, 100000 would come before 99999


def _file_problem(path: Path, has_wal: bool) -> str | None:
    """Why `path` is no SQLite database, from its size and 100-byte header; None when it may be one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            header = file.read(100)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if size == 0:
        return "empty file (0 bytes): not an aegis store"
    if header[:16] != _SQLITE_MAGIC[: len(header)]:
        return "not a SQLite database (no SQLite header): not an aegis store"
    if len(header) < 100:
        return f"truncated: {size} bytes, shorter than a SQLite header"
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size & (page_size - 1):
        return f"not a SQLite database (page size {page_size} in its header)"
    pages = int.from_bytes(header[28:32], "big")
    # The header's page count is valid when its change counter matches (bytes 24 and 92); with a WAL
    # beside it a checkpoint may be resizing the file right now, so only a store nobody writes is judged.
    if not has_wal and header[24:28] == header[92:96] and size < pages * page_size:
        return f"truncated: {size} bytes, its header says {pages} pages of {page_size} bytes"
    return None


def _connect_read_only(path: Path, *, immutable: bool) -> sqlite3.Connection:
    # the URI form: `mode=ro` and `immutable=1` need it; as_uri() percent-encodes names with '?' or '#'
    flags = "mode=ro&immutable=1" if immutable else "mode=ro"
    conn = sqlite3.connect(
        f"{path.resolve().as_uri()}?{flags}", uri=True, timeout=30.0, isolation_level=None, check_same_thread=False
    )
    conn.row_factory = sqlite3.Row
    return conn


def _primary_code(error: sqlite3.Error) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF
    text = str(error)
    return _SQLITE_CANTOPEN if "unable to open" in text else _SQLITE_READONLY if "readonly" in text else None


def _open_store(path: Path) -> tuple[sqlite3.Connection, list[str]]:
    """A read-only connection to the aegis store at `path`, checked, and what is wrong with it short of
    being unreadable (a damaged page, a write-ahead log it could not read). Raises UnreadableStore."""
    wal = path.with_name(path.name + "-wal")
    has_wal = wal.exists()
    problem = _file_problem(path, has_wal)
    if problem:
        raise UnreadableStore(path, problem)
    notes: list[str] = []
    wal_failure = None
    if has_wal:
        # A WAL beside the store: a writer is running, or one was killed before folding its WAL back
        # (committed steps may be only there). `mode=ro` reads them and takes the readers' locks, but
        # needs the -wal and -shm files to exist or a directory it may create them in. When it cannot
        # (a read-only directory after a crash), `immutable=1` still reads what is in the file itself.
        conn = _connect_read_only(path, immutable=False)
        try:
            conn.execute("PRAGMA user_version").fetchone()  # connect() opens nothing: the first read does
        except sqlite3.Error as error:
            conn.close()
            if _primary_code(error) not in (_SQLITE_CANTOPEN, _SQLITE_READONLY):
                raise UnreadableStore(path, f"not readable as SQLite ({error})") from error
            conn = _connect_read_only(path, immutable=True)
            wal_failure = f"its write-ahead log {wal.name} cannot be opened read-only here ({error})"
            notes.append(f"{wal_failure}: read without it, the last committed steps may be missing")
    else:
        # No WAL: every committed transaction is in the file itself, and no connection has it open (a
        # connection to a WAL database keeps the -wal file until the last one closes, and deletes it
        # then). `immutable=1` reads such a file without locks and without creating -wal/-shm files, so
        # the directory is left exactly as it was and may be read-only. It is unsafe only against a
        # writer that opens the store during the read *and* checkpoints into it meanwhile (writes go to
        # the WAL first; SQLite folds them back every 1000 pages and at close): a torn read then fails
        # quick_check or a query, is reported, and reading again gives the right answer.
        conn = _connect_read_only(path, immutable=True)
    try:
        _check_schema(conn, path)
        notes.extend(_quick_check(conn))
    except UnreadableStore as error:
        conn.close()
        if wal_failure is None:
            raise
        raise UnreadableStore(path, f"{error.reason}, without the log: {wal_failure}") from error
    except BaseException:
        conn.close()
        raise
    return conn, notes


def _check_schema(conn: sqlite3.Connection, path: Path) -> None:
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as error:
        raise UnreadableStore(path, f"not readable as SQLite ({error})") from error
    missing = [name for name in _AEGIS_TABLES if name not in tables]
    if len(missing) == len(_AEGIS_TABLES):
        raise UnreadableStore(path, "not an aegis store (a SQLite database without aegis-sdc's tables)")
    if version > SCHEMA_VERSION:
        raise UnreadableStore(
            path, f"schema version {version} is newer than this aegis-sdc reads (1..{SCHEMA_VERSION}): upgrade it"
        )
    if version < 1 or missing:
        lacking = f", no table {', '.join(missing)}" if missing else ""
        raise UnreadableStore(path, f"not an aegis store (schema version {version}{lacking})")


def _quick_check(conn: sqlite3.Connection) -> list[str]:
    # quick_check reads every page once and checks its structure (not the indexes against the tables,
    # which integrity_check adds at a higher cost): a damaged page is then reported, instead of rows
    # silently missing from a listing. It cannot see a changed byte inside a stored value.
    try:
        found = [str(row[0]) for row in conn.execute("PRAGMA quick_check(3)")]
    except sqlite3.Error as error:
        return [f"damaged: PRAGMA quick_check fails ({error}); what could be read was read"]
    if found == ["ok"]:
        return []
    return [f"damaged: PRAGMA quick_check: {'; '.join(found)}; what could be read was read"]


def open_reader(path: str | os.PathLike) -> sqlite3.Connection:
    """A read-only connection to one rank's store, checked first: raises UnreadableStore (a StoreError
    naming the file) for an empty, truncated, damaged or foreign file, a schema newer than this
    version, or a write-ahead log it cannot read. Changes nothing on disk (see `_open_store`)."""
    path = Path(path)
    conn, problems = _open_store(path)
    if problems:
        conn.close()
        raise UnreadableStore(path, problems[0])
    return conn


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[sqlite3.Connection]:
    """A checked, read-only reader of one rank's store (open_reader), closed afterwards."""
    conn = open_reader(path)
    try:
        yield conn
    finally:
        conn.close()


# Every reader is read-only now; the name stays for the code that asks for it.
reading_only = reading


def _claimed_rank(conn: sqlite3.Connection, db: RankDatabase) -> int:
    """The rank the store's run row says it holds (its file name's while the row is not committed)."""
    try:
        row = conn.execute("SELECT rank FROM run WHERE id = 1").fetchone()
    except sqlite3.Error:
        return db.rank
    return row[0] if row is not None and type(row[0]) is int else db.rank


class RunStores:
    """The stores of a run directory (rank_databases), each opened read-only once and checked (open_reader)
    before anything is read; pass it to the `read_*` functions instead of the directory. `strict`
    raises UnreadableStore at the first problem; otherwise each problem is kept in `problems` (a file
    not read, a damaged store, a store claiming another store's rank, rows that could not be read) and
    what can be read is read. Raises StoreError when the directory is missing or holds no
    `aegis-rank*.sqlite`. Use it as a context manager, or close() it."""

    def __init__(self, run_dir: str | os.PathLike, *, strict: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.strict = strict
        self.problems: list[StoreProblem] = []
        self._readers: list[tuple[RankDatabase, sqlite3.Connection]] = []
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    @property
    def databases(self) -> list[RankDatabase]:
        """The stores read, one per rank, ordered by rank."""
        return [db for db, _ in self._readers]

    def _problem(self, path: Path, reason: str, *, skipped: bool = True) -> None:
        if self.strict:
            raise UnreadableStore(path, reason)
        problem = StoreProblem(path, reason, skipped)
        if problem not in self.problems:  # a query that fails on every call is reported once
            self.problems.append(problem)

    def _open(self) -> None:
        names: list[StoreProblem] = []
        found = rank_databases(self.run_dir, names)
        for problem in names:
            self._problem(problem.path, problem.reason)
        for db in found:
            try:
                conn, damage = _open_store(db.path)
            except UnreadableStore as error:
                self._problem(db.path, f"{error.reason}; not read")
                continue
            self._readers.append((db, conn))
            for reason in damage:
                self._problem(db.path, reason, skipped=False)
        # Two stores of one rank (a copy under another rank's name): read one, report the other.
        claims: dict[int, list[tuple[RankDatabase, sqlite3.Connection]]] = {}
        for db, conn in self._readers:
            claims.setdefault(_claimed_rank(conn, db), []).append((db, conn))
        for rank, group in claims.items():
            kept = next((db for db, _ in group if db.rank == rank), group[0][0])
            for db, conn in group:
                if db != kept:
                    self._readers.remove((db, conn))
                    conn.close()
                    reason = f"holds rank {rank} (its run row), as {kept.path.name} does; not read twice"
                    self._problem(db.path, reason)
            if kept.rank != rank:
                reason = f"holds rank {rank} (its run row), not rank {kept.rank} as its name says"
                self._problem(kept.path, reason, skipped=False)

    def collect(self, read: Callable[[RankDatabase, sqlite3.Connection], Iterable[_T]]) -> list[_T]:
        """What `read` gives for every store read, in rank order. A store whose rows cannot be read
        (a damaged page, a foreign table of an aegis name, a value of the wrong type) gives nothing
        for this query: a problem, or UnreadableStore when strict."""
        rows: list[_T] = []
        for db, conn in self._readers:
            try:
                rows.extend(list(read(db, conn)))
            except (sqlite3.Error, ValueError, KeyError, TypeError, AttributeError) as error:
                reason = f"rows cannot be read ({type(error).__name__}: {error}); what could be read was read"
                self._problem(db.path, reason, skipped=False)
        return rows

    def close(self) -> None:
        for _, conn in self._readers:
            conn.close()
        self._readers = []

    def __enter__(self) -> RunStores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect(
    run: str | os.PathLike | RunStores, read: Callable[[RankDatabase, sqlite3.Connection], Iterable[_T]]
) -> list[_T]:
    """`read` over every store of `run`: a RunStores as it was opened, a directory strictly."""
    if isinstance(run, RunStores):
        return run.collect(read)
    with RunStores(run) as stores:
        return stores.collect(read)


def _order(value: Any) -> tuple:
    """A sort key for a stored value of any type (SQLite keeps whatever was written): None, numbers, text."""
    if value is None:
        return (0, 0)
    if isinstance(value, (int, float)):
        return (1, value)
    return (2, str(value))


def _object(text: str | None) -> dict[str, Any]:
    """A stored JSON object ({} for NULL); ValueError for anything else."""
    value = json.loads(text) if text else {}
    if not isinstance(value, dict):
        raise ValueError(f"stored JSON is a {type(value).__name__}, not an object")
    return value


def read_incidents(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """All incidents of all ranks, ordered by step then rank."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        rows = []
        for r in conn.execute(
            "SELECT i.id, i.step, i.host, i.rank, i.local_rank, i.device, i.gpu_uuid, i.record_json, s.name AS site"
            " FROM incidents i JOIN sites s ON s.id = i.site_id ORDER BY i.step, i.id"
        ):
            record = _object(r["record_json"])
            evidence, verdict = record.get("evidence"), record.get("verdict")
            if not isinstance(evidence, dict) or not isinstance(verdict, dict):
                raise ValueError(f"incident {r['id']}: its record holds no evidence and verdict")
            rows.append({
                "id": r["id"], "rank": r["rank"], "local_rank": r["local_rank"], "host": r["host"],
                "device": r["device"], "gpu_uuid": r["gpu_uuid"], "site": r["site"], "step": r["step"],
                "evidence": evidence, "verdict": verdict,
            })  # fmt: skip
        return rows

    rows = _collect(run, read)
    rows.sort(key=lambda r: (_order(r["step"]), _order(r["rank"]), _order(r["id"])))
    return rows


def read_warnings(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Rank-outlier warnings of all ranks (each rank stores those naming it, a disagreement that names
    no rank is stored by the lowest rank involved), ordered by step."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[tuple[tuple, dict[str, Any]]]:
        rows = []
        for r in conn.execute(
            "SELECT e.step, e.message, e.data_json, s.name AS site FROM events e"
            " LEFT JOIN sites s ON s.id = e.site_id WHERE e.kind = 'rank_outlier' ORDER BY e.step, e.id"
        ):
            data = _object(r["data_json"])
            # "rank" is None for a disagreement that names no rank ("ranks" lists those involved)
            row = {"step": r["step"], "site": r["site"], "rank": data.get("rank", db.rank),
                   "ranks": data.get("ranks", [db.rank]), "message": r["message"], "data": data}  # fmt: skip
            named = min(row["ranks"]) if row["rank"] is None else row["rank"]
            rows.append(((_order(r["step"]), _order(named)), row))
        return rows

    return [row for _, row in sorted(_collect(run, read), key=lambda pair: pair[0])]


def read_unattributed(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Corruptions proven but pinned on no device (collective checks without a majority), all ranks,
    ordered by step; `rank` is the rank whose check failed, not a device blamed."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        return [
            {"step": r["step"], "site": r["site"], "rank": db.rank, "message": r["message"]}
            for r in conn.execute(
                "SELECT e.step, e.message, s.name AS site FROM events e"
                " LEFT JOIN sites s ON s.id = e.site_id WHERE e.kind = 'unattributed_sdc' ORDER BY e.step, e.id"
            )
        ]

    rows = _collect(run, read)
    rows.sort(key=lambda r: (_order(r["step"]), r["rank"]))
    return rows


def read_verdict_counts(run: str | os.PathLike | RunStores) -> dict[str, int]:
    """Verdicts by kind; confirmed ones that found an incident's fault again count as `same_fault`
    (so that `confirmed_sdc` counts the incidents' own verdicts)."""

    def read(_: RankDatabase, conn: sqlite3.Connection):
        if not _has_column(conn, "verdicts", "same_fault_as"):  # a store written before version 5
            return conn.execute("SELECT kind, COUNT(*) FROM verdicts GROUP BY kind")
        return conn.execute("SELECT CASE WHEN same_fault_as IS NULL THEN kind ELSE 'same_fault' END AS k, COUNT(*)"
                            " FROM verdicts GROUP BY k")  # fmt: skip

    counts: dict[str, int] = {}
    for kind, n in _collect(run, read):
        counts[str(kind)] = counts.get(str(kind), 0) + n
    return counts


def _has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    """Whether a (read-only, perhaps older) store's `table` has `column`: readers never migrate."""
    return column in {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def _has_flops(conn: sqlite3.Connection) -> bool:
    return _has_column(conn, "steps", "gemm_flops")  # a store written before schema version 3 has none


def read_coverage(run: str | os.PathLike | RunStores) -> dict[str, Any]:
    """How much of the GEMM work was checked: over all steps and ranks, and the range per step."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[tuple[int, int, float, float]]:
        if not _has_flops(conn):
            return []
        query = "SELECT step, gemm_flops, checked_flops FROM steps WHERE gemm_flops > 0"
        return [(db.rank, int(step), float(gemm), float(done)) for step, gemm, done in conn.execute(query)]

    rows = _collect(run, read)
    total, checked = sum(row[2] for row in rows), sum(row[3] for row in rows)
    fractions = [done / gemm for _, _, gemm, done in rows]
    return {
        "steps": len({step for _, step, _, _ in rows}),  # distinct step numbers, whatever the ranks
        "ranks": len({rank for rank, _, _, _ in rows}),
        "checked_flops_fraction": checked / total if total else None,
        "per_step_min": min(fractions, default=None),
        "per_step_max": max(fractions, default=None),
    }


def read_study(path: str | os.PathLike) -> dict[str, Any]:
    """The study of a store: mode, config, summary (None until it finished) and its metric rows."""
    with reading(path) as conn:
        try:
            head = conn.execute("SELECT mode, config_json, summary_json FROM study WHERE id = 1").fetchone()
            if head is None:
                raise StoreError(f"{path} holds no study")
            rows = [
                (r["step"], r["scope"], r["metric"], float("nan") if r["value"] is None else r["value"])
                # rowid: the order the study wrote them in (submodules in module order)
                for r in conn.execute("SELECT step, scope, metric, value FROM study_metrics ORDER BY step, rowid")
            ]
            return {
                "mode": head["mode"],
                "config": json.loads(head["config_json"]),
                "summary": json.loads(head["summary_json"]) if head["summary_json"] else None,
                "rows": rows,
            }
        except (sqlite3.Error, ValueError) as error:
            raise UnreadableStore(Path(path), f"its study cannot be read ({error})") from error


def _loads(text: str | None) -> Any:
    return json.loads(text) if text else None


def read_runs(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Each rank's run row, by rank: identity, start, finish and summary (None while the run is in
    progress), configuration and versions. A store whose run row is not committed yet gives its rank
    with None everywhere else."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        found = conn.execute("SELECT * FROM run WHERE id = 1").fetchone()
        row = dict(found) if found else {}
        return [{
            "rank": db.rank, "path": str(db.path),
            **{key: row.get(key) for key in ("host", "local_rank", "world_size", "device", "gpu_uuid",
                                             "started_wall", "finished_wall")},
            "config": _loads(row.get("config_json")), "versions": _loads(row.get("versions_json")),
            "summary": _loads(row.get("summary_json")),
        }]  # fmt: skip

    return _collect(run, read)


def read_step_totals(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Per step, summed over ranks: checks, alarms, verified vTasks, GEMM FLOPs and checked FLOPs
    (FLOPs are 0 in stores written before schema version 3), ordered by step."""

    def read(_: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        flops = "gemm_flops, checked_flops" if _has_flops(conn) else "0.0 AS gemm_flops, 0.0 AS checked_flops"
        rows = []
        for r in conn.execute(f"SELECT step, checks, alarms, verified, {flops} FROM steps"):
            # numbers checked here: a store may hold text where a count belongs
            rows.append({"step": r["step"], "checks": int(r["checks"]), "alarms": int(r["alarms"]),
                         "verified": int(r["verified"]), "gemm_flops": float(r["gemm_flops"]),
                         "checked_flops": float(r["checked_flops"])})  # fmt: skip
        return rows

    totals: dict[Any, dict[str, Any]] = {}
    for row in _collect(run, read):
        total = totals.setdefault(row["step"], dict.fromkeys(row, 0) | {"step": row["step"]})
        for key in ("checks", "alarms", "verified", "gemm_flops", "checked_flops"):
            total[key] += row[key]
    return [totals[step] for step in sorted(totals, key=_order)]


# The worst difference over its threshold of a (step, site) row, on either channel; None while the
# site calibrates (its threshold is then a loose worst-case bound) or when nothing was checked.
_RATIO = (
    "CASE WHEN t.calibrating = 0 AND t.checks > 0 THEN MAX(COALESCE(t.max_row / t.threshold_row, 0),"
    " COALESCE(t.max_col / t.threshold_col, 0)) END"
)


def read_site_summaries(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Per GEMM site and rank, over all steps: calls, checks, alarms, injected faults, non-finite
    inputs, steps calibrating, and the worst difference/threshold ratio after calibration with its
    step (None before any calibrated check)."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        rows = []
        # one MAX() aggregate: SQLite then takes the bare column t.step from the row holding the maximum
        for r in conn.execute(
            f"SELECT s.name AS site, s.module, s.kind, s.op, SUM(t.calls) AS calls, SUM(t.checks) AS checks,"
            f" SUM(t.alarms) AS alarms, SUM(t.faults) AS faults, SUM(t.nonfinite) AS nonfinite,"
            f" COUNT(*) AS steps, SUM(t.calibrating) AS calibrating_steps, MAX({_RATIO}) AS worst_ratio,"
            f" t.step AS worst_step FROM step_stats t JOIN sites s ON s.id = t.site_id GROUP BY t.site_id ORDER BY s.id"
        ):
            row = dict(r) | {"rank": db.rank}
            if row["worst_ratio"] is None:
                row["worst_step"] = None
            rows.append(row)
        return rows

    return _collect(run, read)


def read_site_series(
    run: str | os.PathLike | RunStores, wanted: Iterable[tuple[str, int]]
) -> dict[tuple[str, int], list]:
    """The per-step rows of the wanted (site name, rank) pairs, ordered by step: largest row and column
    differences, thresholds, calibrating. Asked for a few pairs, so a large run stays cheap to read."""
    by_rank: dict[int, set[str]] = {}
    for name, rank in wanted:
        by_rank.setdefault(rank, set()).add(name)
    series: dict[tuple[str, int], list] = {(name, rank): [] for rank, names in by_rank.items() for name in names}

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[tuple[tuple[str, int], dict[str, Any]]]:
        names = sorted(by_rank.get(db.rank, ()))
        if not names:
            return []
        return [
            ((r["site"], db.rank), dict(r))
            for r in conn.execute(
                "SELECT s.name AS site, t.step, t.checks, t.max_row, t.max_col, t.threshold_row, t.threshold_col,"
                " t.calibrating FROM step_stats t JOIN sites s ON s.id = t.site_id"
                f" WHERE s.name IN ({','.join('?' * len(names))}) ORDER BY t.step",
                names,
            )
        ]

    for key, row in _collect(run, read):
        series[key].append(row)
    return series


def _rows_by_step(run: str | os.PathLike | RunStores, query: str) -> list[dict[str, Any]]:
    """The rows of `query` (which selects a `step` column) from every rank's store, each with its
    rank, ordered by step and rank."""
    rows = _collect(run, lambda db, conn: [dict(r) | {"rank": db.rank} for r in conn.execute(query)])
    rows.sort(key=lambda r: (_order(r["step"]), r["rank"]))
    return rows


def read_nonfinite(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Checked calls whose inputs held NaN/Inf, per step, site and rank, ordered by step."""
    return _rows_by_step(
        run,
        "SELECT t.step, s.name AS site, t.nonfinite FROM step_stats t JOIN sites s ON s.id = t.site_id"
        " WHERE t.nonfinite > 0 ORDER BY t.step, s.id",
    )


def read_events(run: str | os.PathLike | RunStores, kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Events of all ranks (of the given kinds, else all), ordered by step; an event of no step
    (a configuration warning) comes first."""
    wanted = None if kinds is None else sorted(set(kinds))
    where = "" if wanted is None else f" WHERE e.kind IN ({','.join('?' * len(wanted))})"

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        rows = []
        for r in conn.execute(
            "SELECT e.step, e.kind, e.message, e.data_json, e.wall, s.name AS site FROM events e"
            f" LEFT JOIN sites s ON s.id = e.site_id{where} ORDER BY e.id",
            wanted or [],
        ):
            rows.append({"step": r["step"], "kind": r["kind"], "site": r["site"], "rank": db.rank,
                         "message": r["message"], "data": _loads(r["data_json"]), "wall": r["wall"]})  # fmt: skip
        return rows

    rows = _collect(run, read)
    rows.sort(key=lambda r: (_order(r["step"]), r["rank"]))  # None (no step) first
    return rows


def read_verdicts(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Every verdict of all ranks with its vTask's site, step and channel, ordered by step."""
    return _rows_by_step(
        run,
        "SELECT v.vtask_id, t.step, s.name AS site, t.channel, v.kind, v.wrong_execution, v.replay_ms,"
        " v.latency_steps, v.latency_ms, v.decided_step FROM verdicts v JOIN vtasks t ON t.id = v.vtask_id"
        " LEFT JOIN sites s ON s.id = t.site_id ORDER BY t.step, v.vtask_id",
    )


def read_checkpoints(run: str | os.PathLike | RunStores) -> list[dict[str, Any]]:
    """Every checkpoint of all ranks with its certificate's status, ordered by step then rank (stores
    written before schema version 4 have none)."""

    def read(db: RankDatabase, conn: sqlite3.Connection) -> list[dict[str, Any]]:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'checkpoints'").fetchone():
            return []
        return [
            dict(r) | {"rank": db.rank, "certificate": _loads(r["certificate_json"])}
            for r in conn.execute(
                "SELECT path, step, status, reason, verified_through, certificate_json FROM checkpoints"
            )
        ]

    rows = _collect(run, read)
    for row in rows:
        row.pop("certificate_json")
    rows.sort(key=lambda r: (r["step"], r["rank"], r["path"]))
    return rows
