"""Verifier triage on real replay contexts: every verdict, the execution blamed, and scheduling."""

from __future__ import annotations

import pytest
import torch

from aegis_sdc.config import VerifyConfig
from aegis_sdc.events import Channel, Evidence, GemmKind, Site, VerdictKind, VTask, WrongExecution
from aegis_sdc.faults.models import AccumulatorFault
from aegis_sdc.kernels.reference import Tiling, checked_gemm
from aegis_sdc.ops.gemm_replay import GemmCapture, GemmOperands
from aegis_sdc.verify.verifier import Verifier

SITE = Site(0, "layer", GemmKind.FORWARD)
TILING = Tiling(32, 32)


def make_task(
    *,
    dtype=torch.float32,
    fault=None,
    extent="rows",
    channel=Channel.ROW,
    row=40,
    col=20,
    a=None,
    task_id=1,
    step=3,
    copy_whole=False,
):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(100, 64, generator=g).to(dtype) if a is None else a
    b = torch.randn(64, 70, generator=g).to(dtype)
    ops = GemmOperands(a, b, None, dtype, TILING)
    result = checked_gemm(a, b, out_dtype=dtype, col_check=True, tiling=TILING, fault=fault)
    capture = GemmCapture(ops, result, extent=extent, row_index=row, col_index=col, fault=fault, copy_whole=copy_whole)
    evidence = Evidence(SITE, step, 0, channel, 99.0, 10.0, row, 1.0, capture.region, (channel,))
    return VTask(task_id, evidence, capture), b


def fault_at(row, col, model="perturb", delta=5.0, bit=30, persistent=False):
    return AccumulatorFault(model, bit, delta, row, col, 0.0, 0.0, affects_replay=persistent)


def test_a_clean_block_is_a_false_alarm():
    task, _ = make_task()
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.FALSE_ALARM and verdict.wrong_execution is None


@pytest.mark.parametrize("extent", ["rows", "tile", "cols"])
def test_a_fault_in_the_training_step_is_confirmed_and_located(extent):
    task, _ = make_task(fault=fault_at(40, 20), extent=extent)
    verdict = Verifier(VerifyConfig()).verify(task, step=5)
    assert verdict.kind is VerdictKind.CONFIRMED_SDC
    assert verdict.wrong_execution is WrongExecution.ORIGINAL
    assert verdict.latency_steps == 2
    (tile,) = verdict.mismatched_tiles  # exactly the 32×32 tile holding element (40, 20)
    assert (tile.row_start, tile.row_stop, tile.col_start, tile.col_stop) == (32, 64, 0, 32)
    assert not verdict.no_effect_on_output


def test_a_fault_absorbed_by_rounding_is_still_confirmed():
    # bf16 output: +2⁻¹⁴ on an element of magnitude ~8 changes the fp32 accumulator but not the
    # rounded bf16 value (its spacing there is 2⁻⁴); the fp32 checksum still proves the corruption.
    task, _ = make_task(dtype=torch.bfloat16, fault=fault_at(40, 20, delta=2.0**-14))
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.CONFIRMED_SDC
    assert verdict.no_effect_on_output


def test_a_wrong_first_replay_is_blamed_on_the_replay():
    task, _ = make_task()
    capture = task.payload
    honest = capture.replay
    calls = []

    def first_replay_wrong():
        result = honest()
        if not calls:
            result.out[0, 0] += 1.0
        calls.append(1)
        return result

    capture.replay = first_replay_wrong
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.CONFIRMED_SDC and verdict.wrong_execution is WrongExecution.REPLAY


def test_three_different_executions_are_unstable():
    task, _ = make_task()
    capture = task.payload
    honest = capture.replay
    calls = []

    def always_different():
        result = honest()
        calls.append(1)
        result.out[0, 0] += float(len(calls))
        return result

    capture.replay = always_different
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.wrong_execution is WrongExecution.UNSTABLE


def test_a_persistent_fault_that_replays_identically_is_confirmed_by_the_exact_bound():
    task, _ = make_task(fault=fault_at(40, 20, model="bitflip", bit=30, persistent=True))
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.CONFIRMED_SDC
    assert verdict.wrong_execution is WrongExecution.REPRODUCIBLE


def test_a_wrong_reference_side_is_confirmed():
    task, _ = make_task()
    task.payload.saved.row_ref[3] += 1e-3  # the training step's A·(B·1) was computed wrong
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.CONFIRMED_SDC and "reference side" in verdict.detail


def test_a_weight_changed_before_the_replay_makes_the_task_not_verifiable():
    task, b = make_task()
    b.add_(1.0)  # what an optimizer step does to a referenced weight
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.NOT_VERIFIABLE and "modified" in verdict.detail


def test_a_weight_freed_before_the_replay_is_named_and_a_copied_one_still_verifies():
    # FSDP2 resizes an unsharded weight's storage to zero once the module has run.
    task, b = make_task(fault=fault_at(40, 20))
    b.untyped_storage().resize_(0)
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.NOT_VERIFIABLE and "freed before the replay" in verdict.detail
    task, b = make_task(fault=fault_at(40, 20), copy_whole=True)  # what captures do under attach_fsdp
    assert not task.payload.references_tensors
    b.untyped_storage().resize_(0)
    assert Verifier(VerifyConfig()).verify(task, step=3).kind is VerdictKind.CONFIRMED_SDC


def test_nonfinite_operands_are_reported_as_nonfinite_input():
    a = torch.randn(100, 64)
    a[41, 3] = float("nan")
    task, _ = make_task(a=a, channel=Channel.NONFINITE, row=41)
    verdict = Verifier(VerifyConfig()).verify(task, step=3)
    assert verdict.kind is VerdictKind.NONFINITE_INPUT


def test_scheduling_respects_references_budget_and_backlog():
    verifier = Verifier(VerifyConfig(time_budget_ms=0.0, max_backlog=3))
    referencing = [make_task(extent="rows", task_id=i)[0] for i in (1, 2)]  # reference the weight B
    copied = [make_task(extent="tile", task_id=i)[0] for i in (3, 4, 5, 6, 7)]  # own copies only
    assert all(t.references_tensors for t in referencing) and not any(t.references_tensors for t in copied)
    verifier.submit(referencing + copied)
    verdicts = verifier.run(step=3)
    verified = {v.vtask_id for v in verdicts}
    assert {1, 2} <= verified  # weight-referencing tasks never wait, whatever the budget
    assert verifier.backlog == 3  # with no budget, copied tasks wait — but never more than max_backlog
    assert verifier.telemetry.max_backlog == 3
    later = verifier.run(step=5, drain=True)
    assert {v.vtask_id for v in later} == {3, 4, 5, 6, 7} - verified
    assert all(v.latency_steps == 2 for v in later)
    assert verifier.backlog == 0
