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

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 3

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

_MIGRATIONS: dict[int, str] = {1: _SCHEMA_V1, 2: _SCHEMA_V2, 3: _SCHEMA_V3}


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


class Store:
    """Writer of one rank's database."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = _connect(self.path)
        _migrate(self.conn, self.path)
        self._in_tx = False

    # -- transactions ----------------------------------------------------------------------------
    @contextmanager
    def transaction(self, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction; `durable` makes its COMMIT fsync (for incidents)."""
        if self._in_tx:
            yield self.conn
            return
        if durable:
            self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("BEGIN IMMEDIATE")
        self._in_tx = True
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")
        finally:
            self._in_tx = False
            if durable:
                self.conn.execute("PRAGMA synchronous=NORMAL")

    def close(self) -> None:
        self.conn.close()

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
        with self.transaction() as c:
            c.executemany(
                "INSERT OR REPLACE INTO sites (id, name, module, kind, op) VALUES (?, ?, ?, ?, ?)",
                [(s.id, s.name, s.module, s.kind.value, s.op) for s in sites],
            )

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
            list(rows),
        )

    def write_vtask(self, task: Any) -> None:
        e = task.evidence
        self.conn.execute(
            "INSERT INTO vtasks (id, site_id, step, call, channel, value, threshold, idx, raw_l2, tile_json,"
            " raised_wall) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                task.id,
                e.site.id,
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
            " replay_ms, latency_steps, latency_ms, decided_step, decided_wall) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
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
                incident.site.id,
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
            (step, site_id, kind, message, None if data is None else _dumps(data), time.time()),
        )

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
@dataclass(frozen=True)
class RankDatabase:
    rank: int
    path: Path


def rank_databases(run_dir: str | os.PathLike) -> list[RankDatabase]:
    root = Path(run_dir)
    if not root.is_dir():
        raise StoreError(f"{root} is not a directory")
    found = []
    for path in sorted(root.glob("aegis-rank*.sqlite")):
        try:
            found.append(RankDatabase(int(path.stem.removeprefix("aegis-rank")), path))
        except ValueError:
            continue
    if not found:
        raise StoreError(f"no aegis store (aegis-rank*.sqlite) in {root}")
    return found


def open_reader(path: Path) -> sqlite3.Connection:
    """Open a rank database for reading; refuses schemas newer than this version."""
    conn = _connect(path)
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION or version == 0:
        conn.close()
        raise StoreError(f"{path} has schema version {version}; this aegis-sdc reads 1..{SCHEMA_VERSION}")
    return conn


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[sqlite3.Connection]:
    """A reader of one rank database, closed afterwards."""
    conn = open_reader(Path(path))
    try:
        yield conn
    finally:
        conn.close()


def _each_rank(run_dir: str | os.PathLike, opener=None) -> Iterator[tuple[RankDatabase, sqlite3.Connection]]:
    """Every rank database of a run directory with a reader (`reading`, or `opener`), one at a time."""
    for db in rank_databases(run_dir):
        with (opener or reading)(db.path) as conn:
            yield db, conn


