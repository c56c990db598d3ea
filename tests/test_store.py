"""The SQLite store: schema, WAL, versioning, merging ranks, and durability under SIGKILL."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aegis_sdc.events import (
    Channel,
    Evidence,
    GemmKind,
    Incident,
    RankIdentity,
    Site,
    Tile,
    Verdict,
    VerdictKind,
    VTask,
    WrongExecution,
)
from aegis_sdc.store.sqlite import (
    SCHEMA_VERSION,
    RunStores,
    Store,
    StoreError,
    UnreadableStore,
    open_reader,
    rank_databases,
    rank_db_path,
    read_events,
    read_incidents,
    read_runs,
)

ROOT = Path(__file__).resolve().parents[1]


def write_incident(store: Store, incident_id: int, rank: int, step: int) -> None:
    site = Site(0, "layers.0.attn.wq", GemmKind.WGRAD)
    store.write_sites([site])
    evidence = Evidence(site, step, 0, Channel.COL, 80.0, 20.0, 5, 1e-4, Tile(0, 128, 128, 256), (Channel.COL,))
    verdict = Verdict(
        incident_id,
        site,
        step,
        VerdictKind.CONFIRMED_SDC,
        WrongExecution.ORIGINAL,
        mismatched_tiles=(Tile(0, 128, 128, 256),),
    )
    with store.transaction():
        store.write_vtask(VTask(incident_id, evidence, None))
        store.write_verdict(verdict, step)
        store.write_incident(
            Incident(
                incident_id,
                site,
                step,
                RankIdentity("host-a", rank=rank, device=f"cuda:{rank}", gpu_uuid=f"GPU-{rank}"),
                evidence,
                verdict,
            )
        )


def test_a_new_store_has_the_current_schema_in_wal_mode(tmp_path):
    store = Store(rank_db_path(tmp_path, 3))
    assert store.path.name == "aegis-rank00003.sqlite"
    conn = store.conn
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"run", "sites", "steps", "step_stats", "vtasks", "verdicts", "incidents", "events"} <= tables
    store.close()
    Store(store.path).close()  # reopening migrates nothing and keeps the data


def test_a_version_1_store_is_migrated_keeping_its_data(tmp_path):
    from aegis_sdc.store.sqlite import _SCHEMA_V1, read_study

    path = rank_db_path(tmp_path, 0)
    conn = sqlite3.connect(path)
    conn.executescript(f"{_SCHEMA_V1}\nPRAGMA user_version = 1;")
    conn.execute("INSERT INTO events (kind, message, wall) VALUES ('note', 'written by version 1', 0.0)")
    conn.execute("INSERT INTO steps (step, wall, checks, alarms, verified, backlog, verify_ms) VALUES (0,0,5,0,0,0,0)")
    conn.commit()
    conn.close()
    store = Store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 5
    assert store.conn.execute("SELECT message FROM events").fetchone()[0] == "written by version 1"
    # v5: a verdict names the incident whose fault it found again (none here)
    assert "same_fault_as" in {row[1] for row in store.conn.execute("PRAGMA table_info(verdicts)")}
    # v4: the checkpoints' certificates, none yet
    assert store.conn.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] == 0
    # v3: a step's GEMM FLOPs and checked FLOPs; steps written before are kept, with 0 for both
    assert tuple(store.conn.execute("SELECT checks, gemm_flops, checked_flops FROM steps").fetchone()) == (5, 0, 0)
    store.write_study("param-sync", {"steps": 1})
    store.write_study_metrics([(0, "all", "grad_deviation", 0.5), (0, "loss", "suspect", float("nan"))])
    store.close()
    study = read_study(path)
    assert study["mode"] == "param-sync" and study["summary"] is None
    assert study["rows"][0] == (0, "all", "grad_deviation", 0.5) and math.isnan(study["rows"][1][3])


def test_a_store_from_a_newer_version_is_refused_clearly(tmp_path):
    path = rank_db_path(tmp_path, 0)
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this aegis-sdc"):
        Store(path)


def test_incidents_of_all_ranks_are_merged(tmp_path):
    for rank, steps in ((0, (7,)), (1, (3, 9))):
        store = Store(rank_db_path(tmp_path, rank))
        for n, step in enumerate(steps, start=1):
            write_incident(store, n, rank, step)
        store.close()
    rows = read_incidents(tmp_path)
    assert [(r["step"], r["rank"]) for r in rows] == [(3, 1), (7, 0), (9, 1)]
    assert rows[0]["gpu_uuid"] == "GPU-1" and rows[0]["site"] == "layers.0.attn.wq:wgrad"
    assert rows[0]["verdict"]["mismatched_tiles"] == [
        {"row_start": 0, "row_stop": 128, "col_start": 128, "col_stop": 256}
    ]


def test_reading_a_directory_without_stores_fails_clearly(tmp_path):
    with pytest.raises(StoreError, match="no aegis store"):
        read_incidents(tmp_path)
    with pytest.raises(StoreError, match="not a directory"):
        read_incidents(tmp_path / "missing")


def test_sigkill_while_writing_loses_no_committed_incident(tmp_path):
    path = tmp_path / "aegis-rank00000.sqlite"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "store_writer.py"), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    committed = []
    try:
        for line in child.stdout:
            committed.append(int(line))
            if len(committed) >= 60:
                break
    finally:
        child.send_signal(signal.SIGKILL)  # mid-write: the child never stops writing on its own
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    stored = {r[0] for r in conn.execute("SELECT id FROM incidents")}
    assert set(committed) <= stored  # every incident whose COMMIT returned survived
    # Every stored incident is whole: its vTask and verdict were committed with it.
    orphans = conn.execute(
        "SELECT COUNT(*) FROM incidents i LEFT JOIN verdicts v ON v.vtask_id = i.vtask_id WHERE v.vtask_id IS NULL"
    ).fetchone()[0]
    assert orphans == 0
    conn.close()
    Store(path).close()  # the writer reopens it cleanly
    rows = read_incidents(tmp_path)
    assert len(rows) == len(stored) and json.dumps(rows)


def test_clean_step_rows_are_written_off_the_training_thread_and_incidents_before_it_goes_on(tmp_path, monkeypatch):
    # A clean step's rows go to the writer thread: record() returns while the (slowed) write runs.
    # A step with an incident returns only once it is committed. close() leaves nothing queued.
    import threading
    import time

    import torch
    from tests.helpers import guard_config

    import aegis_sdc as aegis
    from aegis_sdc.runtime.record import StepReport

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    guard = aegis.protect(model, config=guard_config(tmp_path))
    recorder, writes = guard.step_recorder, []
    slow = recorder.store.write_step_stats

    def write_step_stats(rows):
        time.sleep(0.3)
        writes.append(threading.current_thread().name)
        slow(rows)

    monkeypatch.setattr(recorder.store, "write_step_stats", write_step_stats)
    started = time.perf_counter()
    recorder.record(StepReport(step=7), [0], backlog=0)
    assert time.perf_counter() - started < 0.2 and writes == []  # queued, not written yet
    recorder.writer.drain()
    assert writes == ["aegis-store-writer"]
    site = guard.sensors[0].site
    evidence = Evidence(site, 8, 0, Channel.ROW, 80.0, 20.0, 5, 1e-4, Tile(0, 8, 0, 8), (Channel.ROW,))
    verdict = Verdict(1, site, 8, VerdictKind.CONFIRMED_SDC, WrongExecution.ORIGINAL)
    incident = Incident(1, site, 8, RankIdentity("host-a", rank=0, device="cpu"), evidence, verdict)
    started = time.perf_counter()
    report = StepReport(step=8, alarms=[VTask(1, evidence, None)], verdicts=[verdict], incidents=[incident])
    recorder.record(report, [0], backlog=0)
    assert time.perf_counter() - started >= 0.3 and len(writes) == 2  # committed before record() returned
    assert [i["step"] for i in read_incidents(tmp_path / "run")] == [8]
    recorder.record(StepReport(step=9), [0], backlog=0)
    guard.close()
    with sqlite3.connect(rank_db_path(tmp_path / "run", 0)) as conn:
        steps = {r[0] for r in conn.execute("SELECT step FROM steps")}
    assert {7, 8, 9} <= steps  # the last one written by the writer before close() returned


def test_a_script_that_ends_without_close_commits_what_it_queued(tmp_path):
    # The writer thread is a daemon: at interpreter exit it is drained (atexit), so the last steps of a
    # script that never calls Guard.close() are in the store.
    script = f"""
