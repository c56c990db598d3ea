"""Sensors of the state no GEMM check sees: the replicas' vote on parameters and optimizer state.

The vote's decision rule on gathered values, then data-parallel training on 2 and 3 gloo processes
with the fault families of the public fault kits injected into one rank's state between steps."""

from __future__ import annotations

import pytest
import torch
from tests import dist_workers
from tests.test_distributed import run_workers

from aegis_sdc.events import StateKind, VerdictKind, WrongExecution
from aegis_sdc.kernels import fingerprint as kfp
from aegis_sdc.ops.transfer import start_to_host
from aegis_sdc.sensors.state_vote import StateVote, VoteColumn, VoteRecord, fold
from aegis_sdc.store.sqlite import read_incidents, read_unattributed

# gloo ranks of their own: one such test at a time (pyproject.toml, xdist_group)
pytestmark = pytest.mark.xdist_group("processes")

# -- the decision rule ------------------------------------------------------------------------------


def _vote(names: list[str]) -> tuple[StateVote, VoteRecord]:
    model = torch.nn.Module()
    for name in names:
        model.register_parameter(name, torch.nn.Parameter(torch.zeros(4)))
    vote = StateVote(model, torch.device("cpu"), param_slices=1, state_slices=len(names))
    columns = [VoteColumn(name, StateKind.PARAM, ()) for name in names]
    return vote, VoteRecord(7, columns, 0, start_to_host([]), [])


def _gathered(rows: list[list[int]]) -> torch.Tensor:
    """int64 [ranks, columns + 1]: each rank's values and a dropped-update count of 0."""
    return torch.tensor([[*row, 0] for row in rows], dtype=torch.int64)


def test_a_majority_names_the_ranks_outside_it():
    vote, record = _vote(["a", "b"])
    (finding,) = vote.judge(record, _gathered([[5, 9], [5, 9], [6, 9], [5, 9]]), [0, 1, 2, 3])
    assert (finding.param, finding.step, finding.minority, finding.majority) == ("a", 7, (2,), True)


def test_two_replicas_that_differ_are_a_pair_and_nobody_is_named():
    vote, record = _vote(["a"])
    (finding,) = vote.judge(record, _gathered([[5], [6]]), [0, 1])
    assert (finding.minority, finding.majority) == ((0, 1), False)
    # an even split of four is no majority either
    vote, record = _vote(["a"])
    (finding,) = vote.judge(record, _gathered([[5], [5], [6], [6]]), [0, 1, 2, 3])
    assert (finding.minority, finding.majority) == ((0, 1, 2, 3), False)


def test_unknown_values_are_not_compared():
    vote, record = _vote(["a"])
    assert vote.judge(record, _gathered([[5], [0], [5]]), [0, 1, 2]) == []


def test_a_divergence_is_raised_once_and_again_when_its_ranks_change():
    vote, record = _vote(["a"])
    assert len(vote.judge(record, _gathered([[5], [6], [5]]), [0, 1, 2])) == 1
    assert vote.judge(record, _gathered([[7], [8], [7]]), [0, 1, 2]) == []  # rank 1 still differs
    (finding,) = vote.judge(record, _gathered([[7], [8], [8]]), [0, 1, 2])  # now rank 0 does
    assert finding.minority == (0,)
    assert vote.judge(record, _gathered([[9], [9], [9]]), [0, 1, 2]) == []  # agreement forgets it
    assert len(vote.judge(record, _gathered([[9], [9], [3]]), [0, 1, 2])) == 1


def test_replicas_out_of_step_by_design_are_not_judged():
    vote, record = _vote(["a"])
    gathered = torch.tensor([[5, 0], [6, 1], [5, 0]], dtype=torch.int64)  # rank 1 dropped an update
    assert vote.judge(record, gathered, [0, 1, 2]) is None
    assert vote.skipped_votes == 1


