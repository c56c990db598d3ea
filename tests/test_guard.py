"""The whole pipeline on the workload: real accumulator faults → alarm → replay → incident → response."""

from __future__ import annotations

import json
import sqlite3
import warnings

import pytest
import torch
from tests.helpers import MEDIUM, guard_config, small_workload, train

import aegis_sdc as aegis
from aegis_sdc.events import VerdictKind, WrongExecution
from aegis_sdc.workloads.llama import lm_loss

TOKENS = 8 * 128  # batch × sequence of the medium workload
GEMM_SHAPE = {  # (M, N) of C = A·B for layers.0.mlp.up_proj (in 256, out 512)
    "fwd": (TOKENS, MEDIUM.hidden_dim),
    "dgrad": (TOKENS, MEDIUM.dim),
    "wgrad": (MEDIUM.hidden_dim, MEDIUM.dim),
}
FAULT_STEPS = (24, 29, 33, 38)


def run_with_fault(tmp_path, spec: aegis.FaultSpec, steps: int = 40, workload=None, **config):
    model, data, optimizer = workload or small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,), **config))
    try:
        train(model, data, optimizer, steps)
    finally:  # also when a policy exits or raises: an open guard would stay installed for later tests
        guard.close()
    return guard


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad"])
def test_a_fault_of_one_median_difference_is_confirmed_at_its_site_and_step(kind, tmp_path):
    site = f"layers.0.mlp.up_proj:{kind}"
    spec = aegis.FaultSpec(site=site, model="perturb", scale=1.0, steps=FAULT_STEPS, seed=11)
    guard = run_with_fault(tmp_path, spec, workload=small_workload(cfg=MEDIUM, batch=8, seq=128))
    injected = {(j.site, j.step): j.fault for j in guard.injector.log}
    assert set(injected) == {(site, s) for s in FAULT_STEPS}
    assert sorted((i.site.name, i.step) for i in guard.incidents) == sorted(injected)
    m, n = GEMM_SHAPE[kind]
    for incident in guard.incidents:
        assert incident.verdict.wrong_execution is WrongExecution.ORIGINAL
        assert incident.identity.rank == 0 and incident.identity.device == "cpu"
        row, col = injected[(incident.site.name, incident.step)].element(m, n)
        tiles = incident.verdict.mismatched_tiles
        assert len(tiles) == 1
        tile = tiles[0]
        assert tile.row_start <= row < tile.row_stop and tile.col_start <= col < tile.col_stop
    summary = guard.summary()
    assert summary.confirmed == len(FAULT_STEPS) and summary.false_alarms == 0


def test_a_high_bit_flip_in_wgrad_is_confirmed(tmp_path):
    spec = aegis.FaultSpec(site="layers.0.attn.wo:wgrad", model="bitflip", bit=29, steps=(20,), seed=2)
    guard = run_with_fault(tmp_path, spec, steps=22)
    assert [(i.site.name, i.step) for i in guard.incidents] == [("layers.0.attn.wo:wgrad", 20)]


