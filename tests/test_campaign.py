"""Fault campaigns on the CPU workload: every fault inside the claimed coverage that changed training
is confirmed and localized, the clean twins confirm nothing, and a sensor that misses inside its
claim fails the campaign."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from aegis_sdc.campaign import LOCATIONS, CampaignConfig, Trial, run_campaign
from aegis_sdc.campaign.coverage import GEMM_MARGIN, Claim, inside
from aegis_sdc.campaign.trials import ELEMENTWISE_OPS
from aegis_sdc.faults.injector import Injection
from aegis_sdc.faults.models import AccumulatorFault

CLAIMED = ("gemm_fwd", "gemm_dgrad", "gemm_wgrad", "saved", "elementwise", "optimizer_update")


@pytest.mark.slow
def test_a_ci_sized_campaign_confirms_every_fault_inside_its_claims():
    # 132 trials: 12 per location, each location's cells in turn (the full record is
    # benchmarks/results/campaign_cpu.json, 2 000 trials).
    result = run_campaign(CampaignConfig(trials=132, twin_every=33))
    summary = result.summary()
    assert summary["trials"] == 132 and {t.trial.location for t in result.trials} == set(LOCATIONS)
    # every trial's fault fired: no site is drawn where its fault cannot strike (the embedding saves
    # only token ids, which a `:saved` fault leaves alone)
    assert all(t.injected for t in result.trials), [t.trial.site for t in result.trials if not t.injected]
    assert summary["missed_inside_coverage"] == 0, [m.to_dict() for m in result.misses_inside()]
    assert summary["false_confirmed"] == 0 and summary["twin_false_alarms"] == 0 and summary["twins_identical"]
    assert summary["clean_twins"] == 5  # before the first trial, every 33, after the last
    assert summary["localized"] >= 0.99
    by_location = {loc: [t for t in result.trials if t.trial.location == loc] for loc in LOCATIONS}
    for location in CLAIMED:  # each claim is exercised: faults inside it, all confirmed
        assert any(t.inside for t in by_location[location]), location
    for location in ("optimizer_state", "weights"):  # one process: no replica votes, nothing claimed
        assert not result.claims[location].claimed and not any(t.inside for t in by_location[location])
    assert all(t.confirmed for t in by_location["optimizer_update"])  # any flipped bit of an update
    for op in ELEMENTWISE_OPS:  # a norm's output, the activation product, the residual sum: each caught
        inside_op = [t for t in by_location["elementwise"] if t.trial.stage == op and t.inside]
        assert inside_op and all(t.confirmed and t.localized for t in inside_op), op
    assert summary["gemm_trials_sized"] == sum(len(by_location[loc]) for loc in CLAIMED[:3])


@pytest.mark.gpu
def test_a_gpu_campaign_strikes_every_location_and_confirms_every_fault_inside_its_claims():
    # bf16 on the Triton kernels, attention on the checked Triton kernels (`triton_attention`): every
    # location's fault fires, attention's included (on CUDA they run nowhere else). The full record
    # is benchmarks/results/campaign_gpu.json.
    result = run_campaign(CampaignConfig(trials=88, device="cuda", dtype="bfloat16", twin_every=44))
    summary = result.summary()
    assert {t.trial.location for t in result.trials} == set(LOCATIONS)
    assert all(t.injected for t in result.trials), [t.trial.site for t in result.trials if not t.injected]
    assert summary["missed_inside_coverage"] == 0, [m.to_dict() for m in result.misses_inside()]
    assert summary["false_confirmed"] == 0 and summary["twin_false_alarms"] == 0 and summary["twins_identical"]
    assert summary["localized"] >= 0.99
    # Attention, measured rather than claimed: flips of the top mantissa bit and of the exponent (bits
    # 22, 30), one per stage and bit, change training; each is confirmed. dS flips are left out of the
    # assertion: 2 of the 5 that changed training went unconfirmed in the 600-trial record.
    stages = ("attention_fwd", "attention_bwd")
    config = CampaignConfig(trials=16, device="cuda", dtype="bfloat16", locations=stages, bits=(22, 30), twin_every=100)
    attention = run_campaign(config)
    assert all(t.injected for t in attention.trials) and attention.summary()["false_confirmed"] == 0
    affected = [t for t in attention.trials if t.affected]
    assert len(affected) >= 8, [(t.trial.stage, t.trial.cell) for t in attention.trials]
    assert all(t.confirmed for t in affected if t.trial.stage != "ds"), [
        (t.trial.location, t.trial.stage, t.trial.cell) for t in affected if not t.confirmed
    ]


def test_a_sensor_that_misses_inside_its_claim_fails_the_campaign(monkeypatch):
    # The update replay made blind (its records never mismatch): every optimizer-update fault that
    # changed training is now a miss inside the claimed coverage.
    from aegis_sdc.sensors import update_replay

    monkeypatch.setattr(update_replay.UpdateRecord, "mismatched", lambda self: [])
    result = run_campaign(CampaignConfig(trials=4, locations=("optimizer_update",), twin_every=10))
    assert result.summary()["missed_inside_coverage"] == 4
    assert all(t.inside and not t.confirmed for t in result.trials)


def _gemm_trial() -> Trial:
    return Trial(0, "gemm_fwd", "layers.0.attn.wq:fwd", "bitflip", 20.0, 1)


def _injection(size: float | None, threshold: float = 10.0) -> Injection:
    fault = AccumulatorFault("bitflip", 20, 0.0, None, None, 0.0, 0.0)
    return Injection("layers.0.attn.wq:fwd", 3, 0, fault, size=size, threshold=threshold)


def test_a_gemm_fault_is_claimed_above_twice_its_threshold_only_when_it_changed_training():
    claims = {"gemm_fwd": Claim("gemm_fwd", "GEMM row checksum + replay", 1.0, "", True)}
    trial = _gemm_trial()
    assert inside(trial, claims, [_injection(GEMM_MARGIN * 10.0 + 0.1)], affected=True, recompute_sites=())
    assert not inside(trial, claims, [_injection(GEMM_MARGIN * 10.0 - 0.1)], affected=True, recompute_sites=())
    assert not inside(trial, claims, [_injection(100.0)], affected=False, recompute_sites=())
    assert not inside(trial, claims, [_injection(None)], affected=True, recompute_sites=())  # not measured
    unchecked = {"gemm_fwd": Claim("gemm_fwd", "", 0.0, "", False)}
    assert not inside(trial, unchecked, [_injection(100.0)], affected=True, recompute_sites=())


def test_aegis_campaign_writes_its_record_as_it_goes_and_exits_0(tmp_path, monkeypatch):
    from aegis_sdc.campaign import report, runner
    from aegis_sdc.cli import app

    monkeypatch.setattr(runner, "PARTIAL_EVERY_S", 0.0)  # a partial record after every trial
    written = []  # (complete, trials) of each record as it landed in the file
    write = report.write

    def recording(result, out, env):
        doc = write(result, out, env)
        on_disk = json.loads(out.read_text())["summary"]
        written.append((on_disk["complete"], on_disk["trials"]))
        return doc

    monkeypatch.setattr(report, "write", recording)
    out = tmp_path / "campaign.json"
    result = CliRunner().invoke(app, ["campaign", "--trials", "11", "--out", str(out), "--plots", str(tmp_path)])
    assert result.exit_code == 0, result.output
    # killed after any trial, the file would hold the record up to it; the last write is the whole one
    assert written == [(False, n) for n in range(1, 11)] + [(True, 11)]
    assert "campaign: 10/11 trials" in result.stderr  # not a terminal: a line per partial record
    doc = json.loads(out.read_text())
    assert set(doc) == {"env", "rows", "summary", "claims", "cells"} and len(doc["rows"]) == 11
    for key in ("trials", "confirmed_inside_coverage", "missed_inside_coverage", "localized", "false_confirmed"):
        assert key in doc["summary"]
    assert (tmp_path / "campaign_coverage.png").stat().st_size > 0
    assert (tmp_path / "campaign_gemm_sensitivity.png").stat().st_size > 0


@pytest.mark.slow
def test_a_campaign_over_three_ranks_names_the_rank_whose_gradient_bucket_went_wrong():
    # 12 trials over 3 gloo processes, exponent and mantissa bits: a rank's local gradient before the
    # all-reduce (the peer replay's claim: any change) and one element of the reduced bucket on one
    # rank (the collective check's claim: over twice its rounding bound).
    from aegis_sdc.campaign.ranks import RankCampaignConfig, run_rank_campaign

    result = run_rank_campaign(RankCampaignConfig(trials=12, world=3, bits=(30, 23, 16, 8), twin_every=6))
    summary = result.summary()
    assert summary["missed_inside_coverage"] == 0, [r for r in result.rows if r["inside"] and not r["confirmed"]]
    assert summary["false_confirmed"] == 0 and summary["twin_false_alarms"] == 0 and summary["clean_twins"] == 3
    assert summary["wrong_rank_named"] == 0 and summary["localized"] == 1.0
    by_location = {loc: [r for r in result.rows if r["location"] == loc] for loc in ("allreduce_result",
                                                                                     "allreduce_input")}  # fmt: skip
    for location, rows in by_location.items():
        assert len(rows) == 6 and all(r["injected"] for r in rows), location
        assert any(r["inside"] for r in rows), location  # each claim is exercised
    for r in by_location["allreduce_input"]:  # any change: the peer replay names the rank at its step
        assert r["by_claimed_sensor"] == r["affected"], r
    for r in by_location["allreduce_result"]:
        if r["inside"]:  # the collective check names the rank at the fault's step (3 ranks: a majority)
            assert r["by_claimed_sensor"] and r["size"] > 2.0, r
    assert result.claims["allreduce_input"]["claimed"] and result.claims["allreduce_result"]["claimed"]


def test_aegis_campaign_over_ranks_writes_its_record(tmp_path):
    from aegis_sdc.cli import app

    out = tmp_path / "ranks.json"
    result = CliRunner().invoke(app, ["campaign", "--ranks", "2", "--trials", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert set(doc) == {"env", "rows", "summary", "claims", "cells"} and len(doc["rows"]) == 2
    assert doc["summary"]["world"] == 2 and doc["env"]["campaign"]["world"] == 2
    assert CliRunner().invoke(app, ["campaign", "--ranks", "1"]).exit_code == 2
