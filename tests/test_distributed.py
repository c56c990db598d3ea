"""Data-parallel sensors with 2–4 processes: rank outliers, collective checks, DDP and FSDP2, and what
happens when a rank dies or stalls. gloo on the CPU; `AEGIS_TEST_BACKEND=nccl` runs the same tests
over NCCL, one GPU per rank (tests needing more ranks than GPUs are skipped)."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from tests import dist_workers

from aegis_sdc.store.sqlite import read_coverage, read_incidents, read_unattributed, read_warnings

# gloo ranks of their own: one such test at a time (pyproject.toml, xdist_group)
pytestmark = pytest.mark.xdist_group("processes")

SITE = "layers.0.mlp.up_proj:fwd"


@functools.cache
def _worker_context():
    """Fresh worker processes forked from a server that imported torch and the library once: a rank
    starts in a fraction of a second instead of seconds of imports (a spawned process's). The server
    starts no threads before forking, so forking it is safe, unlike forking pytest itself. DDP's
    constructor imports torch._dynamo (~900 modules: 4 s on one core, 10 s for three ranks on two)
    the first time it runs in a process: imported here once too."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "aegis_sdc", "tests.dist_workers"])
    return ctx


def run_workers(fn, world: int, tmp_path, options: dict, timeout: float = 240.0, stopped: tuple[int, ...] = ()
                ) -> list[dict]:  # fmt: skip
    """Run `fn(rank, world, rendezvous, dir, options)` in `world` spawned processes; their result files.

    Plain processes of the forkserver context (not torch.multiprocessing.spawn, which kills the
    survivors when one rank exits, and the tests need survivors to report); none outlives `timeout`.
    `stopped`: ranks that stop themselves (SIGSTOP) and never finish: killed once the others ended."""
    if dist_workers.BACKEND == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks over NCCL need {world} GPUs, {torch.cuda.device_count()} present")
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = _worker_context()
    rendezvous = str(tmp_path / "rendezvous")  # a file store: no port to race for
    processes = [ctx.Process(target=dist_workers.run_rank, args=(fn, rank, world, rendezvous, str(tmp_path), options))
                 for rank in range(world)]  # fmt: skip
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for rank, process in enumerate(processes):
        if rank not in stopped:
            process.join(max(0.0, deadline - time.monotonic()))
    for rank in stopped:
        processes[rank].kill()  # SIGKILL ends a stopped process too
        processes[rank].join()
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for rank in hung:
        os.kill(processes[rank].pid, signal.SIGUSR1)  # its stacks, for the failure message
    time.sleep(1.0 if hung else 0.0)
    for rank in hung:
        processes[rank].kill()
    stacks = "\n".join(f"rank {rank}:\n{_read(tmp_path / f'stacks{rank}.txt')}" for rank in hung)
    assert not hung, f"rank(s) {hung} still running after {timeout:.0f} s; their stacks:\n{stacks}"
    results = []
    for rank in range(world):
        path = tmp_path / f"result{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _read(path) -> str:
    return path.read_text() if path.exists() else "(none written)"


def warned(result: dict) -> set[tuple]:
    """(site, step, named rank or None, ranks involved) of a rank's outlier warnings."""
    return {(w["site"], w["step"], w["rank"], tuple(w["ranks"])) for w in result["warnings"]}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "parallel"), [(2, "ddp"), (3, "ddp"), (2, "fsdp2")])
def test_a_faulty_rank_is_named_by_its_incident_and_by_a_majority_never_by_a_pair(world, parallel, tmp_path):
    fault = {"site": SITE, "model": "bitflip", "bit": 27, "steps": (22,), "ranks": (1,)}
    options = {"faults": [fault], "steps": 24, "parallel": parallel}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    incidents = [i for r in results for i in r["incidents"]]
    assert [(i["site"], i["step"], i["rank"]) for i in incidents] == [(SITE, 22, 1)]  # the replay decides
    # Three ranks: the two that agree name rank 1. Two ranks: the disagreement is reported, nobody named.
    expected = (SITE, 22, 1, (1,)) if world == 3 else (SITE, 22, None, (0, 1))
    for r in results:  # every rank sees the same warning
        assert warned(r) == {expected}
        assert r["summary"]["confirmed"] == (1 if r["rank"] == 1 else 0)
    assert results[1]["injected"] == [[SITE, 22]] and results[0]["injected"] == []
    stored = read_warnings(tmp_path / "run")  # kept once: in rank 1's store, or the pair's lowest rank's
    assert [(w["site"], w["step"], w["rank"], tuple(w["ranks"])) for w in stored] == [expected]
    assert [(i["site"], i["step"], i["rank"]) for i in read_incidents(tmp_path / "run")] == [(SITE, 22, 1)]


