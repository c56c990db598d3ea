"""The command line: `aegis demo` end to end, and `aegis incidents` as a table and as JSON."""

import json

from typer.testing import CliRunner

from aegis_sdc.cli import app

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