@pytest.mark.parametrize("kind", ["dgrad", "wgrad"])
def test_a_backward_fault_fires_when_a_forward_without_gradients_comes_first_in_the_step(kind, tmp_path):
    # An evaluation forward under no_grad before the training forward (a metric, a validation pass,
    # a reentrant checkpoint's first run) is its Linear's call 0 but has no backward: the fault's
    # `steps` strike the first backward that runs, at its step, and it is confirmed there.
    site, steps = f"layers.0.mlp.up_proj:{kind}", (12, 15)
    model, data, optimizer = small_workload()
    config = guard_config(tmp_path, faults=(aegis.FaultSpec(site=site, model="bitflip", bit=29, steps=steps),))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    try:
        for _ in range(17):
            tokens, targets = data.batch()
            with torch.no_grad():
                model(tokens)
            lm_loss(model(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        guard.close()
    assert sorted((j.site, j.step) for j in guard.injector.log) == [(site, s) for s in steps]
    assert sorted((i.site.name, i.step) for i in guard.incidents) == [(site, s) for s in steps]
    assert guard.summary().false_alarms == 0


def test_a_persistent_fault_is_confirmed_as_reproducible(tmp_path):
    spec = aegis.FaultSpec(site="layers.0.attn.wq:fwd", model="bitflip", bit=30, steps=(20,), affects_replay=True)
    guard = run_with_fault(tmp_path, spec, steps=21)
    (incident,) = guard.incidents
    assert incident.verdict.wrong_execution is WrongExecution.REPRODUCIBLE


def test_a_fault_on_an_unsampled_call_corrupts_unseen(tmp_path):
    # After calibration the site is never sampled: the fault still fires (and is logged as ground
    # truth) but no check runs, so nothing can be confirmed. This is what sampling trades away.
    spec = aegis.FaultSpec(site="layers.0.mlp.down_proj:fwd", model="bitflip", bit=30, steps=(30,))
    sampling = aegis.SamplingConfig(per_site=(("layers.0.mlp.down_proj:fwd", 0.0),))
    guard = run_with_fault(tmp_path, spec, steps=31, sampling=sampling)
    assert len(guard.injector.log) == 1 and guard.incidents == []


def test_weight_referencing_vtasks_are_verified_before_the_optimizer_step(tmp_path):
    spec = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=28, steps=(20,))
    guard = run_with_fault(tmp_path, spec, steps=25, verify=aegis.VerifyConfig(time_budget_ms=0.0))
    (incident,) = guard.incidents
    assert incident.verdict.latency_steps == 0  # replayed in the pre-hook of step 20 itself
    conn = sqlite3.connect(guard.store.path)
    assert conn.execute("SELECT latency_steps, decided_step FROM verdicts").fetchall() == [(0, 20)]
    assert conn.execute("SELECT MAX(backlog) FROM steps").fetchone()[0] == 0


def test_the_raise_policy_stops_the_step_before_corrupted_gradients_are_applied(tmp_path):
    model, data, optimizer = small_workload()
    spec = aegis.FaultSpec(site="layers.0.mlp.gate_proj:dgrad", model="bitflip", bit=29, steps=(20,))
    cfg = guard_config(tmp_path, faults=(spec,), response=aegis.ResponseConfig(policy="raise"))
    guard = aegis.protect(model, optimizer=optimizer, config=cfg)
    train(model, data, optimizer, 20)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, targets = data.batch()
    from aegis_sdc.workloads.llama import lm_loss

    loss = lm_loss(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    with pytest.raises(aegis.SilentDataCorruptionError) as caught:
        optimizer.step()
    assert caught.value.incident.site.name == "layers.0.mlp.gate_proj:dgrad"
    assert caught.value.incident.step == 20
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    stored = sqlite3.connect(guard.store.path).execute("SELECT site_id, step FROM incidents").fetchall()
    assert len(stored) == 1 and stored[0][1] == 20  # committed before the raise
    guard.close()


def test_the_exit_policy_exits_with_the_documented_code(tmp_path):
    spec = aegis.FaultSpec(site="layers.0.attn.wk:fwd", model="bitflip", bit=29, steps=(20,))
    with pytest.raises(SystemExit) as caught:
        run_with_fault(tmp_path, spec, steps=21, response=aegis.ResponseConfig(policy="exit"))
    assert caught.value.code == aegis.EXIT_CODE_SDC == 86


def test_the_skip_step_policy_drops_the_corrupted_update(tmp_path):
    model, data, optimizer = small_workload()
    spec = aegis.FaultSpec(site="lm_head:wgrad", model="bitflip", bit=29, steps=(20,))
    cfg = guard_config(tmp_path, faults=(spec,), response=aegis.ResponseConfig(policy="skip-step"))
    guard = aegis.protect(model, optimizer=optimizer, config=cfg)
    train(model, data, optimizer, 20)
    before = {k: v.clone() for k, v in model.named_parameters()}
    train(model, data, optimizer, 1)  # step 20: the fault strikes and is confirmed
    assert all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    train(model, data, optimizer, 1)  # step 21 trains normally again
    assert not all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    assert len(guard.incidents) == 1
    guard.close()


def test_the_warn_policy_warns_and_the_quarantine_list_names_the_device(tmp_path):
    spec = aegis.FaultSpec(site="layers.0.attn.wv:fwd", model="bitflip", bit=29, steps=(20, 22))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", aegis.SilentDataCorruptionWarning)
        guard = run_with_fault(tmp_path, spec, steps=24)
    assert sum(issubclass(w.category, aegis.SilentDataCorruptionWarning) for w in caught) == 2
    lines = (tmp_path / "run" / "quarantine.jsonl").read_text().splitlines()
    assert len(lines) == 1  # one entry per device, however many incidents
    entry = json.loads(lines[0])
    assert entry["host"] == guard.identity.host and entry["rank"] == 0 and entry["device"] == "cpu"
    assert entry["gpu_uuid"] is None and entry["site"] == "layers.0.attn.wv:fwd" and entry["step"] == 20


def test_inference_loops_flush_when_the_buffer_is_full(tmp_path):
    model, data, _ = small_workload()
    guard = aegis.protect(model, config=guard_config(tmp_path, max_pending_calls=5))
    with torch.no_grad():
        for _ in range(3):
            model(data.batch()[0])
    assert len(guard.recorder) < 5  # flushed automatically: at most one sync per full buffer
    assert guard.close().checks == 3 * 8  # eight Linears (7 per block + lm_head), forward only


def test_guard_step_numbers_steps_without_an_optimizer(tmp_path):
    model, data, _ = small_workload()
    guard = aegis.protect(model, config=guard_config(tmp_path), start_step=100)
    model(data.batch()[0]).sum().backward()
    report = guard.step()
    assert report.step == 100 and guard.step_number == 101 and report.checks == 24
    guard.close()
    with pytest.raises(RuntimeError, match="closed"):
        guard.step()


def test_protect_rejects_what_it_cannot_protect(tmp_path):
    with pytest.raises(TypeError, match=r"nn.Module"):
        aegis.protect("model")
    with pytest.raises(TypeError, match="optimizer"):
        aegis.protect(torch.nn.Sequential(torch.nn.Linear(2, 2)), optimizer=object(), config=guard_config(tmp_path))
    with pytest.raises(ValueError, match=r"bare nn.Linear"):
        aegis.protect(torch.nn.Linear(2, 2), config=guard_config(tmp_path))
    # a model an open guard protects: named as such (it read "found no nn.Linear"), free after close
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    first = aegis.protect(model, config=guard_config(tmp_path / "first"))
    with pytest.raises(ValueError, match=r"protected by a guard already; close that guard"):
        aegis.protect(model, config=guard_config(tmp_path / "second"))
    first.close()
    aegis.protect(model, config=guard_config(tmp_path / "second")).close()


def test_verdict_counts_reach_the_summary_and_the_store(tmp_path):
    spec = aegis.FaultSpec(site="layers.0.mlp.down_proj:dgrad", model="bitflip", bit=29, steps=(20,))
    guard = run_with_fault(tmp_path, spec, steps=21)
    conn = sqlite3.connect(guard.store.path)
    kinds = dict(conn.execute("SELECT kind, COUNT(*) FROM verdicts GROUP BY kind").fetchall())
    summary = guard.summary()
    assert kinds.get(VerdictKind.CONFIRMED_SDC.value) == summary.confirmed == 1
    assert kinds.get(VerdictKind.FALSE_ALARM.value, 0) == summary.false_alarms
    run = conn.execute("SELECT summary_json FROM run").fetchone()[0]
    assert json.loads(run)["confirmed"] == 1
    faults = conn.execute("SELECT step, kind FROM events WHERE kind = 'fault_injected'").fetchall()
    assert faults == [(20, "fault_injected")]


def test_a_fault_spec_that_matches_no_site_is_named_after_the_first_step(tmp_path):
    model, data, optimizer = small_workload()
    faults = (
        aegis.FaultSpec(site="layers.0.mlp.up:fwd", model="bitflip", bit=27, steps=(3,)),  # no such module
        aegis.FaultSpec(site="layers.0.mlp.up_proj:*", model="bitflip", bit=27, steps=(3,)),  # a pattern that matches
    )
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=faults))
    with pytest.warns(UserWarning, match="'layers.0.mlp.up:fwd' matches no protected site") as caught:
        train(model, data, optimizer, 2)
    assert sum("matches no protected site" in str(w.message) for w in caught) == 1  # once, for the one spec
    guard.close()
    conn = sqlite3.connect(next((tmp_path / "run").glob("*.sqlite")))
    assert conn.execute("SELECT COUNT(*) FROM events WHERE kind = 'fault_unmatched'").fetchone()[0] == 1


