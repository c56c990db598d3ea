"""The library never takes training down, never loses a verdict, never trusts a path: run directories
shared by guards, a full disk, kills at random moments, planted links, storms (docs/operations.md)."""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing as mp
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from tests import reliability_workers
from tests.helpers import guard_config, small_workload, train

import aegis_sdc as aegis
from aegis_sdc.bounded import BoundedLog
from aegis_sdc.events import Site, StateKind, Verdict, VerdictKind
from aegis_sdc.response.console import BURST, PER_MINUTE, RateLimiter, StepConsole
from aegis_sdc.response.quarantine import append_quarantine, read_quarantine
from aegis_sdc.runtime.record import StoreWriter
from aegis_sdc.store.sqlite import Store, StoreError, StoreInUseError, rank_db_path, read_incidents

ROOT = Path(__file__).resolve().parents[1]
SITE = "layers.0.attn.wq:fwd"


def fault(*steps: int) -> aegis.FaultSpec:
    return aegis.FaultSpec(site=SITE, model="bitflip", bit=30, steps=steps)


def stored_incident_ids(run_dir: Path) -> list[tuple[int, str, int]]:
    return [(r["id"], r["site"], r["step"]) for r in read_incidents(run_dir)]


# -- 1. run directories shared by guards --------------------------------------------------------
def test_two_guards_in_one_process_on_the_default_run_directory_each_get_a_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AEGIS_RUN_ID", "shared")
    guards, models = [], []
    for seed in (0, 1):
        model, data, optimizer = small_workload(seed)
        config = aegis.GuardConfig(faults=(fault(4),), response=aegis.ResponseConfig(policy="warn"))
        guards.append(aegis.protect(model, optimizer=optimizer, config=config))
        models.append((model, data, optimizer))
    for model, data, optimizer in models:  # both alarm, verify and commit at step 4: no id collides
        train(model, data, optimizer, 6)
    for guard in guards:
        guard.close()
    assert [g.run_dir for g in guards] == [Path("aegis-runs/shared"), Path("aegis-runs/shared-2")]
    for guard in guards:
        assert [(i.site.name, i.step) for i in guard.incidents] == [(SITE, 4)]
        assert [(site, step) for _, site, step in stored_incident_ids(guard.run_dir)] == [(SITE, 4)]


def test_a_run_id_from_the_clock_names_one_run_and_one_from_the_environment_resumes(tmp_path, monkeypatch):
    # Two guards one after the other in the same second (a sweep in one process, a test suite): the
    # second must not write into the first's store (its steps, incidents, quarantine list). Under a
    # job's own run id the restarted guard writes on in the job's directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AEGIS_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(aegis.config.time, "strftime", lambda _: "run-same-second")

    def protected_run() -> Path:
        model, data, optimizer = small_workload()
        guard = aegis.protect(model, optimizer=optimizer, config=aegis.GuardConfig())
        train(model, data, optimizer, 2)
        guard.close()
        return guard.run_dir

    assert [protected_run(), protected_run()] == [Path("aegis-runs/run-same-second"),
                                                  Path("aegis-runs/run-same-second-2")]  # fmt: skip
    monkeypatch.setenv("AEGIS_RUN_ID", "job-7")
    assert [protected_run(), protected_run()] == [Path("aegis-runs/job-7")] * 2


def test_a_guard_writing_on_where_another_wrote_other_sites_loses_no_record(tmp_path, caplog):
    # The store keeps a site's row by name: the second guard (every Linear, its sites numbered
    # otherwise than the first's MLP-only ones) once replaced rows the first guard's records
    # referenced — "FOREIGN KEY constraint failed", and every record of its run lost.
    up_proj = "layers.0.mlp.up_proj:fwd"
    model, data, optimizer = small_workload()
    first_fault = aegis.FaultSpec(site=up_proj, model="bitflip", bit=30, steps=(3,))
    config = guard_config(tmp_path, include=("*mlp*",), faults=(first_fault,))
    first = aegis.protect(model, optimizer=optimizer, config=config)
    train(model, data, optimizer, 5)
    first.close()
    model, data, optimizer = small_workload(1)
    second = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(fault(4),)))
    with caplog.at_level(logging.WARNING, logger="aegis_sdc"):
        train(model, data, optimizer, 6)
        second.close()
    assert "could not be written" not in caplog.text and "cannot be written" not in caplog.text
    run_dir = tmp_path / "run"
    assert stored_incident_ids(run_dir) == [(1, up_proj, 3), (2, SITE, 4)]
    with sqlite3.connect(rank_db_path(run_dir, 0)) as db:
        calls = dict(db.execute("SELECT s.name, SUM(t.calls) FROM step_stats t JOIN sites s ON s.id = t.site_id"
                                " GROUP BY s.name").fetchall())  # fmt: skip
    assert calls[up_proj] == 5 + 6 and calls[SITE] == 6  # every call of both guards, under its own name