import torch, aegis_sdc as aegis
from tests.helpers import guard_config
from pathlib import Path
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
guard = aegis.protect(model, optimizer=optimizer, config=guard_config(Path({str(tmp_path)!r})))
slow = guard.store.write_step_stats
def write_step_stats(rows):
    import time; time.sleep(0.2); slow(rows)
guard.store.write_step_stats = write_step_stats
for _ in range(5):
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    with sqlite3.connect(rank_db_path(tmp_path / "run", 0)) as conn:
        steps = [r[0] for r in conn.execute("SELECT step FROM steps ORDER BY step")]
        stats = conn.execute("SELECT COUNT(DISTINCT step) FROM step_stats").fetchone()[0]
    assert steps == [0, 1, 2, 3, 4] and stats == 5


# -- reading an untrusted run directory: every file checked, none changed --------------------------------
def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of `directory` with its bytes and modification time, after setting those times (and
    the directory's) an hour back: a write, or a file created and deleted again, shows as a new time
    whatever the clock's resolution."""
    past = time.time() - 3600
    for path in (directory, *directory.iterdir()):
        os.utime(path, (past, past))
    return {".": (b"", directory.stat().st_mtime_ns)} | unchanged_since(directory)


def unchanged_since(directory: Path) -> dict[str, tuple[bytes, int]]:
    """What `snapshot` records, read again without touching the times."""
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}
    return {".": (b"", directory.stat().st_mtime_ns)} | files