@pytest.mark.slow
def test_one_ranks_confirmed_sdc_withholds_every_ranks_certificates_of_the_states_after_it(tmp_path):
    # Rank 1's forward at step 22 is wrong: its gradient, all-reduced, corrupts both replicas' update
    # (the replicas still agree, so their vote cannot tell). Rank 0 learns it in the next exchange.
    fault = {"site": SITE, "model": "bitflip", "bit": 27, "steps": (22,), "ranks": (1,)}
    options = {"faults": [fault], "steps": 26, "checkpoint_steps": [20, 22, 23, 25]}
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, options)
    assert [(i["site"], i["step"]) for r in results for i in r["incidents"]] == [(SITE, 22)]
    for r in results:
        statuses = {step: status for step, status, _ in r["certificates"]}
        # 20 and 22 hold updates of steps before 22; 23 and 25 hold step 22's update
        assert statuses == {20: "certified", 22: "certified", 23: "uncertified", 25: "uncertified"}, r["rank"]
        reasons = {step: reason for step, _, reason in r["certificates"]}
        assert "from step 23" in reasons[23] and "from step 23" in reasons[25]
    coverage = read_coverage(tmp_path / "run")  # `aegis incidents`' line: steps, not rank-steps
    assert coverage["steps"] == 26 and coverage["ranks"] == 2


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
    for r in results:  # groups of two: the disagreement inside the group, no rank named
        expected = {(SITE, 22, None, (2, 3))} if r["rank"] in (2, 3) else set()
        assert warned(r) == expected
    assert [(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]] == [(SITE, 22, 3)]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "faulty"), [(2, False), (3, False), (3, True)])
def test_ddp_cells_of_the_clean_matrix(world, faulty, tmp_path):
    # The data-parallel cells of tests/test_clean_matrix.py: hair-trigger thresholds (every rank
    # replays hundreds of alarms), 40 steps; clean, nothing is confirmed and no rank is blamed; a
    # fault on rank 1 is confirmed there only, at its site and step.
    fault = {"site": SITE, "model": "bitflip", "bit": 27, "steps": (30,), "ranks": (1,)}
    options = {"steps": 40, "thresholds": {"margin": 1.0, "relax_window": 10}, "faults": [fault] if faulty else []}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    incidents = [(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]]
    assert incidents == ([(SITE, 30, 1)] if faulty else [])
    for r in results:
        assert r["summary"]["alarms"] > 0 and r["summary"]["unattributed"] == 0
        assert r["relaxations"] >= 1  # calibrated, widened after false alarms, relaxed back
        assert r["summary"]["confirmed"] == (1 if faulty and r["rank"] == 1 else 0)
        assert {w["rank"] for w in r["warnings"]} <= ({1, None} if faulty else set())
        if not faulty:
            assert r["warnings"] == []


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_corrupted_gradient_bucket_is_detected_and_a_rank_named_only_by_a_majority(world, tmp_path):
    site = "ddp.bucket0:allreduce"
    fault = {"site": site, "model": "bitflip", "bit": 29, "steps": (5,), "ranks": (1,)}
    # every parameter voted at every step; the vote of step 6 is judged at step 7's end
    options = {"faults": [fault], "steps": 8, "distributed": {"vote_param_slices": 1}}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    everything = [(v["site"], v["step"], r["rank"], v["kind"]) for r in results for v in r["verdicts"]]
    # the wrong gradient made rank 1's update differ: the replicas' state vote at the next step's end
    # finds its weights apart (named by the majority of three; with two, proven and nobody named)
    voted = [v for v in everything if v[0].endswith(":param")]
    assert voted and {(step, kind) for _, step, _, kind in voted} == {
        (6, "confirmed_sdc" if world == 3 else "unattributed_sdc")
    }
    assert {rank for _, _, rank, _ in voted} == ({1} if world == 3 else {0})  # two ranks: by the lowest
    incidents = [i for r in results for i in r["incidents"] if i["site"] == site]
    proven = [v for v in everything if v[0] == site]
    if world == 3:  # ranks 0 and 2 passed the same all-reduce: the majority names rank 1
        assert [(i["site"], i["step"], i["rank"]) for i in incidents] == [(site, 5, 1)]
        assert "ranks whose check failed: [1]" in incidents[0]["detail"]
        assert proven == [(site, 5, 1, "confirmed_sdc")]
    else:  # rank 1 holds a wrong result, but rank 0 may have sent it wrong: proven, nobody blamed
        assert incidents == [] and all(r["incidents"] == [] for r in results)
        assert proven == [(site, 5, 1, "unattributed_sdc")]
        assert "no rank named" in results[1]["verdicts"][0]["detail"]
        assert results[1]["summary"]["unattributed"] == 1 and results[1]["summary"]["confirmed"] == 0
        stored = read_unattributed(tmp_path / "run")  # what `aegis incidents` lists
        assert [(u["site"], u["step"], u["rank"]) for u in stored if u["site"] == site] == [(site, 5, 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "kind"), [(2, "weight"), (3, "weight"), (3, "exp_avg")])
