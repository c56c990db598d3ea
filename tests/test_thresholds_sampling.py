"""Threshold life cycle and sampling decisions."""

import math

from aegis_sdc.config import ThresholdConfig
from aegis_sdc.sensors.sampling import Sampler
from aegis_sdc.sensors.thresholds import ThresholdState, worst_case_bound


def test_calibration_sets_the_base_from_the_median_of_clean_values():
    state = ThresholdState(ThresholdConfig(calibration_checks=5, margin=4.0), hard_bound=1e6)
    assert state.calibrating and state.current == 1e6  # the exact worst case guards calibration
    for value in (10.0, 12.0, 11.0, 500.0, 9.0):  # one outlier cannot move a median
        state.observe_clean(value)
    assert not state.calibrating
    assert state.base == state.current == 44.0


def test_exactly_zero_differences_are_no_calibration_samples():
    # LoRA's B starts at zero: A's wgrad and B's forward are all-zero products whose two sides agree
    # exactly — not rounding noise. Counted, the zeros would have set the median at 2.0.
    state = ThresholdState(ThresholdConfig(calibration_checks=5, margin=4.0), hard_bound=1e6)
    for value in (0.0, 0.0, 2.0, 4.4, 3.0):
        state.observe_clean(value)
    assert state.base == 4.0 * 3.0  # the median of (2.0, 4.4, 3.0)


def test_false_alarms_double_and_clean_windows_halve_back_to_the_base():
    cfg = ThresholdConfig(calibration_checks=1, margin=2.0, relax_window=3)
    state = ThresholdState(cfg, hard_bound=1e6)
    state.observe_clean(10.0)
    assert state.current == 20.0
    state.on_false_alarm(25.0)
    state.on_false_alarm(45.0)
    assert state.current == 80.0 and state.false_alarms == 2
    for _ in range(3):
        state.observe_clean(5.0)
    assert state.current == 40.0
    for _ in range(9):
        state.observe_clean(5.0)
    assert state.current == 20.0  # never below the base


def test_the_base_respects_floor_and_hard_bound():
    low = ThresholdState(ThresholdConfig(calibration_checks=1, floor=1.0), hard_bound=1e6)
    low.observe_clean(0.0)  # exact arithmetic (e.g. integer-valued data) gives zero differences
    assert low.base == 1.0
    high = ThresholdState(ThresholdConfig(calibration_checks=1), hard_bound=50.0)
    high.observe_clean(1e9)
    assert high.base == 50.0


def test_worst_case_bound_grows_with_the_gemm():
    assert worst_case_bound(4096, 4096) > worst_case_bound(64, 64) > 0
    assert math.isclose(worst_case_bound(1, 1), 4 * 2 * 1 * 1.01)


def test_sampling_is_deterministic_per_key_and_honours_probabilities():
    sampler = Sampler(0.25, (("lm_head:*", 1.0), ("layers.0.*", 0.0)), seed=7)
    assert sampler.probability_for("lm_head:wgrad") == 1.0
    assert sampler.probability_for("layers.0.mlp:fwd") == 0.0
    assert sampler.probability_for("layers.1.mlp:fwd") == 0.25
    decisions = [sampler.should_check(0.25, 3, step, 0) for step in range(4000)]
    assert decisions == [Sampler(0.25, (), seed=7).should_check(0.25, 3, step, 0) for step in range(4000)]
    assert 0.22 < sum(decisions) / len(decisions) < 0.28  # 4000 Bernoulli(0.25): σ ≈ 0.007
    other_seed = [Sampler(0.25, (), seed=8).should_check(0.25, 3, step, 0) for step in range(4000)]
    assert decisions != other_seed