def test_folded_state_fingerprints_keep_every_tensor_and_its_order():
    assert fold([1, 2]) != fold([2, 1])
    assert fold([1, 2]) != fold([1, 3])
    assert fold([]) == 0 and fold([1, None]) == 0  # nothing (or not everything) known: not compared
    assert fold([0]) != 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_vote_fingerprints_parameters_and_a_rotating_slice_of_the_state(device):
    # on the GPU: the batched kernel's launch, the copy to pinned memory and its read a step later
    model = torch.nn.Linear(4, 3).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4, device=device)).sum().backward()
    optimizer.step()
    vote = StateVote(model, torch.device(device), param_slices=1, state_slices=2)

    def values(record: VoteRecord) -> list[int]:
        record.read()  # what the next step's exchange reads
        return record.values(vote.width).tolist()

    first, second = vote.take(0, optimizer, 0), vote.take(1, optimizer, 0)
    assert [(c.param, c.kind) for c in first.columns] == [
        ("weight", StateKind.PARAM), ("bias", StateKind.PARAM), ("weight", StateKind.OPTIMIZER_STATE)
    ]  # fmt: skip
    assert [c.param for c in second.columns[2:]] == ["bias"]
    assert len(first.columns[2].rows) == 3  # exp_avg, exp_avg_sq, step
    # every state tensor known, the step count too (on the GPU a CPU scalar beside device moments)
    assert values(first)[2] != 0
    assert len(values(first)) == vote.width and values(first)[-1] == 0  # the dropped-update count last
    assert values(first)[0] == kfp.signed64(fold([kfp.fingerprint_reference(model.weight)]))
    before = values(second)[2]
    with torch.no_grad():
        optimizer.state[model.bias]["exp_avg"][0] *= -1
    assert vote.take(1, optimizer, 0) and values(vote.take(1, optimizer, 0))[2] != before


# -- data-parallel training with a fault in one rank's state ------------------------------------------

P = "layers.0.{}.weight"
# (step, rank at 3 ranks, fault): sign, exponent and mantissa bit flips in weights, a scaled row, a
# stale weight (a missed update), a sign flip in Adam's first moment, the second moment × 100
FAULTS = [
    {"step": 3, "rank": 1, "param": P.format("attn.wq"), "kind": "bit", "bit": 31},
    {"step": 5, "rank": 2, "param": P.format("attn.wk"), "kind": "bit", "bit": 25, "index": 3},
    {"step": 7, "rank": 0, "param": P.format("attn.wv"), "kind": "bit", "bit": 12, "index": 5},
    {"step": 9, "rank": 1, "param": P.format("mlp.up_proj"), "kind": "row", "row": 3, "factor": 10.0},
    {"step": 11, "rank": 2, "param": P.format("mlp.down_proj"), "kind": "stale"},
    {"step": 13, "rank": 0, "param": P.format("mlp.gate_proj"), "state": "exp_avg", "kind": "bit", "bit": 31},
    {"step": 15, "rank": 1, "param": P.format("attn.wo"), "state": "exp_avg_sq", "kind": "scale", "factor": 100.0},
]
# what each fault is found as: the tensor at the vote of its step; a corrupted moment also changes its
# parameter's update, so the parameter differs from the next step on (the state is voted in two
# slices here: gate_proj's and wo's at odd steps)
FOUND = {
    (P.format("attn.wq") + ":param", 3), (P.format("attn.wk") + ":param", 5), (P.format("attn.wv") + ":param", 7),
    (P.format("mlp.up_proj") + ":param", 9), (P.format("mlp.down_proj") + ":param", 11),
    (P.format("mlp.gate_proj") + ":optimizer_state", 13), (P.format("mlp.gate_proj") + ":param", 14),
    (P.format("attn.wo") + ":optimizer_state", 15), (P.format("attn.wo") + ":param", 16),
}  # fmt: skip
RANK_OF = {fault["param"]: fault["rank"] for fault in FAULTS}
VOTE = {"vote_param_slices": 1, "vote_state_slices": 2}  # every parameter at every vote


@pytest.mark.slow
def test_three_replicas_name_the_rank_whose_state_was_corrupted(tmp_path):
    options = {"steps": 18, "replica_faults": FAULTS, "distributed": VOTE}
    results = run_workers(dist_workers.guarded_training, 3, tmp_path, options)
    incidents = {(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]}
    assert incidents == {(site, step, RANK_OF[site.split(":")[0]]) for site, step in FOUND}
    for r in results:
        assert r["summary"]["unattributed"] == 0
        assert r["state_votes"] == 18
        assert {w["rank"] for w in r["warnings"]} <= {None, *RANK_OF.values()}
    stored = {(i["site"], i["step"], i["rank"]) for i in read_incidents(tmp_path / "run")}
    assert stored == incidents