def _lbfgs_steps(model, data, optimizer, guard, steps: int, boundary_in_closure: bool) -> None:
    """LBFGS evaluates its closure (forward and backward) several times inside one optimizer.step,
    updating the weights between evaluations."""
    from aegis_sdc.workloads.llama import lm_loss

    for _ in range(steps):
        inputs, targets = data.batch()

        def closure(inputs=inputs, targets=targets):
            optimizer.zero_grad()
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            if boundary_in_closure:
                guard.step()  # this evaluation's checks judged before LBFGS moves the weights on
            return loss

        optimizer.step(closure)


@pytest.mark.parametrize("fault", [False, True])
def test_an_optimizer_evaluating_a_closure_is_verified_with_the_boundary_at_the_closures_end(tmp_path, fault):
    model, data, _ = small_workload()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    site = "layers.0.mlp.up_proj:fwd"  # its replay multiplies by the weight as the call saw it
    specs = (aegis.FaultSpec(site=site, model="bitflip", bit=30, steps=(4,), row=1, col=2),) if fault else ()
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=specs))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _lbfgs_steps(model, data, optimizer, guard, 6, boundary_in_closure=True)
    summary = guard.close()
    assert [(i.step, i.site.name) for i in guard.incidents] == ([(4, site)] if fault else [])
    # (with the warn policy the corrupted update lands: the replays of the extreme data after it
    # reproduce — data false alarms, which leave every threshold alone)
    assert summary.not_verifiable == 0 and summary.false_alarms == summary.data_false_alarms
    assert summary.false_alarms == 0 or fault
    assert not any("could not be verified" in str(w.message) for w in caught)


