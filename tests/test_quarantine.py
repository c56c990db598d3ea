"""The quarantine list: JSON lines, written atomically, shared safely between processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import re
import shutil
from pathlib import Path

import pytest
from tests.helpers import guard_config, small_workload, train
from typer.testing import CliRunner

import aegis_sdc as aegis
from aegis_sdc.cli import app
from aegis_sdc.response.quarantine import append_quarantine, is_safe_host, label_value, read_quarantine
from aegis_sdc.store.sqlite import Store, rank_db_path, read_incidents


def _append_many(path: str, worker: int) -> None:
    for i in range(25):
        append_quarantine(path, [{"host": f"h{worker}", "rank": worker, "n": i, "pad": "x" * 500}])


def test_entries_are_json_lines(tmp_path):
    path = tmp_path / "q.jsonl"
    append_quarantine(path, [{"host": "a", "gpu_uuid": "GPU-1"}])
    append_quarantine(path, [{"host": "b", "gpu_uuid": None}])
    assert [e["host"] for e in read_quarantine(path)] == ["a", "b"]
    assert all(json.loads(line) for line in path.read_text().splitlines())
    assert read_quarantine(tmp_path / "absent.jsonl") == []


def test_concurrent_writers_never_lose_or_tear_a_line(tmp_path):
    path = str(tmp_path / "q.jsonl")
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_append_many, args=(path, w)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    entries = read_quarantine(path)  # json.loads of every line: a torn line would raise
    assert sorted((e["rank"], e["n"]) for e in entries) == [(w, i) for w in range(4) for i in range(25)]
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


# -- `aegis quarantine`: what a scheduler consumes ---------------------------------------------------------
SITE = "layers.0.attn.wq:fwd"
HOSTILE = ("h;rm -rf /", "$(x)", "-n", "node\x1b[31m")
runner = CliRunner()


def quarantine(run_dir: Path, *options: str):
    return runner.invoke(app, ["quarantine", str(run_dir), *options])


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory) -> Path:
    """A protected training whose wq forward GEMM is corrupted at step 4: one confirmed incident."""
    tmp = tmp_path_factory.mktemp("faulty")
    model, data, optimizer = small_workload()
    spec = aegis.FaultSpec(site=SITE, model="bitflip", bit=30, steps=(4,))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp, faults=(spec,)))
    try:
        train(model, data, optimizer, 6)
    finally:
        guard.close()
    assert [(i.site.name, i.step) for i in guard.incidents] == [(SITE, 4)]
    return tmp / "run"


@pytest.fixture
def run(faulty_run, tmp_path) -> Path:
    """A copy of the faulty run, to change."""
    return Path(shutil.copytree(faulty_run, tmp_path / "run"))


def stored_device(run_dir: Path) -> dict:
    (incident,) = read_incidents(run_dir)
    return incident


def test_every_format_names_the_faulty_device(run):
    incident = stored_device(run)
    host = incident["host"]
    assert is_safe_host(host) and incident["device"] == "cpu"  # this machine's name can be printed
    assert (run / "quarantine.jsonl").exists()
    result = quarantine(run)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["run_dir"] == str(run) and document["hosts"] == [host] and document["problems"] == []
    (device,) = document["devices"]
    assert (device["host"], device["device"], device["site"], device["step"]) == (host, "cpu", SITE, 4)
    assert device["incidents"] == 1 and device["listed"] is True and device["incident_id"] == incident["id"]
    assert "note" not in result.stderr
    slurm = quarantine(run, "--format", "slurm-exclude")
    assert slurm.exit_code == 0 and slurm.stdout == f"{host}\n", slurm.output
    k8s = quarantine(run, "--format", "k8s")
    assert k8s.exit_code == 0, k8s.output
    assert k8s.stdout.splitlines() == [
        f"kubectl taint nodes {host} aegis-sdc/sdc=cpu:NoSchedule --overwrite",
        f"kubectl label nodes {host} aegis-sdc/quarantined=true --overwrite",
    ]


def test_a_store_incident_missing_from_the_list_is_included_and_noted(run):
    (run / "quarantine.jsonl").unlink()  # killed between the incident's commit and the list's write
    host = stored_device(run)["host"]
    result = quarantine(run)
    assert result.exit_code == 0, result.output
    (device,) = json.loads(result.stdout)["devices"]
    assert (device["host"], device["step"], device["listed"]) == (host, 4, False)
    assert "is in the stores but not in the quarantine list" in result.stderr
    slurm = quarantine(run, "--format", "slurm-exclude")
    assert slurm.exit_code == 0 and slurm.stdout == f"{host}\n", slurm.output


def test_the_list_and_the_stores_are_merged_one_entry_per_device(run):
    host = stored_device(run)["host"]
    (listed,) = read_quarantine(run / "quarantine.jsonl")
    later = dict(listed, incident_id=listed["incident_id"] + 100, step=9)  # a second incident, list only
    other = dict(listed, host="node-7", device="cuda:0", gpu_uuid=None, step=2, incident_id=1, rank=3)
    append_quarantine(run / "quarantine.jsonl", [later, other])
    result = quarantine(run)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    summary = [(d["host"], d["device"], d["step"], d["incidents"]) for d in document["devices"]]
    assert summary == [("node-7", "cuda:0", 2, 1), (host, "cpu", 4, 2)]
    assert document["hosts"] == sorted([host, "node-7"])


def test_a_hostile_host_name_is_refused_and_never_printed(run):
    host = stored_device(run)["host"]
    entries = [{"host": name, "gpu_uuid": f"GPU-{n}", "device": "cuda:0", "step": 7, "site": SITE}
               for n, name in enumerate(HOSTILE)]  # fmt: skip
    append_quarantine(run / "quarantine.jsonl", entries)
    for fmt in ("slurm-exclude", "k8s"):
        result = quarantine(run, "--format", fmt)
        assert result.exit_code == 1, (fmt, result.output)
        assert host in result.stdout  # the safe host is still drained
        for name in HOSTILE:
            assert name not in result.stdout and "rm -rf" not in result.stdout and "$(" not in result.stdout
        assert "\x1b" not in result.stdout + result.stderr  # not even on stderr: shown as an escape
        assert "error: host name 'h;rm -rf /' refused" in result.stderr
        assert "'$(x)' refused" in result.stderr and "'-n' refused" in result.stderr
        assert "'node\\x1b[31m' refused" in result.stderr
    result = quarantine(run)  # JSON quotes what it holds: nothing is refused there
    assert result.exit_code == 0, result.output
    assert set(HOSTILE) < set(json.loads(result.stdout)["hosts"])


def test_k8s_taint_values_are_label_values(run):
    long_uuid = "GPU-" + "ab:" * 40 + "-"
    entries = [{"host": "node-7", "device": "cuda:0", "gpu_uuid": None, "step": 1},
               {"host": "node-8", "device": "cuda:1", "gpu_uuid": long_uuid, "step": 2},
               {"host": "node-9", "device": "::", "gpu_uuid": "", "step": 3}]  # fmt: skip
    append_quarantine(run / "quarantine.jsonl", entries)
    result = quarantine(run, "--format", "k8s")
    assert result.exit_code == 0, result.output
    taints = {line.split()[3]: line.split()[4] for line in result.stdout.splitlines() if " taint " in line}
    values = {host: taint.removeprefix("aegis-sdc/sdc=").removesuffix(":NoSchedule") for host, taint in taints.items()}
    assert values["node-7"] == "cuda-0" and values["node-9"] == "unknown"
    assert values["node-8"].startswith("GPU-ab-ab-") and len(values["node-8"]) <= 63
    for value in values.values():
        assert re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?", value), value
    labels = [line for line in result.stdout.splitlines() if " label " in line]
    assert len(labels) == 4 and all(line.endswith("aegis-sdc/quarantined=true --overwrite") for line in labels)
    uuid = "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
    assert label_value(uuid) == uuid


def test_a_run_without_incidents_prints_an_empty_result(tmp_path):
    store = Store(rank_db_path(tmp_path, 0))
    store.write_run({"host": "host-a", "rank": 0, "local_rank": 0, "world_size": 1, "device": "cpu"}, {}, {})
    store.close()
    result = quarantine(tmp_path)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["devices"] == [] and document["hosts"] == []
    slurm = quarantine(tmp_path, "--format", "slurm-exclude")
    assert slurm.exit_code == 0 and slurm.stdout == "\n", slurm.output
    k8s = quarantine(tmp_path, "--format", "k8s")
    assert k8s.exit_code == 0 and k8s.stdout == "", k8s.output


def test_exit_codes_follow_aegis_incidents(run, tmp_path):
    host = stored_device(run)["host"]
    rank_db_path(run, 1).write_bytes(b"\x00 not a database " * 100)  # a skipped store
    result = quarantine(run, "--format", "slurm-exclude")
    assert result.exit_code == 1 and result.stdout == f"{host}\n", result.output
    assert f"error: {rank_db_path(run, 1)}: not a SQLite database" in result.stderr
    bad = quarantine(run, "--format", "yaml")
    assert bad.exit_code == 2 and "Invalid value for '--format'" in bad.output and bad.stdout == ""
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = quarantine(empty)
    assert nothing.exit_code == 2 and "no aegis store" in nothing.stderr and nothing.stdout == ""


def test_with_every_store_damaged_the_lists_devices_are_still_printed(run):
    # The scheduler's drain list must not hang on the store: a run whose only store was overwritten
    # still names the device its quarantine list holds (exit 1, the store named).
    host = stored_device(run)["host"]
    rank_db_path(run, 0).write_bytes(b"\x00 not a database " * 100)
    result = quarantine(run, "--format", "slurm-exclude")
    assert result.exit_code == 1 and result.stdout == f"{host}\n", result.output
    assert "no readable aegis store" in result.stderr and "not a SQLite database" in result.stderr
    (device,) = json.loads(quarantine(run).stdout)["devices"]
    assert (device["host"], device["site"], device["listed"]) == (host, SITE, True)
    (run / "quarantine.jsonl").unlink()  # neither store nor list: nothing to say
    nothing = quarantine(run)
    assert nothing.exit_code == 2 and nothing.stdout == "", nothing.output


def test_a_torn_line_of_the_list_is_named_and_the_rest_still_read(run):
    host = stored_device(run)["host"]
    path = run / "quarantine.jsonl"
    other = dict(read_quarantine(path)[0], host="node-7", device="cuda:1", gpu_uuid=None)
    with path.open("a") as f:
        f.write('{"host": "node-9", "dev\n')  # a write cut by a full disk
        f.write(json.dumps(other) + "\n")
    skipped: list[int] = []
    assert [e["host"] for e in read_quarantine(path, skipped)] == [host, "node-7"] and skipped == [2]
    result = quarantine(run)
    assert result.exit_code == 1, result.output
    assert "line(s) 2 not a JSON object" in result.stderr
    document = json.loads(result.stdout)
    assert sorted(document["hosts"]) == sorted([host, "node-7"])
    assert {"path": str(path), "reason": "line 2 is not a JSON object", "skipped": True} in document["problems"]