@pytest.mark.slow
def test_two_replicas_prove_the_corruption_and_name_no_rank(tmp_path):
    faults = [dict(fault, rank=1) for fault in FAULTS]
    options = {"steps": 18, "replica_faults": faults, "distributed": VOTE}
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, options)
    assert all(r["incidents"] == [] for r in results)  # never a guess: not rank 1, not the healthy rank 0
    proven = {(v["site"], v["step"]) for v in results[0]["verdicts"] if v["kind"] == "unattributed_sdc"}
    assert proven == FOUND  # raised once, by the lowest rank of the pair
    assert all("ranks [0, 1]" in v["detail"] for v in results[0]["verdicts"] if v["kind"] == "unattributed_sdc")
    assert not [v for v in results[1]["verdicts"] if v["kind"] == "unattributed_sdc"]
    assert {(u["site"], u["step"]) for u in read_unattributed(tmp_path / "run")} == FOUND


def test_hsdp_replica_sets_are_the_ranks_holding_the_same_shards():
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from aegis_sdc.sensors.state_vote import replica_sets

    # what FSDP2 leaves on a parameter: its mesh of global ranks (3 replicas × 2 shards) and placements
    module = torch.nn.Linear(2, 2)
    module.weight.device_mesh = SimpleNamespace(mesh=torch.arange(6).view(3, 2))
    module.weight.placements = (Replicate(), Shard(0))
    assert replica_sets(module) == [(0, 2, 4), (1, 3, 5)]
    module.weight.placements = (Shard(0), Replicate())  # the replicate dimension second
    assert replica_sets(module) == [(0, 1), (2, 3), (4, 5)]
    module.weight.placements = (Shard(0), Shard(1))  # 2-D sharding: no replicas
    assert replica_sets(module) is None
    assert replica_sets(torch.nn.Linear(2, 2)) is None  # plain tensors: DDP decides, not this


def test_each_replica_set_is_judged_on_its_own_rows():
    vote, record = _vote(["a"])
    vote.sets = [(0, 2, 4), (1, 3, 5)]
    # shards differ between the sets by design; inside (1, 3, 5) rank 3 differs from two replicas
    (finding,) = vote.judge(record, _gathered([[5], [8], [5], [9], [5], [8]]), [0, 1, 2, 3, 4, 5])
    assert (finding.ranks, finding.minority, finding.majority) == ((1, 3, 5), (3,), True)
    vote.sets = [(0, 2), (1, 3)]
    (finding,) = vote.judge(record, _gathered([[5], [8], [6], [8]]), [0, 1, 2, 3])
    assert (finding.ranks, finding.minority, finding.majority) == ((0, 2), (0, 2), False)  # a pair


# HSDP on 3 replicas × 2 shards (mesh [[0, 1], [2, 3], [4, 5]]): faults in a rank's local shards
HSDP_FAULTS = [
    {"step": 3, "rank": 1, "param": P.format("attn.wq"), "kind": "bit", "bit": 31},
    {"step": 5, "rank": 4, "param": P.format("attn.wk"), "kind": "bit", "bit": 25, "index": 3},
    {"step": 7, "rank": 2, "param": P.format("mlp.gate_proj"), "state": "exp_avg", "kind": "bit", "bit": 31},
]


@pytest.mark.slow
def test_hsdp_replicas_of_a_shard_name_the_rank_whose_shard_was_corrupted(tmp_path):
    # 10 steps: the vote of step 8 is judged at step 9's end
    options = {"steps": 10, "parallel": "fsdp", "hsdp": [3, 2], "replica_faults": HSDP_FAULTS, "distributed": VOTE}
    results = run_workers(dist_workers.guarded_training, 6, tmp_path, options, timeout=400.0)
    incidents = {(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]}
    assert incidents == {
        (P.format("attn.wq") + ":param", 3, 1), (P.format("attn.wk") + ":param", 5, 4),
        (P.format("mlp.gate_proj") + ":optimizer_state", 7, 2), (P.format("mlp.gate_proj") + ":param", 8, 2),
    }  # fmt: skip
    for r in results:
        assert r["state_votes"] == 10 and r["summary"]["unattributed"] == 0


# -- the optimizer-update replay (one process) -------------------------------------------------------

TARGET = "layers.0.mlp.up_proj.weight"


