import pytest

import aegis_sdc as aegis
from aegis_sdc.config import EXIT_CODE_SDC


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: aegis.ChecksumConfig(forward="col"), "ChecksumConfig.forward"),
        (lambda: aegis.ThresholdConfig(calibration_checks=0), "calibration_checks"),
        (lambda: aegis.ThresholdConfig(margin=0.5), "margin"),
        (lambda: aegis.ThresholdConfig(backoff=1.0), "backoff"),
        (lambda: aegis.ThresholdConfig(floor=0), "floor"),
        (lambda: aegis.SamplingConfig(probability=1.5), "probability"),
        (lambda: aegis.SamplingConfig(per_site={"layers.*": -0.1}), "layers.*"),
        (lambda: aegis.VerifyConfig(time_budget_ms=-1), "time_budget_ms"),
        (lambda: aegis.VerifyConfig(row_block=0), "blocks"),
        (lambda: aegis.ResponseConfig(policy="panic"), "policy"),
        (lambda: aegis.ResponseConfig(exit_code=0), "exit_code"),
        (lambda: aegis.GuardConfig(checksum="row"), "GuardConfig.checksum"),
        (lambda: aegis.GuardConfig(faults=("x",)), "FaultSpec"),
        (lambda: aegis.GuardConfig(max_pending_calls=0), "max_pending_calls"),
        (lambda: aegis.FaultSpec(site="*", model="melt", steps=(1,)), "model"),
        (lambda: aegis.FaultSpec(site="*", bit=32, steps=(1,)), "bit"),
        (lambda: aegis.FaultSpec(site="*", scale=0, steps=(1,)), "scale"),
        (lambda: aegis.FaultSpec(site="*"), "never fires"),
        (lambda: aegis.FaultSpec(site="", steps=(1,)), "site"),
        (lambda: aegis.FaultSpec(site="*", probability=0.1, start_step=5, stop_step=5), "start_step"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_configs_are_frozen_and_normalized():
    cfg = aegis.SamplingConfig(per_site={"lm_head:*": 0.5})
    assert cfg.per_site == (("lm_head:*", 0.5),)
    guard_cfg = aegis.GuardConfig(include="layers.*")
    assert guard_cfg.include == ("layers.*",)
    with pytest.raises(AttributeError):
        guard_cfg.run_dir = "x"  # frozen
    assert aegis.ResponseConfig().exit_code == EXIT_CODE_SDC == 86
    assert aegis.GuardConfig().to_dict()["checksum"] == {"forward": "row", "dgrad": "row", "wgrad": "row+col"}
