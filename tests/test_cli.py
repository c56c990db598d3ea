"""The command line: `aegis demo` end to end, and `aegis incidents` as a table and as JSON."""

import json
import os
import shutil
import sqlite3
import time

import pytest
from tests.test_store import damage_a_page, finished_store, snapshot, unchanged_since
from typer.testing import CliRunner

from aegis_sdc.cli import app
from aegis_sdc.store.sqlite import rank_db_path

runner = CliRunner(env={"COLUMNS": "200"})


def test_demo_confirms_the_injected_fault_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "demo"
    start = 20  # past the 16 calibration checks of every site; 20 steps of an intermittent fault
    result = runner.invoke(
        app,
        [
            "demo",
            "--steps",
            "40",
            "--fault-start",
            str(start),
            "--fault-probability",
            "0.2",
            "--run-dir",
            str(run_dir),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "INCIDENT" in result.output and "layers.1.mlp.up_proj:fwd" in result.output
    assert "Bad device:" in result.output
    assert (run_dir / "aegis-rank00000.sqlite").exists() and (run_dir / "site-differences.png").stat().st_size > 10_000
    assert (run_dir / "quarantine.jsonl").exists()

    listed = runner.invoke(app, ["incidents", str(run_dir), "--json"])
    assert listed.exit_code == 0
    report = json.loads(listed.output)
    assert report["incidents"] and all(i["site"] == "layers.1.mlp.up_proj:fwd" for i in report["incidents"])
    assert all(i["step"] >= start for i in report["incidents"])
    assert report["verdicts"]["confirmed_sdc"] == len(report["incidents"])
    # the demo checks every call on the CPU: all of every step's GEMM FLOPs
    assert report["coverage"]["checked_flops_fraction"] == 1.0 and report["coverage"]["steps"] > 0

    table = runner.invoke(app, ["incidents", str(run_dir)])
    assert table.exit_code == 0 and "confirmed incidents" in table.output and "original" in table.output
    assert "checked 100.0% of the GEMM FLOPs" in table.output


def test_demo_without_fault_confirms_nothing(tmp_path):
    run_dir = tmp_path / "clean"
    # 24 steps: past the 16 calibration checks of every site, then sampled checks with their thresholds
    result = runner.invoke(app, ["demo", "--steps", "24", "--no-fault", "--run-dir", str(run_dir), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "No confirmed silent data corruption" in result.output
    listed = json.loads(runner.invoke(app, ["incidents", str(run_dir), "--json"]).output)
    assert listed["incidents"] == [] and "confirmed_sdc" not in listed["verdicts"]


def test_incidents_of_a_missing_run_fail_with_a_message(tmp_path):
    result = runner.invoke(app, ["incidents", str(tmp_path)])
    assert result.exit_code == 2 and "no aegis store" in result.output


def test_bad_demo_options_are_rejected():
    result = runner.invoke(app, ["demo", "--steps", "0"])
    assert result.exit_code != 0 and "steps" in result.output


def _bad_invocations(afile):
    """(arguments, the option the usage error must name): each used to end in a traceback, or, for
    the study's run directory, in a refusal after minutes of training."""
    return [
        (["demo", "--fault-probability", "2"], "--fault-probability"),
        (["demo", "--fault-probability", "nan"], "--fault-probability"),
        (["demo", "--device", "cuda"], "--device"),
        (["demo", "--run-dir", str(afile)], "--run-dir"),
        (["demo", "--run-dir", str(afile / "sub")], "--run-dir"),
        (["demo", "--seed", str(2**63)], "--seed"),
        (["study", "--mode", "free-run", "--device", "cuda"], "--device"),
        (["study", "--mode", "free-run", "--suspect-device", "meta"], "--suspect-device"),
        (["study", "--mode", "free-run", "--suspect-device", "no-such-device"], "--suspect-device"),
        (["study", "--mode", "free-run", "--run-dir", str(afile)], "--run-dir"),
        (["study", "--mode", "sideways"], "--mode"),
        (["study", "--mode", "free-run", "--fault", "layers.0.*:fwd@bit=40,steps=3"], "--fault"),
        (["study", "--mode", "free-run", "--seq-len", "100000"], "--seq-len"),
        (["study", "--mode", "free-run", "--baseline-seed", "0"], "--baseline-seed"),
    ]


def test_bad_demo_and_study_options_are_usage_errors_before_any_work(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "no CUDA" on any machine
    monkeypatch.chdir(tmp_path)  # a run that started anyway would write aegis-runs/ here
    afile = tmp_path / "a-file"
    afile.write_text("not a directory")
    runner.invoke(app, ["study", "--mode", "sideways"])  # imports the study's modules once
    for args, option in _bad_invocations(afile):
        started = time.perf_counter()
        result = runner.invoke(app, args)
        elapsed = time.perf_counter() - started
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert f"Invalid value for '{option}'" in result.output and "Traceback" not in result.output, args
        assert elapsed < 0.5, (args, elapsed)  # the run directory's case took 97 s of training
    assert afile.read_text() == "not a directory" and not (tmp_path / "aegis-runs").exists()


# -- reading an untrusted run directory: `aegis incidents`, `aegis report` --------------------------------
def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def listed(result) -> list[tuple[int, int]]:
    """(rank, step) of each incident of an `aegis incidents --json` result."""
    return [(i["rank"], i["step"]) for i in json.loads(result.stdout)["incidents"]]


class TestReadingARunDirectory:
    """Whatever a run directory holds, the reading commands neither crash nor write into it: each bad
    file is named on stderr, the other stores are listed, and the exit status says what happened."""

    def test_corrupt_truncated_and_foreign_files_are_named_and_the_others_listed(self, tmp_path):
        finished_store(rank_db_path(tmp_path, 0), 0, 7)
        truncated = finished_store(rank_db_path(tmp_path, 1), 1, 9, events=300)
        truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
        foreign = rank_db_path(tmp_path, 2)
        with sqlite3.connect(foreign) as conn:
            conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.close()
        garbage = rank_db_path(tmp_path, 3)
        garbage.write_bytes(b"\x00 not a database " * 100)
        expected = {truncated: "truncated", foreign: "not an aegis store", garbage: "not a SQLite database"}
        for args in (("incidents", tmp_path), ("incidents", tmp_path, "--json")):
            result = invoke(*args)
            assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
            assert "Traceback" not in result.output
            errors = result.stderr.splitlines()
            for path, reason in expected.items():
                assert sum(line.startswith(f"error: {path}: {reason}") for line in errors) == 1, (path, errors)
        assert listed(result) == [(0, 7)]
        assert "layers.0.attn.wq:wgrad" in invoke("incidents", tmp_path).stdout
        only = tmp_path / "only-garbage"
        only.mkdir()
        shutil.copy(garbage, rank_db_path(only, 0))
        result = invoke("incidents", only)
        assert result.exit_code == 2 and "not a SQLite database" in result.stderr
        assert "no readable aegis store" in result.stderr and "Traceback" not in result.output

    def test_reading_changes_no_file_of_the_run_directory(self, tmp_path):
        run_dir = tmp_path / "run"
        finished_store(rank_db_path(run_dir, 0), 0, 7)
        finished_store(rank_db_path(run_dir, 1), 1, 3)
        before = snapshot(run_dir)
        result = invoke("incidents", run_dir, "--json")
        assert result.exit_code == 0 and listed(result) == [(1, 3), (0, 7)], result.output
        assert invoke("incidents", run_dir).exit_code == 0
        reported = invoke("report", run_dir, "--out", tmp_path / "page.html")
        assert reported.exit_code == 0, reported.output
        assert unchanged_since(run_dir) == before  # the same bytes and times; no -wal or -shm created

    @pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")
    def test_a_read_only_run_directory_is_listed(self, tmp_path):
        run_dir = tmp_path / "run"
        finished_store(rank_db_path(run_dir, 0), 0, 7)
        rank_db_path(run_dir, 0).chmod(0o444)
        run_dir.chmod(0o555)
        try:
            result = invoke("incidents", run_dir, "--json")
            assert result.exit_code == 0 and listed(result) == [(0, 7)], result.output
            refused = invoke("report", run_dir)  # its page would go into the run directory
            assert refused.exit_code == 2 and "cannot write the page" in refused.stderr
        finally:
            run_dir.chmod(0o755)

    def test_an_empty_file_is_not_a_store_and_stays_untouched(self, tmp_path):
        empty = rank_db_path(tmp_path, 0)
        empty.touch()
        written = empty.stat().st_mtime_ns
        finished_store(rank_db_path(tmp_path, 1), 1, 3)
        result = invoke("incidents", tmp_path, "--json")
        assert result.exit_code == 1 and listed(result) == [(1, 3)], result.output
        assert f"error: {empty}: empty file (0 bytes): not an aegis store" in result.stderr
        assert empty.read_bytes() == b"" and empty.stat().st_mtime_ns == written
        assert sorted(p.name for p in tmp_path.iterdir()) == [empty.name, rank_db_path(tmp_path, 1).name]

    def test_a_page_damaged_store_is_listed_with_a_warning(self, tmp_path):
        path = finished_store(rank_db_path(tmp_path, 0), 0, 7, events=400)
        damage_a_page(path)
        result = invoke("incidents", tmp_path, "--json")
        assert result.exit_code == 1 and listed(result) == [(0, 7)], result.output
        assert f"warning: {path}: damaged: PRAGMA quick_check" in result.stderr
        table = invoke("incidents", tmp_path)
        assert table.exit_code == 1 and "1 confirmed" in table.stdout and "damaged" in table.stderr

    def test_one_rank_under_two_names_is_listed_once(self, tmp_path):
        finished_store(rank_db_path(tmp_path, 0), 0, 7)
        finished_store(rank_db_path(tmp_path, 1), 1, 3)
        shutil.copy(rank_db_path(tmp_path, 1), tmp_path / "aegis-rank1.sqlite")
        shutil.copy(rank_db_path(tmp_path, 0), rank_db_path(tmp_path, 2))  # a copy of rank 0 as rank 2
        result = invoke("incidents", tmp_path, "--json")
        assert result.exit_code == 1 and listed(result) == [(1, 3), (0, 7)], result.output
        assert f"error: {tmp_path / 'aegis-rank1.sqlite'}: not a store's name" in result.stderr
        assert f"error: {rank_db_path(tmp_path, 2)}: holds rank 0 (its run row)" in result.stderr

    def test_stored_strings_reach_the_terminal_and_the_page_as_plain_text(self, tmp_path):
        path = finished_store(rank_db_path(tmp_path, 0), 0, 7)
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE sites SET name = ?", ("[/x]<b>\x1b[31mred",))
            conn.execute("UPDATE incidents SET host = ?", ("host\x1b]0;owned\x07",))
            conn.execute(
                "INSERT INTO events (step, kind, message, data_json, wall) VALUES (7, 'rank_outlier', ?, ?, 0)",
                ("[bold red]outlier[/] :thumbs_up: \x1b[2J", json.dumps({"rank": 0})),
            )
        conn.close()
        result = invoke("incidents", tmp_path)
        assert result.exit_code == 0, (result.output, result.exception)
        assert "\x1b" not in result.output and "\x07" not in result.output
        assert "[/x]<b>\\x1b[31mred" in result.stdout and "host\\x1b]0;owned\\x07" in result.stdout
        assert "[bold red]outlier[/] :thumbs_up: \\x1b[2J" in result.stdout
        page = tmp_path / "page.html"
        assert invoke("report", tmp_path, "--out", page).exit_code == 0
        html = page.read_text(encoding="utf-8")
        assert "[/x]<b>" not in html and "[/x]&lt;b&gt;" in html  # jinja2 autoescape