def _replayed_training(tmp_path, optimizer_of, steps: int, slices: int = 1, before_guard=None, **config):
    """SMALL Llama trained `steps` steps under a guard whose update replay covers `slices` slices;
    `before_guard(model, optimizer)` registers hooks that run before the guard's."""
    from tests.helpers import guard_config, small_workload, train

    import aegis_sdc as aegis

    model, data, _ = small_workload()
    optimizer = optimizer_of(model.parameters())
    if before_guard is not None:
        before_guard(model, optimizer)
    cfg = guard_config(tmp_path, update_replay=aegis.UpdateReplayConfig(slices=slices, every=1), **config)
    verdicts = []
    with aegis.protect(model, optimizer=optimizer, config=cfg) as guard:
        guard.subscribe(lambda event, payload: verdicts.append(payload) if event == "verdict" else None)
        train(model, data, optimizer, steps)
    return guard, verdicts


def test_copies_in_a_reused_block_are_exact_and_keep_their_addresses():
    from aegis_sdc.sensors.update_replay import CopyArena

    g = torch.Generator().manual_seed(2)
    arena = CopyArena()
    first = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g).to(torch.bfloat16), torch.tensor(4.0)]
    copies = arena.copy(first)
    for copy, source in zip(copies, first, strict=True):
        assert torch.equal(copy, source) and copy.dtype == source.dtype and copy.data_ptr() != source.data_ptr()
    assert all(c.data_ptr() % CopyArena.ALIGN == 0 for c in copies)
    again = arena.copy([t * 2 for t in first])  # the same layout: the same memory, the new values
    assert [c.data_ptr() for c in again] == [c.data_ptr() for c in copies]
    assert all(torch.equal(c, t * 2) for c, t in zip(again, first, strict=True))
    bigger = [torch.randn(100, generator=g), *first]  # a larger layout: a new block, still exact
    assert all(torch.equal(c, t) for c, t in zip(arena.copy(bigger), bigger, strict=True))


@pytest.mark.parametrize(
    "optimizer_of",
    [
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        lambda params: torch.optim.AdamW(params, lr=3e-3, foreach=True, amsgrad=True),
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
        lambda params: torch.optim.Adafactor(params, lr=1e-2),
    ],
    ids=["adamw", "adamw-foreach-amsgrad", "sgd-nesterov", "adafactor"],
)
def test_clean_updates_replay_bit_for_bit(tmp_path, optimizer_of):
    guard, verdicts = _replayed_training(tmp_path, optimizer_of, steps=6, slices=2)
    summary = guard.summary()
    assert summary.update_replays == 6 and summary.confirmed == 0
    assert not [v for v in verdicts if v.site.kind is StateKind.OPTIMIZER_UPDATE]


def _flip_after_update(step: int):
    """An optimizer post-hook, registered before the guard's: at `step`, one bit of an element the
    update just wrote flips — an update computed wrong."""

    def install(model, optimizer):
        param = dict(model.named_parameters())[TARGET]
        calls = {"n": 0}

        def flip(opt, args, kwargs):
            if calls["n"] == step:
                with torch.no_grad():
                    param.view(-1)[7:8].view(torch.int32).bitwise_xor_(1 << 20)
            calls["n"] += 1

        optimizer.register_step_post_hook(flip)

    return install


def test_a_wrong_update_is_confirmed_on_its_parameter_and_step(tmp_path):
    guard, verdicts = _replayed_training(tmp_path, lambda p: torch.optim.AdamW(p, lr=3e-3), steps=6,
                                         before_guard=_flip_after_update(3))  # fmt: skip
    (incident,) = guard.incidents
    assert (incident.site.name, incident.step) == (f"{TARGET}:optimizer_update", 3)
    assert incident.verdict.wrong_execution is WrongExecution.ORIGINAL  # the weights carry it
    assert [v.kind for v in verdicts if v.site.kind is StateKind.OPTIMIZER_UPDATE] == [VerdictKind.CONFIRMED_SDC]
    assert [(i["site"], i["step"]) for i in read_incidents(tmp_path / "run")] == [(incident.site.name, 3)]


