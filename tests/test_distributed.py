"""Data-parallel sensors with 2–4 processes: rank outliers, collective checks, DDP and FSDP2, and what
happens when a rank dies or stalls. gloo on the CPU; `AEGIS_TEST_BACKEND=nccl` runs the same tests
over NCCL, one GPU per rank (tests needing more ranks than GPUs are skipped)."""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time

import pytest
import torch
from tests import dist_workers

from aegis_sdc.store.sqlite import read_incidents, read_warnings

SITE = "layers.0.mlp.up_proj:fwd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(fn, world: int, tmp_path, options: dict, timeout: float = 240.0) -> list[dict]:
    """Run `fn(rank, world, port, dir, options)` in `world` spawned processes; their result files.

    Plain processes (not torch's spawn context, which kills the survivors when one rank exits, and the
    tests need survivors to report); none outlives `timeout`."""
    if dist_workers.BACKEND == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks over NCCL need {world} GPUs, {torch.cuda.device_count()} present")
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    processes = [ctx.Process(target=fn, args=(rank, world, port, str(tmp_path), options)) for rank in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
    assert not hung, f"{len(hung)} worker(s) still running after {timeout:.0f} s"
    results = []
    for rank in range(world):
        path = tmp_path / f"result{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("world", "parallel"), [(2, "ddp"), (3, "ddp"), (2, "fsdp2")])
def test_a_faulty_rank_is_named_by_its_incident_and_by_the_outlier_warning(world, parallel, tmp_path):
    fault = {"site": SITE, "model": "bitflip", "bit": 27, "steps": (22,), "ranks": (1,)}
    options = {"faults": [fault], "steps": 24, "parallel": parallel}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    incidents = [i for r in results for i in r["incidents"]]
    assert [(i["site"], i["step"], i["rank"]) for i in incidents] == [(SITE, 22, 1)]
    for r in results:  # every rank sees the same warning, about rank 1 only
        assert {(w["site"], w["step"], w["rank"]) for w in r["warnings"]} == {(SITE, 22, 1)}
        assert r["summary"]["confirmed"] == (1 if r["rank"] == 1 else 0)
    assert results[1]["injected"] == [[SITE, 22]] and results[0]["injected"] == []
    stored = read_warnings(tmp_path / "run")  # kept as warnings in rank 1's store, merged on read
    assert [(w["site"], w["step"], w["rank"]) for w in stored] == [(SITE, 22, 1)]
    assert [(i["site"], i["step"], i["rank"]) for i in read_incidents(tmp_path / "run")] == [(SITE, 22, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_clean_data_parallel_training_raises_nothing(parallel, tmp_path):
    options = {"steps": 30, "sampling": 0.5, "parallel": parallel}
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, options)
    for r in results:
        assert r["incidents"] == [] and r["warnings"] == []
        assert r["summary"]["confirmed"] == 0 and r["summary"]["outlier_warnings"] == 0
        assert r["comm_sites"]  # the all-reduces were checked
    assert results[0]["losses"] != results[1]["losses"]  # ranks saw different data ...
    assert results[0]["summary"]["checks"] == results[1]["summary"]["checks"]  # ... and checked the same calls
    assert results[0]["summary"]["checks"] < 30 * 24  # sampled: fewer than every call


@pytest.mark.slow
def test_ranks_compare_only_within_their_data_parallel_group(tmp_path):
    # 4 ranks as 2 data-parallel groups (think: 2-way tensor parallelism × 2-way data parallelism).
    fault = {"site": SITE, "model": "bitflip", "bit": 27, "steps": (22,), "ranks": (3,)}
    options = {"faults": [fault], "steps": 24, "dp_groups": [[0, 1], [2, 3]]}
    results = run_workers(dist_workers.guarded_training, 4, tmp_path, options)
    for r in results:
        expected = {(SITE, 22, 3)} if r["rank"] in (2, 3) else set()
        assert {(w["site"], w["step"], w["rank"]) for w in r["warnings"]} == expected
    assert [(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]] == [(SITE, 22, 3)]


@pytest.mark.slow
def test_a_corrupted_gradient_bucket_is_detected_with_bucket_step_and_rank(tmp_path):
    fault = {"site": "ddp.bucket0:allreduce", "model": "bitflip", "bit": 29, "steps": (5,), "ranks": (1,)}
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, {"faults": [fault], "steps": 7})
    incidents = [i for r in results for i in r["incidents"]]
    assert [(i["site"], i["step"], i["rank"]) for i in incidents] == [("ddp.bucket0:allreduce", 5, 1)]
    assert "ranks whose check failed: [1]" in incidents[0]["detail"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_protected_and_unprotected_training_give_the_same_losses(parallel, tmp_path):
    plain = run_workers(
        dist_workers.guarded_training, 2, tmp_path / "plain", {"parallel": parallel, "protect": False, "steps": 6}
    )
    checked = run_workers(dist_workers.guarded_training, 2, tmp_path / "checked", {"parallel": parallel, "steps": 6})
    for p, c in zip(plain, checked, strict=True):
        # The checked Linear accumulates in fp32 tile by tile, F.linear in one BLAS call: the losses
        # agree to fp32 rounding amplified over six optimizer steps (measured ~1e-6 relative).
        assert p["losses"] == pytest.approx(c["losses"], rel=1e-4)
        assert c["summary"]["confirmed"] == 0
    if parallel == "fsdp2":
        assert checked[0]["fsdp_hooked"] >= 2 and checked[0]["comm_sites"]


@pytest.mark.slow
def test_a_corrupted_fsdp2_reduce_scatter_is_detected(tmp_path):
    fault = {"site": "fsdp.layers.0:reduce_scatter", "model": "bitflip", "bit": 29, "steps": (4,), "ranks": (0,)}
    options = {"parallel": "fsdp2", "faults": [fault], "steps": 6}
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, options)
    incidents = [i for r in results for i in r["incidents"]]
    assert [(i["site"], i["step"], i["rank"]) for i in incidents] == [("fsdp.layers.0:reduce_scatter", 4, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["stall", "die"])
def test_a_rank_that_stalls_or_dies_makes_the_others_fail_with_a_clear_error(failure, tmp_path):
    options = {"steps": 6, "distributed": {"exchange_timeout_s": 3.0}}
    options.update({"stall_at": 3, "stall_rank": 1} if failure == "stall" else {"die_at": 3, "die_rank": 1})
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, options, timeout=120)
    survivor = results[0]
    assert "a rank died or stalled" in survivor["exchange_error"]
    assert "step 3" in survivor["exchange_error"]
    assert survivor["seconds_in_step"] < 3.0 + 30  # the configured timeout, not a hang
    print(f"\n{failure}: rank 0 raised after {survivor['seconds_in_step']:.1f} s: {survivor['exchange_error'][:160]}")
