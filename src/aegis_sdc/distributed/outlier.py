"""Rank-outlier sensor (AEGIS): one data-parallel rank far above its peers on the same site.

Every rank contributes, per site, the largest normalized checksum difference it saw this step (NaN
when the site was not checked). Sampling decisions are identical across ranks, so the values compare
like with like. For each rank and site the reference is the `quantile` of the *other* ranks' values;
a value above `factor` × the reference stands out. Warnings are heuristics, stored as warnings,
never as confirmed SDC: a confirmation needs the replay.

Naming a rank. A rank is named only when a strict majority of the ranks that checked the site agree
with each other (their values within `factor` of one another) and it alone (or a minority with it)
stands apart: then the majority decides. With
two ranks — or no majority — the statistic cannot tell which side is wrong: a corrupted weight on
one rank can just as well *lower* that rank's normalized differences and make its healthy peer look
high. Such a warning reports the disagreement and the ranks involved, and names none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from aegis_sdc.events import Site

REFERENCE_FLOOR = 1.0  # one unit of fp32 rounding: exact (zero) differences on peers are not a scale
MIN_VOTERS = 3  # below three ranks no majority can single one out


def majority_decides(voters: int, dissenting: int) -> bool:
    """Whether `voters` ranks can name the `dissenting` ones: three or more, and a strict majority
    on the other side. The rule every rank attribution without a replay follows."""
    return voters >= MIN_VOTERS and 2 * (voters - dissenting) > voters


@dataclass(frozen=True)
class OutlierWarning:
    """A site whose ranks disagree in one step.

    `rank` is the rank a majority singles out, or None when nothing decides it; `ranks` and `values`
    list the ranks involved — the named rank alone, or every rank that checked the site — with what
    each saw."""

    step: int
    site: Site
    rank: int | None
    value: float  # the standing-out value (the largest one when no rank is named)
    reference: float  # the quantile of the other ranks' values
    factor: float
    ranks: tuple[int, ...] = ()
    values: tuple[float, ...] = ()

    @property
    def store_rank(self) -> int:
        """The rank whose store keeps this warning: the named rank, else the lowest rank involved (so
        a merged read of all stores sees it once)."""
        return self.rank if self.rank is not None else min(self.ranks)

    def describe(self) -> str:
        ratio = f"{self.value / self.reference:.3g}× the other ranks' reference {self.reference:.3g}"
        if self.rank is not None:
            return (
                f"rank-outlier warning at {self.site.name}, step {self.step}: rank {self.rank} saw {self.value:.3g}, "
                f"{ratio} (limit {self.factor:g}×; the other ranks agree)"
            )
        seen = ", ".join(f"rank {r}: {v:.3g}" for r, v in zip(self.ranks, self.values, strict=True))
        return (
            f"rank disagreement at {self.site.name}, step {self.step}: {seen} ({ratio}, limit {self.factor:g}×); "
            f"no rank named: {len(self.ranks)} ranks with no agreeing majority cannot tell which is wrong"
        )

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "site": self.site.name,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "values": list(self.values),
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
        # unchecked here (or non-finite: reported by the sensor itself)
        checked = [(ranks[r], row[s]) for r, row in enumerate(values) if math.isfinite(row[s])]
        if len(checked) < 2:
            continue
        standing_out = []
        for i, (rank, value) in enumerate(checked):
            reference = max(_quantile([v for j, (_, v) in enumerate(checked) if j != i], quantile), REFERENCE_FLOOR)
            if value > factor * reference:
                standing_out.append((rank, value, reference))
        if not standing_out:
            continue
        apart = {rank for rank, _, _ in standing_out}
        agreeing = [value for rank, value in checked if rank not in apart]
        if majority_decides(len(checked), len(standing_out)) and (
            max(agreeing) <= factor * max(min(agreeing), REFERENCE_FLOOR)  # the majority agrees
        ):
            warnings.extend(
                OutlierWarning(step, site, rank, value, reference, factor, (rank,), (value,))
                for rank, value, reference in standing_out
            )
        else:
            _, value, reference = max(standing_out, key=lambda item: item[1])
            warnings.append(
                OutlierWarning(
                    step, site, None, value, reference, factor,
                    tuple(r for r, _ in checked), tuple(v for _, v in checked),
                )
            )  # fmt: skip
    return warnings