def test_a_wrong_replay_is_confirmed_and_the_weights_are_intact(tmp_path, monkeypatch):
    from aegis_sdc.sensors import update_replay

    execute = update_replay.UpdateInputs.execute
    calls = {"n": 0}

    def once_wrong(self, kind, work=None):
        params, states = execute(self, kind, work)
        calls["n"] += 1
        if calls["n"] == 3 and TARGET in self.names:  # the replay of step 2 (slices=1: every step's)
            with torch.no_grad():
                params[self.names.index(TARGET)].view(-1)[0:1].view(torch.int32).bitwise_xor_(1 << 4)
        return params, states

    monkeypatch.setattr(update_replay.UpdateInputs, "execute", once_wrong)
    guard, _ = _replayed_training(tmp_path, lambda p: torch.optim.AdamW(p, lr=3e-3), steps=5)
    (incident,) = guard.incidents
    assert (incident.site.name, incident.step) == (f"{TARGET}:optimizer_update", 2)
    assert incident.verdict.wrong_execution is WrongExecution.REPLAY


def test_an_update_dropped_by_skip_step_is_not_compared(tmp_path):
    import aegis_sdc as aegis

    fault = aegis.FaultSpec(site="layers.0.attn.wq:fwd", model="bitflip", bit=30, steps=(3,))
    guard, verdicts = _replayed_training(
        tmp_path, lambda p: torch.optim.AdamW(p, lr=3e-3), steps=6, faults=(fault,),
        response=aegis.ResponseConfig(policy="skip-step", quarantine=False),
    )  # fmt: skip
    assert [(i.site.name, i.step) for i in guard.incidents] == [("layers.0.attn.wq:fwd", 3)]
    assert not [v for v in verdicts if v.site.kind is StateKind.OPTIMIZER_UPDATE]
    assert guard.summary().update_replays == 5  # step 3's update was dropped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", [True, False])
def test_fused_and_foreach_adamw_with_a_grad_scaler_replay_bit_for_bit_on_the_gpu(tmp_path, fused):
    from tests.helpers import guard_config, lm_loss, small_workload

    import aegis_sdc as aegis

    model, data, _ = small_workload()
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused, foreach=not fused)
    scaler = torch.amp.GradScaler("cuda")
    cfg = guard_config(tmp_path, update_replay=aegis.UpdateReplayConfig(slices=3, every=1))
    with aegis.protect(model, optimizer=optimizer, config=cfg) as guard:
        for _ in range(8):
            inputs, targets = (t.cuda() for t in data.batch())
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    summary = guard.summary()
    assert summary.update_replays == 8 and summary.confirmed == 0


# -- peer replay of a step (2 and 3 gloo processes) ----------------------------------------------------

PEER = {"peer_replay_period": 2, **VOTE}
# corruption between the checked ops, each at a replay step (even) on one rank: a module's output × 10,
# a sign flip in a Linear's output, a local gradient before the all-reduce with noise, a bit flip, a
# row × 100
STEP_FAULTS = [
    {"step": 2, "rank": 1, "kind": "output", "module": "layers.0.mlp", "factor": 10.0},
    {"step": 4, "rank": 2, "kind": "output_sign", "module": "layers.0.attn.wo"},
    {"step": 6, "rank": 0, "kind": "grad", "param": P.format("mlp.down_proj"), "mode": "noise"},
    {"step": 8, "rank": 1, "kind": "grad", "param": P.format("attn.wq"), "mode": "bit"},
    {"step": 10, "rank": 2, "kind": "grad", "param": "lm_head.weight", "mode": "row"},
]


def _peer_verdicts(results: list[dict]) -> list[tuple]:
    return sorted((v["step"], r["rank"], v["kind"]) for r in results for v in r["verdicts"]
                  if v["site"] == "model:peer_replay")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_peer_replay_names_the_rank_whose_step_went_wrong_between_the_checks(world, tmp_path):
    faults = [dict(f, rank=f["rank"] % world) for f in STEP_FAULTS]
    options = {"steps": 12, "peer": True, "step_faults": faults, "distributed": PEER}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    # each fault fired once, in the training step: the replaying peer and a third execution (by another
    # peer, or with two ranks by the rank itself) agree, so the rank is named even with two ranks
    expected = sorted((f["step"], f["rank"], "confirmed_sdc") for f in faults)
    assert _peer_verdicts(results) == expected
    incidents = sorted((i["step"], i["rank"]) for r in results for i in r["incidents"]
                       if i["site"] == "model:peer_replay")  # fmt: skip
    assert incidents == [(step, rank) for step, rank, _ in expected]
    for r in results:
        assert r["peer_replays"] == 6
        assert {i["rank"] for i in r["incidents"]} <= {f["rank"] for f in faults}