def test_without_the_boundary_in_the_closure_the_warning_says_where_to_put_it(tmp_path):
    model, data, _ = small_workload()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    # the first evaluation's forward is struck; LBFGS moves the weight on before the step's end
    spec = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=30, steps=(2,), row=1, col=2)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=(spec,)))
    with pytest.warns(UserWarning, match=r"optimizer.step\(closure\).*guard.step\(\) at the closure's end"):
        _lbfgs_steps(model, data, optimizer, guard, 6, boundary_in_closure=False)
    assert guard.close().not_verifiable > 0


def test_protect_names_a_wrong_start_step_and_an_optimizer_of_another_model(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    for bad in (-5, 2.0, True):
        with pytest.raises(ValueError, match="start_step must be an int"):
            aegis.protect(model, config=guard_config(tmp_path), start_step=bad)
    assert type(model[0]) is torch.nn.Linear
    other = torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="updates none of the model's parameters"):
        aegis.protect(model, optimizer=other, config=guard_config(tmp_path)).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model's own optimizer: no warning
        aegis.protect(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=guard_config(tmp_path),
                      start_step=7).close()  # fmt: skip


def test_a_fault_whose_gemm_never_runs_is_named_at_close(tmp_path):
    # The first Linear's dgrad never runs (its input needs no gradient): a fault planned there cannot
    # strike, and a test or campaign counting on it is told so; one that struck is not named.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    faults = (aegis.FaultSpec(site="0:dgrad", steps=(2,)), aegis.FaultSpec(site="2:fwd", steps=(3,)))
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path, faults=faults))
    for _ in range(5):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard.close()
    named = [str(w.message) for w in caught if "never fired" in str(w.message)]
    assert len(named) == 1 and "'0:dgrad'" in named[0]
    assert [(j.site, j.step) for j in guard.injector.log] == [("2:fwd", 3)]
