"""Per-site sampling: which calls of a site run the checked kernel.

Unsampled calls run the fastest unchecked implementation. A decision is a pure function of
(seed, site id, step, call index within the step), so data-parallel ranks check the same calls of
the same step and their statistics compare like with like.
"""

from __future__ import annotations

import fnmatch

from aegis_sdc.hashing import unit_hash


class Sampler:
    def __init__(self, probability: float, per_site: tuple[tuple[str, float], ...], seed: int) -> None:
        self._default = probability
        self._rules = per_site  # first matching fnmatch pattern wins
        self._seed = seed

    def probability_for(self, site_name: str, default: float | None = None) -> float:
        """The first matching per-site rule's probability, else `default` (the GEMM default if None)."""
        for pattern, probability in self._rules:
            if fnmatch.fnmatchcase(site_name, pattern):
                return probability
        return self._default if default is None else default

    def should_check(self, probability: float, site_id: int, step: int, call_in_step: int) -> bool:
        if probability >= 1.0:
            return True
        if probability <= 0.0:
            return False
        return unit_hash(self._seed, 0x5A3D, site_id, step, call_in_step) < probability