@pytest.mark.slow
def test_a_weight_corrupted_at_rest_makes_a_pair_of_two_replicas_and_is_named_among_three(tmp_path):
    fault = {"step": 4, "rank": 1, "param": P.format("attn.wv"), "kind": "row", "row": 2, "factor": 10.0}
    for world in (2, 3):
        options = {"steps": 6, "peer": True, "replica_faults": [fault], "distributed": PEER}
        results = run_workers(dist_workers.guarded_training, world, tmp_path / str(world), options)
        peer = _peer_verdicts(results)
        if world == 3:  # rank 1's own step and its replay of rank 0's batch both disagree: named twice
            assert peer == [(4, 1, "confirmed_sdc"), (4, 1, "confirmed_sdc")]
        else:  # each rank reproduces its own result, both batches differ across the pair: nobody named
            assert peer == [(4, 0, "unattributed_sdc"), (4, 0, "unattributed_sdc")]
            assert all(i["rank"] == 1 or i["site"] != "model:peer_replay" for r in results for i in r["incidents"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_gemm_fault_on_a_peer_replay_step_is_one_incident(world, tmp_path):
    # The checked GEMM confirms the fault on rank 1; the peer replay of the same step names rank 1 too
    # (its batch's gradients differ) and joins that incident. The transient fault strikes the step's
    # own call once, not the recomputations the peer replay runs on rank 1 (it struck three times,
    # and with two ranks the pair then looked persistently different: nobody named).
    site = "layers.0.mlp.up_proj:fwd"
    fault = {"site": site, "model": "bitflip", "bit": 27, "steps": (22,), "ranks": (1,)}
    options = {"steps": 24, "peer": True, "faults": [fault], "distributed": {"peer_replay_period": 2}}
    results = run_workers(dist_workers.guarded_training, world, tmp_path, options)
    assert [(i["site"], i["step"], i["rank"]) for r in results for i in r["incidents"]] == [(site, 22, 1)]
    assert results[1]["injected"] == [[site, 22]]
    peer = _peer_verdicts(results)
    assert peer and set(peer) == {(22, 1, "confirmed_sdc")}
    assert results[1]["summary"]["same_fault"] == len(peer) and results[1]["summary"]["confirmed"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_clean_replicas_with_a_slow_rank_vote_and_replay_without_a_finding(tmp_path, checkpointing):
    # with activation checkpointing the replay recomputes each block inside its own backward too
    options = {"steps": 8, "peer": True, "delay": {"rank": 1, "every": 4, "seconds": 1.0}, "distributed": PEER,
               "checkpointing": checkpointing}  # fmt: skip
    results = run_workers(dist_workers.guarded_training, 3, tmp_path, options)
    for r in results:
        assert r["incidents"] == [] and r["verdicts"] == []
        assert r["state_votes"] == 8 and r["peer_replays"] == 4  # peer replays agreed bit for bit
        assert r["summary"]["confirmed"] == 0 and r["summary"]["unattributed"] == 0
        assert r["summary"]["not_deterministic"] == 0


def test_an_optimizer_that_may_couple_parameters_is_named_not_replayed(tmp_path):
    class ClippingAdamW(torch.optim.AdamW):  # clips by the global norm inside its step
        def step(self, closure=None):
            torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1e-3)
            return super().step(closure)

    guard, verdicts = _replayed_training(tmp_path, lambda p: ClippingAdamW(p, lr=3e-3), steps=3)
    assert guard.summary().update_replays == 0 and not verdicts
    assert "ClippingAdamW" in guard.coverage_report().not_covered["optimizer:optimizer_update"]


# -- what the sensors cost, and the budget that pays for them --------------------------------------


def test_the_budget_stretches_the_sensors_periods_only_as_far_as_their_share_needs():
    from aegis_sdc.runtime.sensor_cost import MAX_STRETCH, SENSOR_SHARE, stretch_for

    assert stretch_for(0.4, allowed_ms=1.0) == 1  # within half the budget: the configured periods
    assert stretch_for(SENSOR_SHARE * 1.0, allowed_ms=1.0) == 1
    assert stretch_for(1.2, allowed_ms=1.0) == 3  # 1.2 ms per step into 0.5 ms: every third firing
    assert stretch_for(1e6, allowed_ms=1.0) == MAX_STRETCH  # the floor of coverage
    assert stretch_for(0.1, allowed_ms=0.0) == MAX_STRETCH


def test_the_sensor_clock_adds_a_firings_spans_and_takes_the_median_firing(monkeypatch):
    from aegis_sdc.runtime import sensor_cost, timing

    ticks = iter([0.0, 0.001, 0.010, 0.013, 1.0, 1.005, 2.0, 2.009, 3.0, 3.001])  # seconds
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    clock = sensor_cost.SensorClock(torch.device("cpu"))
    for step in (0, 0, 4, 8, 12):  # step 0: two spans (copies before the update, the replay after)
        clock.end(clock.begin("update_replay", step))
    # firings of 4, 5, 9 ms; the newest (1 ms) is left out while older ones are known
    cost = clock.cost("update_replay", period_steps=4)
    assert cost.ms_per_firing == pytest.approx(5.0) and cost.firings_timed == 4
    assert cost.ms_per_step == pytest.approx(5.0 / 4)
    assert clock.cost("state_vote", 1).ms_per_firing is None  # never fired: costs nothing yet


def _budget_training(tmp_path, budget: float, steps: int = 14):
    from tests.helpers import guard_config, small_workload, train

    import aegis_sdc as aegis

    model, data, optimizer = small_workload()
    sampling = aegis.SamplingConfig(budget=budget, rotation_steps=10, replan_steps=4)
    cfg = guard_config(tmp_path, sampling=sampling, thresholds=aegis.ThresholdConfig(calibration_checks=2))
    guard = aegis.protect(model, optimizer=optimizer, config=cfg)
    train(model, data, optimizer, steps)
    return guard, guard.close()


def test_a_budget_too_small_for_the_update_replay_stretches_its_period(tmp_path):
    from aegis_sdc.runtime.sensor_cost import MAX_STRETCH

    # 0.01% of a CPU step is microseconds: a replay slice costs far more, so it fires 16× less often
    guard, summary = _budget_training(tmp_path, budget=1e-4)
    assert guard.budget_plan is not None and guard.sensor_stretch == MAX_STRETCH
    assert guard.update_replay.every == 4 * MAX_STRETCH
    cost = summary.state_sensor_costs["update_replay"]
    assert cost["ms_per_firing"] > 0 and cost["period_steps"] == 4 * MAX_STRETCH
    assert guard.budget.sensors_ms > 0 and summary.confirmed == 0


def test_a_budget_that_affords_the_update_replay_keeps_its_period(tmp_path):
    # the whole step as budget: half of it pays for a slice every 4 steps many times over
    guard, summary = _budget_training(tmp_path, budget=1.0)
    assert guard.budget_plan is not None and guard.sensor_stretch == 1
    assert summary.state_sensor_costs["update_replay"]["period_steps"] == 4
    assert summary.update_replays == 4 and summary.confirmed == 0  # steps 0, 4, 8, 12


@pytest.mark.slow
def test_ranks_adopt_the_longest_sensor_periods_any_of_their_budgets_asks_for(tmp_path):
    from aegis_sdc.runtime.sensor_cost import MAX_STRETCH

    # rank 1's budget (0.01% of the step) cannot pay for the vote, the peer replay or the update replay;
    # rank 0's (the whole step) can: both fire every sensor at rank 1's cadence, on the same steps
    options = {"steps": 14, "peer": True, "budgets": [1.0, 1e-4], "distributed": PEER,
               "thresholds": {"calibration_checks": 2}}  # fmt: skip
    results = run_workers(dist_workers.guarded_training, 2, tmp_path, options)
    assert [r["sensor_stretch"] for r in results] == [MAX_STRETCH, MAX_STRETCH]
    assert results[0]["state_votes"] == results[1]["state_votes"] < 14
    assert results[0]["peer_replays"] == results[1]["peer_replays"]
    for r in results:
        assert r["incidents"] == [] and r["summary"]["confirmed"] == 0
        costs = r["summary"]["state_sensor_costs"]
        assert set(costs) == {"state_vote", "update_replay", "peer_replay"}
        assert costs["peer_replay"]["period_steps"] == 2 * MAX_STRETCH
