"""The SQLite store: schema, WAL, versioning, merging ranks, and durability under SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
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
from aegis_sdc.store.sqlite import SCHEMA_VERSION, Store, StoreError, rank_db_path, read_incidents

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
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    assert store.conn.execute("SELECT message FROM events").fetchone()[0] == "written by version 1"
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
