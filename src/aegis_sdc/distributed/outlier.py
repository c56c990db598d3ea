"""Rank-outlier sensor (AEGIS): one data-parallel rank far above its peers on the same site.

Every rank contributes, per site, the largest normalized checksum difference it saw this step (NaN
when the site was not checked). Sampling decisions are identical across ranks, so the values compare
like with like. For each rank and site the reference is the `quantile` of the *other* ranks' values;
a value above `factor` × the reference is a warning. Warnings are heuristics, stored as warnings,
never as confirmed SDC: a confirmation needs the replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aegis_sdc.events import Site

REFERENCE_FLOOR = 1.0  # one unit of fp32 rounding: exact (zero) differences on peers are not a scale


@dataclass(frozen=True)
class OutlierWarning:
    step: int
    site: Site
    rank: int  # the global rank that stands out
    value: float
    reference: float  # quantile of the other ranks' values
    factor: float

    def describe(self) -> str:
        return (
            f"rank-outlier warning at {self.site.name}, step {self.step}: rank {self.rank} saw {self.value:.3g}, "
            f"{self.value / self.reference:.3g}× the other ranks' reference {self.reference:.3g} "
            f"(limit {self.factor:g}×)"
        )

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "site": self.site.name,
            "rank": self.rank,
            "value": self.value,
            "reference": self.reference,
            "factor": self.factor,
        }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def detect_outliers(
    gathered: torch.Tensor,  # [dp ranks, sites] float64, NaN where a site was not checked
    ranks: list[int],
    sites: list[Site],
    step: int,
    factor: float,
    quantile: float,
) -> list[OutlierWarning]:
    values = gathered.tolist()
    warnings = []
    for s, site in enumerate(sites):
        column = [row[s] for row in values]
        for r, value in enumerate(column):
            if not math.isfinite(value):
                continue  # unchecked here (or non-finite: reported by the sensor itself)
            others = [v for i, v in enumerate(column) if i != r and math.isfinite(v)]
            if not others:
                continue
            reference = max(_quantile(others, quantile), REFERENCE_FLOOR)
            if value > factor * reference:
                warnings.append(OutlierWarning(step, site, ranks[r], value, reference, factor))
    return warnings