def test_a_named_run_directory_in_use_is_refused_at_protect_and_free_again_after_close(tmp_path):
    model, _, optimizer = small_workload()
    first = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    other, _, other_optimizer = small_workload(1)
    with pytest.raises(StoreInUseError, match=f"pid {os.getpid()}.*own run directory"):
        aegis.protect(other, optimizer=other_optimizer, config=guard_config(tmp_path))
    # the failed protect() left the model as it was
    assert all(type(m) is torch.nn.Linear for m in other.modules() if isinstance(m, torch.nn.Linear))
    first.close()
    aegis.protect(other, optimizer=other_optimizer, config=guard_config(tmp_path)).close()


def test_a_second_process_on_the_same_rank_store_is_refused_clearly(tmp_path):
    path = rank_db_path(tmp_path, 0)
    holder = Store(path, lock=True)
    try:
        code = (
            "import sys\nfrom aegis_sdc.store.sqlite import Store, StoreInUseError\n"
            f"try:\n    Store({str(path)!r}, lock=True)\nexcept StoreInUseError as e:\n    print(e); sys.exit(3)\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))  # fmt: skip
        assert done.returncode == 3, done.stderr
        assert f"pid {os.getpid()}" in done.stdout and "being written by another guard" in done.stdout
    finally:
        holder.close()


# -- 2. a full disk ------------------------------------------------------------------------------
@pytest.fixture
def small_filesystem(tmp_path):
    """A 16 MiB tmpfs of the test's own (needs the right to mount: skipped elsewhere)."""
    mount = tmp_path / "fs"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system of `directory` to the last byte; the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        for size in (1 << 16, 1):
            try:
                while f.write(b"\0" * size):
                    pass
            except OSError:
                pass
    return filler


def test_a_full_disk_never_stops_training_and_loses_nothing_once_space_returns(small_filesystem, caplog):
    caplog.set_level(logging.WARNING, logger="aegis_sdc")
    run_dir = small_filesystem / "run"
    model, data, optimizer = small_workload()
    config = aegis.GuardConfig(run_dir=str(run_dir), faults=(fault(8, 10),),
                               response=aegis.ResponseConfig(policy="warn"))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    train(model, data, optimizer, 6)
    filler = fill(small_filesystem)
    train(model, data, optimizer, 6)  # steps 6–11 on a full disk: two incidents, their commits fail
    assert [(i.site.name, i.step) for i in guard.incidents] == [(SITE, 8), (SITE, 10)]
    assert guard.step_recorder.writer.waiting > 0
    text = caplog.text
    assert "cannot be written" in text and "confirmed SDC at layers.0.attn.wq:fwd, step 8" in text
    assert "the quarantine list" in text  # its entries wait too
    filler.unlink()  # space returns: the next step after the retry interval writes everything that waited
    time.sleep(StoreWriter.RETRY_S)
    train(model, data, optimizer, 2)
    guard.step_recorder.writer.drain()
    assert guard.step_recorder.writer.waiting == 0
    guard.close()
    stored = stored_incident_ids(run_dir)
    assert [(site, step) for _, site, step in stored] == [(SITE, 8), (SITE, 10)]
    assert sorted(row[0] for row in stored) == sorted(i.id for i in guard.incidents)
    with sqlite3.connect(rank_db_path(run_dir, 0)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        steps = [r[0] for r in conn.execute("SELECT step FROM steps ORDER BY step")]
        assert conn.execute("SELECT summary_json FROM run").fetchone()[0] is not None
    assert steps[:14] == list(range(14))  # every step's row, the full-disk steps included (14: close's flush)
    (entry,) = read_quarantine(run_dir / "quarantine.jsonl")
    assert entry["step"] == 8 and entry["rank"] == 0


def test_an_unwritable_quarantine_path_never_stops_training(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="aegis_sdc")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the list's directory should be")
    response = aegis.ResponseConfig(policy="warn", quarantine_path=str(blocker / "quarantine.jsonl"))
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(fault(4),),
                                                                           response=response))  # fmt: skip
    train(model, data, optimizer, 6)
    guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(SITE, 4)]
    assert "the quarantine list" in caplog.text and "cannot be written" in caplog.text
    assert guard.responder.pending_quarantine  # still waiting: never dropped, never raised


