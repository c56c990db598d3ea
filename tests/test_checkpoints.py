"""Certified checkpoints and rollback (response/checkpoints.py, docs/response.md): a confirmed SDC
rolls training back onto a checkpoint known to be clean, and the run ends bit for bit where a run
without the fault ends."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from tests.helpers import small_workload
from tests.reliability_workers import TINY
from typer.testing import CliRunner

import aegis_sdc as aegis
from aegis_sdc.cli import app
from aegis_sdc.response.checkpoints import CheckpointError, load_state, read_certificate
from aegis_sdc.store.sqlite import read_checkpoints, read_incidents
from aegis_sdc.workloads.llama import lm_loss

SITE = "layers.0.attn.wq:fwd"
STEPS = 14
EVERY = 4  # a checkpoint every this many steps


def one_step(model, optimizer, x, y) -> None:
    loss = lm_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def batches(data, n: int) -> list:
    return [data.batch() for _ in range(n)]


def train_with_checkpoints(tmp_path: Path, name: str, faults=(), policy="warn", start=None, steps=STEPS):
    """Train to `steps` by the guard's step number (a rollback moves it back), saving a checkpoint every
    EVERY steps; `start`: a checkpoint to resume from. Returns the model, optimizer and guard."""
    model, data, optimizer = small_workload()
    inputs = batches(data, steps)
    config = aegis.GuardConfig(run_dir=str(tmp_path / name), faults=tuple(faults),
                               response=aegis.ResponseConfig(policy=policy))  # fmt: skip
    first = 0
    if start is not None:
        state = load_state(start)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"]
    guard = aegis.protect(model, optimizer=optimizer, config=config, start_step=first)
    positions = []
    # the callback sees the guard already at the checkpoint's step, as the loop will after the step
    guard.on_rollback(lambda step, extra: positions.append((step, extra["data_step"], guard.step_number)))
    try:
        while guard.step_number < steps:
            x, y = inputs[guard.step_number]
            one_step(model, optimizer, x, y)
            if guard.step_number % EVERY == 0:
                guard.save_checkpoint(tmp_path / name / f"ckpt-{guard.step_number}.pt",
                                      extra={"data_step": guard.step_number})  # fmt: skip
    finally:
        guard.close()
    guard.positions = positions
    return model, optimizer, guard


def assert_bit_identical(a, b) -> None:
    (model_a, opt_a), (model_b, opt_b) = a, b
    for (name, p), q in zip(model_a.state_dict().items(), model_b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    for sa, sb in zip(opt_a.state_dict()["state"].values(), opt_b.state_dict()["state"].values(), strict=True):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), key


FAULT = aegis.FaultSpec(site=SITE, model="bitflip", bit=29, steps=(10,))


def test_rollback_ends_bit_identical_to_the_run_without_the_fault(tmp_path):
    clean_model, clean_opt, _ = train_with_checkpoints(tmp_path, "clean")
    model, optimizer, guard = train_with_checkpoints(tmp_path, "faulty", faults=(FAULT,), policy="rollback")
    assert [(i.site.name, i.step) for i in guard.incidents] == [(SITE, 10)]
    assert guard.rollbacks == 1 and guard.positions == [(8, 8, 8)]  # back to the checkpoint of step 8
    assert_bit_identical((model, optimizer), (clean_model, clean_opt))
    # every checkpoint certified: the fault never reached one (step 10's update was never applied)
    # (8 twice: the loop saves again right after the rollback, the restored state, at the same path)
    assert [(c.step, c.status) for c in guard.certificates] == [(4, "certified"), (8, "certified"),
                                                                (8, "certified"), (12, "certified")]  # fmt: skip
    stored = read_checkpoints(tmp_path / "faulty")
    assert [(r["step"], r["status"]) for r in stored] == [(4, "certified"), (8, "certified"), (12, "certified")]


def test_a_rollback_passes_over_a_damaged_checkpoint_to_the_certified_one_before(tmp_path):
    model, data, optimizer = small_workload()
    inputs = batches(data, STEPS)
    config = aegis.GuardConfig(run_dir=str(tmp_path / "run"), faults=(FAULT,),
                               response=aegis.ResponseConfig(policy="rollback"))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    positions = []
    guard.on_rollback(lambda step, extra: positions.append(step))
    while guard.step_number < 10:
        one_step(model, optimizer, *inputs[guard.step_number])
        if guard.step_number in (4, 8):
            guard.save_checkpoint(tmp_path / f"ckpt-{guard.step_number}.pt")
    damaged = tmp_path / "ckpt-8.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # truncated on disk after it was certified
    with pytest.warns(aegis.SilentDataCorruptionWarning):
        one_step(model, optimizer, *inputs[10])  # step 10's fault: rolled back, to step 4's state
    summary = guard.close()
    assert positions == [4] and guard.rollbacks == 1 and summary.confirmed == 1
    for name, value in load_state(tmp_path / "ckpt-4.pt")["model"].items():
        assert torch.equal(model.state_dict()[name], value), name
    statuses = {c.step: (c.status, c.reason) for c in guard.certificates}
    assert statuses[4][0] == "certified" and statuses[8][0] == "uncertified"
    assert "unreadable when a rollback needed it" in statuses[8][1]
    assert read_certificate(damaged).status == "uncertified"


def test_a_checkpoint_after_a_corrupted_update_is_never_certified(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aegis.SilentDataCorruptionWarning)
        _, _, guard = train_with_checkpoints(tmp_path, "warned", faults=(FAULT,), policy="warn")
    statuses = {c.step: (c.status, c.reason) for c in guard.certificates}
    assert statuses[4][0] == statuses[8][0] == "certified"
    assert statuses[12][0] == "uncertified" and "from step 11" in statuses[12][1]
    on_disk = read_certificate(tmp_path / "warned" / "ckpt-12.pt")
    assert on_disk.status == "uncertified" and on_disk.fingerprints == guard.certificates[-1].fingerprints


def test_exit_then_a_restart_from_the_certified_checkpoint_ends_bit_identical(tmp_path):
    clean = train_with_checkpoints(tmp_path, "clean")[:2]
    with pytest.raises(SystemExit) as stopped:
        train_with_checkpoints(tmp_path, "exited", faults=(FAULT,), policy="exit")
    assert stopped.value.code == aegis.EXIT_CODE_SDC
    certified = [r for r in read_checkpoints(tmp_path / "exited") if r["status"] == "certified"]
    assert [r["step"] for r in certified] == [4, 8]
    # the second process: resumes from the latest certified checkpoint on a healthy device
    done = _context().Process(target=_resume, args=(str(tmp_path), certified[-1]["path"]))
    done.start()
    done.join(300)
    assert done.exitcode == 0
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    model, _, optimizer = small_workload()
    model.load_state_dict(resumed["model"])
    optimizer.load_state_dict(resumed["optimizer"])
    assert_bit_identical((model, optimizer), clean)


def _resume(tmp: str, checkpoint: str) -> None:
    model, optimizer, _ = train_with_checkpoints(Path(tmp), "resumed", start=checkpoint)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, Path(tmp) / "resumed.pt")


def test_a_checkpoint_that_differs_from_its_certificate_is_refused(tmp_path):
    _, _, guard = train_with_checkpoints(tmp_path, "run", steps=5)
    path = Path(guard.certificates[0].path)
    state = torch.load(path, weights_only=True)
    state["model"]["layers.0.attn.wq.weight"][0, 0] += 1.0
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="does not match its certificate"):
        load_state(path)


def test_a_certificate_written_with_the_earlier_fingerprint_function_is_checked_with_it(tmp_path):
    # A certificate from before `fingerprint_function` existed holds function-1 fingerprints: it must
    # still verify its checkpoint (not be taken for a corrupted one), and still catch a change.
    from aegis_sdc.response.checkpoints import certificate_path, fingerprints

    _, _, guard = train_with_checkpoints(tmp_path, "run", steps=5)
    path = Path(guard.certificates[0].path)
    state = torch.load(path, weights_only=True)
    doc = json.loads(certificate_path(path).read_text())
    assert doc.pop("fingerprint_function") == 2
    doc["fingerprints"] = fingerprints(state, function=1)
    assert doc["fingerprints"] != fingerprints(state)  # the two functions differ: the test can tell
    certificate_path(path).write_text(json.dumps(doc))
    assert read_certificate(path).fingerprint_function == 1
    load_state(path)
    state["model"]["layers.0.attn.wq.weight"][0, 0] += 1.0
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="does not match its certificate"):
        load_state(path)


def test_aegis_checkpoints_lists_them_with_their_status(tmp_path):
    train_with_checkpoints(tmp_path, "run", steps=9)
    result = CliRunner().invoke(app, ["checkpoints", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["step"], r["status"]) for r in rows] == [(4, "certified"), (8, "certified")]


# -- kills -----------------------------------------------------------------------------------------
@functools.cache
def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "aegis_sdc", "tests.helpers", "tests.reliability_workers"])
    return ctx


def _checkpoint_forever(run_dir: str) -> None:
    """Checkpoint every step while a fault strikes now and then (warn: the corrupted updates land)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, data, optimizer = small_workload(cfg=TINY, batch=2, seq=32)
    fault = aegis.FaultSpec(site=SITE, model="bitflip", bit=30, steps=range(12, 10**6, 7))
    guard = aegis.protect(model, optimizer=optimizer, config=aegis.GuardConfig(run_dir=run_dir, faults=(fault,)))
    while True:
        x, y = data.batch()
        one_step(model, optimizer, x, y)
        step = guard.step_number  # its own file up to step 16, then three files in turn
        guard.save_checkpoint(Path(run_dir) / (f"ckpt-{step}.pt" if step <= 16 else f"ckpt-r{step % 3}.pt"))


