"""Prometheus metrics (integrations/metrics.py): the text a node_exporter textfile collector reads,
parsed back, agrees with the guard's summary after a run with a confirmed fault."""

from __future__ import annotations

import pytest
from tests.helpers import guard_config, small_workload, train

import aegis_sdc as aegis

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from aegis_sdc.integrations.metrics import GuardMetrics  # noqa: E402


def test_the_textfile_agrees_with_the_summary(tmp_path):
    model, data, optimizer = small_workload()
    fault = aegis.FaultSpec(site="layers.0.mlp.up_proj:fwd", model="bitflip", bit=30, steps=(3,))
    config = guard_config(tmp_path, faults=(fault,), thresholds=aegis.ThresholdConfig(calibration_checks=2))
    guard = aegis.protect(model, optimizer=optimizer, config=config)
    metrics = GuardMetrics(guard)
    with pytest.warns(aegis.SilentDataCorruptionWarning):
        train(model, data, optimizer, 5)
    summary = guard.summary()
    path = tmp_path / "aegis.prom"
    metrics.write_textfile(str(path))
    samples = {
        (sample.name, sample.labels.get("kind")): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
        if sample.name.endswith("_total") or not sample.name.endswith("_created")
    }
    assert samples[("aegis_steps_total", None)] == 5
    assert samples[("aegis_checks_total", None)] == summary.checks
    assert samples[("aegis_alarms_total", None)] == summary.alarms
    assert samples[("aegis_confirmed_sdc_total", None)] == summary.confirmed == 1
    assert samples[("aegis_verdicts_total", "confirmed_sdc")] == 1
    assert samples[("aegis_verification_backlog", None)] == 0
    assert 0.0 < samples[("aegis_checked_flops_fraction", None)] <= 1.0
    assert 'rank="0"' in path.read_text()
    guard.close()
