"""A long clean run: every Linear protected, zero confirmed incidents, false alarms counted."""

import sqlite3

import pytest
from tests.helpers import guard_config, small_workload, train

import aegis_sdc as aegis
from aegis_sdc.workloads.llama import LlamaConfig


@pytest.mark.slow
def test_200_clean_steps_confirm_nothing(tmp_path):
    # 9 000 checks over a loss falling by more than 2: a false confirmation rate of 1e-3 per check
    # would show ~9 times (the clean matrices and the GPU runs add hundreds of thousands more)
    cfg = LlamaConfig()  # the demo's workload: 2 layers, 45 sites; 512 tokens per step (the demo: 1024)
    model, data, optimizer = small_workload(cfg=cfg, batch=4, seq=128)
    guard = aegis.protect(model, optimizer=optimizer, config=guard_config(tmp_path))
    losses = train(model, data, optimizer, 200)
    summary = guard.close()
    assert losses[-1] < losses[0] - 2.0
    assert summary.steps == 200 and summary.checks == 200 * 45
    assert summary.confirmed == 0 and summary.not_verifiable == 0 and summary.nonfinite_inputs == 0
    # False alarms are allowed (each one costs a replay and widens its threshold), but must be rare,
    # every one must have been replayed, and the store must agree with the summary.
    assert summary.false_alarms == summary.alarms
    assert summary.false_alarm_rate < 1e-3
    conn = sqlite3.connect(guard.store.path)
    assert conn.execute("SELECT COUNT(*) FROM incidents").fetchone()[0] == 0
    assert (
        conn.execute("SELECT COUNT(*) FROM verdicts WHERE kind = 'false_alarm'").fetchone()[0] == summary.false_alarms
    )
    print(
        f"\nclean run: {summary.checks} checks, {summary.false_alarms} false alarms "
        f"({summary.false_alarm_rate:.2e} per check)"
    )