@pytest.mark.slow
def test_sigkill_never_leaves_a_certified_checkpoint_incomplete_or_corrupted(tmp_path):
    rng = random.Random(18)
    certified_seen = 0
    for trial in range(30):
        run_dir = tmp_path / f"run{trial}"
        child = _context().Process(target=_checkpoint_forever, args=(str(run_dir),))
        child.start()
        deadline = time.monotonic() + 120
        while not (run_dir / "ckpt-1.pt").exists() and child.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop is saving checkpoints from here on
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
        incidents = read_incidents(run_dir) if (run_dir / "aegis-rank00000.sqlite").exists() else []
        corrupt_from = min((i["step"] + 1 for i in incidents), default=None)
        for path in run_dir.glob("ckpt-*.pt"):
            certificate = read_certificate(path)
            if certificate is None or certificate.status != "certified":
                continue
            certified_seen += 1
            state = load_state(path)  # complete, and its tensors are what was certified
            assert state["step"] == certificate.step
            assert corrupt_from is None or certificate.step < corrupt_from
    assert certified_seen >= 10


# -- torch.distributed.checkpoint, saved and certified by the caller ------------------------------
def test_dcp_checkpoints_certified_by_the_caller_roll_back_bit_identical(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from aegis_sdc.response.checkpoints import verify_state

    clean = train_with_checkpoints(tmp_path, "clean")[:2]
    model, data, optimizer = small_workload()
    inputs = batches(data, STEPS)
    config = aegis.GuardConfig(run_dir=str(tmp_path / "dcp"), faults=(FAULT,),
                               response=aegis.ResponseConfig(policy="rollback"))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)

    def restore(path: str) -> dict:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=path)
        verify_state(path, state)  # what was loaded is what was certified
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return {"data_step": int(Path(path).name.split("-")[1])}

    guard.on_rollback(restore=restore)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # DCP in one process, without a process group
        warnings.simplefilter("ignore", UserWarning)
        while guard.step_number < STEPS:
            x, y = inputs[guard.step_number]
            one_step(model, optimizer, x, y)
            if guard.step_number % EVERY == 0:
                model_state, optim_state = get_state_dict(model, optimizer)
                state = {"model": model_state, "optimizer": optim_state}
                path = tmp_path / "dcp" / f"step-{guard.step_number}"
                dcp.save(state, checkpoint_id=path)
                guard.certify(path, state)
    guard.close()
    assert guard.rollbacks == 1 and [(i.site.name, i.step) for i in guard.incidents] == [(SITE, 10)]
    assert (tmp_path / "dcp" / "step-8" / "aegis-certificate.json").exists()
    assert all(c.status == "certified" and c.saved_by == "caller" for c in guard.certificates)
    assert_bit_identical((model, optimizer), clean)