# -- 3. kills ------------------------------------------------------------------------------------
@functools.cache
def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "aegis_sdc", "tests.reliability_workers"])
    return ctx


def reopen(run_dir: Path) -> None:
    """What a restarted job does: protect again on the same run directory (the list is rebuilt)."""
    model, _, optimizer = small_workload()
    aegis.protect(model, optimizer=optimizer, config=aegis.GuardConfig(run_dir=str(run_dir))).close()


def assert_consistent(run_dir: Path, announced: set[int]) -> None:
    with sqlite3.connect(rank_db_path(run_dir, 0)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    stored = {row[0] for row in stored_incident_ids(run_dir)}
    assert announced <= stored  # every incident announced after its commit survived the kill
    listed = read_quarantine(run_dir / "quarantine.jsonl")
    assert bool(listed) == bool(stored)  # the device is listed iff it has an incident
    assert len(listed) <= 1 and all(e["rank"] == 0 and e["device"] == "cpu" for e in listed)
    leftovers = [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers, leftovers


def test_a_kill_between_the_incident_commit_and_the_quarantine_write_is_repaired_on_restart(tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "log"
    child = _context().Process(target=reliability_workers.killed_before_quarantine, args=(str(run_dir), str(log)))
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL and log.read_text() == "1\n"
    (tmp_path / "run" / ".quarantine.jsonl.12345.tmp").write_text('{"torn')  # an older writer's leftover
    assert stored_incident_ids(run_dir) and not read_quarantine(run_dir / "quarantine.jsonl")
    reopen(run_dir)
    assert_consistent(run_dir, set())
    (entry,) = read_quarantine(run_dir / "quarantine.jsonl")
    assert (entry["site"], entry["step"]) == (SITE, reliability_workers.FIRST_FAULT_STEP)


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_no_incident_and_leaves_no_torn_file(tmp_path):
    run_dir = tmp_path / "run"
    rng = random.Random(20)
    announced: set[int] = set()
    kills = 0
    for trial in range(20):
        log = tmp_path / f"incidents{trial}"
        child = _context().Process(target=reliability_workers.train_until_killed, args=(str(run_dir), str(log)))
        child.start()
        deadline = time.monotonic() + 60
        while not (log.exists() and log.stat().st_size) and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the first incident: the loop is confirming by then
        time.sleep(rng.uniform(0.0, 0.5))
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        kills += child.exitcode == -signal.SIGKILL
        announced |= {int(line) for line in log.read_text().split()}
        reopen(run_dir)  # the restart: rebuilds the list, cleans what a killed writer left
        assert_consistent(run_dir, announced)
    assert kills == 20 and len(announced) >= 20


# -- 4. paths nobody should trust ----------------------------------------------------------------
def test_the_quarantine_writer_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    shared = tmp_path / "shared"
    shared.mkdir()
    path = shared / "quarantine.jsonl"
    # an old predictable temporary name, pointing at the victim: removed as a leftover, never written
    (shared / f".quarantine.jsonl.{os.getpid()}.tmp").symlink_to(victim)
    append_quarantine(path, [{"host": "a", "gpu_uuid": "GPU-1"}])
    assert victim.read_text() == "precious\n" and read_quarantine(path) == [{"host": "a", "gpu_uuid": "GPU-1"}]
    for planted in (path.with_name("quarantine.jsonl.lock"), path):  # the lock, then the list itself
        planted.unlink()
        planted.symlink_to(victim)
        with pytest.raises(OSError):
            append_quarantine(path, [{"host": "b"}])
        assert victim.read_text() == "precious\n"
        planted.unlink()
        if planted == path:
            continue
        append_quarantine(path, [{"host": "c"}])  # once the link is gone, the list is written again


HOSTILE_IDS = [
    ("AEGIS_RUN_ID", "../../x"),
    ("AEGIS_RUN_ID", "/etc/x"),
    ("TORCHELASTIC_RUN_ID", "a/../../b"),
    ("AEGIS_RUN_ID", ".."),
]


@pytest.mark.parametrize(("variable", "run_id"), HOSTILE_IDS)
def test_a_run_id_from_the_environment_never_leaves_the_runs_directory(variable, run_id, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AEGIS_RUN_ID", raising=False)
    monkeypatch.setenv(variable, run_id)
    model, _, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer)
    guard.close()
    runs = (tmp_path / "aegis-runs").resolve()
    assert guard.run_dir.resolve().parent == runs
    assert [p.name for p in tmp_path.iterdir()] == ["aegis-runs"]


# -- 7. bounded memory and logs ------------------------------------------------------------------
def test_a_bounded_log_keeps_the_latest_and_counts_the_rest():
    log = BoundedLog(3)
    log.extend(range(5))
    assert list(log) == [2, 3, 4] and log.total == 5 and log.dropped == 2 and log[-1] == 4
    assert log.since(3) == [3, 4] and log.since(0) == [2, 3, 4] and log.since(5) == []
    assert log == [2, 3, 4] and log != []
    assert log[-2:] == [3, 4] and log[:1] == [2] and log[::-1] == [4, 3, 2]  # slices, as the list it replaces


def test_a_storm_keeps_memory_bounded_the_counts_whole_and_the_console_rate_limited(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("aegis_sdc.bounded.RECORDS_KEPT", 4)
    monkeypatch.setattr("aegis_sdc.response.evidence.MAX_EVIDENCE_FILES", 3)
    caplog.set_level(logging.INFO, logger="aegis_sdc")
    storm = aegis.FaultSpec(site=SITE, model="bitflip", bit=27, steps=range(2, 30))
    model, data, optimizer = small_workload()
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(storm,)))
        train(model, data, optimizer, 30)
        guard.close()
    refilled = PER_MINUTE * (time.monotonic() - started) / 60.0  # lines the bucket regained meanwhile
    summary = guard.summary()
    stored = stored_incident_ids(tmp_path / "run")
    assert summary.faults_injected == 28 and len(guard.injector.log) == 4 and guard.injector.log.total == 28
    assert summary.confirmed == guard.incidents.total == len(stored) >= 24  # the store has every one
    assert len(guard.incidents) == 4 and [i.id for i in guard.incidents] == [row[0] for row in stored[-4:]]
    assert summary.records_dropped_from_memory == (summary.confirmed - 4) + (28 - 4)
    assert len(list((tmp_path / "run" / "evidence").glob("*.json"))) == 3  # the disk is bounded too
    assert guard.evidence_budget.skipped == summary.confirmed - 3
    # the console's lines (one-time notes elsewhere, such as the evidence files' limit, are not its)
    lines = [r for r in caplog.records if r.name == "aegis_sdc" and r.levelno >= logging.WARNING
             and r.pathname.endswith("console.py")]  # fmt: skip
    # 28 steps with an incident each: 56 lines (the incident, the step's summary) unlimited
    assert BURST <= len(lines) <= BURST + refilled + 1 < 2 * summary.confirmed, (len(lines), refilled)
    assert "held back by the rate limit" in lines[-1].getMessage()  # said at close
    assert summary.console_lines_held_back >= 2 * summary.confirmed - len(lines)
    sdc_warnings = [w for w in caught if issubclass(w.category, aegis.SilentDataCorruptionWarning)]
    assert BURST <= len(sdc_warnings) <= BURST + refilled + 1


def test_the_rate_limit_refills_and_says_what_it_held_back():
    now = [0.0]
    limiter = RateLimiter(burst=2, per_minute=60.0, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(5)] == [True, True, False, False, False]
    now[0] += 1.0  # one line a second
    assert limiter.allow() and "3 earlier console lines held back" in limiter.take_suppressed()
    assert limiter.take_suppressed() == ""


def test_every_verdict_kind_reaches_the_console(caplog):
    caplog.set_level(logging.INFO, logger="aegis_sdc")
    site = Site(0, "layers.0.mlp.up_proj", StateKind.PARAM)
    verdicts = [Verdict(i, site, 7, kind) for i, kind in enumerate(VerdictKind)]
    StepConsole().step(7, verdicts, [], alarms=len(verdicts), outlier_warnings=2)
    (line,) = [r.getMessage() for r in caplog.records]
    for words in ("confirmed SDC", "no device is blamed", "not verifiable", "not deterministic",
                  "NaN/Inf input", "false alarm", "2 rank-outlier warnings", "step 7"):  # fmt: skip
        assert words in line, (words, line)
    assert caplog.records[0].levelno == logging.ERROR
    caplog.clear()
    twice = [
        Verdict(i, site, 8, kind) for kind in (VerdictKind.NONFINITE_INPUT, VerdictKind.UNATTRIBUTED) for i in (1, 2)
    ]
    StepConsole().step(8, twice, [], alarms=4, outlier_warnings=0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "2 NaN/Inf inputs (from the data)" in line and "2 corruptions no device is blamed for" in line


def test_nonfinite_inputs_after_a_confirmed_sdc_are_not_blamed_on_the_data(caplog):
    from aegis_sdc.runtime.step import _log_nonfinite_inputs

    caplog.set_level(logging.INFO, logger="aegis_sdc")
    site = Site(0, "layers.0.mlp.up_proj", StateKind.PARAM)
    verdicts = [Verdict(0, site, 6, VerdictKind.NONFINITE_INPUT)]
    _log_nonfinite_inputs(StepConsole(), verdicts, None)
    _log_nonfinite_inputs(StepConsole(), verdicts, 5)
    before, after = (r.getMessage() for r in caplog.records)
    assert "from the data, not the device" in before
    assert "after the confirmed SDC of step 5" in after and "from the data" not in after


def test_a_loop_without_a_step_boundary_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr("aegis_sdc.guard.NO_BOUNDARY_FORWARDS", 4)
    model, data, _ = small_workload()
    guard = aegis.protect(model, config=guard_config(tmp_path))
    with torch.no_grad():  # inference is no training loop: never counted
        for _ in range(5):
            model(data.batch()[0])
    assert not guard._warned_no_boundary
    with pytest.warns(UserWarning, match="4 forward passes with gradients and no step boundary yet"):
        for _ in range(4):
            inputs, targets = data.batch()
            torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    guard.close()


# -- 8. the user's exception stays the user's ------------------------------------------------------
def test_a_with_block_under_the_raise_policy_keeps_the_users_exception(tmp_path):
    model, data, _ = small_workload()
    config = guard_config(tmp_path, faults=(fault(0),), response=aegis.ResponseConfig(policy="raise"))
    with pytest.raises(KeyError, match="the user's own") as raised, aegis.protect(model, config=config) as guard:
        model(data.batch()[0])  # the fault strikes; its verdict comes at close
        raise KeyError("the user's own")
    assert guard.summary().confirmed == 1
    assert any("confirmed SDC" in note for note in raised.value.__notes__)
    assert [(site, step) for _, site, step in stored_incident_ids(tmp_path / "run")] == [(SITE, 0)]
    # without an exception of the user's, the policy raises as always
    with pytest.raises(aegis.SilentDataCorruptionError), aegis.protect(model, config=config):
        model(data.batch()[0])
    json.dumps(raised.value.__notes__)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "pages_zeroed"])
def test_protect_on_a_damaged_store_names_the_file(tmp_path, damage):
    run = tmp_path / "run"
    store = Store(rank_db_path(run, 0), lock=True)
    store.close()
    path = rank_db_path(run, 0)
    data = path.read_bytes()
    if damage == "pages_zeroed":  # the header and schema page intact, the tables' pages zeroed: found
        page = int.from_bytes(data[16:18], "big")  # by the first reads past the opening, not by it
        damaged = data[:page] + bytes(len(data) - page)
    else:
        damaged = b"not a database at all" * 100 if damage == "garbage" else data[:200]
    path.write_bytes(damaged)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(StoreError, match=f"{path.name} is not a readable aegis store"):
        aegis.protect(model, config=aegis.GuardConfig(run_dir=str(run)))
    assert type(model[0]) is torch.nn.Linear  # left as it was


def test_a_run_dir_that_is_a_file_is_named(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(StoreError, match="is a file, not a directory"):
        aegis.protect(torch.nn.Sequential(torch.nn.Linear(8, 8)), config=aegis.GuardConfig(run_dir=str(afile)))
    assert afile.read_text() == "mine"


def test_a_run_dir_that_cannot_be_made_is_named(tmp_path):
    # below a file (no directory can be made there; the same error as a permission refused, which
    # root, the CI's user, never meets): a StoreError naming the directory, not a raw OSError
    afile = tmp_path / "afile"
    afile.write_text("mine")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(StoreError, match=f"cannot write the run directory {afile / 'run'}"):
        aegis.protect(model, config=aegis.GuardConfig(run_dir=str(afile / "run")))
    assert type(model[0]) is torch.nn.Linear and afile.read_text() == "mine"
