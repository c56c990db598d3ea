"""Adaptive per-site thresholds on normalized checksum differences (see ThresholdConfig).

Life of a threshold:

1. Calibration: the first `calibration_checks` clean values of the site are collected. Meanwhile the
   threshold is the exact worst-case rounding bound of the GEMM (`worst_case_bound`), so a gross
   fault is still caught, and a value above it is never taken as a calibration sample.
2. base = max(floor, margin × median(calibration's nonzero values)); current = base (an exactly zero
   difference comes from an all-zero product or exact arithmetic, not from rounding).
3. A false alarm (the replay reproduced everything bit for bit) multiplies current by `backoff`.
4. After `relax_window` consecutive clean checks, current halves back toward base (`relaxations`
   counts these steps back).

A false alarm with a non-finite value widens nothing; the GEMM sensor also spares the threshold a
false alarm on unusual data (`ThresholdConfig.data_outlier_factor`).
"""

from __future__ import annotations

import math
import statistics

from aegis_sdc.config import ThresholdConfig


def worst_case_bound(k: int, n: int) -> float:
    """An upper bound on the normalized row-checksum difference of any correct fp32 execution.

    For C = A·B with A [M, K], B [K, N], both sides of the row check are sums of the products
    A_ik·B_kj; their rounding errors are at most (γ_K + γ_N)·S_i each, S_i = Σ_jk |A_ik||B_kj|,
    and S_i ≤ sqrt(K·N)·s_i (Cauchy–Schwarz, s_i as in kernels/reference.py). In units of u·s_i,
    with u' = 2u to admit truncating accumulators: 2·2(K + N)·sqrt(K·N). The column check is the
    same bound with the roles of M and N swapped, so callers pass (K, M) for it.
    """
    return 4.0 * (k + n) * math.sqrt(max(k, 1) * max(n, 1)) * 1.01


class ThresholdState:
    """The threshold of one (site, channel)."""

    def __init__(self, config: ThresholdConfig, hard_bound: float) -> None:
        self.config = config
        self.hard_bound = hard_bound
        self.samples: list[float] = []
        self.base: float | None = None
        self.current: float = hard_bound
        self.clean_streak = 0
        self.false_alarms = 0
        self.relaxations = 0

    @property
    def calibrating(self) -> bool:
        return self.base is None

    def observe_clean(self, value: float) -> None:
        """A checked value under the threshold (or one whose alarm was a false alarm)."""
        if self.base is None:
            self.samples.append(value)
            if len(self.samples) >= self.config.calibration_checks:
                # An exactly zero difference is no sample of the rounding noise: an all-zero product
                # (LoRA's B at its zero init: A's wgrad, B's forward) or exact arithmetic. Counted,
                # such calls would set the median under the noise of the site's other calls; a site
                # of nothing but zeros calibrates to the floor.
                noise = [v for v in self.samples if v != 0.0]
                median = statistics.median(noise) if noise else 0.0
                self.base = min(self.hard_bound, max(self.config.floor, self.config.margin * median))
                self.current = self.base
            return
        self.clean_streak += 1
        if self.clean_streak >= self.config.relax_window and self.current > self.base:
            self.current = max(self.base, self.current / self.config.backoff)
            self.clean_streak = 0
            self.relaxations += 1

    def on_false_alarm(self, value: float) -> None:
        self.false_alarms += 1
        if not math.isfinite(value):
            return  # a non-finite checksum came from the data (an overflow): it says nothing about noise
        self.clean_streak = 0
        if self.base is None:
            # A false alarm during calibration means the value was legitimate noise: keep it.
            self.observe_clean(value)
            return
        self.current = self.current * self.config.backoff