def test_a_caller_certified_checkpoint_without_a_restore_is_not_rolled_back_to(tmp_path):
    model, data, optimizer = small_workload()
    config = aegis.GuardConfig(run_dir=str(tmp_path / "run"), faults=(FAULT,),
                               response=aegis.ResponseConfig(policy="rollback"))  # fmt: skip
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    with pytest.raises(aegis.SilentDataCorruptionError, match="no certified checkpoint to roll back to"):
        while True:
            x, y = data.batch()
            one_step(model, optimizer, x, y)
            torch.save(model.state_dict(), tmp_path / "mine.pt")
            guard.certify(tmp_path / "mine.pt", model.state_dict())
    guard.close()
    assert guard.certificates[0].certified and guard.rollbacks == 0


@pytest.mark.parametrize("edit", ["emptied fingerprints", "no fingerprints", "bogus status", "step in words", "a list"])
def test_a_hand_edited_certificate_is_refused_not_trusted(tmp_path, edit):
    model, data, optimizer = small_workload()
    guard = aegis.protect(model, optimizer=optimizer, config=aegis.GuardConfig(run_dir=str(tmp_path / "run")))
    one_step(model, optimizer, *data.batch())
    path = tmp_path / "ckpt.pt"
    certificate = guard.save_checkpoint(path)
    guard.close()
    on_disk = Path(str(path) + ".aegis-certificate.json")
    assert certificate.certified and read_certificate(path).certified and load_state(path)["step"] == 1
    content = json.loads(on_disk.read_text())
    if edit == "emptied fingerprints":
        content["fingerprints"] = {}
    elif edit == "no fingerprints":
        del content["fingerprints"]
    elif edit == "bogus status":
        content["status"] = "bogus"
    elif edit == "step in words":
        content["step"] = "nine"
    else:
        content = [1, 2]
    on_disk.write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=r"ckpt\.pt"):
        load_state(path)  # what a rollback and a resume read