def finished_store(path: Path, rank: int, step: int, events: int = 0) -> Path:
    """A closed store of `rank` with its run row, one incident at `step` and `events` long events."""
    store = Store(path)
    identity = {"host": "host-a", "rank": rank, "local_rank": rank, "world_size": 4, "device": f"cuda:{rank}"}
    store.write_run(identity, {}, {})
    write_incident(store, 1, rank, step)
    for n in range(events):  # pages enough to damage one in the middle and still read the incidents
        store.write_event("note", f"event {n} " + "x" * 200, step=n)
    store.close()
    return path


def damage_a_page(path: Path) -> None:
    """Overwrite the page in the middle of the file (a page of events: they were written last)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 4096 // 2 * 4096
    data[middle : middle + 4096] = bytes(range(256)) * 16
    path.write_bytes(data)


def test_readers_open_stores_read_only_and_change_no_file(tmp_path):
    finished_store(rank_db_path(tmp_path, 0), 0, 5)
    finished_store(rank_db_path(tmp_path, 1), 1, 3)
    before = snapshot(tmp_path)
    assert [(i["step"], i["rank"]) for i in read_incidents(tmp_path)] == [(3, 1), (5, 0)]
    assert [r["rank"] for r in read_runs(tmp_path)] == [0, 1] and read_events(tmp_path) == []
    with RunStores(tmp_path) as stores:
        read_incidents(stores)
    open_reader(rank_db_path(tmp_path, 0)).close()
    assert unchanged_since(tmp_path) == before  # same bytes and times, and no -wal/-shm created


def test_an_empty_file_is_not_a_store_and_stays_empty(tmp_path):
    empty = rank_db_path(tmp_path, 0)
    empty.touch()
    finished_store(rank_db_path(tmp_path, 1), 1, 3)
    before = snapshot(tmp_path)
    with pytest.raises(UnreadableStore, match="empty file"):
        open_reader(empty)
    with pytest.raises(StoreError, match=re.escape(f"{empty.name}: empty file")):
        read_incidents(tmp_path)
    with RunStores(tmp_path, strict=False) as stores:
        assert [i["rank"] for i in read_incidents(stores)] == [1]
    assert [(p.path, p.skipped) for p in stores.problems] == [(empty, True)]
    assert unchanged_since(tmp_path) == before and empty.read_bytes() == b""


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("truncated", "truncated"),
        ("foreign", "not an aegis store"),
        ("garbage", "not a SQLite database"),
        ("newer", "newer than this aegis-sdc"),
    ],
)
def test_a_corrupt_truncated_or_foreign_file_is_refused_by_name(tmp_path, damage, reason):
    path = rank_db_path(tmp_path, 0)
    if damage == "foreign":
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.close()
    elif damage == "garbage":
        path.write_bytes(b"not a database at all\n" * 200)
    else:
        finished_store(path, 0, 5, events=300)
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            with sqlite3.connect(path) as conn:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
            conn.close()
    with pytest.raises(UnreadableStore, match=reason) as refused:
        open_reader(path)
    assert refused.value.path == path and str(refused.value).startswith(str(path))


def test_a_page_damaged_store_is_read_with_a_warning(tmp_path):
    path = finished_store(rank_db_path(tmp_path, 0), 0, 5, events=400)
    damage_a_page(path)
    with pytest.raises(StoreError, match="damaged: PRAGMA quick_check"):
        read_incidents(tmp_path)
    with RunStores(tmp_path, strict=False) as stores:
        assert [i["step"] for i in read_incidents(stores)] == [5]  # its pages are intact
        read_events(stores)  # the damaged page holds events
    assert stores.problems and all(p.path == path and not p.skipped for p in stores.problems)
    assert "damaged: PRAGMA quick_check" in stores.problems[0].reason


def test_only_store_names_are_read_and_each_rank_once(tmp_path):
    finished_store(rank_db_path(tmp_path, 0), 0, 5)
    finished_store(rank_db_path(tmp_path, 1), 1, 3)
    shutil.copy(rank_db_path(tmp_path, 1), tmp_path / "aegis-rank1.sqlite")  # rank 1 under another name
    shutil.copy(rank_db_path(tmp_path, 0), rank_db_path(tmp_path, 2))  # rank 0 under rank 2's name
    skipped: list = []
    assert [db.rank for db in rank_databases(tmp_path, skipped)] == [0, 1, 2]
    assert [p.path.name for p in skipped] == ["aegis-rank1.sqlite"]
    with RunStores(tmp_path, strict=False) as stores:
        assert [db.rank for db in stores.databases] == [0, 1]
        assert [(i["step"], i["rank"]) for i in read_incidents(stores)] == [(3, 1), (5, 0)]
    problems = {p.path.name: p.reason for p in stores.problems}
    assert problems.keys() == {"aegis-rank1.sqlite", "aegis-rank00002.sqlite"}
    assert "aegis-rank00001.sqlite is" in problems["aegis-rank1.sqlite"]
    assert "holds rank 0 (its run row), as aegis-rank00000.sqlite does" in problems["aegis-rank00002.sqlite"]
    with pytest.raises(StoreError, match=r"aegis-rank1\.sqlite"):
        read_incidents(tmp_path)


def test_a_log_that_cannot_be_opened_read_only_is_read_around(tmp_path):
    # mode=ro needs the -wal and -shm files; when the WAL cannot be opened (a directory here, whatever the
    # permissions; a read-only directory after a crash in practice) the file itself is read, with a warning
    path = finished_store(rank_db_path(tmp_path, 0), 0, 5)
    (tmp_path / f"{path.name}-wal").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with RunStores(tmp_path, strict=False) as stores:
        assert [i["step"] for i in read_incidents(stores)] == [5]
    assert len(stores.problems) == 1 and "write-ahead log" in stores.problems[0].reason
    with pytest.raises(StoreError, match="cannot be opened read-only"):
        open_reader(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no -shm created


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")
def test_a_read_only_run_directory_is_read_without_writing(tmp_path):
    run_dir = tmp_path / "run"
    finished_store(rank_db_path(run_dir, 0), 0, 5)
    live = Store(rank_db_path(tmp_path / "live", 1))  # a writer killed mid-run: its WAL holds the incident
    write_incident(live, 1, 1, 3)
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(f"{live.path}{suffix}", f"{rank_db_path(run_dir, 1)}{suffix}")
    live.close()
    for path in run_dir.iterdir():
        path.chmod(0o444)
    run_dir.chmod(0o555)
    try:
        before = snapshot(run_dir)
        assert [(i["step"], i["rank"]) for i in read_incidents(run_dir)] == [(3, 1), (5, 0)]
        assert unchanged_since(run_dir) == before
    finally:
        run_dir.chmod(0o755)
