"""The quarantine list: JSON lines, written atomically, shared safely between processes."""

from __future__ import annotations

import json
import multiprocessing as mp

from aegis_sdc.response.quarantine import append_quarantine, read_quarantine


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