def test_corrupted_state_on_one_rank_is_never_blamed_on_a_healthy_rank(world, kind, tmp_path):
    # A memory fault at rest on rank 1 (no op computes wrong): eight elements of a weight or of Adam's
    # first moment times 1e30. Rank 1's model saturates; its normalized checksum differences fall
    # below its peers', so with two ranks the healthy rank 0 is the one that "stands out" (it was
    # named before majorities were required). No warning or incident may name a healthy rank.
    corruption = {"kind": kind, "param": "layers.0.mlp.up_proj.weight", "rank": 1, "step": 22, "factor": 1e30}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, {"steps": 28, "corrupt": corruption})
    allowed = {None} if world == 2 else {1, None}  # two ranks: a disagreement, never a name
    for r in results:
        assert {i["rank"] for i in r["incidents"]} <= {1}
        assert {w["rank"] for w in r["warnings"]} <= allowed
    assert results[0]["losses"][-1] < results[1]["losses"][-1]  # the corruption did hit rank 1's training
    assert {w["rank"] for w in read_warnings(tmp_path / "run")} <= allowed
    assert {i["rank"] for i in read_incidents(tmp_path / "run")} <= {1}


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


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_a_fault_in_one_expert_of_a_moe_model_is_confirmed_on_its_rank_under_ddp_and_fsdp2(parallel, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.helpers import skip_unless_fused_experts

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1, vocab_size=8,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)  # fmt: skip
    skip_unless_fused_experts(transformers.MixtralForCausalLM(config))
    # Mixtral's experts are 3-D parameters run by a grouped GEMM (integrations/matrices.py): FSDP2
    # gathers them per layer, DDP all-reduces their gradients; the faulty expert is found on its rank
    site = "model.layers.1.mlp.experts.2.down_proj:wgrad"
    fault = {"site": site, "model": "bitflip", "bit": 30, "steps": (5,), "ranks": (1,)}
    options = {"parallel": parallel, "fault": fault}
    results = run_workers(dist_workers.moe_training, 2, tmp_path, options)
    assert [r["incidents"] for r in results] == [[], [[5, site, 1]]]
    assert all(r["false_alarms"] == 0 and r["unattributed"] == 0 for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_corrupted_fsdp2_reduce_scatter_is_detected(world, tmp_path):
    site = "fsdp.layers.0:reduce_scatter"
    fault = {"site": site, "model": "bitflip", "bit": 29, "steps": (4,), "ranks": (0,)}
    options = {"parallel": "fsdp2", "faults": [fault], "steps": 6}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    incidents = [(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]]
    proven = [(v["site"], v["step"], r["rank"], v["kind"]) for r in results for v in r["verdicts"]]
    # named by the majority of three; with two ranks proven on rank 0's shard, nobody blamed
    assert incidents == ([(site, 4, 0)] if world == 3 else [])
    assert proven == [(site, 4, 0, "confirmed_sdc" if world == 3 else "unattributed_sdc")]


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


@pytest.mark.slow
@pytest.mark.parametrize("ddp", [True, False], ids=["ddp", "no_ddp"])
def test_a_stopped_rank_makes_every_other_rank_raise_within_the_exchange_timeout(ddp, tmp_path):
    # Three ranks; rank 1 stops itself (SIGSTOP) after its forward of step 3. Under DDP the others wait
    # for it in the gradient all-reduce (the user's group: 30 min by default), bounded by the checked
    # all-reduce's hook; without DDP in the guard's exchange. Either way within the exchange timeout.
    if ddp and dist_workers.BACKEND == "nccl":
        pytest.skip("NCCL: the host does not wait for the gradient all-reduce in the hook (docs/distributed.md)")
    timeout = 5.0
    options = {"ddp": ddp, "exchange_timeout_s": timeout, "steps": 6, "stop_rank": 1, "stop_at": 3}
    results = run_workers(dist_workers.stalled_rank, 3, tmp_path, options, timeout=90, stopped=(1,))
    assert results[1] is None  # stopped, then killed
    for r in (results[0], results[2]):
        assert r["step"] == 3 and "a rank died or stalled" in r["error"]
        assert "step 3" in r["error"] and "[0, 1, 2]" in r["error"] and "5 s" in r["error"]
        assert ("gradient all-reduce" in r["error"]) == ddp
        assert timeout - 0.5 < r["seconds"] < timeout + 5, r  # the configured timeout, not the group's
        print(f"\nrank {r['rank']} raised after {r['seconds']:.1f} s: {r['error'][:200]}")


@pytest.mark.parametrize(
    ("differ", "named"),
    [
        (
            "model",
            [
                "protected sites: 24 on rank 0, 45 on rank 1",
                "rank 1 has 'layers.1.attn.wq:fwd' where rank 0 has 'lm_head:fwd'",
                "model parameters: 12 on rank 0, 21 on rank 1",
            ],
        ),
        ("include", ["GuardConfig.include: ('*',) on rank 0, ('*mlp*',) on rank 1", "protected sites"]),
        ("seed", ["SamplingConfig.seed: 0 on rank 0, 7 on rank 1"]),
    ],
)
def test_ranks_whose_guards_differ_all_fail_at_protect_naming_the_difference(differ, named, tmp_path):
    results = run_workers(dist_workers.mismatched_protect, 2, tmp_path, {"differ": differ}, timeout=60)
    for r in results:  # every rank, with the same message
        assert "protected" not in r and r["value_error"]
        assert r["error"] == results[0]["error"]
        for part in named:
            assert part in r["error"], r["error"]
    print(f"\n{differ}: {results[0]['error']}")