def read_incidents(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All incidents of all ranks, ordered by step then rank."""
    rows: list[dict[str, Any]] = []
    for _, conn in _each_rank(run_dir):
        for r in conn.execute(
            "SELECT i.id, i.step, i.host, i.rank, i.local_rank, i.device, i.gpu_uuid, i.record_json, s.name AS site"
            " FROM incidents i JOIN sites s ON s.id = i.site_id ORDER BY i.step, i.id"
        ):
            record = json.loads(r["record_json"])
            rows.append(
                {
                    "id": r["id"],
                    "rank": r["rank"],
                    "local_rank": r["local_rank"],
                    "host": r["host"],
                    "device": r["device"],
                    "gpu_uuid": r["gpu_uuid"],
                    "site": r["site"],
                    "step": r["step"],
                    "evidence": record["evidence"],
                    "verdict": record["verdict"],
                }
            )
    rows.sort(key=lambda r: (r["step"], r["rank"], r["id"]))
    return rows


def read_warnings(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Rank-outlier warnings of all ranks (each rank stores those naming it, a disagreement that names
    no rank is stored by the lowest rank involved), ordered by step."""
    rows: list[dict[str, Any]] = []
    for db, conn in _each_rank(run_dir):
        for r in conn.execute(
            "SELECT e.step, e.message, e.data_json, s.name AS site FROM events e"
            " LEFT JOIN sites s ON s.id = e.site_id WHERE e.kind = 'rank_outlier' ORDER BY e.step, e.id"
        ):
            data = json.loads(r["data_json"]) if r["data_json"] else {}
            # "rank" is None for a disagreement that names no rank ("ranks" lists those involved)
            rows.append({"step": r["step"], "site": r["site"], "rank": data.get("rank", db.rank),
                         "ranks": data.get("ranks", [db.rank]), "message": r["message"], "data": data})  # fmt: skip
    rows.sort(key=lambda r: (r["step"], min(r["ranks"]) if r["rank"] is None else r["rank"]))
    return rows


def read_unattributed(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Corruptions proven but pinned on no device (collective checks without a majority), all ranks,
    ordered by step; `rank` is the rank whose check failed, not a device blamed."""
    rows: list[dict[str, Any]] = []
    for db, conn in _each_rank(run_dir):
        for r in conn.execute(
            "SELECT e.step, e.message, s.name AS site FROM events e"
            " LEFT JOIN sites s ON s.id = e.site_id WHERE e.kind = 'unattributed_sdc' ORDER BY e.step, e.id"
        ):
            rows.append({"step": r["step"], "site": r["site"], "rank": db.rank, "message": r["message"]})
    rows.sort(key=lambda r: (r["step"], r["rank"]))
    return rows


def read_verdict_counts(run_dir: str | os.PathLike) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, conn in _each_rank(run_dir):
        for kind, n in conn.execute("SELECT kind, COUNT(*) FROM verdicts GROUP BY kind"):
            counts[kind] = counts.get(kind, 0) + n
    return counts


def read_coverage(run_dir: str | os.PathLike) -> dict[str, Any]:
    """How much of the GEMM work was checked: over all steps and ranks, and the range per step."""
    total = checked = 0.0
    fractions: list[float] = []
    for _, conn in _each_rank(run_dir):
        if "gemm_flops" not in {row[1] for row in conn.execute("PRAGMA table_info(steps)")}:
            continue  # written before schema v3
        for gemm, done in conn.execute("SELECT gemm_flops, checked_flops FROM steps WHERE gemm_flops > 0"):
            total, checked = total + gemm, checked + done
            fractions.append(done / gemm)
    return {
        "steps": len(fractions),
        "checked_flops_fraction": checked / total if total else None,
        "per_step_min": min(fractions, default=None),
        "per_step_max": max(fractions, default=None),
    }


def read_study(path: str | os.PathLike) -> dict[str, Any]:
    """The study of a store: mode, config, summary (None until it finished) and its metric rows."""
    with reading(path) as conn:
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


# -- read-only readers: what `aegis report` reads --------------------------------------------------
@contextmanager
def reading_only(path: str | os.PathLike) -> Iterator[sqlite3.Connection]:
    """A reader in SQLite's read-only mode: it cannot change the store, even while the run still writes
    to it (committed steps in the WAL are read too). Refuses schemas it does not know."""
    path = Path(path)
    # the URI form: `?mode=ro` needs it; as_uri() percent-encodes names with '?' or '#'
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
    conn.row_factory = sqlite3.Row
    try:
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        except sqlite3.DatabaseError as error:  # not a database at all, or a damaged one
            raise StoreError(f"{path}: {error}") from error
        if version > SCHEMA_VERSION or version == 0:
            raise StoreError(f"{path} has schema version {version}; this aegis-sdc reads 1..{SCHEMA_VERSION}")
        yield conn
    finally:
        conn.close()


def _each_rank_read_only(run_dir: str | os.PathLike) -> Iterator[tuple[RankDatabase, sqlite3.Connection]]:
    return _each_rank(run_dir, reading_only)


def _loads(text: str | None) -> Any:
    return json.loads(text) if text else None


def read_runs(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Each rank's run row, by rank: identity, start, finish and summary (None while the run is in
    progress), configuration and versions. A store whose run row is not committed yet gives its rank
    with None everywhere else."""
    runs = []
    for db, conn in _each_rank_read_only(run_dir):
        found = conn.execute("SELECT * FROM run WHERE id = 1").fetchone()
        row = dict(found) if found else {}
        runs.append({
            "rank": db.rank, "path": str(db.path),
            **{key: row.get(key) for key in ("host", "local_rank", "world_size", "device", "gpu_uuid",
                                             "started_wall", "finished_wall")},
            "config": _loads(row.get("config_json")), "versions": _loads(row.get("versions_json")),
            "summary": _loads(row.get("summary_json")),
        })  # fmt: skip
    return runs


def read_step_totals(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Per step, summed over ranks: checks, alarms, verified vTasks, GEMM FLOPs and checked FLOPs
    (FLOPs are 0 in stores written before schema version 3), ordered by step."""
    totals: dict[int, dict[str, Any]] = {}
    for _, conn in _each_rank_read_only(run_dir):
        has_flops = "gemm_flops" in {row[1] for row in conn.execute("PRAGMA table_info(steps)")}
        flops = "gemm_flops, checked_flops" if has_flops else "0.0 AS gemm_flops, 0.0 AS checked_flops"
        for r in conn.execute(f"SELECT step, checks, alarms, verified, {flops} FROM steps"):
            total = totals.setdefault(r["step"], dict.fromkeys(r.keys(), 0) | {"step": r["step"]})
            for key in ("checks", "alarms", "verified", "gemm_flops", "checked_flops"):
                total[key] += r[key]
    return [totals[step] for step in sorted(totals)]


# The worst difference over its threshold of a (step, site) row, on either channel; None while the
# site calibrates (its threshold is then a loose worst-case bound) or when nothing was checked.
_RATIO = (
    "CASE WHEN t.calibrating = 0 AND t.checks > 0 THEN MAX(COALESCE(t.max_row / t.threshold_row, 0),"
    " COALESCE(t.max_col / t.threshold_col, 0)) END"
)


def read_site_summaries(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Per GEMM site and rank, over all steps: calls, checks, alarms, injected faults, non-finite
    inputs, steps calibrating, and the worst difference/threshold ratio after calibration with its
    step (None before any calibrated check)."""
    rows = []
    for db, conn in _each_rank_read_only(run_dir):
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


def read_site_series(run_dir: str | os.PathLike, wanted: Iterable[tuple[str, int]]) -> dict[tuple[str, int], list]:
    """The per-step rows of the wanted (site name, rank) pairs, ordered by step: largest row and column
    differences, thresholds, calibrating. Asked for a few pairs, so a large run stays cheap to read."""
    by_rank: dict[int, set[str]] = {}
    for name, rank in wanted:
        by_rank.setdefault(rank, set()).add(name)
    series: dict[tuple[str, int], list] = {(name, rank): [] for rank, names in by_rank.items() for name in names}
    for db in rank_databases(run_dir):
        names = sorted(by_rank.get(db.rank, ()))
        if not names:
            continue
        with reading_only(db.path) as conn:
            for r in conn.execute(
                "SELECT s.name AS site, t.step, t.checks, t.max_row, t.max_col, t.threshold_row, t.threshold_col,"
                " t.calibrating FROM step_stats t JOIN sites s ON s.id = t.site_id"
                f" WHERE s.name IN ({','.join('?' * len(names))}) ORDER BY t.step",
                names,
            ):
                series[(r["site"], db.rank)].append(dict(r))
    return series


def _rows_by_step(run_dir: str | os.PathLike, query: str) -> list[dict[str, Any]]:
    """The rows of `query` (which selects a `step` column) from every rank's store, each with its
    rank, ordered by step and rank."""
    rows = [dict(r) | {"rank": db.rank} for db, conn in _each_rank_read_only(run_dir) for r in conn.execute(query)]
    rows.sort(key=lambda r: (r["step"], r["rank"]))
    return rows


def read_nonfinite(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Checked calls whose inputs held NaN/Inf, per step, site and rank, ordered by step."""
    return _rows_by_step(
        run_dir,
        "SELECT t.step, s.name AS site, t.nonfinite FROM step_stats t JOIN sites s ON s.id = t.site_id"
        " WHERE t.nonfinite > 0 ORDER BY t.step, s.id",
    )


def read_events(run_dir: str | os.PathLike, kinds: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Events of all ranks (of the given kinds, else all), ordered by step; an event of no step
    (a configuration warning) comes first."""
    wanted = None if kinds is None else sorted(set(kinds))
    where = "" if wanted is None else f" WHERE e.kind IN ({','.join('?' * len(wanted))})"
    rows = []
    for db, conn in _each_rank_read_only(run_dir):
        for r in conn.execute(
            "SELECT e.step, e.kind, e.message, e.data_json, e.wall, s.name AS site FROM events e"
            f" LEFT JOIN sites s ON s.id = e.site_id{where} ORDER BY e.id",
            wanted or [],
        ):
            rows.append({"step": r["step"], "kind": r["kind"], "site": r["site"], "rank": db.rank,
                         "message": r["message"], "data": _loads(r["data_json"]), "wall": r["wall"]})  # fmt: skip
    rows.sort(key=lambda r: (-1 if r["step"] is None else r["step"], r["rank"]))
    return rows


def read_verdicts(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every verdict of all ranks with its vTask's site, step and channel, ordered by step."""
    return _rows_by_step(
        run_dir,
        "SELECT v.vtask_id, t.step, s.name AS site, t.channel, v.kind, v.wrong_execution, v.replay_ms,"
        " v.latency_steps, v.latency_ms, v.decided_step FROM verdicts v JOIN vtasks t ON t.id = v.vtask_id"
        " LEFT JOIN sites s ON s.id = t.site_id ORDER BY t.step, v.vtask_id",
    )
