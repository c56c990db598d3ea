"""The step's sampling plan: which calls of which GEMM sites run checked, decided once per step.

A protected Linear owns three GEMM sites (forward, dgrad, wgrad; Linear i has sites 3i, 3i+1, 3i+2).
When a step begins, the plan draws for all sites at once whether call c of each site is checked — a
pure function of (seed, site id, step, call), so every data-parallel rank draws the same — and marks
Linear i *active* for call c when any of its three GEMMs is checked or forced (its thresholds are
calibrating), or when a fault may fire in it. An inactive call runs `F.linear` and nothing else: `take()` — a
list lookup and a counter — is the whole cost of protection on it.

Calls beyond the first of a step (gradient accumulation, a Linear used several times) are drawn when
asked, for the asking site alone, by the same hash.
"""

from __future__ import annotations

import numpy as np

from aegis_sdc.hashing import unit_hash, unit_hash_array

SAMPLING_SALT = 0x5A3D  # the salt of Sampler.should_check: both draw the same decisions
GEMMS_PER_LINEAR = 3


class StepPlan:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.step = -1
        self._probabilities: list[float] = []  # per GEMM site
        self._ids = np.zeros(0, dtype=np.int64)
        self._p = np.zeros(0)
        self._forced = np.zeros(0, dtype=bool)
        self._faulted = np.zeros(0, dtype=bool)  # [Linears]
        self._quiet = False
        self._checked_first: list[bool] = []  # call 0 of each site
        self._active_first: list[bool] = []  # call 0 of each Linear
        self._forced_list: list[bool] = []
        self._faulted_list: list[bool] = []
        self.calls: list[int] = []  # calls of each Linear in this step
        self._reported: list[int] = []  # calls already handed to the store this step

    @property
    def linears(self) -> int:
        return len(self._probabilities) // GEMMS_PER_LINEAR

    def add_linear(self, probabilities: tuple[float, float, float]) -> int:
        """Register a Linear's three sites (site ids must follow in this order); returns its index."""
        self._probabilities.extend(float(p) for p in probabilities)
        self.calls.append(0)  # (the arrays follow at the next `begin`)
        self._reported.append(0)
        return self.linears - 1

    def set_probabilities(self, probabilities: np.ndarray) -> None:
        """New per-site probabilities (the budget sampler); they apply from the next `begin`."""
        probabilities = np.asarray(probabilities, dtype=np.float64)
        if probabilities.shape != (len(self._probabilities),):
            raise ValueError(f"expected {len(self._probabilities)} probabilities, got {probabilities.shape}")
        self._p = np.clip(probabilities, 0.0, 1.0)
        self._probabilities = self._p.tolist()

    @property
    def probabilities(self) -> np.ndarray:
        return np.asarray(self._probabilities, dtype=np.float64)

    def begin(
        self, step: int, calibrating: np.ndarray | None = None, faulted: np.ndarray | None = None, quiet: bool = False
    ) -> None:
        """Start `step`. [sites] bool masks: `calibrating` sites are checked at every call; a Linear
        with a `faulted` site (a fault may fire) takes the planned path at every call, checked or
        not, so that the fault is applied (an unsampled call then corrupts training unseen). A `quiet`
        step samples nothing (the budget measures the step itself on such steps)."""
        self.step = step
        self._quiet = quiet
        if self._p.shape[0] != len(self._probabilities):  # Linears were added since the last step
            self._p = np.asarray(self._probabilities, dtype=np.float64)
            self._ids = np.arange(self._p.shape[0], dtype=np.int64)
        none = np.zeros(self._p.shape, dtype=bool)
        self._forced = none if calibrating is None else np.asarray(calibrating, dtype=bool)
        faulted = none if faulted is None else np.asarray(faulted, dtype=bool)
        self._faulted = faulted.reshape(-1, GEMMS_PER_LINEAR).any(axis=1)
        self._faulted_list = self._faulted.tolist()
        self._forced_list = self._forced.tolist()
        self.calls = [0] * self.linears
        self._reported = [0] * self.linears
        self._draw_first_calls()

    # -- hot path -----------------------------------------------------------------------------------
    def take(self, linear: int) -> int | None:
        """Count a call of Linear `linear`: its call index when active, None when it runs unchecked."""
        call = self.calls[linear]
        self.calls[linear] = call + 1
        if call == 0:
            return 0 if self._active_first[linear] else None
        first = linear * GEMMS_PER_LINEAR
        active = self._faulted_list[linear] or any(self.checked(site, call) for site in range(first, first + 3))
        return call if active else None

    def active_first(self, linear: int) -> bool:
        """Whether the first call of Linear `linear` in this step takes the planned path."""
        return linear < len(self._active_first) and self._active_first[linear]

    def checked(self, site: int, call: int) -> bool:
        """Whether call `call` of GEMM site `site` is sampled for a check in this step."""
        if call == 0:
            return self._checked_first[site]
        # Later calls (accumulation, a Linear used several times) are drawn for the asking site
        # alone: a vectorized row per call index would cost all sites' hashes at every call.
        if self._forced_list[site]:
            return True
        p = self._probabilities[site]
        if self._quiet or p <= 0.0:
            return False
        return p >= 1.0 or unit_hash(self.seed, SAMPLING_SALT, site, self.step, call) < p

    # -- per step -----------------------------------------------------------------------------------
    def _draw_first_calls(self) -> None:
        """Call 0 of every site, vectorized (equal to `unit_hash` draw by draw)."""
        if self._quiet:
            checked = self._forced.copy()
        else:
            checked = (unit_hash_array(self.seed, SAMPLING_SALT, self._ids, self.step, 0) < self._p) | self._forced
        self._checked_first = checked.tolist()
        by_linear = checked.reshape(-1, GEMMS_PER_LINEAR).any(axis=1) | self._faulted
        self._active_first = by_linear.tolist()

    def take_counts(self) -> list[int]:
        """Calls of each Linear since the last take (a flush within a step, or the step's end)."""
        counts = [c - r for c, r in zip(self.calls, self._reported, strict=True)]
        self._reported = list(self.calls)
        return counts
